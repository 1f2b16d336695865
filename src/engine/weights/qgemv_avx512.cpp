// qgemv / qgemm kernels for AVX-512 F+BW+VL+DQ (this file alone is compiled with those flags;
// the dispatcher in qgemv.cpp calls it only from SimdLevel::Avx512 up). Same arithmetic as the
// AVX2 kernels, 16 codes per vector: a block of 32 is two conversions instead of four, and
// Q5_0's fifth bits become a masked add of 16 (the 16-bit halves of qh are the masks).
// Two accumulators per activation row hide the FMA latency of the per-block scaling.
//
// Each kernel takes N activation rows (qgemv_kernels.h): a block's codes are converted to
// floats once, then each row runs the one-row arithmetic on them; the per-row state lives in
// arrays indexed by compile-time constants only (unrolled loops), so it stays in registers.
#include <immintrin.h>

#include <cstring>

#include "engine/weights/qgemv_kernels.h"
#include "engine/weights/qgemv_simd.h"

namespace tqkv::engine::detail {
namespace {

inline __m512 u8x16(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }
inline __m512 i8x16(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

// The 32 4-bit codes of one Q4_0/Q4_1/Q5_0 block as floats: elements 0-15 (low nibbles),
// 16-31 (high nibbles).
inline void nibbles(const uint8_t* qs, __m512& lo, __m512& hi) {
  const __m128i m4 = _mm_set1_epi8(0x0f);
  const __m128i q = load16(qs);
  lo = u8x16(_mm_and_si128(q, m4));
  hi = u8x16(_mm_and_si128(_mm_srli_epi16(q, 4), m4));
}

// sum_j q_j x_j over one row's 32 elements xb, the codes as floats lo (0-15) and hi (16-31).
inline __m512 dot32(__m512 lo, __m512 hi, const float* xb) {
  return _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xb)));
}

struct Vec {
  using type = __m512;
};
template <int N>
using Sums = RowSums<Vec, N>;

// Row t's dot product: the sum of its two accumulators.
template <int N>
inline float dot(const Sums<N>& s, int t) {
  return _mm512_reduce_add_ps(_mm512_add_ps(s.acc[0][t], s.acc[1][t]));
}

template <int K>
using Acc = std::integral_constant<int, K>;

// For each weight row of [r0, r1): runs block(b, i, Acc<k>, s) over its 32-element blocks of
// kBytes bytes, pairs of blocks alternating accumulators 0 and 1 (an odd last block takes 0), and
// stores y = out(t, s) for each activation row t.
template <int N, int kBytes, class Block, class Out>
inline void over_rows(const QgemmArgs& a, Block block, Out out) {
  const int nb = a.cols / 32;
  for (int r = a.r0; r < a.r1; ++r) {
    const uint8_t* row = a.w + static_cast<size_t>(r) * nb * kBytes;
    Sums<N> s;
    int i = 0;
    for (; i + 1 < nb; i += 2) {
      block(row + static_cast<size_t>(kBytes) * i, i, Acc<0>{}, s);
      block(row + static_cast<size_t>(kBytes) * (i + 1), i + 1, Acc<1>{}, s);
    }
    if (i < nb) block(row + static_cast<size_t>(kBytes) * i, i, Acc<0>{}, s);
#pragma GCC unroll 8
    for (int t = 0; t < N; ++t) a.y[t * a.ldy + (r - a.r0)] = out(t, s);
  }
}

template <int N>
void q4_0(const QgemmArgs& a) {
  const int nb = a.cols / 32;
  over_rows<N, 18>(
      a,
      [&](const uint8_t* b, int i, auto k, Sums<N>& s) {
        const float d = f16(b);
        __m512 lo, hi;
        nibbles(b + 2, lo, hi);
#pragma GCC unroll 8
        for (int t = 0; t < N; ++t) {
          const __m512 p = dot32(lo, hi, a.x + static_cast<size_t>(t) * a.cols + 32 * i);
          s.acc[k][t] = _mm512_fmadd_ps(p, _mm512_set1_ps(d), s.acc[k][t]);
          s.sum[t] += d * a.xsum[t * nb + i];
        }
      },
      [](int t, const Sums<N>& s) { return dot(s, t) - 8.0f * s.sum[t]; });
}

template <int N>
void q4_1(const QgemmArgs& a) {
  const int nb = a.cols / 32;
  over_rows<N, 20>(
      a,
      [&](const uint8_t* b, int i, auto k, Sums<N>& s) {
        __m512 lo, hi;
        nibbles(b + 4, lo, hi);
#pragma GCC unroll 8
        for (int t = 0; t < N; ++t) {
          const __m512 p = dot32(lo, hi, a.x + static_cast<size_t>(t) * a.cols + 32 * i);
          s.acc[k][t] = _mm512_fmadd_ps(p, _mm512_set1_ps(f16(b)), s.acc[k][t]);
          s.sum[t] += f16(b + 2) * a.xsum[t * nb + i];
        }
      },
      [](int t, const Sums<N>& s) { return dot(s, t) + s.sum[t]; });
}

template <int N>
void q5_0(const QgemmArgs& a) {
  const int nb = a.cols / 32;
  const __m512 sixteen = _mm512_set1_ps(16.0f);
  over_rows<N, 22>(
      a,
      [&](const uint8_t* b, int i, auto k, Sums<N>& s) {
        uint32_t qh;
        std::memcpy(&qh, b + 2, 4);
        const float d = f16(b);
        __m512 lo, hi;
        nibbles(b + 6, lo, hi);
        lo = _mm512_mask_add_ps(lo, static_cast<__mmask16>(qh), lo, sixteen);
        hi = _mm512_mask_add_ps(hi, static_cast<__mmask16>(qh >> 16), hi, sixteen);
#pragma GCC unroll 8
        for (int t = 0; t < N; ++t) {
          const __m512 p = dot32(lo, hi, a.x + static_cast<size_t>(t) * a.cols + 32 * i);
          s.acc[k][t] = _mm512_fmadd_ps(p, _mm512_set1_ps(d), s.acc[k][t]);
          s.sum[t] += d * a.xsum[t * nb + i];
        }
      },
      [](int t, const Sums<N>& s) { return dot(s, t) - 16.0f * s.sum[t]; });
}

template <int N>
void q8_0(const QgemmArgs& a) {
  over_rows<N, 34>(
      a,
      [&](const uint8_t* b, int i, auto k, Sums<N>& s) {
        const __m512 lo = i8x16(load16(b + 2)), hi = i8x16(load16(b + 18));
#pragma GCC unroll 8
        for (int t = 0; t < N; ++t) {
          const __m512 p = dot32(lo, hi, a.x + static_cast<size_t>(t) * a.cols + 32 * i);
          s.acc[k][t] = _mm512_fmadd_ps(p, _mm512_set1_ps(f16(b)), s.acc[k][t]);
        }
      },
      [](int t, const Sums<N>& s) { return dot(s, t); });
}

// Q4_K and Q6_K: accumulator 0 takes the first half of each sub-block pair, 1 the second.
template <int N>
void q4_k(const QgemmArgs& a) {
  const int nb = a.cols / 256;
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  for (int r = a.r0; r < a.r1; ++r) {
    const uint8_t* b = a.w + static_cast<size_t>(r) * nb * 144;
    Sums<N> s;
    for (int i = 0; i < nb; ++i, b += 144) {
      const float d = f16(b), dmin = f16(b + 2);
      const uint8_t* q = b + 16;
      for (int g = 0; g < 4; ++g, q += 32) {
        int s0, m0, s1, m1;
        q4_k_scale_min(b + 4, 2 * g, s0, m0);
        q4_k_scale_min(b + 4, 2 * g + 1, s1, m1);
        const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        const __m256i c0 = _mm256_and_si256(qv, m4), c1 = _mm256_and_si256(_mm256_srli_epi16(qv, 4), m4);
        const __m512 l0 = u8x16(_mm256_castsi256_si128(c0)), h0 = u8x16(_mm256_extracti128_si256(c0, 1));
        const __m512 l1 = u8x16(_mm256_castsi256_si128(c1)), h1 = u8x16(_mm256_extracti128_si256(c1, 1));
#pragma GCC unroll 8
        for (int t = 0; t < N; ++t) {
          const float* x0 = a.x + static_cast<size_t>(t) * a.cols + 256 * i + 64 * g;
          s.acc[0][t] = _mm512_fmadd_ps(dot32(l0, h0, x0), _mm512_set1_ps(d * static_cast<float>(s0)), s.acc[0][t]);
          s.acc[1][t] = _mm512_fmadd_ps(dot32(l1, h1, x0 + 32), _mm512_set1_ps(d * static_cast<float>(s1)), s.acc[1][t]);
          const float* xs = a.xsum + static_cast<size_t>(t) * (a.cols / 32) + 8 * i + 2 * g;
          s.sum[t] += dmin * (static_cast<float>(m0) * xs[0] + static_cast<float>(m1) * xs[1]);
        }
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < N; ++t) a.y[t * a.ldy + (r - a.r0)] = dot(s, t) - s.sum[t];
  }
}

template <int N>
void q6_k(const QgemmArgs& a) {
  const int nb = a.cols / 256;
  for (int r = a.r0; r < a.r1; ++r) {
    const uint8_t* b = a.w + static_cast<size_t>(r) * nb * kQ6kBytes;
    Sums<N> s;
    for (int i = 0; i < nb; ++i, b += kQ6kBytes) {
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int h = 0; h < 2; ++h) {
        __m256i q[4];
        q6_k_codes(b + 64 * h, b + 128 + 32 * h, q);
        for (int k = 0; k < 4; ++k) {
          const int8_t* sk = sc + 8 * h + 2 * k;
          const __m512 c0 = i8x16(_mm256_castsi256_si128(q[k])), c1 = i8x16(_mm256_extracti128_si256(q[k], 1));
#pragma GCC unroll 8
          for (int t = 0; t < N; ++t) {
            const float* xh = a.x + static_cast<size_t>(t) * a.cols + 256 * i + 128 * h + 32 * k;
            s.acc[0][t] = _mm512_fmadd_ps(_mm512_mul_ps(c0, _mm512_loadu_ps(xh)), _mm512_set1_ps(d * static_cast<float>(sk[0])),
                                          s.acc[0][t]);
            s.acc[1][t] = _mm512_fmadd_ps(_mm512_mul_ps(c1, _mm512_loadu_ps(xh + 16)),
                                          _mm512_set1_ps(d * static_cast<float>(sk[1])), s.acc[1][t]);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < N; ++t) a.y[t * a.ldy + (r - a.r0)] = dot(s, t);
  }
}

// The entry point of kernel K for any row count 1 .. kQgemmRows.
}  // namespace

QgemvKernels qgemv_avx512() {
  return {TQKV_QGEMM_ENTRY(q4_0), TQKV_QGEMM_ENTRY(q4_1), TQKV_QGEMM_ENTRY(q5_0),
          TQKV_QGEMM_ENTRY(q8_0), TQKV_QGEMM_ENTRY(q4_k), TQKV_QGEMM_ENTRY(q6_k)};
}

}  // namespace tqkv::engine::detail
