// vLLM's TurboQuant cache as the tqkv_vllm kernels see it (docs/VLLM.md, "The slot"): one
// slot per (token, kv head) of
//   [key codes | key fp16 norm (MSE keys only) | value codes | value fp16 scale | value fp16 zero]
// with codes packed little-endian, code j at bits [j * bits, (j + 1) * bits) of its field
// (two 4-bit codes per byte, low nibble first; eight 3-bit codes in three bytes); FP8 keys are
// one E4M3 byte per element and have no norm. The cache tensor is addressed through its byte
// strides as the view [num_blocks, block_size, num_kv_heads, slot_bytes] (vLLM 0.26-0.27
// allocate it head-major, [num_blocks, num_kv_heads, block_size, slot_bytes], and transpose).
#pragma once
#include <cstdint>

namespace tqkv_vllm {

enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// The per-head byte sizes of a preset at head dim D (vLLM's TurboQuantConfig).
template <int KB, int VB, int D>
struct Slot {
  static constexpr bool kFp8 = KB == 8;
  static constexpr int kKeyCodeBytes = kFp8 ? D : (D * KB + 7) / 8;
  static constexpr int kKeyBytes = kFp8 ? D : kKeyCodeBytes + 2;  // vLLM's key_packed_size
  static constexpr int kValueCodeBytes = (D * VB + 7) / 8;
  static constexpr int kBytes = kKeyBytes + kValueCodeBytes + 4;
  static constexpr int kAligned = kBytes + (kBytes & 1);  // vLLM's slot_size_aligned
  static_assert(D % 64 == 0 && D <= 256, "head dims 64, 128, 256");
  static_assert(KB == 3 || KB == 4 || KB == 8, "3- or 4-bit MSE keys or FP8 keys");
  static_assert(VB == 3 || VB == 4, "3- or 4-bit uniform values");
};
// vLLM's four presets at head dim 128 take 196, 134, 118 and 102 bytes (config.py).
static_assert(Slot<8, 4, 128>::kAligned == 196 && Slot<4, 4, 128>::kAligned == 134);
static_assert(Slot<3, 4, 128>::kAligned == 118 && Slot<3, 3, 128>::kAligned == 102);
static_assert(Slot<8, 4, 64>::kAligned == 100 && Slot<3, 3, 64>::kAligned == 54);

// One layer's cache: byte strides of the [num_blocks, block_size, num_kv_heads, slot] view.
struct CacheView {
  uint8_t* base;
  int64_t stride_block;
  int64_t stride_pos;
  int64_t stride_head;
  int block_size;
  int n_kv_heads;
};

}  // namespace tqkv_vllm
