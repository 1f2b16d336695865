// qgemv kernels for AVX-512 F+BW+VL+DQ (this file alone is compiled with those flags; the
// dispatcher in qgemv.cpp calls it only from SimdLevel::Avx512 up). Same arithmetic as the
// AVX2 kernels, 16 codes per vector: a block of 32 is two conversions instead of four, and
// Q5_0's fifth bits become a masked add of 16 (the 16-bit halves of qh are the masks).
// Two accumulators per row hide the FMA latency of the per-block scaling.
#include <immintrin.h>

#include <cstring>

#include "qgemv_kernels.h"
#include "qgemv_q6k_codes.h"

namespace tqkv::engine::detail {
namespace {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
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

// Runs `block(i, acc)` for blocks [0, nb), alternating two accumulators; returns their sum.
template <class Block>
inline float over_blocks(int nb, Block block) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int i = 0;
  for (; i + 1 < nb; i += 2) {
    block(i, acc0);
    block(i + 1, acc1);
  }
  if (i < nb) block(i, acc0);
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

void q4_0(const uint8_t* w, int cols, int r0, int r1, const float* x, const float* xsum, float* y) {
  const int nb = cols / 32;
  for (int r = r0; r < r1; ++r) {
    const uint8_t* row = w + static_cast<size_t>(r) * nb * 18;
    float corr = 0;
    const float dot = over_blocks(nb, [&](int i, __m512& acc) {
      const uint8_t* b = row + 18 * i;
      const float d = f16(b);
      __m512 lo, hi;
      nibbles(b + 2, lo, hi);
      const __m512 s = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 32 * i + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(x + 32 * i)));
      acc = _mm512_fmadd_ps(s, _mm512_set1_ps(d), acc);
      corr += d * xsum[i];
    });
    y[r - r0] = dot - 8.0f * corr;
  }
}

void q4_1(const uint8_t* w, int cols, int r0, int r1, const float* x, const float* xsum, float* y) {
  const int nb = cols / 32;
  for (int r = r0; r < r1; ++r) {
    const uint8_t* row = w + static_cast<size_t>(r) * nb * 20;
    float off = 0;
    const float dot = over_blocks(nb, [&](int i, __m512& acc) {
      const uint8_t* b = row + 20 * i;
      __m512 lo, hi;
      nibbles(b + 4, lo, hi);
      const __m512 s = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 32 * i + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(x + 32 * i)));
      acc = _mm512_fmadd_ps(s, _mm512_set1_ps(f16(b)), acc);
      off += f16(b + 2) * xsum[i];
    });
    y[r - r0] = dot + off;
  }
}

void q5_0(const uint8_t* w, int cols, int r0, int r1, const float* x, const float* xsum, float* y) {
  const int nb = cols / 32;
  const __m512 sixteen = _mm512_set1_ps(16.0f);
  for (int r = r0; r < r1; ++r) {
    const uint8_t* row = w + static_cast<size_t>(r) * nb * 22;
    float corr = 0;
    const float dot = over_blocks(nb, [&](int i, __m512& acc) {
      const uint8_t* b = row + 22 * i;
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      const float d = f16(b);
      __m512 lo, hi;
      nibbles(b + 6, lo, hi);
      lo = _mm512_mask_add_ps(lo, static_cast<__mmask16>(qh), lo, sixteen);
      hi = _mm512_mask_add_ps(hi, static_cast<__mmask16>(qh >> 16), hi, sixteen);
      const __m512 s = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 32 * i + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(x + 32 * i)));
      acc = _mm512_fmadd_ps(s, _mm512_set1_ps(d), acc);
      corr += d * xsum[i];
    });
    y[r - r0] = dot - 16.0f * corr;
  }
}

void q8_0(const uint8_t* w, int cols, int r0, int r1, const float* x, const float*, float* y) {
  const int nb = cols / 32;
  for (int r = r0; r < r1; ++r) {
    const uint8_t* row = w + static_cast<size_t>(r) * nb * 34;
    y[r - r0] = over_blocks(nb, [&](int i, __m512& acc) {
      const uint8_t* b = row + 34 * i;
      const __m512 s = _mm512_fmadd_ps(i8x16(load16(b + 18)), _mm512_loadu_ps(x + 32 * i + 16),
                                       _mm512_mul_ps(i8x16(load16(b + 2)), _mm512_loadu_ps(x + 32 * i)));
      acc = _mm512_fmadd_ps(s, _mm512_set1_ps(f16(b)), acc);
    });
  }
}

// sum_j q_j x_j over 32 bytes of codes 0-15 and 32 floats.
inline __m512 dot_u8x32(__m256i q, const float* xb) {
  return _mm512_fmadd_ps(u8x16(_mm256_extracti128_si256(q, 1)), _mm512_loadu_ps(xb + 16),
                         _mm512_mul_ps(u8x16(_mm256_castsi256_si128(q)), _mm512_loadu_ps(xb)));
}

void q4_k(const uint8_t* w, int cols, int r0, int r1, const float* x, const float* xsum, float* y) {
  const int nb = cols / 256;
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  for (int r = r0; r < r1; ++r) {
    const uint8_t* b = w + static_cast<size_t>(r) * nb * 144;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    float corr = 0;
    for (int i = 0; i < nb; ++i, b += 144) {
      const float d = f16(b), dmin = f16(b + 2);
      const uint8_t* q = b + 16;
      for (int g = 0; g < 4; ++g, q += 32) {
        int s0, m0, s1, m1;
        q4_k_scale_min(b + 4, 2 * g, s0, m0);
        q4_k_scale_min(b + 4, 2 * g + 1, s1, m1);
        const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        const float* x0 = x + 256 * i + 64 * g;
        acc0 = _mm512_fmadd_ps(dot_u8x32(_mm256_and_si256(qv, m4), x0), _mm512_set1_ps(d * static_cast<float>(s0)), acc0);
        acc1 = _mm512_fmadd_ps(dot_u8x32(_mm256_and_si256(_mm256_srli_epi16(qv, 4), m4), x0 + 32),
                               _mm512_set1_ps(d * static_cast<float>(s1)), acc1);
        const float* xs = xsum + 8 * i + 2 * g;
        corr += dmin * (static_cast<float>(m0) * xs[0] + static_cast<float>(m1) * xs[1]);
      }
    }
    y[r - r0] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) - corr;
  }
}

void q6_k(const uint8_t* w, int cols, int r0, int r1, const float* x, const float*, float* y) {
  const int nb = cols / 256;
  for (int r = r0; r < r1; ++r) {
    const uint8_t* b = w + static_cast<size_t>(r) * nb * kQ6kBytes;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int i = 0; i < nb; ++i, b += kQ6kBytes) {
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int h = 0; h < 2; ++h) {
        __m256i q[4];
        q6_k_codes(b + 64 * h, b + 128 + 32 * h, q);
        const float* xh = x + 256 * i + 128 * h;
        for (int k = 0; k < 4; ++k) {
          const int8_t* s = sc + 8 * h + 2 * k;
          acc0 = _mm512_fmadd_ps(_mm512_mul_ps(i8x16(_mm256_castsi256_si128(q[k])), _mm512_loadu_ps(xh + 32 * k)),
                                 _mm512_set1_ps(d * static_cast<float>(s[0])), acc0);
          acc1 = _mm512_fmadd_ps(_mm512_mul_ps(i8x16(_mm256_extracti128_si256(q[k], 1)), _mm512_loadu_ps(xh + 32 * k + 16)),
                                 _mm512_set1_ps(d * static_cast<float>(s[1])), acc1);
        }
      }
    }
    y[r - r0] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
}

}  // namespace

QgemvKernels qgemv_avx512() { return {q4_0, q4_1, q5_0, q8_0, q4_k, q6_k}; }

}  // namespace tqkv::engine::detail
