// AVX2 + FMA + F16C build of the attention kernel: 8 floats per vector. Same decoding tricks
// as the AVX-512 build; the 16-level table is two 8-entry permutes and a blend.
#include <immintrin.h>

#include "kernel_impl.h"
#include "wide_codes.h"

namespace tqkv::cpu {
namespace {

struct IsaAvx2 {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr bool kAnyBits = false;
  static constexpr float kFp8Factor = 256.0f;
  static constexpr int kAccRegs = 8;
  // 3-bit codes keep the per-vector decode: 8 vectors of a split block and 8 row accumulators
  // would not fit in 16 registers.
  static constexpr int split_codes(int b) { return b == 4 ? 2 : b == 2 ? 4 : 1; }
  // Int8 key scores (kernel_impl.h) of 2-5-bit codes, 32 channels per vector: bytes of codes
  // (4 bits: the 16 bytes and their high nibbles; 2 bits: the 8 bytes shifted by 0, 2, 4, 6 in
  // the four qwords, both masked to 4 bits; 3 and 5 bits: one code per byte, channel order),
  // looked up by vpshufb in 16-entry tables that both 128-bit lanes hold (5 bits: two tables,
  // the code's bit 4 picking one by a byte blend); products by vpmaddubsw (pairs within int16:
  // kernel.h) + vpmaddwd.
  static constexpr bool kHasI8 = true;
  using IV = __m256i;
  // Entries 0-15 and 16-31 of the level table in both lanes (2-4 bits use the first).
  struct IT {
    __m256i lo, hi;
  };
  static constexpr int i8_block(int b) { return b >= 2 && b <= kI8WideBits ? 32 : 0; }
  static IT i8_table(const void* table) {
    const auto* t = static_cast<const __m128i*>(table);
    return {_mm256_broadcastsi128_si256(_mm_loadu_si128(t)), _mm256_broadcastsi128_si256(_mm_loadu_si128(t + 1))};
  }
  static IV izero() { return _mm256_setzero_si256(); }
  static V i2f(IV a) { return _mm256_cvtepi32_ps(a); }
  static IV dot_u8i8(IV acc, IV u, const int8_t* q) {
    const __m256i pairs = _mm256_maddubs_epi16(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  // acc + 64 * (h . q) + (l . q) per lane (6-bit keys' two level bytes; kernel.h key_wide).
  static IV dot_u8i8_wide(IV acc, IV h, IV l, const int8_t* q) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(h, x), _mm256_set1_epi16(64));
    const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(l, x), _mm256_set1_epi16(1));
    return _mm256_add_epi32(acc, _mm256_add_epi32(hi, lo));
  }
  // The four vectors' lane sums (exact).
  static void reduce4_i(IV a, IV b, IV c, IV d, int32_t* out) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
  }
  template <int B>
  [[gnu::always_inline]] static IV levels_u8(const uint8_t* p, int i, const IT& table) {
    const __m256i x = code_bytes<B>(p, i);
    if constexpr (B <= 4) {
      return _mm256_shuffle_epi8(table.lo, x);
    } else {
      static_assert(B == 5, "AVX2 int8 levels take 2-5-bit codes");
      // vpblendvb picks by each byte's bit 7: the code's bit 4, moved there by a 16-bit shift
      // (codes are below 32, so no bit crosses into the neighbouring byte's bit 7).
      return _mm256_blendv_epi8(_mm256_shuffle_epi8(table.lo, x), _mm256_shuffle_epi8(table.hi, x),
                                _mm256_slli_epi16(x, 3));
    }
  }
  // 6-bit keys' two level bytes (kernel.h key_wide), from 64-entry tables held as four 16-entry
  // registers each (i8_table of entries 0-31 and of 32-63), picked by the code's bits 4 and 5.
  struct IT64 {
    IT a, b;
  };
  static IT64 i8_table_wide(const uint8_t* t) { return {i8_table(t), i8_table(t + 32)}; }
  template <int B>
  [[gnu::always_inline]] static void levels_wide(const uint8_t* p, int i, const IT64& hi, const IT64& lo, IV& h,
                                                 IV& l) {
    static_assert(B == kI8WideBits, "two-byte levels are for 6-bit codes");
    const __m256i x = code_bytes<B>(p, i), bit4 = _mm256_slli_epi16(x, 3), bit5 = _mm256_slli_epi16(x, 2);
    const auto look = [&](const IT64& t) {
      return _mm256_blendv_epi8(
          _mm256_blendv_epi8(_mm256_shuffle_epi8(t.a.lo, x), _mm256_shuffle_epi8(t.a.hi, x), bit4),
          _mm256_blendv_epi8(_mm256_shuffle_epi8(t.b.lo, x), _mm256_shuffle_epi8(t.b.hi, x), bit4), bit5);
    };
    h = look(hi);
    l = look(lo);
  }
  // The codes of channels i .. i + 31 as bytes (2 and 4 bits: in the order above, only the low
  // 4 bits meaningful; 3, 5 and 6 bits: channel order, nothing above the code). These helpers
  // are forced inline: GCC left the 5- and 6-bit ones out of line, a call per 32 channels and
  // key with the tables passed through memory.
  template <int B>
  [[gnu::always_inline]] static __m256i code_bytes(const uint8_t* p, int i) {
    if constexpr (B == 4) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i / 2));
      return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1),
                              _mm256_set1_epi8(0x0f));
    } else if constexpr (B == 2) {
      long long a;
      std::memcpy(&a, p + i / 4, 8);
      return _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(a), _mm256_set_epi64x(6, 4, 2, 0)),
                              _mm256_set1_epi8(0x0f));
    } else {
      static_assert(B == 3 || B == 5 || B == 6, "AVX2 int8 codes are 2-6 bits");
      // The 4B bytes of the block; lane h holds the bytes of channels 16h .. 16h + 15 (3 bits:
      // 12 bytes in both lanes; 5 and 6 bits: bytes [0, 16) and [4B - 16, 4B)). Word w of lane
      // h takes the two bytes holding the code of channel 16h + w (first vector) or 16h + 8 + w
      // (second), code at bit s = Bc mod 8: a multiply by 2^(16 - B - s) moves it to the top
      // bits, a shift to the bottom, and a pack to bytes. Where the second byte would lie past
      // the block the code ends in the first (4B bytes hold 32 codes exactly), so its index
      // repeats the first's.
      constexpr int off1 = B == 3 ? 0 : 4 * B - 16;
      alignas(32) static constexpr auto t = [] {
        struct {
          uint8_t ctl[2][32];
          uint16_t mul[2][16];
        } x{};
        for (int v = 0; v < 2; ++v)
          for (int h = 0; h < 2; ++h)
            for (int w = 0; w < 8; ++w) {
              const int c = 16 * h + 8 * v + w, at = B * c / 8 - (h ? off1 : 0);
              x.ctl[v][16 * h + 2 * w] = static_cast<uint8_t>(at);
              x.ctl[v][16 * h + 2 * w + 1] = static_cast<uint8_t>(at + 1 < 16 ? at + 1 : at);
              x.mul[v][8 * h + w] = static_cast<uint16_t>(1u << (16 - B - B * c % 8));
            }
        return x;
      }();
      const uint8_t* q = p + i * B / 8;
      __m256i b;
      if constexpr (B == 3) {
        uint32_t hi;
        std::memcpy(&hi, q + 8, 4);
        b = _mm256_broadcastsi128_si256(
            _mm_insert_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)), static_cast<int>(hi), 2));
      } else {
        b = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))),
                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + off1)), 1);
      }
      const auto half = [&](int v) {
        const __m256i w = _mm256_shuffle_epi8(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(t.ctl[v])));
        return _mm256_srli_epi16(_mm256_mullo_epi16(w, _mm256_load_si256(reinterpret_cast<const __m256i*>(t.mul[v]))),
                                 16 - B);
      };
      return _mm256_packus_epi16(half(0), half(1));
    }
  }

  // Int8 value sums (kernel_impl.h, "Int8 values"), 32 channels per block: the same layout as
  // the AVX-512 build (a 32-bit lane holds one channel of four consecutive keys), summed by
  // vpmaddubsw (u8 weight x s8 level, pairs within int16: kernel.h) + vpmaddwd against ones.
  // Each key's 32 levels come from levels_u8 on the signed table (two 16-channel halves in the
  // 128-bit lanes), then four keys are interleaved by 8 unpacks:
  // vector q, lane h, dword e holds byte x = 4q + e of lane h (i8v_channel).
  // Rows per pass: up to 3 (kernel_impl.h values_i8_rows picks 2 or 3): 2 x 4 accumulators, 4
  // level vectors, the broadcast weights and the ones fit in the 16 registers; a third row's
  // accumulators spill, which costs less than decoding the four keys' levels again (d = 64,
  // GQA 3: 5-15% faster per step than 2 + 1).
  static constexpr bool kI8Values = true;
  static constexpr int kI8vRows = 3;
  static constexpr int i8v_block(int b) { return b >= 2 && b <= kI8WideBits ? 32 : 0; }
  static IT i8v_table(const int8_t* t) { return i8_table(t); }
  // 6-bit values (kernel.h value_wide): the high and the low bytes' 64-entry tables.
  struct IT64x2 {
    IT64 h, lo;
  };
  static IT64x2 i8v_table_wide(const int8_t* h, const int8_t* lo) {
    return {i8_table_wide(reinterpret_cast<const uint8_t*>(h)), i8_table_wide(reinterpret_cast<const uint8_t*>(lo))};
  }
  static int i8v_channel(int bits, int t) {
    const int x = 4 * (t / 8) + t % 4, h = (t % 8) / 4;
    if (bits == 4) return 2 * x + h;                // lane 0: low nibbles, lane 1: high nibbles
    if (bits == 2) return 4 * (x % 8) + 2 * h + x / 8;  // qword m of the 8 bytes shifted by 2m
    return 16 * h + x;                              // 3, 5 and 6 bits: channel order
  }
  // Four keys' level bytes l[4] into t[4]: vector q, lane h, dword e = byte 4q + e of lane h.
  [[gnu::always_inline]] static void interleave_i8v(const __m256i* l, __m256i* t) {
    const __m256i lo01 = _mm256_unpacklo_epi8(l[0], l[1]), hi01 = _mm256_unpackhi_epi8(l[0], l[1]);
    const __m256i lo23 = _mm256_unpacklo_epi8(l[2], l[3]), hi23 = _mm256_unpackhi_epi8(l[2], l[3]);
    t[0] = _mm256_unpacklo_epi16(lo01, lo23);
    t[1] = _mm256_unpackhi_epi16(lo01, lo23);
    t[2] = _mm256_unpacklo_epi16(hi01, hi23);
    t[3] = _mm256_unpackhi_epi16(hi01, hi23);
  }
  template <int B>
  [[gnu::always_inline]] static void levels_i8v(const uint8_t* const* p, int i, const IT& table, __m256i* t) {
    const __m256i l[4] = {levels_u8<B>(p[0], i, table), levels_u8<B>(p[1], i, table), levels_u8<B>(p[2], i, table),
                          levels_u8<B>(p[3], i, table)};
    interleave_i8v(l, t);
  }
  template <int B>
  [[gnu::always_inline]] static void levels_i8v_wide(const uint8_t* const* p, int i, const IT64x2& table, __m256i* th,
                                                     __m256i* tl) {
    __m256i h[4], l[4];
    for (int k = 0; k < 4; ++k) levels_wide<B>(p[k], i, table.h, table.lo, h[k], l[k]);
    interleave_i8v(h, th);
    interleave_i8v(l, tl);
  }
  // 8 weights to bytes: nearest-even, clamped to 0 .. 255 (as the AVX-512 build's vpmovusdb
  // after a max with 0: NaN converts to INT_MIN and becomes 0 in both).
  static void store_u8(uint8_t* p, V x) {
    const __m256i i = _mm256_cvtps_epi32(x);
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }
  // acc + the sums of the four u8 weights of wb (a dword) times the four s8 levels of t.
  static IV dot_u8v(IV acc, IV wb, IV t) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(wb, t), _mm256_set1_epi16(1)));
  }
  // The same with 64 times the products (the high bytes of two-byte levels; |pair| * 64 < 2^21).
  static IV dot_u8v64(IV acc, IV wb, IV t) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(wb, t), _mm256_set1_epi16(64)));
  }
  static IV set1_u32(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float reduce_max(V v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void reduce4(V a, V b, V c, V d, float* out) {
    const V h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
  static float half(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
  }
  static V halfs(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // Inline asm, not _mm_prefetch: GCC 12 found the kernel's prefetch helpers const (their only
  // effect a __builtin_prefetch) and deleted every call, so that no kernel issued a prefetch.
  // prefetch: into L2 (prefetcht1); prefetch_l1: into L1 (prefetcht0).
  static void prefetch(const uint8_t* p) { __asm__ volatile("prefetcht1 %0" : : "m"(*p)); }
  static void prefetch_l1(const uint8_t* p) { __asm__ volatile("prefetcht0 %0" : : "m"(*p)); }

  // Cephes-style expf: 2^n * p(r), |relative error| ~ 2e-7; 0 below -87.
  static V exp(V x) {
    const V tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const V n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    V y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // 2^n for n in [-126, 127] through the exponent field.
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
  }
  static float exp_scalar(float x) { return _mm256_cvtss_f32(exp(_mm256_set1_ps(x))); }
  // The int8 value weights' exp (kernel.h kExpWPoly); n >= -126 wherever x >= -87.
  static V exp_w(V x) {
    const V drop = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    const V t = _mm256_mul_ps(x, _mm256_set1_ps(kExpWLog2e));
    const V n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V y = exp_w_poly<IsaAvx2>(_mm256_sub_ps(t, n));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(drop, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
  }

  static V f32(const uint8_t* p, int i) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + i); }
  static V f16(const uint8_t* p, int i) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i)));
  }
  static V bf16(const uint8_t* p, int i) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  // E4M3 -> the fp16 with its sign at bit 15 and its other 7 bits at bits 13..7: each byte
  // into the high byte of a 16-bit lane (one unpack against zero), one arithmetic shift right
  // (which also copies the sign into bit 14) and the AND that clears bit 14.
  static V fp8(const uint8_t* p, int i) {
    const __m128i b8 = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i)));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(b8, 1), _mm_set1_epi16(static_cast<short>(0xBFFF))));
  }
  // Codes i .. i+7 (i a multiple of 8): one group of 8 codes in B bytes, read as a 32-bit word
  // (up to 2 bytes past the codes, inside the slot or page: metadata follows). Lanes keep the
  // code in their low B bits; lut() tables are replicated so higher bits do not matter.
  template <int B>
  static __m256i code_ints(const uint8_t* p, int i) {
    if constexpr (B == 8) {
      // Whole bytes: one widening load, nothing to shift or mask.
      return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i)));
    } else if constexpr (B >= 5) {
      // 8 codes in exactly B bytes (no read past them) in both 128-bit lanes, then one byte
      // shuffle and one shift (wide_codes.h). lut() and codes() mask the neighbours' bits.
      static constexpr auto tables = wide_code_tables<B, 8>();
      const __m256i w = _mm256_broadcastsi128_si256(_mm_cvtsi64_si128(static_cast<long long>(load_bytes<B>(p + (i / 8) * B))));
      const __m256i two = _mm256_shuffle_epi8(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tables.ctl)));
      return _mm256_srlv_epi32(two, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tables.shift)));
    } else {
      return narrow_code_ints<B>(p, i);
    }
  }
  // The B (5..8) bytes at p as the low bytes of a word, read as whole 4-, 2- and 1-byte loads:
  // a memcpy of B bytes into a zeroed word went through the stack and stalled every read on a
  // failed store-to-load forward (half of the 5-bit kernel's time).
  template <int B>
  static uint64_t load_bytes(const uint8_t* p) {
    if constexpr (B == 8) {
      uint64_t a;
      std::memcpy(&a, p, 8);
      return a;
    } else {
      uint32_t lo;
      std::memcpy(&lo, p, 4);
      uint64_t hi = 0;
      if constexpr (B == 5 || B == 7) hi = p[B - 1];
      if constexpr (B >= 6) {
        uint16_t h;
        std::memcpy(&h, p + 4, 2);
        hi = (hi << 16) | h;
      }
      return lo | (hi << 32);
    }
  }
  template <int B>
  static __m256i narrow_code_ints(const uint8_t* p, int i) {
    uint32_t a;
    std::memcpy(&a, p + (i / 8) * B, 4);
    if constexpr (B == 4) {
      const __m128i b = _mm_cvtsi32_si128(static_cast<int>(a));
      return _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(b, _mm_srli_epi16(b, 4)));
    } else {
      static_assert(B == 2 || B == 3, "narrow codes are 2, 3 or 4 bits");
      return _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(a)),
                               _mm256_set_epi32(7 * B, 6 * B, 5 * B, 4 * B, 3 * B, 2 * B, B, 0));
    }
  }
  // Split decode (kernel_impl.h): 8 bytes, one lane per byte, then a shift and a table lookup
  // per vector.
  template <int B>
  static void lut_split(const uint8_t* p, int i, const float* table16, V* out) {
    constexpr int K = split_codes(B);
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i * B / 8)));
    out[0] = lut16<B>(x, table16);
    for (int k = 1; k < K; ++k) out[k] = lut16<B>(_mm256_srli_epi32(x, B * k), table16);
  }
  template <int B>
  static V codes(const uint8_t* p, int i) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(code_ints<B>(p, i), _mm256_set1_epi32((1 << B) - 1)));
  }
  template <int B>
  static V lut(const uint8_t* p, int i, const float* table16) {
    const __m256i c = code_ints<B>(p, i);
    if constexpr (B >= 7) {  // table16 is the full 2^B-entry level table here
      return _mm256_i32gather_ps(table16, B == 8 ? c : _mm256_and_si256(c, _mm256_set1_epi32((1 << B) - 1)), 4);
    } else {
      return lut_regs<B>(c, table16);
    }
  }
  // 2^B entries in 8-entry registers: a lookup in each half of the table, the code's bit B-1
  // picks one (5 bits: 4 permutes and 3 blends, which beat a gather; 6 bits: 8 and 7).
  template <int B>
  static V lut_regs(__m256i c, const float* table) {
    if constexpr (B <= 4) {
      return lut16<B>(c, table);
    } else {
      const V lo = lut_regs<B - 1>(c, table), hi = lut_regs<B - 1>(c, table + (1 << (B - 1)));
      return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(c, 32 - B)));
    }
  }
  template <int B>
  static V lut16(__m256i c, const float* table16) {
    const V lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table16), c);
    if constexpr (B <= 3) return lo;  // table replicated: entries 0-7 cover every 3-bit index
    const V hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table16 + 8), c);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
  }
};

}  // namespace

void run_avx2(const KernelFormat& f, const SlotRun* runs, int n_runs, const RowBlock& rows, const RowState& st,
              float* scratch) {
  Kernel<IsaAvx2>::run(f, runs, n_runs, rows, st, scratch);
}

}  // namespace tqkv::cpu
