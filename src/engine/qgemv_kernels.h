// Per-ISA entry points of qgemv / qgemm (internal to the engine).
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

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
