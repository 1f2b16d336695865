// Where the bytes of one (token, kv head) live in a page of the paged cache, for both
// arrangements of docs/FORMAT.md ("Paged cache"). One definition for the CPU pool
// (paged_cache.cpp, paged_attention.cpp) and the CUDA kernels (src/cuda): plain integer
// arithmetic, includable by g++ and nvcc, callable from device code.
#pragma once
#include <cstddef>
#include <cstdint>

#include "tqkv/format.h"

#if defined(__CUDACC__)
#define TQKV_HOST_DEVICE __host__ __device__
#else
#define TQKV_HOST_DEVICE
#endif

namespace tqkv {

enum class PageLayout : uint8_t {
  Slot,  // vLLM's AoS: slot of (offset t, head h) at (t * n_kv_heads + h) * slot_bytes
  Page,  // SoA per head: K codes of all tokens, V codes, K meta plane, V meta planes, pad (FORMAT.md)
};

// One layer's page shape. All offsets are bytes from the start of a page; t is the token's
// offset in the page (0 .. block_size - 1), h its kv head.
struct PageGeometry {
  int block_size = 16;  // tokens per page
  int n_kv_heads = 1;
  int key_code_bytes = 0;    // per token: K codes / elements
  int key_meta_bytes = 0;    // 0 or 2 (fp16 norm)
  int value_code_bytes = 0;  // per token: V codes / elements
  int value_meta_bytes = 0;  // 0, 2 (fp16 norm) or 4 (fp16 scale, fp16 zero)
  int slot_bytes = 0;        // the four above rounded up to even
  PageLayout layout = PageLayout::Slot;

  TQKV_HOST_DEVICE constexpr int64_t page_bytes() const {
    return static_cast<int64_t>(block_size) * n_kv_heads * slot_bytes;
  }
  // Page layout: head h's section of block_size * slot_bytes bytes. Slot layout: slot (0, h).
  TQKV_HOST_DEVICE constexpr int64_t section_offset(int h) const {
    return layout == PageLayout::Page ? static_cast<int64_t>(h) * block_size * slot_bytes
                                      : static_cast<int64_t>(h) * slot_bytes;
  }
  // Slot layout only: the start of the whole slot of (t, h).
  TQKV_HOST_DEVICE constexpr int64_t slot_offset(int t, int h) const {
    return (static_cast<int64_t>(t) * n_kv_heads + h) * slot_bytes;
  }
  // Bytes between the same field of tokens t and t + 1 of one head.
  TQKV_HOST_DEVICE constexpr int64_t key_code_stride() const {
    return layout == PageLayout::Page ? key_code_bytes : static_cast<int64_t>(n_kv_heads) * slot_bytes;
  }
  TQKV_HOST_DEVICE constexpr int64_t value_code_stride() const {
    return layout == PageLayout::Page ? value_code_bytes : static_cast<int64_t>(n_kv_heads) * slot_bytes;
  }
  TQKV_HOST_DEVICE constexpr int64_t meta_stride() const {
    return layout == PageLayout::Page ? 2 : static_cast<int64_t>(n_kv_heads) * slot_bytes;
  }

  TQKV_HOST_DEVICE constexpr int64_t key_codes(int t, int h) const {
    return layout == PageLayout::Page ? section_offset(h) + static_cast<int64_t>(t) * key_code_bytes
                                      : slot_offset(t, h);
  }
  // Meta field j (0, 1) of the key: the fp16 norm is j = 0.
  TQKV_HOST_DEVICE constexpr int64_t key_meta(int t, int h, int j = 0) const {
    return layout == PageLayout::Page
               ? section_offset(h) + static_cast<int64_t>(block_size) * (key_code_bytes + value_code_bytes) +
                     2 * (static_cast<int64_t>(j) * block_size + t)
               : slot_offset(t, h) + key_code_bytes + 2 * j;
  }
  TQKV_HOST_DEVICE constexpr int64_t value_codes(int t, int h) const {
    return layout == PageLayout::Page
               ? section_offset(h) + static_cast<int64_t>(block_size) * key_code_bytes +
                     static_cast<int64_t>(t) * value_code_bytes
               : slot_offset(t, h) + key_code_bytes + key_meta_bytes;
  }
  // Meta field j of the value: j = 0 the fp16 scale (Uniform) or norm (Mse), j = 1 the fp16 zero.
  TQKV_HOST_DEVICE constexpr int64_t value_meta(int t, int h, int j = 0) const {
    return layout == PageLayout::Page
               ? section_offset(h) + static_cast<int64_t>(block_size) * (key_code_bytes + value_code_bytes + key_meta_bytes) +
                     2 * (static_cast<int64_t>(j) * block_size + t)
               : slot_offset(t, h) + key_code_bytes + key_meta_bytes + value_code_bytes + 2 * j;
  }
  // The pad byte (meaningful where the four fields add up to an odd size).
  TQKV_HOST_DEVICE constexpr int64_t pad(int t, int h) const {
    const int fields = key_code_bytes + key_meta_bytes + value_code_bytes + value_meta_bytes;
    return layout == PageLayout::Page ? section_offset(h) + static_cast<int64_t>(block_size) * fields + t
                                      : slot_offset(t, h) + fields;
  }
};

// The geometry of a format at one head dim (host side).
inline PageGeometry page_geometry(const Format& f, int head_dim, int block_size, int n_kv_heads, PageLayout layout) {
  PageGeometry g;
  g.block_size = block_size;
  g.n_kv_heads = n_kv_heads;
  g.key_code_bytes = static_cast<int>(f.key_code_bytes(head_dim));
  g.key_meta_bytes = static_cast<int>(f.key_meta_bytes());
  g.value_code_bytes = static_cast<int>(f.value_code_bytes(head_dim));
  g.value_meta_bytes = static_cast<int>(f.value_meta_bytes());
  g.slot_bytes = static_cast<int>(f.slot_bytes(head_dim));
  g.layout = layout;
  return g;
}

}  // namespace tqkv
