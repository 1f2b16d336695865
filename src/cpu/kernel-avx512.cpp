// AVX-512 (F, BW, VL, DQ) build of the attention kernel: 16 floats per vector. fp16 via
// vcvtph2ps, bf16 by a 16-bit shift, fp8 E4M3 by moving its bits into an fp16 (value / 256),
// packed 2/3/4-bit codes by variable shifts of broadcast 32-bit words, Lloyd-Max levels by a
// 16-entry in-register table (vpermps).
#include <immintrin.h>

#include "kernel_impl.h"

namespace tqkv::cpu {
namespace {

struct IsaAvx512 {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr bool kFullTable = false;
  static constexpr float kFp8Factor = 256.0f;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce(V v) { return _mm512_reduce_add_ps(v); }

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

  static V f32(const uint8_t* p, int i) { return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + i); }
  static V f16(const uint8_t* p, int i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i)));
  }
  static V bf16(const uint8_t* p, int i) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static V fp8(const uint8_t* p, int i) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_cvtph_ps(h);
  }
  // Codes i .. i+15 (i a multiple of 16): two groups of 8 codes, `bits` bytes each. Each group
  // is read as a 32-bit word; for 2 and 3 bits that reads up to 2 bytes past the codes, which
  // always lie inside the slot or page (metadata follows every packed code row).
  static __m512i code_ints(const uint8_t* p, int i, int bits) {
    const uint8_t* g = p + (i / 8) * bits;
    uint32_t a, b;
    std::memcpy(&a, g, 4);
    std::memcpy(&b, g + bits, 4);
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(static_cast<int>(a))),
                                         _mm256_set1_epi32(static_cast<int>(b)), 1);
    const __m512i lane = _mm512_and_si512(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(7));
    const __m512i shift = _mm512_mullo_epi32(lane, _mm512_set1_epi32(bits));
    return _mm512_and_si512(_mm512_srlv_epi32(w, shift), _mm512_set1_epi32((1 << bits) - 1));
  }
  static V codes(const uint8_t* p, int i, int bits) { return _mm512_cvtepi32_ps(code_ints(p, i, bits)); }
  static V lut(const uint8_t* p, int i, int bits, const float* table16) {
    return _mm512_permutexvar_ps(code_ints(p, i, bits), _mm512_loadu_ps(table16));
  }
};

}  // namespace

void run_avx512(const KernelFormat& f, const SlotRun& run, const RowBlock& rows, const RowState& st,
                float* scratch) {
  Kernel<IsaAvx512>::run(f, run, rows, st, scratch);
}

}  // namespace tqkv::cpu
