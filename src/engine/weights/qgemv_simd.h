// Helpers shared by the AVX2 and AVX-512 qgemv / qdot files: fp16 fields, unaligned loads,
// Q6_K code unpacking, the last steps of a horizontal sum. Included only by files compiled
// with AVX2+F16C or more; the unnamed namespace gives each file its own copy, compiled for
// its own ISA (an inline function with external linkage could be merged across them).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "engine/weights/qgemv_kernels.h"

namespace tqkv::engine::detail {
namespace {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The int8 path's tree (qgemv_kernels.h) from its 8-lane step on: s8[l] = lanes l + (l + 8),
// then l + 4, then l + 2, then lane 0 + lane 1.
inline float tree8(__m256 s8) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// q4_k_scales_mins (qgemv_kernels.h) in one register, bytes 0-7 the scales and 8-15 the mins:
// the same whole-word masks and shifts on 4 dwords at once. Reads 16 bytes at sc, the 12
// packed bytes and 4 bytes after them (in a Q4_K block: codes), which the masks drop.
inline __m128i q4_k_scales_mins_v(const uint8_t* sc) {
  const __m128i v = load16(sc);                                      // u0 u1 u2 -
  const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));  // u0 u2 u1 u2
  const __m128i b = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));  // u0 u0 u1 u1
  const __m128i lo = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                                   _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  // ((u >> 6) & 0x03030303) << 4 == (u >> 2) & 0x30303030
  const __m128i hi = _mm_and_si128(_mm_srli_epi32(b, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return _mm_or_si128(lo, hi);
}

// 4 x 32 Q6_K codes of one 128-element half (qgemv_kernels.h), unsigned (0-63).
inline void q6_k_codes_u(const uint8_t* ql, const uint8_t* qh, __m256i q[4]) {
  const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(0x30);
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  // 16-bit shifts move bits across bytes, but the masks keep only each byte's own.
  q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m3));
  q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m3));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(h, m3));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(h, 2), m3));
}

// The same codes as int8 q - 32.
inline void q6_k_codes(const uint8_t* ql, const uint8_t* qh, __m256i q[4]) {
  const __m256i off = _mm256_set1_epi8(32);
  q6_k_codes_u(ql, qh, q);
  for (int k = 0; k < 4; ++k) q[k] = _mm256_sub_epi8(q[k], off);
}

// K-quant rows on the per-256 contract (qgemv_kernels.h), the part every ISA shares:
// decode(block, k) decodes a super-block into k (of type K: its codes as the ISA holds them;
// s: the 16 int16 scales, Q4_K's each twice, Q6_K's one per 16 elements; m: the factors of the
// 16-element activation sums, Q4_K's mins each twice, Q6_K's scales; d, dmin), lanes(k, xk, su)
// gives the 8 int32 lanes of its scaled sub-block dot products with the codes xk, su being
// k.s times the sub-scales; kMin: Q4_K's mins, else Q6_K's offset 32.
template <int N, int kBytes, bool kMin, class K, class Decode, class Lanes>
inline void k_quant_rows(const QdotArgs& a, Decode decode, Lanes lanes) {
  constexpr int kPrefetch = 1024;
  const int nw = a.cols / 256;
  for (int r = a.r0; r < a.r1; ++r) {
    const uint8_t* row = a.w + static_cast<size_t>(r) * nw * kBytes;
    __m256 acc[N];
#pragma GCC unroll 8
    for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
    for (int i = 0; i < nw; ++i) {
      const uint8_t* blk = row + static_cast<size_t>(i) * kBytes;
      for (int l = 0; l < kBytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch + l), _MM_HINT_T0);
      K k;
      decode(blk, k);
#pragma GCC unroll 8
      for (int t = 0; t < N; ++t) {
        const size_t at = static_cast<size_t>(t) * nw + i;
        const __m256i u = load32(a.x.xku + 16 * at);
        __m256i S = lanes(k, a.x.xk + 256 * at, _mm256_mullo_epi16(k.s, u));
        const __m256i m = _mm256_madd_epi16(_mm256_mullo_epi16(k.m, u), load32(a.x.xkb + 16 * at));
        if (!kMin) S = _mm256_sub_epi32(S, _mm256_slli_epi32(m, 5));
        const float xd = a.x.xkd[at];
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_set1_ps(k.d * xd), acc[t]);
        if (kMin) acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(k.dmin * xd), acc[t]);
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < N; ++t) a.y[t * a.ldy + (r - a.r0)] = tree8(acc[t]);
  }
}

}  // namespace
}  // namespace tqkv::engine::detail
