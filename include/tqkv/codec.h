// The scalar reference codec: encodes and decodes the key and value of one (token, kv-head)
// into one slot of a Format. This is the oracle every SIMD and CUDA path is tested against.
//
// Encoding checks its input first and throws tqkv::Error (NonFinite, Overflow) before
// writing anything, so a failed encode leaves the slot untouched.
#pragma once
#include <cstdint>
#include <vector>

#include "tqkv/codebook.h"
#include "tqkv/format.h"
#include "tqkv/rotation.h"

namespace tqkv {

class SlotCodec {
 public:
  // The rotation is seeded by `seed` (shared by keys and values). dim >= 2; MSE formats with a
  // non-power-of-two dim use a dense rotation. 1-bit and 3-bit packs need nothing special.
  SlotCodec(const Format& format, int dim, uint64_t seed = kDefaultSeed);

  const Format& format() const { return format_; }
  int dim() const { return dim_; }
  size_t slot_bytes() const { return format_.slot_bytes(dim_); }
  size_t key_bytes() const { return format_.key_bytes(dim_); }
  size_t value_bytes() const { return format_.value_bytes(dim_); }
  const Rotation& rotation() const { return rotation_; }
  const Codebook* key_codebook() const { return key_cb_; }
  const Codebook* value_codebook() const { return value_cb_; }

  // k, v: [dim] floats. key_out: [key_bytes()], value_out: [value_bytes()]. Throws on bad input.
  void encode_key(const float* k, uint8_t* key_out) const;
  void encode_value(const float* v, uint8_t* value_out) const;
  // Whole slot [slot_bytes()]: key, value, then a zero pad byte where the size is odd.
  void encode(const float* k, const float* v, uint8_t* slot) const;

  // Decoded vectors in the original domain: out [dim].
  void decode_key(const uint8_t* key_in, float* out) const;
  void decode_value(const uint8_t* value_in, float* out) const;

  // Decoded vectors in the domain attention works in: rotated (R x) for rotated codecs,
  // original otherwise. No rotation is applied here.
  void decode_key_domain(const uint8_t* key_in, float* out) const;
  void decode_value_domain(const uint8_t* value_in, float* out) const;

  // Throws tqkv::Error(NonFinite) if any of the dim values is NaN or Inf.
  void check_finite(const float* x, const char* what) const;

 private:
  void encode_mse(const float* x, const Codebook& cb, int bits, uint8_t* out) const;
  void decode_mse_rotated(const uint8_t* in, const Codebook& cb, int bits, float* out) const;

  Format format_;
  int dim_;
  Rotation rotation_;
  const Codebook* key_cb_ = nullptr;
  const Codebook* value_cb_ = nullptr;
};

// Low-level element codecs shared with other backends.
// Uniform min/max codes: scale = fp16((max - min) / (2^bits - 1)) (at least 1e-8 before
// rounding), zero = fp16(min), code = clamp(round_half_up((x - zero) / scale), 0, 2^bits - 1)
// computed with the fp16-rounded scale and zero so that the decoder sees what the encoder used.
struct UniformParams {
  uint16_t scale_f16;
  uint16_t zero_f16;
};
UniformParams uniform_params(const float* x, int n, int bits);

}  // namespace tqkv
