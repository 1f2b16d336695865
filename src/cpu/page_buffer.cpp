#include "page_buffer.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <utility>

namespace tqkv::cpu {

namespace {
constexpr size_t kHuge = size_t{2} << 20;
}

PageBuffer::PageBuffer(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  // Rounding up to huge pages, plus one for the alignment, must not wrap to a short mapping;
  // nothing this large can be mapped anyway.
  if (bytes > SIZE_MAX - 2 * kHuge) throw std::bad_alloc();
  // Small buffers: plain pages (a huge page would commit 2 MiB for a few slots).
  const bool huge = bytes >= kHuge;
  const size_t rounded = huge ? (bytes + kHuge - 1) / kHuge * kHuge : bytes;
  map_bytes_ = huge ? rounded + kHuge : bytes;
  // MAP_NORESERVE: a pool is address space for its worst case (every sequence at capacity) and
  // commits only the pages written, so the kernel's overcommit heuristic must not count it whole.
  map_ = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw std::bad_alloc();
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(map_);
  data_ = reinterpret_cast<uint8_t*>(huge ? (base + kHuge - 1) / kHuge * kHuge : base);
#ifdef MADV_HUGEPAGE
  if (huge) madvise(data_, rounded, MADV_HUGEPAGE);  // advisory: ignored where THP is off
#endif
}

PageBuffer::~PageBuffer() {
  if (map_) munmap(map_, map_bytes_);
}

void PageBuffer::zero() {
  if (data_) std::memset(data_, 0, size_);
}

void PageBuffer::swap(PageBuffer& o) noexcept {
  std::swap(map_, o.map_);
  std::swap(map_bytes_, o.map_bytes_);
  std::swap(data_, o.data_);
  std::swap(size_, o.size_);
}

}  // namespace tqkv::cpu
