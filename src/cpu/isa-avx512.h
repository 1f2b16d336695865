// The AVX-512 traits of the attention kernel (internal): included only by kernel-avx512.cpp
// (F, BW, VL, DQ) and kernel-avx512vnni.cpp (+ VNNI, VBMI: int8 key scores), each compiled
// with its own flags; like kernel_impl.h, everything lives in an anonymous namespace.
//
// 16 floats per vector. fp16 via vcvtph2ps, bf16 by a 16-bit shift, fp8 E4M3 by moving its bits
// into an fp16 (value / 256), packed 2/3/4-bit codes by variable shifts of broadcast 32-bit
// words, Lloyd-Max levels by a 16-entry in-register table (vpermps). With VNNI + VBMI, 2-6-bit
// key and value codes become bytes (vpsrlvw / vpmultishiftqb), their int8 levels come from
// 64-entry byte tables (vpermb; 6-bit codes: two of them, the levels' high and low bytes) and
// the sums from vpdpbusd.
#pragma once
#include <immintrin.h>

#include "kernel_impl.h"
#include "wide_codes.h"

namespace tqkv::cpu {
namespace {

struct IsaAvx512 {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr bool kAnyBits = false;
  static constexpr float kFp8Factor = 256.0f;
  static constexpr int kAccRegs = 16;
  static constexpr int split_codes(int b) { return b == 4 ? 2 : b == 2 ? 4 : b == 3 ? 4 : 1; }
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  // Int8 key scores (kernel_impl.h): 64 channels (one byte each) per vector for 2-8 bits (6-8:
  // two-byte levels, kernel.h key_wide).
  static constexpr bool kHasI8 = true;
  using IV = __m512i;
  using IT = __m512i;
  static constexpr int i8_block(int b) { return b >= 2 && b <= kI8MaxKeyBits ? 64 : 0; }
  static IT i8_table(const uint8_t* t) { return _mm512_loadu_si512(t); }
  static IV izero() { return _mm512_setzero_si512(); }
  static V i2f(IV a) { return _mm512_cvtepi32_ps(a); }
  static IV dot_u8i8(IV acc, IV u, const int8_t* q) { return _mm512_dpbusd_epi32(acc, u, _mm512_loadu_si512(q)); }
  // 64 codes of 3, 5, 6, 7 or 8 bits -> 64 bytes in channel order, each code in the low B bits
  // (the next code's bits above it, which the tables, replicated every 2^B entries, ignore):
  // qword g gets bytes Bg .. Bg+7 (vpermb; those past the 8B are the masked load's zeros), byte
  // m of it the 8 bits from bit Bm (vpmultishiftqb). 8 bits: the bytes themselves.
  template <int B>
  [[gnu::always_inline]] static __m512i code_bytes(const uint8_t* p, int i) {
    static_assert(B == 3 || B >= 5, "code_bytes takes 3- and 5-8-bit codes");
    if constexpr (B == 8) return _mm512_loadu_si512(p + i);
    alignas(64) static constexpr auto ctl = [] {
      struct {
        uint8_t v[64];
      } x{};
      for (int g = 0; g < 8; ++g)
        for (int k = 0; k < 8; ++k) x.v[8 * g + k] = static_cast<uint8_t>(B * g + k);
      return x;
    }();
    constexpr long long shifts = [] {
      unsigned long long v = 0;
      for (int m = 0; m < 8; ++m) v |= static_cast<unsigned long long>(B * m) << (8 * m);
      return static_cast<long long>(v);
    }();
    const __m512i raw = _mm512_maskz_loadu_epi8(~0ull >> (64 - 8 * B), p + i * B / 8);
    return _mm512_multishift_epi64_epi8(_mm512_set1_epi64(shifts), _mm512_permutexvar_epi8(_mm512_load_si512(ctl.v), raw));
  }
  // A tile's int8 scores four keys at a time with the keys in the 128-bit lanes: the 4 keys'
  // level vectors of a 64-channel block are transposed by 128-bit blocks (8 vshufi64x2), so
  // vector m holds channels 16m .. 16m+15 of key k in lane k, and vpdpbusd against chunk m of
  // the row broadcast to the four lanes (qb: [rows][d/16][64] bytes, i8_broadcast_rows) leaves
  // each key's partial sums in its own lane. One transposing reduction per 4 keys and 4 rows
  // (9 instructions) replaces a 4-row reduction per key. The integers are those of
  // scores_i8 (integer sums in any order).
  static constexpr bool kI8Tiles = true;
  // z[m] lane k = level bytes 16m .. 16m+15 (kernel_impl.h i8_channel order) of key k's block at channel i.
  // 4 and 2 bits: the keys' code bytes go to the lanes first (one load and three 128-bit
  // inserts per 16 bytes), then a shift and a vpermb per vector (14 / 11 instructions per 4
  // keys instead of 4 decodes and 8 vshufi64x2: 20).
  // 16 bytes at p[k] + off in 128-bit lane k.
  static __m512i lanes16(const uint8_t* const* p, int off) {
    __m512i x = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[0] + off)));
    x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[1] + off)), 1);
    x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[2] + off)), 2);
    return _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[3] + off)), 3);
  }
  // out[m] = the levels of the 2-bit codes at bit 2m of every byte of x.
  static void lookup_2bit(__m512i x, IT table, __m512i* out) {
    out[0] = _mm512_permutexvar_epi8(x, table);
    out[1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(x, 2), table);
    out[2] = _mm512_permutexvar_epi8(_mm512_srli_epi16(x, 4), table);
    out[3] = _mm512_permutexvar_epi8(_mm512_srli_epi16(x, 6), table);
  }
  template <int B>
  static void levels_i8k(const uint8_t* const* p, int i, IT table, __m512i* z) {
    const auto lanes = [&](int off) { return lanes16(p, off); };
    if constexpr (B == 4) {  // low nibbles of bytes 0-15, 16-31, then the high ones
      const __m512i a = lanes(i / 2), b = lanes(i / 2 + 16);
      z[0] = _mm512_permutexvar_epi8(a, table);
      z[1] = _mm512_permutexvar_epi8(b, table);
      z[2] = _mm512_permutexvar_epi8(_mm512_srli_epi16(a, 4), table);
      z[3] = _mm512_permutexvar_epi8(_mm512_srli_epi16(b, 4), table);
    } else if constexpr (B == 2) {  // code m of each byte
      lookup_2bit(lanes(i / 4), table, z);
    } else {
      codes_i8k<B>(p, i, z);
      for (int m = 0; m < 4; ++m) z[m] = _mm512_permutexvar_epi8(z[m], table);
    }
  }
  // 3 and 5-8 bits: z[m] lane k = the code bytes 16m .. 16m+15 of key k's block at channel i,
  // the four keys' code_bytes transposed by 128-bit blocks (a lookup commutes with that, so the
  // tables apply after it: 6-8-bit codes look up both level bytes from one transposition).
  template <int B>
  [[gnu::always_inline]] static void codes_i8k(const uint8_t* const* p, int i, __m512i* z) {
    const __m512i l0 = code_bytes<B>(p[0], i), l1 = code_bytes<B>(p[1], i), l2 = code_bytes<B>(p[2], i),
                  l3 = code_bytes<B>(p[3], i);
    const __m512i t0 = _mm512_shuffle_i64x2(l0, l1, 0x44), t1 = _mm512_shuffle_i64x2(l0, l1, 0xee);
    const __m512i t2 = _mm512_shuffle_i64x2(l2, l3, 0x44), t3 = _mm512_shuffle_i64x2(l2, l3, 0xee);
    z[0] = _mm512_shuffle_i64x2(t0, t2, 0x88);
    z[1] = _mm512_shuffle_i64x2(t0, t2, 0xdd);
    z[2] = _mm512_shuffle_i64x2(t1, t3, 0x88);
    z[3] = _mm512_shuffle_i64x2(t1, t3, 0xdd);
  }
  static void i8_broadcast_rows(const int8_t* q8, int rows, int d, int8_t* qb) {
    for (int r = 0; r < rows; ++r)
      for (int m = 0; m < d / 16; ++m)
        for (int lane = 0; lane < 4; ++lane)
          std::memcpy(qb + (static_cast<size_t>(r) * (d / 16) + m) * 64 + lane * 16,
                      q8 + static_cast<size_t>(r) * d + m * 16, 16);
  }
  // A group of four keys' scores (p[4]: their code rows) against NR rows -> s[r * kTile + k],
  // k < n (n = 4 but in a run's last group). A whole group stores its four lanes unmasked
  // (masked stores are slow on Zen 4); the last group masked, as it may end a tile's row.
  // 6-8-bit keys (two-byte levels, kernel.h key_wide; T = WideTable<B>): the high bytes'
  // products (table) and the low bytes' (lo) in two accumulators a row, then 64 X + Y per lane
  // (|64 X + Y| < 2^31); the others take T = IT, lo unused.
  template <int NR, int B, class T>
  [[gnu::always_inline]] static void scores_i8_group(const int8_t* qb, int d, const uint8_t* const* p, float* s,
                                                     const T& table, const T& lo, int n) {
    constexpr bool kWide = B >= kI8WideBits;
    const int nc = d / 16;
    __m512i acc[NR], acc_lo[kWide ? NR : 1];
    for (int r = 0; r < NR; ++r) acc[r] = acc_lo[kWide ? r : 0] = _mm512_setzero_si512();
    for (int i = 0; i < d; i += 64) {
      __m512i z[4], zl[4];
      if constexpr (kWide) {
        codes_i8k<B>(p, i, z);
        for (int m = 0; m < 4; ++m) {
          zl[m] = lo(z[m]);
          z[m] = table(z[m]);
        }
      } else {
        levels_i8k<B>(p, i, table, z);
      }
      for (int r = 0; r < NR; ++r) {
        const int8_t* qr = qb + (static_cast<size_t>(r) * nc + i / 16) * 64;
        for (int m = 0; m < 4; ++m) {
          const __m512i q = _mm512_loadu_si512(qr + 64 * m);
          acc[r] = _mm512_dpbusd_epi32(acc[r], z[m], q);
          if constexpr (kWide) acc_lo[r] = _mm512_dpbusd_epi32(acc_lo[r], zl[m], q);
        }
      }
    }
    if constexpr (kWide)
      for (int r = 0; r < NR; ++r) acc[r] = _mm512_add_epi32(_mm512_slli_epi32(acc[r], 6), acc_lo[r]);
    // Rows by fours: lane k of x = the 4 rows' sums for key k, transposed to row-major.
    for (int r0 = 0; r0 < NR; r0 += 4) {
      const auto row = [&](int r) { return r0 + r < NR ? acc[r0 + r] : _mm512_setzero_si512(); };
      const __m512i a = row(0), b = row(1), c = row(2), e = row(3);
      const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
      const __m512i ce = _mm512_add_epi32(_mm512_unpacklo_epi32(c, e), _mm512_unpackhi_epi32(c, e));
      const __m512i x = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, ce), _mm512_unpackhi_epi64(ab, ce));
      const V y = _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0),
                                        _mm512_cvtepi32_ps(x));
      if (n == 4) {
        _mm_storeu_ps(s + (r0 + 0) * kTile, _mm512_castps512_ps128(y));
        if (r0 + 1 < NR) _mm_storeu_ps(s + (r0 + 1) * kTile, _mm512_extractf32x4_ps(y, 1));
        if (r0 + 2 < NR) _mm_storeu_ps(s + (r0 + 2) * kTile, _mm512_extractf32x4_ps(y, 2));
        if (r0 + 3 < NR) _mm_storeu_ps(s + (r0 + 3) * kTile, _mm512_extractf32x4_ps(y, 3));
      } else {
        const __mmask8 keep = static_cast<__mmask8>((1u << n) - 1u);
        _mm_mask_storeu_ps(s + (r0 + 0) * kTile, keep, _mm512_castps512_ps128(y));
        if (r0 + 1 < NR) _mm_mask_storeu_ps(s + (r0 + 1) * kTile, keep, _mm512_extractf32x4_ps(y, 1));
        if (r0 + 2 < NR) _mm_mask_storeu_ps(s + (r0 + 2) * kTile, keep, _mm512_extractf32x4_ps(y, 2));
        if (r0 + 3 < NR) _mm_mask_storeu_ps(s + (r0 + 3) * kTile, keep, _mm512_extractf32x4_ps(y, 3));
      }
    }
  }
  template <int NR, int B, class Pf, class T>
  static void scores_i8_groups(const int8_t* qb, int d, const uint8_t* base, size_t stride, int nt, float* s,
                               const T& table, const T& lo, const Pf& pf) {
    int j = 0;
    for (; j + 4 <= nt; j += 4) {
      pf(j, 4);
      const uint8_t* const p[4] = {base + static_cast<size_t>(j) * stride, base + static_cast<size_t>(j + 1) * stride,
                                   base + static_cast<size_t>(j + 2) * stride,
                                   base + static_cast<size_t>(j + 3) * stride};
      scores_i8_group<NR, B>(qb, d, p, s + j, table, lo, 4);
    }
    if (j < nt) {  // 1-3 keys left: the last one's codes fill the group
      const int n = nt - j;
      pf(j, n);
      const uint8_t* p[4];
      for (int k = 0; k < 4; ++k) p[k] = base + static_cast<size_t>(j + (k < n ? k : n - 1)) * stride;
      scores_i8_group<NR, B>(qb, d, p, s + j, table, lo, n);
    }
  }

  template <int NR, int B, class Pf>
  static void scores_i8_tile(const int8_t* qb, int d, const uint8_t* base, size_t stride, int nt, float* s,
                             IT table, const Pf& pf) {
    scores_i8_groups<NR, B>(qb, d, base, stride, nt, s, table, table, pf);
  }
  // A 6-8-bit level byte table of 2^B entries (kernel.h key_wide: 256 stored, replicated every
  // 2^B) in registers, looked up by a code byte's low B bits: one vpermb (64 entries), one
  // vpermt2b (128), or two and a blend on the code's bit 7 (256).
  template <int B>
  struct WideTable {
    static constexpr int kRegs = B <= 6 ? 1 : B == 7 ? 2 : 4;
    __m512i t[kRegs];
    explicit WideTable(const uint8_t* p) {
      for (int k = 0; k < kRegs; ++k) t[k] = _mm512_loadu_si512(p + 64 * k);
    }
    __m512i operator()(__m512i c) const {
      if constexpr (B <= 6)
        return _mm512_permutexvar_epi8(c, t[0]);
      else if constexpr (B == 7)
        return _mm512_permutex2var_epi8(t[0], c, t[1]);
      else
        return _mm512_mask_blend_epi8(_mm512_movepi8_mask(c), _mm512_permutex2var_epi8(t[0], c, t[1]),
                                      _mm512_permutex2var_epi8(t[2], c, t[3]));
    }
  };
  // 6-8-bit keys (kernel.h key_wide): hi, lo the level bytes' tables (256 entries each).
  template <int NR, int B, class Pf>
  static void scores_i8_tile_wide(const int8_t* qb, int d, const uint8_t* base, size_t stride, int nt, float* s,
                                  const uint8_t* hi, const uint8_t* lo, const Pf& pf) {
    static_assert(B >= kI8WideBits && B <= kI8MaxKeyBits, "two-byte key levels are for 6-8-bit codes");
    scores_i8_groups<NR, B>(qb, d, base, stride, nt, s, WideTable<B>(hi), WideTable<B>(lo), pf);
  }

  // Int8 value sums (kernel_impl.h), 64 channels per block, in vectors whose 32-bit lanes each
  // hold one channel of four consecutive keys, so that vpdpbusd against the row's four u8
  // weights (broadcast) sums them. 4 and 2 bits: the four keys' code bytes are interleaved
  // first (one vpermt2b / vpermb), then each code position of the byte is shifted down and
  // looked up (vpermb on the signed table value_i8, replicated every 2^B entries): vector q
  // lane j holds channel 2j + q (4 bits: q = 0, 1 from bytes 0-15, + 32 for q = 2, 3 from
  // bytes 16-31) or 4j + q (2 bits). 3, 5 and 6 bits: code_bytes per key, interleaved by 8
  // unpacks (position 16q + 4l + e, vector q, 128-bit lane l, holds channel 16l + 4q + e), then
  // looked up (6 bits: in both level bytes' tables, kernel.h value_wide).
  static constexpr bool kI8Values = true;
  static constexpr int i8v_block(int b) { return b >= 2 && b <= kI8WideBits ? 64 : 0; }
  static IT i8v_table(const int8_t* t) { return _mm512_loadu_si512(t); }
  struct IT2 {
    IT h, lo;
  };
  static IT2 i8v_table_wide(const int8_t* h, const int8_t* lo) { return {i8v_table(h), i8v_table(lo)}; }
  static int i8v_channel(int bits, int t) {
    const int q = t / 16, j = t % 16;
    if (bits == 4) return 32 * (q / 2) + 2 * j + q % 2;
    if (bits == 2) return 4 * j + q;
    return 16 * (j / 4) + 4 * q + j % 4;
  }
  // Code bytes of four keys (64 channels each) as four level vectors in the i8v_channel order.
  template <int B>
  static void levels_i8v(const uint8_t* const* p, int i, IT table, __m512i* t) {
    if constexpr (B == 4) {
      // out byte 4j + k = byte j (+ 16 for the second vector) of key k: k0 k1 in a, k2 k3 in b
      alignas(64) static constexpr auto idx = [] {
        struct {
          uint8_t v[2][64];
        } x{};
        for (int h = 0; h < 2; ++h)
          for (int j = 0; j < 16; ++j)
            for (int k = 0; k < 4; ++k) x.v[h][4 * j + k] = static_cast<uint8_t>(32 * k + 16 * h + j);
        return x;
      }();
      const auto two = [&](int a, int b) {
        return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[a] + i / 2))),
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[b] + i / 2)), 1);
      };
      const __m512i k01 = two(0, 1), k23 = two(2, 3);
      const __m512i x0 = _mm512_permutex2var_epi8(k01, _mm512_load_si512(idx.v[0]), k23);
      const __m512i x1 = _mm512_permutex2var_epi8(k01, _mm512_load_si512(idx.v[1]), k23);
      t[0] = _mm512_permutexvar_epi8(x0, table);
      t[1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(x0, 4), table);
      t[2] = _mm512_permutexvar_epi8(x1, table);
      t[3] = _mm512_permutexvar_epi8(_mm512_srli_epi16(x1, 4), table);
    } else if constexpr (B == 2) {
      alignas(64) static constexpr auto idx = [] {
        struct {
          uint8_t v[64];
        } x{};
        for (int j = 0; j < 16; ++j)
          for (int k = 0; k < 4; ++k) x.v[4 * j + k] = static_cast<uint8_t>(16 * k + j);
        return x;
      }();
      lookup_2bit(_mm512_permutexvar_epi8(_mm512_load_si512(idx.v), lanes16(p, i / 4)), table, t);
    } else {
      codes_i8v<B>(p, i, t);
      for (int q = 0; q < 4; ++q) t[q] = _mm512_permutexvar_epi8(t[q], table);
    }
  }
  // 3, 5 and 6 bits: the four keys' code_bytes interleaved into the i8v_channel order.
  template <int B>
  [[gnu::always_inline]] static void codes_i8v(const uint8_t* const* p, int i, __m512i* t) {
    const __m512i l0 = code_bytes<B>(p[0], i), l1 = code_bytes<B>(p[1], i), l2 = code_bytes<B>(p[2], i),
                  l3 = code_bytes<B>(p[3], i);
    const __m512i lo01 = _mm512_unpacklo_epi8(l0, l1), hi01 = _mm512_unpackhi_epi8(l0, l1);
    const __m512i lo23 = _mm512_unpacklo_epi8(l2, l3), hi23 = _mm512_unpackhi_epi8(l2, l3);
    t[0] = _mm512_unpacklo_epi16(lo01, lo23);
    t[1] = _mm512_unpackhi_epi16(lo01, lo23);
    t[2] = _mm512_unpacklo_epi16(hi01, hi23);
    t[3] = _mm512_unpackhi_epi16(hi01, hi23);
  }
  // 6-bit values: the high (t) and the low (lo) level bytes of four keys, in the same order.
  template <int B>
  [[gnu::always_inline]] static void levels_i8v_wide(const uint8_t* const* p, int i, const IT2& table, __m512i* t,
                                                     __m512i* lo) {
    static_assert(B == kI8WideBits, "two-byte levels are for 6-bit codes");
    codes_i8v<B>(p, i, t);
    for (int q = 0; q < 4; ++q) {
      lo[q] = _mm512_permutexvar_epi8(t[q], table.lo);
      t[q] = _mm512_permutexvar_epi8(t[q], table.h);
    }
  }
  static void store_u8(uint8_t* p, V x) {
    const __m512i i = _mm512_max_epi32(_mm512_cvtps_epi32(x), _mm512_setzero_si512());
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtusepi32_epi8(i));
  }
  static IV dot_u8v(IV acc, IV wb, IV t) { return _mm512_dpbusd_epi32(acc, wb, t); }
  // The same with 64 times the products (the high bytes of two-byte levels): the products' sum
  // shifted, |sum| * 64 <= 4 * 255 * 63 * 64 < 2^23.
  static IV dot_u8v64(IV acc, IV wb, IV t) {
    return _mm512_add_epi32(acc, _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wb, t), 6));
  }
  static IV set1_u32(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
#else
  static constexpr bool kHasI8 = false;
  static constexpr int i8_block(int) { return 0; }
#endif
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce(V v) { return _mm512_reduce_add_ps(v); }
  // Four horizontal sums at once: fold 512 -> 256 -> 128 bits pairwise, then within lanes.
  static void reduce4(V a, V b, V c, V d, float* out) {
    const V ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
    const V cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
    V x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4e));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xb1));
    // lanes 0, 4, 8, 12 hold a, b, c, d
    const __m128 s = _mm512_castps512_ps128(
        _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), x));
    _mm_storeu_ps(out, s);
  }
  static float half(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
  }
  static V halfs(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // Inline asm, not _mm_prefetch: GCC 12 found the kernel's prefetch helpers const (their only
  // effect a __builtin_prefetch) and deleted every call, so that no kernel issued a prefetch.
  // prefetch: into L2 (prefetcht1); prefetch_l1: into L1 (prefetcht0).
  static void prefetch(const uint8_t* p) { __asm__ volatile("prefetcht1 %0" : : "m"(*p)); }
  static void prefetch_l1(const uint8_t* p) { __asm__ volatile("prefetcht0 %0" : : "m"(*p)); }

  // Cephes-style expf: 2^n * p(r), |relative error| ~ 2e-7; 0 below -87.
  static V exp(V x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    V y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(y, n));
  }
  static float exp_scalar(float x) { return _mm_cvtss_f32(_mm512_castps512_ps128(exp(_mm512_set1_ps(x)))); }
  // The int8 value weights' exp (kernel.h kExpWPoly).
  static V exp_w(V x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
    const V t = _mm512_mul_ps(x, _mm512_set1_ps(kExpWLog2e));
    const V n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_maskz_scalef_ps(keep, exp_w_poly<IsaAvx512>(_mm512_sub_ps(t, n)), n);
  }

  static V f32(const uint8_t* p, int i) { return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + i); }
  static V f16(const uint8_t* p, int i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i)));
  }
  static V bf16(const uint8_t* p, int i) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  // E4M3 -> fp16 bits as in the AVX2 build: each byte into a lane's high byte, an arithmetic
  // shift right by one (the sign lands in bits 15 and 14) and the AND that clears bit 14.
  static V fp8(const uint8_t* p, int i) {
    const __m256i b8 = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))), 8);
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(b8, 1), _mm256_set1_epi16(static_cast<short>(0xBFFF))));
  }
  // Codes i .. i+15 (i a multiple of 16) as 32-bit lanes whose low B bits are the code (higher
  // bits may hold neighbours; lut() tables are replicated so that they do not matter).
  // 2 and 3 bits read a few bytes past the codes (4 / 8 bytes for 4 / 6 bytes of codes),
  // which always lie inside the slot or page: metadata follows every packed code row.
  template <int B>
  static __m512i code_ints(const uint8_t* p, int i) {
    if constexpr (B >= 5) {
      // 16 codes in exactly 2B bytes (a masked load reads nothing past them), broadcast to the
      // four 128-bit lanes, then one byte shuffle and one shift (wide_codes.h). lut() and
      // codes() mask the neighbours' bits above B.
      static constexpr auto tables = wide_code_tables<B, 16>();
      const __m128i raw = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << (2 * B)) - 1u), p + (i / 8) * B);
      const __m512i two = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(raw), _mm512_loadu_si512(tables.ctl));
      return _mm512_srlv_epi32(two, _mm512_loadu_si512(tables.shift));
    } else if constexpr (B == 4) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i / 2));
      return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, _mm_srli_epi16(b, 4)));
    } else if constexpr (B == 2) {
      uint32_t a;
      std::memcpy(&a, p + i / 4, 4);
      return _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(a)),
                               _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0));
    } else {
      static_assert(B == 3, "AVX-512 kernel decodes 2 to 8 bits");
      uint64_t a;
      std::memcpy(&a, p + (i / 8) * 3, 8);
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(static_cast<int>(a))),
                                           _mm256_set1_epi32(static_cast<int>(a >> 24)), 1);
      return _mm512_srlv_epi32(w, _mm512_set_epi32(21, 18, 15, 12, 9, 6, 3, 0, 21, 18, 15, 12, 9, 6, 3, 0));
    }
  }
  // Split decode (kernel_impl.h): one lane per byte of the block (2, 4 bits), or per 12 bits
  // (3 bits: 4 codes; the two 16-bit words holding them, shifted down), then a shift and a
  // table lookup per vector.
  template <int B>
  static void lut_split(const uint8_t* p, int i, const float* table16, V* out) {
    constexpr int K = split_codes(B);
    __m512i x;
    if constexpr (B == 3) {
      // 64 codes in 24 bytes (a masked load reads nothing past them); lane l's codes start at
      // bit 12l: word 3l/4, shift 12l mod 16.
      const __m512i raw = _mm512_maskz_loadu_epi8(0xffffff, p + (i / 8) * 3);
      const __m512i words = _mm512_permutexvar_epi16(
          _mm512_set_epi16(12, 11, 11, 10, 10, 9, 10, 9, 9, 8, 8, 7, 7, 6, 7, 6, 6, 5, 5, 4, 4, 3, 4, 3, 3, 2, 2, 1, 1, 0,
                           1, 0),
          raw);
      x = _mm512_srlv_epi32(words, _mm512_set_epi32(4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0));
    } else {
      x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i * B / 8)));
    }
    const V t = _mm512_loadu_ps(table16);
    out[0] = _mm512_permutexvar_ps(x, t);
    for (int k = 1; k < K; ++k) out[k] = _mm512_permutexvar_ps(_mm512_srli_epi32(x, B * k), t);
  }
  template <int B>
  static V codes(const uint8_t* p, int i) {
    return _mm512_cvtepi32_ps(_mm512_and_si512(code_ints<B>(p, i), _mm512_set1_epi32((1 << B) - 1)));
  }
  template <int B>
  static V lut(const uint8_t* p, int i, const float* table16) {
    if constexpr (B == 5) {  // table16 is the full 2^B-entry level table here
      // A 32-entry table in two registers: vpermi2ps reads the low 5 bits of each lane.
      return _mm512_permutex2var_ps(_mm512_loadu_ps(table16), code_ints<B>(p, i), _mm512_loadu_ps(table16 + 16));
    } else if constexpr (B == 6) {
      // 64 entries: two 32-entry lookups, bit 5 of the code picks one.
      const __m512i c = code_ints<B>(p, i);
      const V lo = _mm512_permutex2var_ps(_mm512_loadu_ps(table16), c, _mm512_loadu_ps(table16 + 16));
      const V hi = _mm512_permutex2var_ps(_mm512_loadu_ps(table16 + 32), c, _mm512_loadu_ps(table16 + 48));
      return _mm512_mask_blend_ps(_mm512_test_epi32_mask(c, _mm512_set1_epi32(32)), lo, hi);
    } else if constexpr (B >= 7) {
      return _mm512_i32gather_ps(_mm512_and_si512(code_ints<B>(p, i), _mm512_set1_epi32((1 << B) - 1)), table16, 4);
    } else {
      return _mm512_permutexvar_ps(code_ints<B>(p, i), _mm512_loadu_ps(table16));
    }
  }
};

}  // namespace
}  // namespace tqkv::cpu
