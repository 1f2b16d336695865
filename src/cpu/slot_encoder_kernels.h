// Per-ISA slot encode/decode kernels behind include/tqkv/slot_encoder.h (internal header).
// Each returns false when it does not cover the codec's format or dim; the caller then
// uses the scalar SlotCodec. Inputs are already validated (finite) by the caller.
#pragma once
#include <cstdint>

#include "tqkv/codec.h"

namespace tqkv::detail {

// Writes one slot [codec.slot_bytes()]; throws tqkv::Error(Overflow) before writing anything
// when a norm or scale leaves the fp16 range.
bool encode_slot_avx2(const SlotCodec& codec, const float* k, const float* v, uint8_t* slot);
// out [dim]: the key (keys = true) or value of one slot, original domain.
bool decode_slot_avx2(const SlotCodec& codec, const uint8_t* slot, bool keys, float* out);

}  // namespace tqkv::detail
