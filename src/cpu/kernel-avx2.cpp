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
  // Int8 key scores (kernel_impl.h) of 2- and 4-bit codes, 32 channels per vector: bytes of
  // codes (4 bits: the 16 bytes and their high nibbles; 2 bits: the 8 bytes shifted by 0, 2, 4,
  // 6 in the four qwords), masked to 4 bits, looked up by vpshufb in the 16-entry table that
  // both 128-bit lanes hold; products by vpmaddubsw (pairs within int16: kernel.h) + vpmaddwd.
  static constexpr bool kHasI8 = true;
  using IV = __m256i;
  using IT = __m256i;
  static constexpr int i8_block(int b) { return b == 2 || b == 4 ? 32 : 0; }
  static IT i8_table(const uint8_t* t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)); }
  static IV izero() { return _mm256_setzero_si256(); }
  static V i2f(IV a) { return _mm256_cvtepi32_ps(a); }
  static IV dot_u8i8(IV acc, IV u, const int8_t* q) {
    const __m256i pairs = _mm256_maddubs_epi16(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  template <int B>
  static IV levels_u8(const uint8_t* p, int i, IT table) {
    __m256i x;
    if constexpr (B == 4) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i / 2));
      x = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
    } else {
      static_assert(B == 2, "AVX2 int8 scores take 2- and 4-bit codes");
      long long a;
      std::memcpy(&a, p + i / 4, 8);
      x = _mm256_srlv_epi64(_mm256_set1_epi64x(a), _mm256_set_epi64x(6, 4, 2, 0));
    }
    return _mm256_shuffle_epi8(table, _mm256_and_si256(x, _mm256_set1_epi8(0x0f)));
  }
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
  static void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

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

  static V f32(const uint8_t* p, int i) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + i); }
  static V f16(const uint8_t* p, int i) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i)));
  }
  static V bf16(const uint8_t* p, int i) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static V fp8(const uint8_t* p, int i) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
    return _mm256_cvtph_ps(h);
  }
  // Codes i .. i+7 (i a multiple of 8): one group of 8 codes in B bytes, read as a 32-bit word
  // (up to 2 bytes past the codes, inside the slot or page: metadata follows). Lanes keep the
  // code in their low B bits; lut() tables are replicated so higher bits do not matter.
  template <int B>
  static __m256i code_ints(const uint8_t* p, int i) {
    if constexpr (B >= 5) {
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
      return _mm256_i32gather_ps(table16, _mm256_and_si256(c, _mm256_set1_epi32((1 << B) - 1)), 4);
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
