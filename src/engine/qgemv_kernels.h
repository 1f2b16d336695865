// Per-ISA entry points of qgemv (internal to the engine).
#pragma once
#include <cstdint>

namespace tqkv::engine::detail {

// xsum: [cols / 32] sums of x per 32-element block (Q4_K's sub-blocks too; Q6_K, Q8_0 do not
// read it); y: [r1 - r0].
using QgemvFn = void (*)(const uint8_t* w, int cols, int r0, int r1, const float* x, const float* xsum, float* y);

struct QgemvKernels {
  QgemvFn q4_0, q4_1, q5_0, q8_0, q4_k, q6_k;
};

// Q4_K's 6-bit scale and min of sub-block j (0-7) from the block's 12 packed bytes.
inline void q4_k_scale_min(const uint8_t* sc, int j, int& s, int& m) {
  if (j < 4) {
    s = sc[j] & 63;
    m = sc[j + 4] & 63;
  } else {
    s = (sc[j + 4] & 0x0f) | ((sc[j - 4] >> 6) << 4);
    m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
  }
}

// Q6_K (210-byte blocks of 256): ql[128] low nibbles, qh[64] high 2-bit pairs, 16 int8 scales
// (one per 16 elements), fp16 d. Each 128-element half reads ql[0..63] and qh[0..31]: element
// l + 32k (l < 32, k < 4) has low nibble (k & 1 ? ql[l + 32] : ql[l]) >> (k < 2 ? 0 : 4) and
// high bits (qh[l] >> 2k) & 3, value d * scale * (q - 32).
inline constexpr int kQ6kBytes = 210;

QgemvKernels qgemv_scalar();
QgemvKernels qgemv_avx2();
QgemvKernels qgemv_avx512();

}  // namespace tqkv::engine::detail
