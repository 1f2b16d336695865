// qgemv / qgemm kernels for AVX2 + FMA + F16C (this file alone is compiled with those flags;
// the dispatcher in qgemv.cpp calls it only when the CPU has them).
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

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 codes as floats, elements 8k .. 8k + 7 in c[k].
struct Codes32 {
  __m256 c[4];
};

inline __m256 u8x8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)); }
inline __m256 i8x8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }

// One block's 32 4-bit codes (low nibbles: elements 0-15, high: 16-31).
inline Codes32 nibbles(const uint8_t* qs) {
  const __m128i m4 = _mm_set1_epi8(0x0f);
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
  return {{u8x8(lo), u8x8(_mm_srli_si128(lo, 8)), u8x8(hi), u8x8(_mm_srli_si128(hi, 8))}};
}

// 32 bytes of codes 0-255 (here 0-15).
inline Codes32 u8x32(__m256i q) {
  const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
  return {{u8x8(q0), u8x8(_mm_srli_si128(q0, 8)), u8x8(q1), u8x8(_mm_srli_si128(q1, 8))}};
}

// sum_j q_j x_j over one row's 32 elements xb.
inline __m256 dot32(const Codes32& q, const float* xb) {
  __m256 s = _mm256_mul_ps(q.c[0], _mm256_loadu_ps(xb));
  s = _mm256_fmadd_ps(q.c[1], _mm256_loadu_ps(xb + 8), s);
  s = _mm256_fmadd_ps(q.c[2], _mm256_loadu_ps(xb + 16), s);
  return _mm256_fmadd_ps(q.c[3], _mm256_loadu_ps(xb + 24), s);
}

// sum_j q_j x_j over 16 codes (as floats, elements 0-7 and 8-15) and 16 floats.
inline __m256 dot16(__m256 q0, __m256 q1, const float* xb) {
  const __m256 s = _mm256_mul_ps(q0, _mm256_loadu_ps(xb));
  return _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb + 8), s);
}

struct Vec {
  using type = __m256;
};
template <int N>
using Sums = RowSums<Vec, N>;

// For each weight row of [r0, r1): runs block(b, i, s) over its 32-element blocks of kBytes
// bytes and stores y = out(t, s) for each activation row t.
template <int N, int kBytes, class Block, class Out>
inline void over_rows(const QgemmArgs& a, Block block, Out out) {
  const int nb = a.cols / 32;
  for (int r = a.r0; r < a.r1; ++r) {
    const uint8_t* b = a.w + static_cast<size_t>(r) * nb * kBytes;
    Sums<N> s;
    for (int i = 0; i < nb; ++i, b += kBytes) block(b, i, s);
#pragma GCC unroll 8
    for (int t = 0; t < N; ++t) a.y[t * a.ldy + (r - a.r0)] = out(t, s);
  }
}

inline const float* row_x(const QgemmArgs& a, int t) { return a.x + static_cast<size_t>(t) * a.cols; }

template <int N>
void q4_0(const QgemmArgs& a) {
  const int nb = a.cols / 32;
  over_rows<N, 18>(
      a,
      [&](const uint8_t* b, int i, Sums<N>& s) {
        const float d = f16(b);
        const Codes32 q = nibbles(b + 2);
#pragma GCC unroll 8
        for (int t = 0; t < N; ++t) {
          s.acc[0][t] = _mm256_fmadd_ps(dot32(q, row_x(a, t) + 32 * i), _mm256_set1_ps(d), s.acc[0][t]);
          s.sum[t] += d * a.xsum[t * nb + i];
        }
      },
      [](int t, const Sums<N>& s) { return hsum(s.acc[0][t]) - 8.0f * s.sum[t]; });
}

template <int N>
void q4_1(const QgemmArgs& a) {
  const int nb = a.cols / 32;
  over_rows<N, 20>(
      a,
      [&](const uint8_t* b, int i, Sums<N>& s) {
        const Codes32 q = nibbles(b + 4);
#pragma GCC unroll 8
        for (int t = 0; t < N; ++t) {
          s.acc[0][t] = _mm256_fmadd_ps(dot32(q, row_x(a, t) + 32 * i), _mm256_set1_ps(f16(b)), s.acc[0][t]);
          s.sum[t] += f16(b + 2) * a.xsum[t * nb + i];
        }
      },
      [](int t, const Sums<N>& s) { return hsum(s.acc[0][t]) + s.sum[t]; });
}

template <int N>
void q5_0(const QgemmArgs& a) {
  const int nb = a.cols / 32;
  const __m256 sixteen = _mm256_set1_ps(16.0f);
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  over_rows<N, 22>(
      a,
      [&](const uint8_t* b, int i, Sums<N>& s) {
        uint32_t qh;
        std::memcpy(&qh, b + 2, 4);
        const float d = f16(b);
        const Codes32 q = nibbles(b + 6);
        // Elements 8k .. 8k + 7 whose 5th bit (bit j of qh) is set.
        __m256 m[4];
        for (int k = 0; k < 4; ++k) {
          const __m256i bits = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>((qh >> (8 * k)) & 0xff)), sel);
          m[k] = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, sel));
        }
#pragma GCC unroll 8
        for (int t = 0; t < N; ++t) {
          const float* xb = row_x(a, t) + 32 * i;
          __m256 hx = _mm256_setzero_ps();  // sum of x where the 5th bit is set
          for (int k = 0; k < 4; ++k) hx = _mm256_add_ps(hx, _mm256_and_ps(m[k], _mm256_loadu_ps(xb + 8 * k)));
          const __m256 p = _mm256_fmadd_ps(hx, sixteen, dot32(q, xb));
          s.acc[0][t] = _mm256_fmadd_ps(p, _mm256_set1_ps(d), s.acc[0][t]);
          s.sum[t] += d * a.xsum[t * nb + i];
        }
      },
      [](int t, const Sums<N>& s) { return hsum(s.acc[0][t]) - 16.0f * s.sum[t]; });
}

template <int N>
void q8_0(const QgemmArgs& a) {
  over_rows<N, 34>(
      a,
      [&](const uint8_t* b, int i, Sums<N>& s) {
        Codes32 q;
        for (int k = 0; k < 4; ++k) q.c[k] = i8x8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * k)));
#pragma GCC unroll 8
        for (int t = 0; t < N; ++t) {
          const float* xb = row_x(a, t) + 32 * i;
          __m256 p = _mm256_setzero_ps();
          for (int k = 0; k < 4; ++k) p = _mm256_fmadd_ps(q.c[k], _mm256_loadu_ps(xb + 8 * k), p);
          s.acc[0][t] = _mm256_fmadd_ps(p, _mm256_set1_ps(f16(b)), s.acc[0][t]);
        }
      },
      [](int t, const Sums<N>& s) { return hsum(s.acc[0][t]); });
}

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
        const Codes32 c0 = u8x32(_mm256_and_si256(qv, m4)), c1 = u8x32(_mm256_and_si256(_mm256_srli_epi16(qv, 4), m4));
#pragma GCC unroll 8
        for (int t = 0; t < N; ++t) {
          const float* x0 = row_x(a, t) + 256 * i + 64 * g;
          s.acc[0][t] = _mm256_fmadd_ps(dot32(c0, x0), _mm256_set1_ps(d * static_cast<float>(s0)), s.acc[0][t]);
          s.acc[0][t] = _mm256_fmadd_ps(dot32(c1, x0 + 32), _mm256_set1_ps(d * static_cast<float>(s1)), s.acc[0][t]);
          const float* xs = a.xsum + static_cast<size_t>(t) * (a.cols / 32) + 8 * i + 2 * g;
          s.sum[t] += dmin * (static_cast<float>(m0) * xs[0] + static_cast<float>(m1) * xs[1]);
        }
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < N; ++t) a.y[t * a.ldy + (r - a.r0)] = hsum(s.acc[0][t]) - s.sum[t];
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
          const __m128i q0 = _mm256_castsi256_si128(q[k]), q1 = _mm256_extracti128_si256(q[k], 1);
          const __m256 c0 = i8x8(q0), c1 = i8x8(_mm_srli_si128(q0, 8));
          const __m256 c2 = i8x8(q1), c3 = i8x8(_mm_srli_si128(q1, 8));
#pragma GCC unroll 8
          for (int t = 0; t < N; ++t) {
            const float* xh = row_x(a, t) + 256 * i + 128 * h + 32 * k;
            s.acc[0][t] = _mm256_fmadd_ps(dot16(c0, c1, xh), _mm256_set1_ps(d * static_cast<float>(sk[0])), s.acc[0][t]);
            s.acc[1][t] = _mm256_fmadd_ps(dot16(c2, c3, xh + 16), _mm256_set1_ps(d * static_cast<float>(sk[1])), s.acc[1][t]);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < N; ++t) a.y[t * a.ldy + (r - a.r0)] = hsum(_mm256_add_ps(s.acc[0][t], s.acc[1][t]));
  }
}

}  // namespace

QgemvKernels qgemv_avx2() {
  return {TQKV_QGEMM_ENTRY(q4_0), TQKV_QGEMM_ENTRY(q4_1), TQKV_QGEMM_ENTRY(q5_0),
          TQKV_QGEMM_ENTRY(q8_0), TQKV_QGEMM_ENTRY(q4_k), TQKV_QGEMM_ENTRY(q6_k)};
}

}  // namespace tqkv::engine::detail
