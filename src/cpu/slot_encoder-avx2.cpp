// AVX2 slot encode/decode. Every floating-point operation is the one the scalar reference
// performs on the same operands, in the same order where order matters (the norms are summed
// sequentially in double; the Walsh-Hadamard butterflies are computed stage by stage), and
// this file is compiled with -ffp-contract=off, so the bytes are identical to SlotCodec's.
#include <immintrin.h>

#include <cmath>
#include <string>

#include "slot_encoder_kernels.h"
#include "tqkv/bitpack.h"
#include "tqkv/error.h"
#include "tqkv/half.h"

namespace tqkv::detail {
namespace {

constexpr int kMaxDim = 1024;

void store_u16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v & 0xff);
  p[1] = static_cast<uint8_t>(v >> 8);
}
uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// Unnormalised fast Walsh-Hadamard transform, d a power of two >= 8: stages of length 1, 2
// and 4 inside each register (permute + add/sub + blend), longer ones across registers.
void fwht(float* x, int d) {
  for (int i = 0; i < d; i += 8) {
    __m256 r = _mm256_loadu_ps(x + i);
    __m256 t = _mm256_permute_ps(r, _MM_SHUFFLE(2, 3, 0, 1));
    r = _mm256_blend_ps(_mm256_add_ps(r, t), _mm256_sub_ps(t, r), 0xAA);
    t = _mm256_permute_ps(r, _MM_SHUFFLE(1, 0, 3, 2));
    r = _mm256_blend_ps(_mm256_add_ps(r, t), _mm256_sub_ps(t, r), 0xCC);
    t = _mm256_permute2f128_ps(r, r, 1);
    r = _mm256_blend_ps(_mm256_add_ps(r, t), _mm256_sub_ps(t, r), 0xF0);
    _mm256_storeu_ps(x + i, r);
  }
  for (int len = 8; len < d; len <<= 1)
    for (int i = 0; i < d; i += len << 1)
      for (int j = i; j < i + len; j += 8) {
        const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + len);
        _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
        _mm256_storeu_ps(x + j + len, _mm256_sub_ps(a, b));
      }
}

void scale(float* x, int d, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  for (int i = 0; i < d; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
}

void mul(float* x, const float* y, int d) {
  for (int i = 0; i < d; i += 8)
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

// Rotation::apply / inverse for Srht and Hadamard.
void rotate(const Rotation& r, float* x, bool inverse) {
  const int d = r.dim();
  const float s = 1.0f / std::sqrt(static_cast<float>(d));
  const bool srht = r.kind() == RotationKind::Srht;
  if (srht && !inverse) mul(x, r.signs().data(), d);
  fwht(x, d);
  scale(x, d, s);
  if (srht && inverse) mul(x, r.signs().data(), d);
}

bool covered(const SlotCodec& codec) {
  const int d = codec.dim();
  if (d % 8 != 0 || d > kMaxDim) return false;
  return !codec.format().uses_rotation() || codec.rotation().kind() != RotationKind::Dense;
}

void encode_mse(const SlotCodec& codec, const float* x, const Codebook& cb, int bits, uint8_t* out) {
  const int d = codec.dim();
  double sq = 0;
  for (int i = 0; i < d; ++i) sq += static_cast<double>(x[i]) * x[i];
  const float norm = static_cast<float>(std::sqrt(sq));
  alignas(32) float y[kMaxDim];
  const __m256 inv = _mm256_set1_ps(norm > 0 ? 1.0f / norm : 1.0f);
  for (int i = 0; i < d; i += 8) _mm256_store_ps(y + i, norm > 0 ? _mm256_mul_ps(_mm256_loadu_ps(x + i), inv) : _mm256_loadu_ps(x + i));
  rotate(codec.rotation(), y, false);
  // code = number of thresholds <= y (the reference's lower bound, ties up).
  alignas(32) int32_t code32[kMaxDim];
  const int nt = static_cast<int>(cb.thresholds_f32.size());
  for (int i = 0; i < d; i += 8) {
    const __m256 yi = _mm256_load_ps(y + i);
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < nt; ++j) {
      const __m256 ge = _mm256_cmp_ps(yi, _mm256_set1_ps(cb.thresholds_f32[j]), _CMP_GE_OQ);
      acc = _mm256_sub_epi32(acc, _mm256_castps_si256(ge));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(code32 + i), acc);
  }
  uint8_t codes[kMaxDim];
  double csq = 0;
  for (int i = 0; i < d; ++i) {
    codes[i] = static_cast<uint8_t>(code32[i]);
    const double c = cb.levels_f32[codes[i]];
    csq += c * c;
  }
  float stored = norm;
  if (codec.format().norm_correction && csq > 0) stored = static_cast<float>(norm / std::sqrt(csq));
  if (!(stored <= kHalfMax))
    throw Error(ErrorCode::Overflow, "vector norm magnitude " + std::to_string(stored) +
                                         " exceeds the fp16 range (65504) of this format");
  pack_bits(codes, d, bits, out);
  store_u16(out + packed_bytes(d, bits), float_to_half(stored));
}

void encode_uniform(const SlotCodec& codec, const float* v, int bits, uint8_t* out) {
  const int d = codec.dim();
  const UniformParams p = uniform_params(v, d, bits);
  const __m256 s = _mm256_set1_ps(half_to_float(p.scale_f16)), z = _mm256_set1_ps(half_to_float(p.zero_f16));
  const __m256 half = _mm256_set1_ps(0.5f), lo = _mm256_setzero_ps();
  const __m256 hi = _mm256_set1_ps(static_cast<float>((1 << bits) - 1));
  alignas(32) int32_t code32[kMaxDim];
  for (int i = 0; i < d; i += 8) {
    __m256 q = _mm256_floor_ps(_mm256_add_ps(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(v + i), z), s), half));
    q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
    _mm256_store_si256(reinterpret_cast<__m256i*>(code32 + i), _mm256_cvttps_epi32(q));
  }
  uint8_t codes[kMaxDim];
  for (int i = 0; i < d; ++i) codes[i] = static_cast<uint8_t>(code32[i]);
  pack_bits(codes, d, bits, out);
  uint8_t* meta = out + packed_bytes(d, bits);
  store_u16(meta, p.scale_f16);
  store_u16(meta + 2, p.zero_f16);
}

// Levels times the stored norm, in the rotated domain, then rotated back.
void decode_mse(const SlotCodec& codec, const uint8_t* in, const Codebook& cb, int bits, float* out) {
  const int d = codec.dim();
  const float norm = half_to_float(load_u16(in + packed_bytes(d, bits)));
  uint8_t codes[kMaxDim];
  unpack_bits(in, d, bits, codes);
  const __m256 vn = _mm256_set1_ps(norm);
  alignas(32) float lv[kMaxDim];
  for (int i = 0; i < d; ++i) lv[i] = cb.levels_f32[codes[i]];
  for (int i = 0; i < d; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(vn, _mm256_load_ps(lv + i)));
  rotate(codec.rotation(), out, true);
}

void decode_uniform(const SlotCodec& codec, const uint8_t* in, int bits, float* out) {
  const int d = codec.dim();
  const uint8_t* meta = in + packed_bytes(d, bits);
  const __m256 s = _mm256_set1_ps(half_to_float(load_u16(meta))), z = _mm256_set1_ps(half_to_float(load_u16(meta + 2)));
  uint8_t codes[kMaxDim];
  unpack_bits(in, d, bits, codes);
  for (int i = 0; i < d; i += 8) {
    const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
    const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c8));
    _mm256_storeu_ps(out + i, _mm256_add_ps(z, _mm256_mul_ps(s, c)));
  }
}

}  // namespace

bool encode_slot_avx2(const SlotCodec& codec, const float* k, const float* v, uint8_t* slot) {
  if (!covered(codec)) return false;
  const Format& f = codec.format();
  const int d = codec.dim();
  if (f.key == KeyCodec::Mse)
    encode_mse(codec, k, *codec.key_codebook(), f.key_bits, slot);
  else
    codec.encode_key(k, slot);
  uint8_t* vout = slot + codec.key_bytes();
  if (f.value == ValueCodec::Mse)
    encode_mse(codec, v, *codec.value_codebook(), f.value_bits, vout);
  else if (f.value == ValueCodec::Uniform)
    encode_uniform(codec, v, f.value_bits, vout);
  else
    codec.encode_value(v, vout);
  if (codec.slot_bytes() > codec.key_bytes() + codec.value_bytes()) slot[codec.slot_bytes() - 1] = 0;
  (void)d;
  return true;
}

bool decode_slot_avx2(const SlotCodec& codec, const uint8_t* slot, bool keys, float* out) {
  if (!covered(codec)) return false;
  const Format& f = codec.format();
  if (keys) {
    if (f.key == KeyCodec::Mse)
      decode_mse(codec, slot, *codec.key_codebook(), f.key_bits, out);
    else
      codec.decode_key(slot, out);
    return true;
  }
  const uint8_t* vin = slot + codec.key_bytes();
  if (f.value == ValueCodec::Mse)
    decode_mse(codec, vin, *codec.value_codebook(), f.value_bits, out);
  else if (f.value == ValueCodec::Uniform)
    decode_uniform(codec, vin, f.value_bits, out);
  else
    codec.decode_value(vin, out);
  return true;
}

}  // namespace tqkv::detail
