// qgemv kernels for AVX2 + FMA + F16C (this file alone is compiled with those flags; the
// dispatcher in qgemv.cpp calls it only when the CPU has them).
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

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_j q_j x_j over one block of 32 4-bit codes (low nibbles: elements 0-15, high: 16-31).
inline __m256 dot_nibbles(const uint8_t* qs, const float* xb) {
  const __m128i m4 = _mm_set1_epi8(0x0f);
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i lo = _mm_and_si128(q, m4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
  const __m256 l0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  const __m256 l1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  const __m256 h0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  const __m256 h1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  __m256 s = _mm256_mul_ps(l0, _mm256_loadu_ps(xb));
  s = _mm256_fmadd_ps(l1, _mm256_loadu_ps(xb + 8), s);
  s = _mm256_fmadd_ps(h0, _mm256_loadu_ps(xb + 16), s);
  return _mm256_fmadd_ps(h1, _mm256_loadu_ps(xb + 24), s);
}

void q4_0(const uint8_t* w, int cols, int r0, int r1, const float* x, const float* xsum, float* y) {
  const int nb = cols / 32;
  for (int r = r0; r < r1; ++r) {
    const uint8_t* b = w + static_cast<size_t>(r) * nb * 18;
    __m256 acc = _mm256_setzero_ps();
    float corr = 0;
    for (int i = 0; i < nb; ++i, b += 18) {
      const float d = f16(b);
      acc = _mm256_fmadd_ps(dot_nibbles(b + 2, x + 32 * i), _mm256_set1_ps(d), acc);
      corr += d * xsum[i];
    }
    y[r - r0] = hsum(acc) - 8.0f * corr;
  }
}

void q4_1(const uint8_t* w, int cols, int r0, int r1, const float* x, const float* xsum, float* y) {
  const int nb = cols / 32;
  for (int r = r0; r < r1; ++r) {
    const uint8_t* b = w + static_cast<size_t>(r) * nb * 20;
    __m256 acc = _mm256_setzero_ps();
    float off = 0;
    for (int i = 0; i < nb; ++i, b += 20) {
      acc = _mm256_fmadd_ps(dot_nibbles(b + 4, x + 32 * i), _mm256_set1_ps(f16(b)), acc);
      off += f16(b + 2) * xsum[i];
    }
    y[r - r0] = hsum(acc) + off;
  }
}

// sum_j x_j over the elements of one block whose bit j of qh is set (Q5_0's 5th bits).
inline __m256 sum_where_bit(uint32_t qh, const float* xb) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256 s = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    const __m256i bits = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>((qh >> (8 * k)) & 0xff)), sel);
    const __m256 m = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, sel));
    s = _mm256_add_ps(s, _mm256_and_ps(m, _mm256_loadu_ps(xb + 8 * k)));
  }
  return s;
}

void q5_0(const uint8_t* w, int cols, int r0, int r1, const float* x, const float* xsum, float* y) {
  const int nb = cols / 32;
  const __m256 sixteen = _mm256_set1_ps(16.0f);
  for (int r = r0; r < r1; ++r) {
    const uint8_t* b = w + static_cast<size_t>(r) * nb * 22;
    __m256 acc = _mm256_setzero_ps();
    float corr = 0;
    for (int i = 0; i < nb; ++i, b += 22) {
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      const float d = f16(b);
      const float* xb = x + 32 * i;
      const __m256 s = _mm256_fmadd_ps(sum_where_bit(qh, xb), sixteen, dot_nibbles(b + 6, xb));
      acc = _mm256_fmadd_ps(s, _mm256_set1_ps(d), acc);
      corr += d * xsum[i];
    }
    y[r - r0] = hsum(acc) - 16.0f * corr;
  }
}

void q8_0(const uint8_t* w, int cols, int r0, int r1, const float* x, const float*, float* y) {
  const int nb = cols / 32;
  for (int r = r0; r < r1; ++r) {
    const uint8_t* b = w + static_cast<size_t>(r) * nb * 34;
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; ++i, b += 34) {
      const float* xb = x + 32 * i;
      __m256 s = _mm256_setzero_ps();
      for (int k = 0; k < 4; ++k) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * k));
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_loadu_ps(xb + 8 * k), s);
      }
      acc = _mm256_fmadd_ps(s, _mm256_set1_ps(f16(b)), acc);
    }
    y[r - r0] = hsum(acc);
  }
}

// sum_j q_j x_j over 32 bytes of codes 0-255 (here 0-15) and 32 floats.
inline __m256 dot_u8x32(__m256i q, const float* xb) {
  const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
  __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q0)), _mm256_loadu_ps(xb));
  s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q0, 8))), _mm256_loadu_ps(xb + 8), s);
  s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q1)), _mm256_loadu_ps(xb + 16), s);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q1, 8))), _mm256_loadu_ps(xb + 24), s);
}

void q4_k(const uint8_t* w, int cols, int r0, int r1, const float* x, const float* xsum, float* y) {
  const int nb = cols / 256;
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  for (int r = r0; r < r1; ++r) {
    const uint8_t* b = w + static_cast<size_t>(r) * nb * 144;
    __m256 acc = _mm256_setzero_ps();
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
        acc = _mm256_fmadd_ps(dot_u8x32(_mm256_and_si256(qv, m4), x0), _mm256_set1_ps(d * static_cast<float>(s0)), acc);
        acc = _mm256_fmadd_ps(dot_u8x32(_mm256_and_si256(_mm256_srli_epi16(qv, 4), m4), x0 + 32),
                              _mm256_set1_ps(d * static_cast<float>(s1)), acc);
        const float* xs = xsum + 8 * i + 2 * g;
        corr += dmin * (static_cast<float>(m0) * xs[0] + static_cast<float>(m1) * xs[1]);
      }
    }
    y[r - r0] = hsum(acc) - corr;
  }
}

// sum_j q_j x_j over 16 signed bytes and 16 floats.
inline __m256 dot_i8x16(__m128i q, const float* xb) {
  const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_loadu_ps(xb));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), _mm256_loadu_ps(xb + 8), s);
}

void q6_k(const uint8_t* w, int cols, int r0, int r1, const float* x, const float*, float* y) {
  const int nb = cols / 256;
  for (int r = r0; r < r1; ++r) {
    const uint8_t* b = w + static_cast<size_t>(r) * nb * kQ6kBytes;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int i = 0; i < nb; ++i, b += kQ6kBytes) {
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int h = 0; h < 2; ++h) {
        __m256i q[4];
        q6_k_codes(b + 64 * h, b + 128 + 32 * h, q);
        const float* xh = x + 256 * i + 128 * h;
        for (int k = 0; k < 4; ++k) {
          const int8_t* s = sc + 8 * h + 2 * k;
          acc0 = _mm256_fmadd_ps(dot_i8x16(_mm256_castsi256_si128(q[k]), xh + 32 * k),
                                 _mm256_set1_ps(d * static_cast<float>(s[0])), acc0);
          acc1 = _mm256_fmadd_ps(dot_i8x16(_mm256_extracti128_si256(q[k], 1), xh + 32 * k + 16),
                                 _mm256_set1_ps(d * static_cast<float>(s[1])), acc1);
        }
      }
    }
    y[r - r0] = hsum(_mm256_add_ps(acc0, acc1));
  }
}

}  // namespace

QgemvKernels qgemv_avx2() { return {q4_0, q4_1, q5_0, q8_0, q4_k, q6_k}; }

}  // namespace tqkv::engine::detail
