// Per-ISA entry points of qgemv / qgemm (internal to the engine).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "tqkv/gguf_blocks.h"

namespace tqkv::engine::detail {

// One kernel call: rows [r0, r1) of W times n activation rows at once (1 <= n <= kQgemmRows).
// Each weight block is decoded once and applied to the n rows; row t's arithmetic (operations
// and their order) is exactly that of the kernel with n = 1 on row t alone, so the results
// are bit-identical to qgemv row by row.
inline constexpr int kQgemmRows = 8;

struct QgemmArgs {
  const uint8_t* w;   // rows of `cols` elements in GGUF blocks
  int cols, r0, r1;
  const float* x;     // [n, cols]
  const float* xsum;  // [n, cols / 32] sums of x per 32-element block (Q4_K's sub-blocks too;
                      // Q6_K, Q8_0 do not read it)
  int n;              // 1 .. kQgemmRows
  float* y;           // y[t * ldy + r - r0]
  size_t ldy;
};

using QgemmFn = void (*)(const QgemmArgs& a);

struct QgemvKernels {
  QgemmFn q4_0, q4_1, q5_0, q8_0, q4_k, q6_k;
};

// Calls f(std::integral_constant<int, n>{}) for the run-time row count n in 1 .. kQgemmRows,
// so that kernels keep one accumulator set per row in registers.
template <class F, int... I>
inline void with_row_count_impl(int n, F& f, std::integer_sequence<int, I...>) {
  ((n == I + 1 ? (f(std::integral_constant<int, I + 1>{}), 0) : 0), ...);
}
template <class F>
inline void with_row_count(int n, F&& f) {
  with_row_count_impl(n, f, std::make_integer_sequence<int, kQgemmRows>{});
}

// The QgemmFn of kernel template K<N> (N = rows): K<n>(a) for a.n = n.
#define TQKV_QGEMM_ENTRY(K) \
  [](const QgemmArgs& a) { with_row_count(a.n, [&](auto n) { K<decltype(n)::value>(a); }); }

// Per activation row of an N-row SIMD kernel: two accumulators of vector type Vec::type
// (zeroed) and a scalar one (block offsets or mins). Kernels index them by compile-time
// constants only (unrolled loops), so they stay in registers. (Vec wraps the vector type: a
// template argument of an attributed type such as __m512 would lose its attributes.)
template <class Vec, int N>
struct RowSums {
  using V = typename Vec::type;
  V acc[2][N];
  float sum[N];
  RowSums() {
#pragma GCC unroll 8
    for (int t = 0; t < N; ++t) {
      acc[0][t] = acc[1][t] = V{};
      sum[t] = 0;
    }
  }
};

// Q4_K's 6-bit scale and min of sub-block j (0-7) from the block's 12 packed bytes.
using gguf::q4_k_scale_min;

// All 8 of Q4_K's 6-bit scales (out[0..7]) and mins (out[8..15]) at once, as q4_k_scale_min
// gives them, by whole-word masks and shifts over the 12 packed bytes.
inline void q4_k_scales_mins(const uint8_t* sc, uint8_t out[16]) {
  uint32_t u[3];
  std::memcpy(u, sc, 12);
  const uint32_t w[4] = {u[0] & 0x3f3f3f3fu, (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4),
                         u[1] & 0x3f3f3f3fu, ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)};
  std::memcpy(out, w, 16);
}

// Q6_K (210-byte blocks of 256): ql[128] low nibbles, qh[64] high 2-bit pairs, 16 int8 scales
// (one per 16 elements), fp16 d. Each 128-element half reads ql[0..63] and qh[0..31]: element
// l + 32k (l < 32, k < 4) has low nibble (k & 1 ? ql[l + 32] : ql[l]) >> (k < 2 ? 0 : 4) and
// high bits (qh[l] >> 2k) & 3, value d * scale * (q - 32).
inline constexpr int kQ6kBytes = 210;

// The int8 path (qgemv.h, QdotMode::Int8). Each activation row is quantized once per product
// or group of products (quantize_rows, QgemmInput): per 32-element block b, scale xd[b] = max|x| / 127 and codes
// xq = round(x / xd[b]) in [-127, 127]. Weight block codes q (unsigned, Q8_0 signed) meet xq
// in integer dot products; the contract every ISA meets bit for bit (the scalar twin is its
// definition), for the types of 32-element blocks:
//   lane l (0-7) of 32-element block b: L = sum_{e<4} (q[4l+e] - o) xq[4l+e], exact int32,
//     o = 8 (Q4_0), 16 (Q5_0), else 0;
//   float accumulator lane 8 (b & 1) + l of 16: acc = fma(float(L), dw * xd[b], acc), in block
//     order, dw the block's float scale;
//   mins (Q4_1: m) in one float: off = fma(mw, xs[b], off), block order,
//     xs[b] = xd[b] * float(sum of the block's xq);
//   y = tree(acc) + off (Q4_1), tree(acc) otherwise, tree summing
//     lanes l + 8, then l + 4, then l + 2, then lane 0 + lane 1.
//
// Q4_K and Q6_K read the rows quantized per 256-element super-block instead (as llama.cpp's
// q8_K, with integer sub-scales): a base scale xkd[i] = max|x| / (127 kSub) per super-block i,
// an integer sub-scale u_j = ceil(kSub max_j|x| / max|x|) in 1 .. kSub per 32 elements j (so a
// sub-block far below the super-block's peak keeps its own resolution), codes
// xk = round(x / (xkd[i] u_j)) in [-127, 127], xkb[n] = the sum of the codes of each 16
// elements and xku[n] = the u_j of those 16. A super-block's products stay integers across its
// sub-blocks, scales, sub-scales and mins applied as integers, and meet floats twice per
// super-block; the contract, 8 int32 lanes l per super-block i (exact, so their order of
// summation is free), float lanes acc[l]:
//   Q4_K: S_l = sum_{j<8} s_j u_j sum_{e<4} q[32j+4l+e] xk[32j+4l+e],
//         M_l = m_l u_l (xkb[2l] + xkb[2l+1]);
//         acc[l] = fma(float(S_l), d xkd[i], acc[l]), then acc[l] = fma(float(M_l), -(dmin xkd[i]), acc[l]);
//   Q6_K: S_l = sum_{b<8} sc[2b + l/4] u_b sum_{e<4} q[32b+4l+e] xk[32b+4l+e]
//               - 32 (sc[2l] u_l xkb[2l] + sc[2l+1] u_l xkb[2l+1]), q the unsigned codes (0-63)
//         with element 32b + e of the super-block being element 32k + e of half h = b / 4, k = b % 4;
//         acc[l] = fma(float(S_l), d xkd[i], acc[l]);
//   y = tree8(acc): lanes l + 4, then l + 2, then lane 0 + lane 1.
// With kSub = 16: scales times sub-scales stay within int16 (63 * 16, 128 * 16), the int16 pair
// sums of vpmaddubsw (at most 2 * 63 * 127) do not saturate, and |S_l| < 2^30, |M_l| < 2^23.
inline constexpr int kSub = 16;
struct QdotRows {
  const int8_t* xq;   // [n, cols]
  const int32_t* x4n; // [n, cols / 4]: -(sum of xq over each 4 elements), for the offsets o
  const float* xd8;   // [n, cols / 4]: xd[b] repeated over its block's 8 lanes
  const float* xs;    // [n, cols / 32]
  const int8_t* xk;   // [n, cols]: per-256 codes (nullptr unless cols is a multiple of 256)
  const float* xkd;   // [n, cols / 256]
  const int16_t* xkb; // [n, cols / 16]
  const int16_t* xku; // [n, cols / 16]
  const float* xd;    // [n, cols / 32]: xd[b] once (Q5_0 in groups: eight blocks' scales at once)
};

// The quantized rows of one product, and quantize_rows (qdot.cpp) which fills them.
struct QdotBuffers {
  std::vector<int8_t> xq, xk;
  std::vector<int32_t> x4n;
  std::vector<float> xd8, xs, xkd, xd;
  std::vector<int16_t> xkb, xku;
  QdotRows rows(int t, int cols) const {
    const size_t c = static_cast<size_t>(t) * cols;
    const bool q = !xq.empty(), k = !xk.empty();
    return {q ? xq.data() + c : nullptr,      q ? x4n.data() + c / 4 : nullptr,
            q ? xd8.data() + c / 4 : nullptr, q ? xs.data() + c / 32 : nullptr,
            k ? xk.data() + c : nullptr,      k ? xkd.data() + c / 256 : nullptr,
            k ? xkb.data() + c / 16 : nullptr, k ? xku.data() + c / 16 : nullptr,
            q ? xd.data() + c / 32 : nullptr};
  }
};
// blocks32: also the per-32 rows (xq, x4n, xd8, xs, xd; always where cols is not a multiple of 256),
// else those are left empty.
void quantize_rows(const float* x, int n, int cols, QdotBuffers& out, bool blocks32 = true);

struct QdotArgs {
  const uint8_t* w;
  int cols, r0, r1;
  QdotRows x;
  int n;  // 1 .. kQgemmRows
  float* y;
  size_t ldy;
};

using QdotFn = void (*)(const QdotArgs& a);

struct QdotKernels {
  QdotFn q4_0, q4_1, q5_0, q8_0, q4_k, q6_k;
  // Q5_0, Q4_1 and Q8_0 in groups of eight blocks (block_groups.h), where the ISA reads those
  // layouts; else nullptr, and qgemm restores the GGUF layout for q5_0 / q4_1 / q8_0.
  QdotFn q5_0_groups = nullptr, q4_1_groups = nullptr, q8_0_groups = nullptr;
};

#define TQKV_QDOT_ENTRY(K) \
  [](const QdotArgs& a) { with_row_count(a.n, [&](auto n) { K<decltype(n)::value>(a); }); }

QdotKernels qdot_scalar();
QdotKernels qdot_avx2();
// AVX-512 F+BW+VL+DQ with VNNI (vpdpbusd); qdot_avx512_supported() says whether this CPU has it.
QdotKernels qdot_avx512();
bool qdot_avx512_supported();
// quantize_rows's per-256 pass over `blocks` super-blocks of x, bit for bit, where
// qdot_avx512_supported(); quantize_rows takes it at SimdLevel::Avx512.
void quantize_rows_256_avx512(const float* x, size_t blocks, int8_t* xk, float* xkd, int16_t* xkb, int16_t* xku);

QgemvKernels qgemv_scalar();
QgemvKernels qgemv_avx2();
QgemvKernels qgemv_avx512();

}  // namespace tqkv::engine::detail
