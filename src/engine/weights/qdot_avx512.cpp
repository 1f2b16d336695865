// The int8 path's kernels for AVX-512 F+BW+VL+DQ with VNNI (this file alone is compiled with
// those flags; qgemv.cpp calls it only where qdot_avx512_supported()): the contract of
// qgemv_kernels.h with two 32-element blocks per 512-bit vector, even block in lanes 0-7, odd
// in 8-15, which is the contract's 16 lanes as they are. One vpdpbusd per 64 weights and row
// gives the lanes' 4-element sums, starting from the precomputed -sum(xq) of each lane times
// the offset o; Q8_0's signed codes take the sign trick (|w| times xq negated where w < 0).
// A row of an odd number of blocks ends in a half vector (lanes 0-7, masked).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "engine/weights/qgemv_kernels.h"
#include "engine/weights/qgemv_simd.h"

namespace tqkv::engine::detail {
namespace {

inline __m512i pair_i(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline __m512 pair_ps(float lo, float hi) {
  return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

// The fp16 fields at pa and pb as floats, pa's in lanes 0-7 and pb's in 8-15 (one conversion).
inline __m512 pair_f16(const uint8_t* pa, const uint8_t* pb) {
  uint16_t ha, hb;
  std::memcpy(&ha, pa, 2);
  std::memcpy(&hb, pb, 2);
  const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(ha | (static_cast<uint32_t>(hb) << 16))));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), _mm512_castps128_ps512(two));
}

// The codes of two Q4_0/Q4_1/Q5_0 blocks (qs of each): per block its low nibbles, then its
// high ones.
inline __m512i nibbles2(const uint8_t* qa, const uint8_t* qb) {
  const __m512i q = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                             _mm512_castsi256_si512(_mm256_set_m128i(load16(qb), load16(qa))));
  return _mm512_and_si512(_mm512_srlv_epi64(q, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)), _mm512_set1_epi8(0x0f));
}

// Two blocks of a weight row (or one, lanes 0-7): codes, lane scales, their min weights.
struct Pair {
  __m512i c;
  __m512 dw;
  float mw[2];
};

// One K-quant super-block decoded: 4 vectors of 64 codes, the int16 scales and factors of
// k_quant_rows, d, dmin.
struct KBlock {
  __m512i c[4];
  __m256i s, m;  // as k_quant_rows (qgemv_simd.h)
  float d, dmin;
};

// The contract's tree over 16 lanes.
inline float tree(__m512 acc) { return tree8(_mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1))); }

template <int N>
struct RowState {
  __m512 acc[N];
  float off[N];
  RowState() {
#pragma GCC unroll 8
    for (int t = 0; t < N; ++t) {
      acc[t] = _mm512_setzero_ps();
      off[t] = 0;
    }
  }
};

// Adds blocks b (even) and b + 1 (kHalf: b alone) of weight pair p to the N rows' state.
// kShift: log2 of the offset o, or -1; kMin: whether p has min weights; kSigned: Q8_0.
template <int N, int kShift, bool kMin, bool kSigned, bool kHalf>
inline void apply(const QdotArgs& a, const Pair& p, int b, RowState<N>& s) {
  const int cols4 = a.cols / 4, nb = a.cols / 32;
  const __mmask16 lanes = kHalf ? 0x00ff : 0xffff;
  const __mmask64 neg = kSigned ? _mm512_movepi8_mask(p.c) : 0;
  const __m512i u = kSigned ? _mm512_abs_epi8(p.c) : p.c;
#pragma GCC unroll 8
  for (int t = 0; t < N; ++t) {
    const int8_t* xqp = a.x.xq + static_cast<size_t>(t) * a.cols + 32 * b;
    const size_t at = static_cast<size_t>(t) * cols4 + 8 * b;
    __m512i xq = kHalf ? _mm512_zextsi256_si512(load32(xqp)) : _mm512_loadu_si512(xqp);
    if (kSigned) xq = _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq);
    __m512i start = _mm512_setzero_si512();
    if (kShift >= 0) start = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(lanes, a.x.x4n + at), kShift < 0 ? 0 : kShift);
    const __m512i sum = _mm512_dpbusd_epi32(start, u, xq);
    const __m512 scale = _mm512_mul_ps(p.dw, _mm512_maskz_loadu_ps(lanes, a.x.xd8 + at));
    s.acc[t] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, s.acc[t], lanes);
    if (kMin) {
      const float* xs = a.x.xs + static_cast<size_t>(t) * nb + b;
      s.off[t] = std::fma(p.mw[0], xs[0], s.off[t]);
      if (!kHalf) s.off[t] = std::fma(p.mw[1], xs[1], s.off[t]);
    }
  }
}

// y of the N rows from their state; kMin as in qdot.cpp's twin.
template <int N, int kMin>
inline void store(const QdotArgs& a, int r, const RowState<N>& s) {
#pragma GCC unroll 8
  for (int t = 0; t < N; ++t) {
    const float v = tree(s.acc[t]);
    a.y[t * a.ldy + (r - a.r0)] = kMin > 0 ? v + s.off[t] : kMin < 0 ? v - s.off[t] : v;
  }
}

// Types of 32-element blocks (kBytes each): pair(b0, b1) decodes two blocks (b1 = nullptr:
// b0 alone, its codes in the low half).
template <int N, int kBytes, int kShift, int kMin, bool kSigned, class PairOf>
inline void over_rows32(const QdotArgs& a, PairOf pair) {
  const int nb = a.cols / 32;
  for (int r = a.r0; r < a.r1; ++r) {
    const uint8_t* row = a.w + static_cast<size_t>(r) * nb * kBytes;
    RowState<N> s;
    int b = 0;
    for (; b + 1 < nb; b += 2) {
      const uint8_t* p0 = row + static_cast<size_t>(b) * kBytes;
      apply<N, kShift, kMin != 0, kSigned, false>(a, pair(p0, p0 + kBytes), b, s);
    }
    if (b < nb) apply<N, kShift, kMin != 0, kSigned, true>(a, pair(row + static_cast<size_t>(b) * kBytes, nullptr), b, s);
    store<N, kMin>(a, r, s);
  }
}

template <int N>
void q4_0(const QdotArgs& a) {
  over_rows32<N, 18, 3, 0, false>(a, [](const uint8_t* b0, const uint8_t* b1) {
    const uint8_t* c1 = b1 ? b1 : b0;
    Pair p;
    p.c = nibbles2(b0 + 2, c1 + 2);
    p.dw = pair_f16(b0, c1);
    return p;
  });
}

template <int N>
void q4_1(const QdotArgs& a) {
  over_rows32<N, 20, -1, 1, false>(a, [](const uint8_t* b0, const uint8_t* b1) {
    const uint8_t* c1 = b1 ? b1 : b0;
    Pair p;
    p.c = nibbles2(b0 + 4, c1 + 4);
    p.dw = pair_f16(b0, c1);
    p.mw[0] = f16(b0 + 2);
    p.mw[1] = f16(c1 + 2);
    return p;
  });
}

// Q5_0: the two blocks' qh words are the 64-bit mask of the codes that get 16 added.
template <int N>
void q5_0(const QdotArgs& a) {
  over_rows32<N, 22, 4, 0, false>(a, [](const uint8_t* b0, const uint8_t* b1) {
    const uint8_t* c1 = b1 ? b1 : b0;
    uint32_t h0, h1;
    std::memcpy(&h0, b0 + 2, 4);
    std::memcpy(&h1, c1 + 2, 4);
    Pair p;
    const __m512i c = nibbles2(b0 + 6, c1 + 6);
    p.c = _mm512_mask_add_epi8(c, static_cast<__mmask64>(h0) | (static_cast<__mmask64>(h1) << 32), c, _mm512_set1_epi8(16));
    p.dw = pair_f16(b0, c1);
    return p;
  });
}

template <int N>
void q8_0(const QdotArgs& a) {
  over_rows32<N, 34, -1, 0, true>(a, [](const uint8_t* b0, const uint8_t* b1) {
    const uint8_t* c1 = b1 ? b1 : b0;
    Pair p;
    p.c = pair_i(load32(b0 + 2), load32(c1 + 2));
    p.dw = pair_f16(b0, c1);
    return p;
  });
}

// K-quants (per-256 activations, qgemv_kernels.h): a super-block is 4 vectors of 64 codes
// (two 32-element blocks each); vpmaddubsw gives int16 pair sums, vpdpwssd multiplies them by
// the int16 scales (times sub-scales) of their 16 elements and adds pairs into the int32
// lanes, and the halves of the 16 lanes fold into the contract's 8. kMin: Q4_K (dword j of su
// is sub-block j's scale twice), else Q6_K (word n: the scale of elements 16n ..).
template <int N, int kBytes, bool kMin, class Decode>
inline void over_rows256(const QdotArgs& a, Decode decode) {
  k_quant_rows<N, kBytes, kMin, KBlock>(a, decode, [](const KBlock& k, const int8_t* xk, __m256i su) {
    const __m512i s16 = _mm512_castsi256_si512(su);
    const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i quarter = _mm512_set_epi64(0x0003000300030003, 0x0003000300030003, 0x0002000200020002,
                                             0x0002000200020002, 0x0001000100010001, 0x0001000100010001, 0, 0);
    __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      // Vector g's scales: Q4_K sub-blocks 2g, 2g + 1; Q6_K 16-element halves 4g .. 4g + 3.
      const __m512i sc = kMin ? _mm512_permutexvar_epi32(_mm512_add_epi32(pair, _mm512_set1_epi32(2 * g)), s16)
                              : _mm512_permutexvar_epi16(_mm512_add_epi16(quarter, _mm512_set1_epi16(static_cast<int16_t>(4 * g))), s16);
      s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(k.c[g], _mm512_loadu_si512(xk + 64 * g)), sc);
    }
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
  });
}

// Q4_K: vector g holds sub-blocks 2g (low nibbles) and 2g + 1 (high).
template <int N>
void q4_k(const QdotArgs& a) {
  over_rows256<N, 144, true>(a, [](const uint8_t* b, KBlock& k) {
    const __m128i v = q4_k_scales_mins_v(b + 4);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    // The 32 bytes in both halves (a load, no shuffle), the upper half shifted to its high nibbles.
    for (int g = 0; g < 4; ++g) {
      const __m512i q = _mm512_broadcast_i64x4(load32(b + 16 + 32 * g));
      k.c[g] = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xffff0000u, q, 4), m4);
    }
    k.s = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
    k.m = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v));
    k.d = f16(b);
    k.dmin = f16(b + 2);
  });
}

// Q6_K: vector g holds 32-element blocks 2g and 2g + 1, whose 16-element halves take the
// scales sc[4g .. 4g + 3].
template <int N>
void q6_k(const QdotArgs& a) {
  over_rows256<N, kQ6kBytes, false>(a, [](const uint8_t* b, KBlock& k) {
    // q6_k_codes_u's 4 vectors as 2 of 64 codes: ql's 64 bytes in one load, qh's 32 in both
    // halves, each half shifted by its own count; (a & m4) | (b & m3) as and + vpternlog.
    const __m512i m4 = _mm512_set1_epi8(0x0f), m3 = _mm512_set1_epi8(0x30);
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);  // per-word counts
    for (int h = 0; h < 2; ++h) {
      const __m512i l = _mm512_loadu_si512(b + 64 * h);
      const __m512i hb = _mm512_broadcast_i64x4(load32(b + 128 + 32 * h));
      const __m512i h01 = _mm512_sllv_epi16(hb, up);
      const __m512i h23 = _mm512_mask_srli_epi16(hb, 0xffff0000u, hb, 2);
      k.c[2 * h] = _mm512_ternarylogic_epi32(_mm512_and_si512(l, m4), h01, m3, 0xf8);
      k.c[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4), h23, m3, 0xf8);
    }
    k.s = k.m = _mm256_cvtepi8_epi16(load16(b + 192));
    k.d = f16(b + 208);
    k.dmin = 0;
  });
}

}  // namespace

// quantize_rows's per-256 pass (qdot.cpp) 16 floats at a time, bit for bit: a super-block's
// max |x| is exact in any order, x * id is one rounded multiply (roundscale then takes the
// nearest even integer, as the scalar's (v + 1.5 * 2^23) - 1.5 * 2^23 does for |v| < 2^22;
// past that both clamp), and NaN or inf give the same INT_MIN before the clamp.
void quantize_rows_256_avx512(const float* x, size_t blocks, int8_t* xk, float* xkd, int16_t* xkb, int16_t* xku) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (size_t i = 0; i < blocks; ++i) {
    const float* xi = x + 256 * i;
    __m512 v[16];
    __mmask16 bad = 0;
#pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) {
      v[c] = _mm512_loadu_ps(xi + 16 * c);
      bad |= _mm512_fpclass_ps_mask(v[c], 0x99);  // QNaN, +inf, -inf, SNaN
    }
    float amax[8], top = 0;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      amax[j] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v[2 * j]), _mm512_andnot_ps(sign, v[2 * j + 1])));
      top = amax[j] > top ? amax[j] : top;
    }
    const float d = bad == 0 ? top / (127.0f * kSub) : std::nanf("");
    xkd[i] = d;
    for (int j = 0; j < 8; ++j) {
      int u = 1;
      if (d > 0) u = static_cast<int>(std::ceil(kSub * amax[j] / top));
      u = u < 1 ? 1 : u > kSub ? kSub : u;
      const __m512 id = _mm512_set1_ps(d > 0 ? 1.0f / (d * static_cast<float>(u)) : 0.0f);
      for (int h = 0; h < 2; ++h) {
        const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[2 * j + h], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i c = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(r)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xk + 256 * i + 32 * j + 16 * h), _mm512_cvtepi32_epi8(c));
        xkb[16 * i + 2 * j + h] = static_cast<int16_t>(_mm512_reduce_add_epi32(c));
        xku[16 * i + 2 * j + h] = static_cast<int16_t>(u);
      }
    }
  }
}

QdotKernels qdot_avx512() {
  return {TQKV_QDOT_ENTRY(q4_0), TQKV_QDOT_ENTRY(q4_1), TQKV_QDOT_ENTRY(q5_0),
          TQKV_QDOT_ENTRY(q8_0), TQKV_QDOT_ENTRY(q4_k), TQKV_QDOT_ENTRY(q6_k)};
}

}  // namespace tqkv::engine::detail
