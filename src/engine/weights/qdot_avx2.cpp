// The int8 path's kernels for AVX2+FMA+F16C (this file alone is compiled with those flags):
// the contract of qgemv_kernels.h with one 32-element block per 256-bit vector. vpmaddubsw
// multiplies the unsigned weight codes by the int8 activations and adds pairs (at most
// 2 * 63 * 127 or, for Q8_0's sign trick, 2 * 128 * 127: no saturation), vpmaddwd adds pairs
// again, which gives the contract's 8 lanes of 4 elements exactly; the offsets o come from the
// precomputed -sum(xq) of each lane times o (a shift). Even blocks accumulate in one vector,
// odd ones in another: together the contract's 16 lanes.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "engine/weights/block_groups.h"
#include "engine/weights/qgemv_kernels.h"
#include "engine/weights/qgemv_simd.h"

namespace tqkv::engine::detail {
namespace {


// The 32 codes of a Q4_0/Q4_1/Q5_0 block: low nibbles (elements 0-15), then high ones.
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i m4 = _mm_set1_epi8(0x0f), q = load16(qs);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}

// 32-element blocks of one weight block (J of them): codes, lane scales, min weights.
template <int J>
struct Blocks {
  __m256i c[J];
  __m256 dw[J];
  float mw[J];
};

// The contract's tree over the 16 lanes even (0-7) and odd (8-15).
inline float tree(__m256 even, __m256 odd) { return tree8(_mm256_add_ps(even, odd)); }

// For each weight row, its 32-element blocks (kBytes bytes) decoded by block(p, k), each
// multiplied by the N activation rows. kShift: log2 of the offset o, or -1 for none; kMin as in
// qdot.cpp's twin; kSigned: Q8_0's signed codes. Blocks go in pairs, even then odd, so that the
// accumulator of each parity is a compile-time index and stays in a register (indexed by
// b & 1 it lived on the stack: every block's FMA waited on the last one's store, ~30% of
// SmolLM2's decode step on an AVX2 host).
template <int N, int kElems, int kBytes, int kShift, int kMin, bool kSigned, class Block>
inline void over_rows(const QdotArgs& a, Block block) {
  static_assert(kElems == 32, "over_rows takes 32-element blocks");
  const int nb = a.cols / 32, cols4 = a.cols / 4;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = a.r0; r < a.r1; ++r) {
    const uint8_t* row = a.w + static_cast<size_t>(r) * nb * kBytes;
    __m256 acc[2][N];
    float off[N];
#pragma GCC unroll 8
    for (int t = 0; t < N; ++t) {
      acc[0][t] = acc[1][t] = _mm256_setzero_ps();
      off[t] = 0;
    }
    // Block b into the accumulators of parity P (= b & 1).
    const auto one = [&]<int P>(int b) {
      Blocks<1> k;
      block(row + static_cast<size_t>(b) * kBytes, k);
      const __m256i u = kSigned ? _mm256_sign_epi8(k.c[0], k.c[0]) : k.c[0];
#pragma GCC unroll 8
      for (int t = 0; t < N; ++t) {
        __m256i xq = load32(a.x.xq + static_cast<size_t>(t) * a.cols + 32 * b);
        if (kSigned) xq = _mm256_sign_epi8(xq, k.c[0]);
        __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq), ones);
        const size_t at = static_cast<size_t>(t) * cols4 + 8 * b;
        if (kShift >= 0) s = _mm256_add_epi32(s, _mm256_slli_epi32(load32(a.x.x4n + at), kShift < 0 ? 0 : kShift));
        const __m256 scale = _mm256_mul_ps(k.dw[0], _mm256_loadu_ps(a.x.xd8 + at));
        acc[P][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[P][t]);
        if (kMin != 0) off[t] = std::fma(k.mw[0], a.x.xs[static_cast<size_t>(t) * nb + b], off[t]);
      }
    };
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
      one.template operator()<0>(b);
      one.template operator()<1>(b + 1);
    }
    if (b < nb) one.template operator()<0>(b);
#pragma GCC unroll 8
    for (int t = 0; t < N; ++t) {
      const float s = tree(acc[0][t], acc[1][t]);
      a.y[t * a.ldy + (r - a.r0)] = kMin > 0 ? s + off[t] : kMin < 0 ? s - off[t] : s;
    }
  }
}

template <int N>
void q4_0(const QdotArgs& a) {
  over_rows<N, 32, 18, 3, 0, false>(a, [](const uint8_t* b, Blocks<1>& k) {
    k.c[0] = nibbles(b + 2);
    k.dw[0] = _mm256_set1_ps(f16(b));
  });
}

template <int N>
void q4_1(const QdotArgs& a) {
  over_rows<N, 32, 20, -1, 1, false>(a, [](const uint8_t* b, Blocks<1>& k) {
    k.c[0] = nibbles(b + 4);
    k.dw[0] = _mm256_set1_ps(f16(b));
    k.mw[0] = f16(b + 2);
  });
}

// Q5_0's 32 codes (0-31): byte j gets bit j of qh (byte j / 8 of it, spread by a shuffle).
inline __m256i q5_0_codes(const uint8_t* b) {
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), spread);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
  return _mm256_or_si256(nibbles(b + 6), _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

template <int N>
void q5_0(const QdotArgs& a) {
  over_rows<N, 32, 22, 4, 0, false>(a, [](const uint8_t* b, Blocks<1>& k) {
    k.c[0] = q5_0_codes(b);
    k.dw[0] = _mm256_set1_ps(f16(b));
  });
}

// Q5_0, Q4_1 and Q8_0 in groups of eight blocks (block_groups.h), the same contracts as q5_0,
// q4_1 and q8_0 bit for bit (the same lane sums, scales dw * xd[b], accumulators in block order,
// and Q4_1's mins one scalar fma a block in block order). Per group: one vcvtph2ps for the
// eight scales (and one for Q4_1's eight mins) and one multiply by the eight activation scales
// per row; per pair of 4-bit blocks one load for both blocks' nibbles; per Q5_0 block a
// broadcast, a shift and a blend for the high bits (every byte's sign bit is its element's, see
// the layout). About 12 instructions a Q5_0 block against q5_0's 24; the weights are prefetched
// 1 KB ahead, which only paid once the kernel was this lean (one core: Q5_0 7-9 -> 11-12.5 GB/s
// on an earlier AVX2 EPYC host; on a Zen 1 core Q4_1 4.1-4.2 -> 5.1, Q8_0 6.0-6.3 -> 7.4-7.5).
enum class GroupKind { Q5_0, Q4_1, Q8_0 };

template <int N, GroupKind kKind>
void grouped(const QdotArgs& a) {
  constexpr bool kQ4_1 = kKind == GroupKind::Q4_1, kQ8_0 = kKind == GroupKind::Q8_0;
  constexpr int kPrefetch = 1024, kBlockBytes = kQ4_1 ? 20 : kQ8_0 ? 34 : 22;
  constexpr int kGroupBytes = kQ4_1 ? kQ4_1GroupBytes : kQ8_0 ? kQ8_0GroupBytes : kQ5_0GroupBytes;
  constexpr int kCodesAt = kQ4_1 ? 32 : kQ8_0 ? 16 : 48;
  const int nb = a.cols / 32, groups = nb / kGroupBlocks, cols4 = a.cols / 4;
  const size_t row_bytes = static_cast<size_t>(nb) * kBlockBytes;
  const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(16);
  const __m256i to_sign = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  for (int r = a.r0; r < a.r1; ++r) {
    const uint8_t* row = a.w + static_cast<size_t>(r) * row_bytes;
    __m256 acc[2][N];
    float off[N];
#pragma GCC unroll 8
    for (int t = 0; t < N; ++t) {
      acc[0][t] = acc[1][t] = _mm256_setzero_ps();
      off[t] = 0;
    }
    // Codes c of block b into the accumulators of parity P, lane scales scale(t), Q4_1's min mw.
    const auto apply = [&]<int P>(__m256i c, int b, auto scale, float mw) {
      const __m256i u = kQ8_0 ? _mm256_sign_epi8(c, c) : c;  // Q8_0: |c| against sign(c) x
#pragma GCC unroll 8
      for (int t = 0; t < N; ++t) {
        __m256i xq = load32(a.x.xq + static_cast<size_t>(t) * a.cols + 32 * b);
        if constexpr (kQ8_0) xq = _mm256_sign_epi8(xq, c);
        __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq), ones);
        if constexpr (kKind == GroupKind::Q5_0)  // the offset 16
          s = _mm256_add_epi32(s, _mm256_slli_epi32(load32(a.x.x4n + static_cast<size_t>(t) * cols4 + 8 * b), 4));
        acc[P][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale(t), acc[P][t]);
        if constexpr (kQ4_1) off[t] = std::fma(mw, a.x.xs[static_cast<size_t>(t) * nb + b], off[t]);
      }
    };
    for (int g = 0; g < groups; ++g) {
      const uint8_t* G = row + static_cast<size_t>(g) * kGroupBytes;
      for (int l = 0; l < kGroupBytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(G + kPrefetch + l), _MM_HINT_T0);
      const __m256 dw = _mm256_cvtph_ps(load16(G));
      alignas(32) float mw[kGroupBlocks] = {};
      if constexpr (kQ4_1) _mm256_store_ps(mw, _mm256_cvtph_ps(load16(G + 16)));
      __m256 sc[N];
#pragma GCC unroll 8
      for (int t = 0; t < N; ++t) sc[t] = _mm256_mul_ps(dw, _mm256_loadu_ps(a.x.xd + static_cast<size_t>(t) * nb + 8 * g));
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        __m256i codes[2];
        if constexpr (kQ8_0) {
          codes[0] = load32(G + kCodesAt + 64 * p);
          codes[1] = load32(G + kCodesAt + 64 * p + 32);
        } else {
          const __m256i v = load32(G + kCodesAt + 32 * p);
          codes[0] = _mm256_and_si256(v, m4);
          codes[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        const auto block = [&]<int H>() {
          const int j = 2 * p + H;
          __m256i c = codes[H];
          if constexpr (kKind == GroupKind::Q5_0) {
            int32_t w;
            std::memcpy(&w, G + 16 + 4 * j, 4);
            const __m256i high = _mm256_sllv_epi32(_mm256_set1_epi32(w), to_sign);
            c = _mm256_blendv_epi8(c, _mm256_or_si256(c, bit4), high);
          }
          const __m256i lane = _mm256_set1_epi32(j);
          apply.template operator()<H>(c, 8 * g + j, [&](int t) { return _mm256_permutevar8x32_ps(sc[t], lane); }, mw[j]);
        };
        block.template operator()<0>();
        block.template operator()<1>();
      }
    }
    // The row's last nb % 8 blocks, GGUF layout (the first of them has an even index).
    const auto gguf = [&]<int P>(int b) {
      const uint8_t* blk = row + static_cast<size_t>(b) * kBlockBytes;
      const __m256 dw = _mm256_set1_ps(f16(blk));
      const __m256i c = kQ4_1 ? nibbles(blk + 4) : kQ8_0 ? load32(blk + 2) : q5_0_codes(blk);
      apply.template operator()<P>(c, b, [&](int t) {
        return _mm256_mul_ps(dw, _mm256_loadu_ps(a.x.xd8 + static_cast<size_t>(t) * cols4 + 8 * b));
      }, kQ4_1 ? f16(blk + 2) : 0.0f);
    };
    int b = kGroupBlocks * groups;
    for (; b + 2 <= nb; b += 2) {
      gguf.template operator()<0>(b);
      gguf.template operator()<1>(b + 1);
    }
    if (b < nb) gguf.template operator()<0>(b);
#pragma GCC unroll 8
    for (int t = 0; t < N; ++t) {
      if constexpr (kQ4_1) {
        a.y[t * a.ldy + (r - a.r0)] = tree(acc[0][t], acc[1][t]) + off[t];
      } else {
        a.y[t * a.ldy + (r - a.r0)] = tree(acc[0][t], acc[1][t]);
      }
    }
  }
}
template <int N>
void q5_0_groups(const QdotArgs& a) {
  grouped<N, GroupKind::Q5_0>(a);
}
template <int N>
void q4_1_groups(const QdotArgs& a) {
  grouped<N, GroupKind::Q4_1>(a);
}
template <int N>
void q8_0_groups(const QdotArgs& a) {
  grouped<N, GroupKind::Q8_0>(a);
}

template <int N>
void q8_0(const QdotArgs& a) {
  over_rows<N, 32, 34, -1, 0, true>(a, [](const uint8_t* b, Blocks<1>& k) {
    k.c[0] = load32(b + 2);
    k.dw[0] = _mm256_set1_ps(f16(b));
  });
}

// K-quants (per-256 activations, qgemv_kernels.h): vpmaddubsw gives int16 pair sums of a
// 32-element block, vpmaddwd multiplies them by the int16 scales (times sub-scales) of their
// 16 elements and adds pairs into the contract's 8 int32 lanes.
struct KBlock {
  __m256i c[8];
  __m256i s, m;  // as k_quant_rows (qgemv_simd.h)
  float d, dmin;
};

// kMin: Q4_K (dword j of su is block j's scale twice), else Q6_K (dword j: its two halves').
template <int N, int kBytes, bool kMin, class Decode>
inline void over_rows256(const QdotArgs& a, Decode decode) {
  k_quant_rows<N, kBytes, kMin, KBlock>(a, decode, [](const KBlock& k, const int8_t* xk, __m256i su) {
    // Q6_K: block j's first 16 elements take word 2j of su, the next 16 word 2j + 1. With the
    // even words gathered in the low 128 bits and the odd ones in the high bits (one shuffle
    // and one qword permute per super-block), each block's scales are one in-lane shuffle
    // (vpermd + vpshufb before: 8 instructions fewer a super-block, more on hosts that split
    // 256-bit permutes).
    if (!kMin) {
      const __m256i evens_odds = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9,
                                                  12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
      su = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(su, evens_odds), _MM_SHUFFLE(3, 1, 2, 0));
    }
    __m256i S = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i sc = kMin ? _mm256_permutevar8x32_epi32(su, _mm256_set1_epi32(j))
                              : _mm256_shuffle_epi8(su, _mm256_set1_epi16(static_cast<short>(0x0100 + 0x0202 * j)));
      S = _mm256_add_epi32(S, _mm256_madd_epi16(_mm256_maddubs_epi16(k.c[j], load32(xk + 32 * j)), sc));
    }
    return S;
  });
}

template <int N>
void q4_k(const QdotArgs& a) {
  over_rows256<N, 144, true>(a, [](const uint8_t* b, KBlock& k) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int g = 0; g < 4; ++g) {
      const __m256i q = load32(b + 16 + 32 * g);
      k.c[2 * g] = _mm256_and_si256(q, m4);
      k.c[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    }
    const __m128i v = q4_k_scales_mins_v(b + 4);
    k.s = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
    k.m = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v));
    k.d = f16(b);
    k.dmin = f16(b + 2);
  });
}

// Q6_K: block j = 4h + k's elements 0-15 take sc[2j], 16-31 sc[2j + 1].
template <int N>
void q6_k(const QdotArgs& a) {
  over_rows256<N, kQ6kBytes, false>(a, [](const uint8_t* b, KBlock& k) {
    for (int h = 0; h < 2; ++h) q6_k_codes_u(b + 64 * h, b + 128 + 32 * h, k.c + 4 * h);
    k.s = k.m = _mm256_cvtepi8_epi16(load16(b + 192));
    k.d = f16(b + 208);
    k.dmin = 0;
  });
}

}  // namespace

QdotKernels qdot_avx2() {
  return {TQKV_QDOT_ENTRY(q4_0), TQKV_QDOT_ENTRY(q4_1), TQKV_QDOT_ENTRY(q5_0), TQKV_QDOT_ENTRY(q8_0),
          TQKV_QDOT_ENTRY(q4_k), TQKV_QDOT_ENTRY(q6_k), TQKV_QDOT_ENTRY(q5_0_groups),
          TQKV_QDOT_ENTRY(q4_1_groups), TQKV_QDOT_ENTRY(q8_0_groups)};
}

}  // namespace tqkv::engine::detail
