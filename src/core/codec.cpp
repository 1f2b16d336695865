#include "tqkv/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "tqkv/bitpack.h"
#include "tqkv/error.h"
#include "tqkv/fp8.h"
#include "tqkv/half.h"

namespace tqkv {
namespace {

void store_u16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v & 0xff);
  p[1] = static_cast<uint8_t>(v >> 8);
}
uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

[[noreturn]] void overflow(const char* what, float v) {
  throw Error(ErrorCode::Overflow, std::string(what) + " magnitude " + std::to_string(v) +
                                       " exceeds the fp16 range (65504) of this format");
}

// Plain element codecs (F32=0, F16=1, BF16=2, Fp8=3 in both enums) share one encoder and decoder.
void encode_plain(int codec, const float* x, int n, uint8_t* out) {
  switch (codec) {
    case 0: std::memcpy(out, x, sizeof(float) * n); return;
    case 1:
      for (int i = 0; i < n; ++i) store_u16(out + 2 * i, float_to_half(x[i]));
      return;
    case 2:
      for (int i = 0; i < n; ++i) store_u16(out + 2 * i, float_to_bf16(x[i]));
      return;
    default:
      for (int i = 0; i < n; ++i) out[i] = float_to_fp8_e4m3(x[i]);
      return;
  }
}

void decode_plain(int codec, const uint8_t* in, int n, float* out) {
  switch (codec) {
    case 0: std::memcpy(out, in, sizeof(float) * n); return;
    case 1:
      for (int i = 0; i < n; ++i) out[i] = half_to_float(load_u16(in + 2 * i));
      return;
    case 2:
      for (int i = 0; i < n; ++i) out[i] = bf16_to_float(load_u16(in + 2 * i));
      return;
    default:
      for (int i = 0; i < n; ++i) out[i] = fp8_e4m3_to_float(in[i]);
      return;
  }
}

// F16 and FP8 elements beyond the type's range are an error, not a silent clip.
void check_plain_range(int codec, const float* x, int n, const char* what) {
  const float limit = codec == 1 ? kHalfMax : codec == 3 ? kFp8E4m3Max : INFINITY;
  for (int i = 0; i < n; ++i)
    if (std::abs(x[i]) > limit)
      throw Error(ErrorCode::Overflow, std::string(what) + " " + std::to_string(x[i]) + " exceeds the range (" +
                                           std::to_string(limit) + ") of this format");
}

}  // namespace

UniformParams uniform_params(const float* x, int n, int bits) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  const float levels = static_cast<float>((1 << bits) - 1);
  const float scale = std::max((hi - lo) / levels, 1e-8f);
  if (!(scale <= kHalfMax)) overflow("value range", hi - lo);
  if (std::abs(lo) > kHalfMax) overflow("value minimum", lo);
  uint16_t scale_h = float_to_half(scale);
  if (half_to_float(scale_h) == 0.0f) scale_h = 0x0001;  // smallest subnormal: keep codes finite
  return {scale_h, float_to_half(lo)};
}

SlotCodec::SlotCodec(const Format& format, int dim, uint64_t seed)
    : format_(format), dim_(dim), rotation_(make_rotation(format.rotation, std::max(dim, 1), seed)) {
  if (dim < 2) throw Error(ErrorCode::InvalidArgument, "head dim must be >= 2, got " + std::to_string(dim));
  if (format.key == KeyCodec::Mse) key_cb_ = &get_codebook(format.law, dim, format.key_bits);
  if (format.value == ValueCodec::Mse) value_cb_ = &get_codebook(format.law, dim, format.value_bits);
}

void SlotCodec::check_finite(const float* x, const char* what) const {
  for (int i = 0; i < dim_; ++i)
    if (!std::isfinite(x[i]))
      throw Error(ErrorCode::NonFinite, std::string(what) + " has a non-finite element at index " +
                                            std::to_string(i));
}

void SlotCodec::encode_mse(const float* x, const Codebook& cb, int bits, uint8_t* out) const {
  double sq = 0;
  for (int i = 0; i < dim_; ++i) sq += static_cast<double>(x[i]) * x[i];
  const float norm = static_cast<float>(std::sqrt(sq));
  std::vector<float> y(x, x + dim_);
  if (norm > 0) {
    const float inv = 1.0f / norm;
    for (auto& v : y) v *= inv;
  }
  rotation_.apply(y.data());
  std::vector<uint8_t> codes(dim_);
  double csq = 0;
  for (int i = 0; i < dim_; ++i) {
    codes[i] = cb.quantize(y[i]);
    const double c = cb.levels_f32[codes[i]];
    csq += c * c;
  }
  float stored = norm;
  if (format_.norm_correction && csq > 0) stored = static_cast<float>(norm / std::sqrt(csq));
  if (!(stored <= kHalfMax)) overflow("vector norm", stored);
  pack_bits(codes.data(), dim_, bits, out);
  store_u16(out + packed_bytes(dim_, bits), float_to_half(stored));
}

void SlotCodec::decode_mse_rotated(const uint8_t* in, const Codebook& cb, int bits, float* out) const {
  const float norm = half_to_float(load_u16(in + packed_bytes(dim_, bits)));
  for (int i = 0; i < dim_; ++i) out[i] = norm * cb.levels_f32[unpack_one(in, i, bits)];
}

void SlotCodec::encode_key(const float* k, uint8_t* out) const {
  check_finite(k, "key");
  const Format& f = format_;
  if (f.key == KeyCodec::Mse) {
    encode_mse(k, *key_cb_, f.key_bits, out);
  } else {
    check_plain_range(static_cast<int>(f.key), k, dim_, "key element");
    encode_plain(static_cast<int>(f.key), k, dim_, out);
  }
}

void SlotCodec::encode_value(const float* v, uint8_t* out) const {
  check_finite(v, "value");
  const Format& f = format_;
  switch (f.value) {
    case ValueCodec::Mse: encode_mse(v, *value_cb_, f.value_bits, out); return;
    case ValueCodec::Uniform: {
      const UniformParams p = uniform_params(v, dim_, f.value_bits);
      const float scale = half_to_float(p.scale_f16), zero = half_to_float(p.zero_f16);
      const int max_code = (1 << f.value_bits) - 1;
      std::vector<uint8_t> codes(dim_);
      for (int i = 0; i < dim_; ++i) {
        const float q = std::floor((v[i] - zero) / scale + 0.5f);
        codes[i] = static_cast<uint8_t>(std::clamp(q, 0.0f, static_cast<float>(max_code)));
      }
      pack_bits(codes.data(), dim_, f.value_bits, out);
      uint8_t* meta = out + f.value_code_bytes(dim_);
      store_u16(meta, p.scale_f16);
      store_u16(meta + 2, p.zero_f16);
      return;
    }
    default:
      check_plain_range(static_cast<int>(f.value), v, dim_, "value element");
      encode_plain(static_cast<int>(f.value), v, dim_, out);
      return;
  }
}

void SlotCodec::encode(const float* k, const float* v, uint8_t* slot) const {
  // Encode into a scratch slot so that a failure in the value leaves the slot untouched.
  std::vector<uint8_t> tmp(slot_bytes(), 0);
  encode_key(k, tmp.data());
  encode_value(v, tmp.data() + key_bytes());
  std::memcpy(slot, tmp.data(), tmp.size());
}

void SlotCodec::decode_key_domain(const uint8_t* in, float* out) const {
  const Format& f = format_;
  if (f.key == KeyCodec::Mse)
    decode_mse_rotated(in, *key_cb_, f.key_bits, out);
  else
    decode_plain(static_cast<int>(f.key), in, dim_, out);
}

void SlotCodec::decode_value_domain(const uint8_t* in, float* out) const {
  const Format& f = format_;
  switch (f.value) {
    case ValueCodec::Mse: decode_mse_rotated(in, *value_cb_, f.value_bits, out); return;
    case ValueCodec::Uniform: {
      const uint8_t* meta = in + f.value_code_bytes(dim_);
      const float scale = half_to_float(load_u16(meta)), zero = half_to_float(load_u16(meta + 2));
      for (int i = 0; i < dim_; ++i) out[i] = zero + scale * static_cast<float>(unpack_one(in, i, f.value_bits));
      return;
    }
    default: decode_plain(static_cast<int>(f.value), in, dim_, out); return;
  }
}

void SlotCodec::decode_key(const uint8_t* in, float* out) const {
  decode_key_domain(in, out);
  if (format_.keys_rotated()) rotation_.inverse(out);
}

void SlotCodec::decode_value(const uint8_t* in, float* out) const {
  decode_value_domain(in, out);
  if (format_.values_rotated()) rotation_.inverse(out);
}

}  // namespace tqkv
