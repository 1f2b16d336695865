#include "tqkv/slot_encoder.h"

#include <cstring>
#include <vector>

#include "slot_encoder_kernels.h"
#include "tqkv/simd.h"

namespace tqkv {
namespace {

#if defined(__x86_64__) || defined(_M_X64)
bool vector_encode(const SlotCodec& c, const float* k, const float* v, uint8_t* out) {
  return active_simd_level() != SimdLevel::Scalar && detail::encode_slot_avx2(c, k, v, out);
}
bool vector_decode(const SlotCodec& c, const uint8_t* s, bool keys, float* out) {
  return active_simd_level() != SimdLevel::Scalar && detail::decode_slot_avx2(c, s, keys, out);
}
#else
bool vector_encode(const SlotCodec&, const float*, const float*, uint8_t*) { return false; }
bool vector_decode(const SlotCodec&, const uint8_t*, bool, float*) { return false; }
#endif

}  // namespace

void encode_slots(const SlotCodec& codec, const float* k, const float* v, int n, uint8_t* slots, size_t stride) {
  const int d = codec.dim();
  // Validate and encode everything into scratch first, so a bad vector anywhere leaves every
  // slot untouched.
  for (int i = 0; i < n; ++i) {
    codec.check_finite(k + static_cast<size_t>(i) * d, "key");
    codec.check_finite(v + static_cast<size_t>(i) * d, "value");
  }
  const size_t sb = codec.slot_bytes();
  std::vector<uint8_t> scratch(static_cast<size_t>(n) * sb, 0);
  for (int i = 0; i < n; ++i) {
    const float* ki = k + static_cast<size_t>(i) * d;
    const float* vi = v + static_cast<size_t>(i) * d;
    uint8_t* out = &scratch[static_cast<size_t>(i) * sb];
    if (!vector_encode(codec, ki, vi, out)) codec.encode(ki, vi, out);
  }
  for (int i = 0; i < n; ++i) std::memcpy(slots + static_cast<size_t>(i) * stride, &scratch[static_cast<size_t>(i) * sb], sb);
}

void encode_slot(const SlotCodec& codec, const float* k, const float* v, uint8_t* slot) {
  codec.check_finite(k, "key");
  codec.check_finite(v, "value");
  // The vector path may throw (fp16 overflow of the value) after writing the key bytes:
  // encode into a local slot and copy once it succeeded.
  uint8_t local[4 * 1024 * 2 + 2];
  const size_t sb = codec.slot_bytes();
  if (sb > sizeof(local)) {
    codec.encode(k, v, slot);
    return;
  }
  if (!vector_encode(codec, k, v, local)) codec.encode(k, v, local);
  std::memcpy(slot, local, sb);
}

void decode_slots(const SlotCodec& codec, const uint8_t* slots, size_t stride, int n, bool keys, float* out) {
  const int d = codec.dim();
  for (int i = 0; i < n; ++i) {
    const uint8_t* s = slots + static_cast<size_t>(i) * stride;
    float* o = out + static_cast<size_t>(i) * d;
    if (vector_decode(codec, s, keys, o)) continue;
    if (keys)
      codec.decode_key(s, o);
    else
      codec.decode_value(s + codec.key_bytes(), o);
  }
}

}  // namespace tqkv
