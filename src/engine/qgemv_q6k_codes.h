// Q6_K code unpacking shared by the AVX2 and AVX-512 qgemv files. Included only by files
// compiled with AVX2 or more; the unnamed namespace gives each file its own copy, compiled for
// its own ISA (an inline function with external linkage could be merged across them).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace tqkv::engine::detail {
namespace {

// 4 x 32 Q6_K codes of one 128-element half (qgemv_kernels.h), as int8 q - 32.
inline void q6_k_codes(const uint8_t* ql, const uint8_t* qh, __m256i q[4]) {
  const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  // 16-bit shifts move bits across bytes, but the masks keep only each byte's own.
  q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m3));
  q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m3));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(h, m3));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(h, 2), m3));
  for (int k = 0; k < 4; ++k) q[k] = _mm256_sub_epi8(q[k], off);
}

}  // namespace
}  // namespace tqkv::engine::detail
