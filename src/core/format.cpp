#include "tqkv/format.h"

#include <array>
#include <stdexcept>

namespace tqkv {
namespace {

constexpr Format plain(const char* name, KeyCodec k, ValueCodec v, uint8_t bits, const char* summary) {
  return Format{name, k, bits, v, bits, false, Law::Gauss, RotationKind::Hadamard, summary};
}
// vLLM's presets: Gaussian codebook, plain Hadamard, uniform min/max values.
constexpr Format vllm(const char* name, KeyCodec k, uint8_t kb, uint8_t vb, bool nc, const char* summary) {
  return Format{name, k, kb, ValueCodec::Uniform, vb, nc, Law::Gauss, RotationKind::Hadamard, summary};
}
// The spec's pairs: exact sphere-law codebook, SRHT, MSE values, norm correction.
constexpr Format pair(const char* name, uint8_t kb, uint8_t vb) {
  return Format{name, KeyCodec::Mse, kb, ValueCodec::Mse, vb, true, Law::Sphere, RotationKind::Srht,
                "spec K/V pair: Lloyd-Max keys and values on the unit sphere, SRHT"};
}

constexpr std::array<Format, 9> kPairs = {
    pair("tq-k2v2", 2, 2), pair("tq-k2v3", 2, 3), pair("tq-k2v4", 2, 4),
    pair("tq-k3v2", 3, 2), pair("tq-k3v3", 3, 3), pair("tq-k3v4", 3, 4),
    pair("tq-k4v2", 4, 2), pair("tq-k4v3", 4, 3), pair("tq-k4v4", 4, 4),
};

constexpr std::array<Format, 12> kFormats = {
    plain("f32", KeyCodec::F32, ValueCodec::F32, 32, "uncompressed float32"),
    plain("f16", KeyCodec::F16, ValueCodec::F16, 16, "uncompressed float16"),
    plain("bf16", KeyCodec::BF16, ValueCodec::BF16, 16, "uncompressed bfloat16"),
    plain("fp8", KeyCodec::Fp8, ValueCodec::Fp8, 8, "FP8 E4M3 per element, no scale"),
    vllm("turboquant_k8v4", KeyCodec::Fp8, 8, 4, false, "vLLM: FP8 keys, 4-bit uniform values"),
    vllm("turboquant_4bit_nc", KeyCodec::Mse, 4, 4, true, "vLLM: 4-bit MSE keys (norm-corrected), 4-bit uniform values"),
    vllm("turboquant_k3v4_nc", KeyCodec::Mse, 3, 4, true, "vLLM: 3-bit MSE keys (norm-corrected), 4-bit uniform values"),
    vllm("turboquant_3bit_nc", KeyCodec::Mse, 3, 3, true, "vLLM: 3-bit MSE keys (norm-corrected), 3-bit uniform values"),
    kPairs[6],  // tq-k4v2, the spec's default
    kPairs[3],  // tq-k3v2
    kPairs[7],  // tq-k4v3
    kPairs[8],  // tq-k4v4
};

// The byte contract, checked at compile time (docs/FORMAT.md).
constexpr size_t slot_of(std::string_view name, int dim) {
  for (const auto& f : kFormats)
    if (std::string_view(f.name) == name) return f.slot_bytes(dim);
  return 0;
}
static_assert(slot_of("turboquant_k8v4", 128) == 196 && slot_of("turboquant_k8v4", 64) == 100);
static_assert(slot_of("turboquant_4bit_nc", 128) == 134 && slot_of("turboquant_4bit_nc", 64) == 70);
static_assert(slot_of("turboquant_k3v4_nc", 128) == 118 && slot_of("turboquant_k3v4_nc", 64) == 62);
static_assert(slot_of("turboquant_3bit_nc", 128) == 102 && slot_of("turboquant_3bit_nc", 64) == 54);
static_assert(slot_of("tq-k4v2", 128) == 100 && slot_of("f16", 128) == 512 && slot_of("fp8", 64) == 128);

}  // namespace

std::span<const Format> all_formats() { return kFormats; }

const Format* try_find_format(std::string_view name) {
  for (const auto& f : kFormats)
    if (name == f.name) return &f;
  for (const auto& f : kPairs)
    if (name == f.name) return &f;
  return nullptr;
}

std::string format_names_joined(std::string_view sep) {
  std::string out;
  for (const auto& f : kFormats) {
    if (!out.empty()) out += sep;
    out += f.name;
  }
  return out;
}

const Format& find_format(std::string_view name) {
  if (const Format* f = try_find_format(name)) return *f;
  throw std::invalid_argument("unknown KV-cache format '" + std::string(name) +
                              "'; valid formats: " + format_names_joined());
}

const Format& mse_pair_format(int key_bits, int value_bits) {
  if (key_bits < 2 || key_bits > 4 || value_bits < 2 || value_bits > 4)
    throw std::invalid_argument("tq pair bits must be in 2..4, got K" + std::to_string(key_bits) + "/V" +
                                std::to_string(value_bits));
  // Prefer the entry of the named table, so that a format has one address.
  return *try_find_format(kPairs[(key_bits - 2) * 3 + (value_bits - 2)].name);
}

}  // namespace tqkv
