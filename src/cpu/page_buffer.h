// Zero-initialised cache storage from mmap, 2 MiB aligned, with transparent huge pages
// requested (MADV_HUGEPAGE) where the kernel allows them (internal). Attention walks a head's
// slots with page-sized strides through a paged pool; with 4 KiB pages nearly every slot would
// be a TLB miss.
#pragma once
#include <cstddef>
#include <cstdint>

namespace tqkv::cpu {

class PageBuffer {
 public:
  PageBuffer() = default;
  explicit PageBuffer(size_t bytes);
  ~PageBuffer();
  PageBuffer(PageBuffer&& o) noexcept { swap(o); }
  PageBuffer& operator=(PageBuffer&& o) noexcept {
    swap(o);
    return *this;
  }
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  void zero();  // all bytes back to 0

 private:
  void swap(PageBuffer& o) noexcept;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace tqkv::cpu
