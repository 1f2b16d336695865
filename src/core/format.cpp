#include "tqkv/format.h"

#include <array>

#include "tqkv/error.h"

namespace tqkv {
namespace {

constexpr Format plain(KeyCodec k, ValueCodec v, uint8_t bits) {
  return Format{k, bits, v, bits, false, Law::Gauss, RotationKind::Hadamard};
}
// vLLM's presets: Gaussian codebook, plain Hadamard, uniform min/max values.
constexpr Format vllm(KeyCodec k, uint8_t kb, uint8_t vb, bool nc) {
  return Format{k, kb, ValueCodec::Uniform, vb, nc, Law::Gauss, RotationKind::Hadamard};
}
// The spec's pairs: exact sphere-law codebook, SRHT, MSE values, norm correction.
constexpr Format pair(int kb, int vb) {
  return Format{KeyCodec::Mse, static_cast<uint8_t>(kb), ValueCodec::Mse, static_cast<uint8_t>(vb),
                true,          Law::Sphere,               RotationKind::Srht};
}
constexpr std::string_view kPairSummary = "spec K/V pair: Lloyd-Max keys and values on the unit sphere, SRHT";
constexpr NamedFormat named_pair(std::string_view name, int kb, int vb) { return {name, pair(kb, vb), kPairSummary}; }

constexpr std::array<NamedFormat, 9> kPairs = {
    named_pair("tq-k2v2", 2, 2), named_pair("tq-k2v3", 2, 3), named_pair("tq-k2v4", 2, 4),
    named_pair("tq-k3v2", 3, 2), named_pair("tq-k3v3", 3, 3), named_pair("tq-k3v4", 3, 4),
    named_pair("tq-k4v2", 4, 2), named_pair("tq-k4v3", 4, 3), named_pair("tq-k4v4", 4, 4),
};

constexpr std::array<NamedFormat, 12> kFormats = {{
    {"f32", plain(KeyCodec::F32, ValueCodec::F32, 32), "uncompressed float32"},
    {"f16", plain(KeyCodec::F16, ValueCodec::F16, 16), "uncompressed float16"},
    {"bf16", plain(KeyCodec::BF16, ValueCodec::BF16, 16), "uncompressed bfloat16"},
    {"fp8", plain(KeyCodec::Fp8, ValueCodec::Fp8, 8), "FP8 E4M3 per element, no scale"},
    {"turboquant_k8v4", vllm(KeyCodec::Fp8, 8, 4, false), "vLLM: FP8 keys, 4-bit uniform values"},
    {"turboquant_4bit_nc", vllm(KeyCodec::Mse, 4, 4, true), "vLLM: 4-bit MSE keys (norm-corrected), 4-bit uniform values"},
    {"turboquant_k3v4_nc", vllm(KeyCodec::Mse, 3, 4, true), "vLLM: 3-bit MSE keys (norm-corrected), 4-bit uniform values"},
    {"turboquant_3bit_nc", vllm(KeyCodec::Mse, 3, 3, true), "vLLM: 3-bit MSE keys (norm-corrected), 3-bit uniform values"},
    kPairs[6],  // tq-k4v2, the spec's default
    kPairs[3],  // tq-k3v2
    kPairs[7],  // tq-k4v3
    kPairs[8],  // tq-k4v4
}};

// The byte contract, checked at compile time (docs/FORMAT.md).
constexpr size_t slot_of(std::string_view name, int dim) {
  for (const auto& f : kFormats)
    if (f.name == name) return f.format.slot_bytes(dim);
  return 0;
}
static_assert(slot_of("turboquant_k8v4", 128) == 196 && slot_of("turboquant_k8v4", 64) == 100);
static_assert(slot_of("turboquant_4bit_nc", 128) == 134 && slot_of("turboquant_4bit_nc", 64) == 70);
static_assert(slot_of("turboquant_k3v4_nc", 128) == 118 && slot_of("turboquant_k3v4_nc", 64) == 62);
static_assert(slot_of("turboquant_3bit_nc", 128) == 102 && slot_of("turboquant_3bit_nc", 64) == 54);
static_assert(slot_of("tq-k4v2", 128) == 100 && slot_of("f16", 128) == 512 && slot_of("fp8", 64) == 128);
// The canonical spelling of vLLM's FP8-key preset, by value.
static_assert(vllm(KeyCodec::Fp8, 8, 4, false) == Format{KeyCodec::Fp8, 8, ValueCodec::Uniform, 4});

const NamedFormat* named_by_value(const Format& f) {
  for (const auto& n : kFormats)
    if (n.format == f) return &n;
  for (const auto& n : kPairs)
    if (n.format == f) return &n;
  return nullptr;
}

// The plain (uncompressed or fp8) codecs' spellings in a variant, "f16" of "kf16".
struct PlainSpelling {
  std::string_view text;
  KeyCodec key;
  ValueCodec value;
  uint8_t bits;
};
constexpr std::array<PlainSpelling, 4> kPlain = {{
    {"fp8", KeyCodec::Fp8, ValueCodec::Fp8, 8},
    {"f16", KeyCodec::F16, ValueCodec::F16, 16},
    {"bf16", KeyCodec::BF16, ValueCodec::BF16, 16},
    {"f32", KeyCodec::F32, ValueCodec::F32, 32},
}};

// One side of a variant ("4", "fp8", ...) at the front of s: the matching plain spelling, or
// bits 1..8 (a single digit) for an Mse/Uniform side. Consumes what it read.
struct Side {
  const PlainSpelling* plain = nullptr;
  int bits = 0;
};
std::optional<Side> take_side(std::string_view& s) {
  for (const auto& p : kPlain)
    if (s.starts_with(p.text)) {
      s.remove_prefix(p.text.size());
      return Side{&p, p.bits};
    }
  if (s.empty() || s[0] < '1' || s[0] > '8') return std::nullopt;
  const int bits = s[0] - '0';
  s.remove_prefix(1);
  if (!s.empty() && s[0] >= '0' && s[0] <= '9') return std::nullopt;  // k10v4
  return Side{nullptr, bits};
}

std::optional<Format> parse_variant(std::string_view s) {
  if (s.starts_with("tq-")) s.remove_prefix(3);
  if (!s.starts_with("k")) return std::nullopt;
  s.remove_prefix(1);
  const auto k = take_side(s);
  if (!k || !s.starts_with("v")) return std::nullopt;
  s.remove_prefix(1);
  const auto v = take_side(s);
  if (!v) return std::nullopt;
  Format f = pair(1, 1);
  if (k->plain) f.key = k->plain->key;
  f.key_bits = static_cast<uint8_t>(k->bits);
  if (v->plain) f.value = v->plain->value;
  f.value_bits = static_cast<uint8_t>(v->bits);
  bool seen_law = false, seen_rot = false, seen_vu = false, seen_raw = false;
  while (!s.empty()) {
    if (s[0] != '+') return std::nullopt;
    s.remove_prefix(1);
    const size_t end = s.find('+');
    const std::string_view mod = s.substr(0, end);
    s = end == std::string_view::npos ? std::string_view() : s.substr(end);
    if (mod == "gauss" && !seen_law) {
      f.law = Law::Gauss, seen_law = true;
    } else if ((mod == "had" || mod == "dense") && !seen_rot) {
      f.rotation = mod == "had" ? RotationKind::Hadamard : RotationKind::Dense, seen_rot = true;
    } else if (mod == "vu" && !seen_vu && !v->plain) {
      f.value = ValueCodec::Uniform, seen_vu = true;
    } else if (mod == "raw" && !seen_raw) {
      f.norm_correction = false, seen_raw = true;
    } else {
      return std::nullopt;
    }
  }
  return f;
}

std::string_view plain_text_of_key(KeyCodec k) {
  for (const auto& p : kPlain)
    if (p.key == k) return p.text;
  return "?";
}
std::string_view plain_text_of_value(ValueCodec v) {
  for (const auto& p : kPlain)
    if (p.value == v) return p.text;
  return "?";
}

}  // namespace

std::string Format::name() const {
  if (const NamedFormat* n = named_by_value(*this)) return std::string(n->name);
  // Appends only: GCC 12 warns falsely (-Wrestrict) on "literal" + std::string.
  std::string out;
  out.append("k");
  if (key == KeyCodec::Mse)
    out.append(std::to_string(key_bits));
  else
    out.append(plain_text_of_key(key));
  out.append("v");
  if (value == ValueCodec::Mse || value == ValueCodec::Uniform)
    out.append(std::to_string(value_bits));
  else
    out.append(plain_text_of_value(value));
  if (uses_rotation()) {
    if (law == Law::Gauss) out += "+gauss";
    if (rotation == RotationKind::Hadamard) out += "+had";
    if (rotation == RotationKind::Dense) out += "+dense";
  }
  if (value == ValueCodec::Uniform) out += "+vu";
  if (uses_rotation() && !norm_correction) out += "+raw";
  return out;
}

std::string_view Format::summary() const {
  const NamedFormat* n = named_by_value(*this);
  return n ? n->summary : std::string_view("variant");
}

std::optional<Format> Format::try_parse(std::string_view name) {
  if (const NamedFormat* n = find_named_format(name)) return n->format;
  return parse_variant(name);
}

Format Format::parse(std::string_view name) {
  if (auto f = try_parse(name)) return *f;
  throw Error(ErrorCode::InvalidArgument,
              "unknown KV-cache format '" + std::string(name) + "'; valid formats: " + format_names_joined() +
                  ", tq-k<K>v<V> (K, V in 2..4), or a variant k<K>v<V>[+gauss][+had][+vu][+raw] with K, V in "
                  "1..8 bits (kfp8/kf16/kbf16/kf32 and vfp8/vf16/vbf16/vf32 for uncompressed sides)");
}

std::span<const NamedFormat> named_formats() { return kFormats; }

const NamedFormat* find_named_format(std::string_view name) {
  for (const auto& f : kFormats)
    if (name == f.name) return &f;
  for (const auto& f : kPairs)
    if (name == f.name) return &f;
  return nullptr;
}

Format find_format(std::string_view name) { return Format::parse(name); }

std::string format_names_joined(std::string_view sep) {
  std::string out;
  for (const auto& f : kFormats) {
    if (!out.empty()) out += sep;
    out += f.name;
  }
  return out;
}

Format mse_pair_format(int key_bits, int value_bits) {
  if (key_bits < 1 || key_bits > 8 || value_bits < 1 || value_bits > 8)
    throw Error(ErrorCode::InvalidArgument, "tq pair bits must be in 1..8, got K" + std::to_string(key_bits) +
                                                "/V" + std::to_string(value_bits));
  return pair(key_bits, value_bits);
}

}  // namespace tqkv
