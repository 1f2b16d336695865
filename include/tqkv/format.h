// The traits table of every KV-cache format: how a key and a value of one (token, kv-head)
// are coded and how many bytes their slot takes. docs/FORMAT.md documents every byte.
//
// Slot layout (one slot per token per kv-head, fixed size, rounded up to an even size):
//   [K codes | K meta | V codes | V meta | pad to even]
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "tqkv/codebook.h"
#include "tqkv/codec_kind.h"
#include "tqkv/rotation.h"

namespace tqkv {

// A cache format as a value: the key and value codecs, their bits, and how the Mse codecs are
// built. Two formats are equal when they produce the same bytes; fields no codec of the format
// uses (law, rotation, norm_correction without an Mse side) do not take part.
struct Format {
  KeyCodec key = KeyCodec::F16;
  uint8_t key_bits = 16;  // bits per element of the key codes (32/16/8 for the plain codecs)
  ValueCodec value = ValueCodec::F16;
  uint8_t value_bits = 16;
  bool norm_correction = false;                    // Mse codecs: store |x| / |c| so the decoded vector has norm |x|
  Law law = Law::Gauss;                            // Mse codecs: codebook law
  RotationKind rotation = RotationKind::Hadamard;  // Mse codecs: preferred rotation (Dense where dim is not a power of 2)

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

  // The named format's name where this value equals one (f16, turboquant_4bit_nc, tq-k4v2, ...),
  // else the canonical variant spelling (k5v4, k3v3+gauss+had, kfp8v2+vu, ...); parse(name())
  // gives back an equal Format.
  std::string name() const;
  // The named format's summary, else "variant".
  std::string_view summary() const;

  // A named format or a variant spelling (grammar below). Throws tqkv::Error(InvalidArgument)
  // naming every valid spelling.
  //   [tq-]k<K>v<V>   Mse keys of K bits, Mse values of V bits (K, V in 1..8), sphere law, SRHT,
  //                   norm correction; key part kfp8/kf16/kbf16/kf32 and value part
  //                   vfp8/vf16/vbf16/vf32 for the plain codecs;
  //   then modifiers, each at most once, canonically in this order: +gauss (Gauss law), +had
  //   (plain Hadamard), +vu (values with the Uniform codec, V bits), +raw (no norm correction).
  static Format parse(std::string_view name);
  static std::optional<Format> try_parse(std::string_view name);

  friend constexpr bool operator==(const Format& a, const Format& b) {
    if (a.key != b.key || a.key_bits != b.key_bits || a.value != b.value || a.value_bits != b.value_bits) return false;
    if (!a.uses_rotation()) return true;  // law, rotation and norm correction only shape Mse codes
    return a.norm_correction == b.norm_correction && a.law == b.law && a.rotation == b.rotation;
  }
};

struct NamedFormat {
  std::string_view name;
  Format format;
  std::string_view summary;
};

// Every named format, in a stable order: the uncompressed ones, vLLM's presets, the spec's
// K/V bit pairs.
std::span<const NamedFormat> named_formats();

// A named format by name: those of named_formats() and every tq-k<K>v<V> pair with K, V in 2..4.
// nullptr where there is none.
const NamedFormat* find_named_format(std::string_view name);

// = Format::parse.
Format find_format(std::string_view name);

// The spec's MSE key / MSE value pair k<K>v<V> (sphere law, SRHT, norm correction) for
// 1 <= K, V <= 8. Throws tqkv::Error(InvalidArgument) for other bits.
Format mse_pair_format(int key_bits, int value_bits);

inline constexpr std::string_view kDefaultFormat = "tq-k4v2";

// The spec pairs k<K>v<V> (Lloyd-Max keys and values) that have a GPU decode kernel at every head
// dim, whatever model files exist: keys of kKernelMinBits..kKernelMaxKeyBits bits, values of
// kKernelMinBits..kKernelMaxValueBits, the 1-bit and wider pairs through the generic path (the
// layer dequantized each step). src/cuda/decode_pairs.cmake reads these three lines; `tqkv
// calibrate` fits within them. The recent window's k<B>v<B> copies (wq<B>) have kernels for B up
// to 5 and for kKernelWindowBits (the fused three-part launch too, for every pair above).
inline constexpr int kKernelMinBits = 2;
inline constexpr int kKernelMaxKeyBits = 8;
inline constexpr int kKernelMaxValueBits = 5;
inline constexpr int kKernelWindowBits = 6;

// The names of named_formats(), joined.
std::string format_names_joined(std::string_view sep = ", ");

}  // namespace tqkv
