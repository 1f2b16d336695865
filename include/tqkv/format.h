// The traits table of every KV-cache format: how a key and a value of one (token, kv-head)
// are coded and how many bytes their slot takes. docs/FORMAT.md documents every byte.
//
// Slot layout (one slot per token per kv-head, fixed size, rounded up to an even size):
//   [K codes | K meta | V codes | V meta | pad to even]
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "tqkv/codebook.h"
#include "tqkv/rotation.h"

namespace tqkv {

enum class KeyCodec : uint8_t {
  F32,   // 4 B/elem, no meta
  F16,   // 2 B/elem
  BF16,  // 2 B/elem
  Fp8,   // FP8 E4M3 per element, no scale
  Mse,   // b-bit Lloyd-Max codes of R k/|k| + fp16 norm (norm-corrected when asked)
};

enum class ValueCodec : uint8_t {
  F32,
  F16,
  BF16,
  Fp8,
  Uniform,  // b-bit codes of (v - min)/scale + fp16 scale + fp16 zero (= min), no rotation
  Mse,      // like KeyCodec::Mse, in the rotated domain
};

struct Format {
  const char* name;
  KeyCodec key;
  uint8_t key_bits;  // bits per element of the key codes (32/16/8 for the plain codecs)
  ValueCodec value;
  uint8_t value_bits;
  bool norm_correction;   // Mse codecs: store |x| / |c| so the decoded vector has norm |x|
  Law law;                // Mse codecs: codebook law
  RotationKind rotation;  // Mse codecs: preferred rotation (Dense where dim is not a power of 2)
  const char* summary;

  constexpr size_t key_code_bytes(int dim) const { return (static_cast<size_t>(dim) * key_bits + 7) / 8; }
  constexpr size_t key_meta_bytes() const { return key == KeyCodec::Mse ? 2 : 0; }
  constexpr size_t key_bytes(int dim) const { return key_code_bytes(dim) + key_meta_bytes(); }
  constexpr size_t value_code_bytes(int dim) const { return (static_cast<size_t>(dim) * value_bits + 7) / 8; }
  constexpr size_t value_meta_bytes() const {
    return value == ValueCodec::Uniform ? 4 : value == ValueCodec::Mse ? 2 : 0;
  }
  constexpr size_t value_bytes(int dim) const { return value_code_bytes(dim) + value_meta_bytes(); }
  constexpr size_t value_offset(int dim) const { return key_bytes(dim); }
  constexpr size_t slot_bytes(int dim) const {
    const size_t s = key_bytes(dim) + value_bytes(dim);
    return s + (s & 1);
  }
  // Bits per cached element, metadata included: slot bytes * 8 / (2 * dim).
  constexpr double bits_per_element(int dim) const { return slot_bytes(dim) * 8.0 / (2.0 * dim); }
  constexpr bool keys_rotated() const { return key == KeyCodec::Mse; }
  constexpr bool values_rotated() const { return value == ValueCodec::Mse; }
  constexpr bool uses_rotation() const { return keys_rotated() || values_rotated(); }
  constexpr bool compressed() const { return key != KeyCodec::F32 && key != KeyCodec::F16 && key != KeyCodec::BF16; }
};

// Every named format, in a stable order: the uncompressed ones, vLLM's presets, the spec's
// K/V bit pairs.
std::span<const Format> all_formats();

// Throws std::invalid_argument naming every valid format when `name` is unknown.
const Format& find_format(std::string_view name);
const Format* try_find_format(std::string_view name);

// The spec's MSE key / MSE value pair "tq-k<K>v<V>" for 2 <= K, V <= 4 (sphere law, SRHT,
// norm correction), whether or not it is one of the named formats.
const Format& mse_pair_format(int key_bits, int value_bits);

inline constexpr const char* kDefaultFormat = "tq-k4v2";

std::string format_names_joined(std::string_view sep = ", ");

}  // namespace tqkv
