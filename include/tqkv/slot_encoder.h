// Fast slot encoding and decoding on the CPU: the same bytes and floats as the scalar
// reference SlotCodec (tests/cpu/test_slot_encoder.cpp checks every format at every SIMD
// level byte for byte), with the rotation, quantization and dequantization vectorised.
// The level is the active one (tqkv::active_simd_level(), TQKV_SIMD); formats or dims the
// vector path does not cover (dense rotations, dims that are not a multiple of 8) use the
// scalar codec.
#pragma once
#include <cstddef>
#include <cstdint>

#include "tqkv/codec.h"

namespace tqkv {

// Encodes n (key, value) pairs into n slots `stride` bytes apart.
//   k, v: [n, dim] floats; slots: n * stride bytes.
// Validates every input first: on NaN/Inf or fp16 overflow it throws tqkv::Error and writes
// nothing.
void encode_slots(const SlotCodec& codec, const float* k, const float* v, int n, uint8_t* slots, size_t stride);

// One slot, as SlotCodec::encode (validates first; throws tqkv::Error and writes nothing on
// NaN/Inf or fp16 overflow), through the vector path where it applies.
void encode_slot(const SlotCodec& codec, const float* k, const float* v, uint8_t* slot);

// Decodes the keys (or values) of n slots `stride` bytes apart into out [n, dim], in the
// original domain (as SlotCodec::decode_key / decode_value).
void decode_slots(const SlotCodec& codec, const uint8_t* slots, size_t stride, int n, bool keys, float* out);

}  // namespace tqkv
