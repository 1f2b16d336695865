// Format (the traits table's value type), the named formats, and SlotCodec (encode/decode of
// slots through the CPU slot encoder, tqkv/slot_encoder.h).
#include <memory>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/operators.h>
#include <nanobind/stl/vector.h>

#include "arrays.h"
#include "bindings.h"
#include "tqkv/codec.h"
#include "tqkv/contiguous_cache.h"
#include "tqkv/error.h"
#include "tqkv/format.h"
#include "tqkv/slot_encoder.h"

namespace tqkv::python {
namespace {

const char* codec_name(KeyCodec c) {
  switch (c) {
    case KeyCodec::F32: return "f32";
    case KeyCodec::F16: return "f16";
    case KeyCodec::BF16: return "bf16";
    case KeyCodec::Fp8: return "fp8";
    case KeyCodec::Mse: return "mse";
  }
  return "?";
}

const char* codec_name(ValueCodec c) {
  switch (c) {
    case ValueCodec::F32: return "f32";
    case ValueCodec::F16: return "f16";
    case ValueCodec::BF16: return "bf16";
    case ValueCodec::Fp8: return "fp8";
    case ValueCodec::Uniform: return "uniform";
    case ValueCodec::Mse: return "mse";
  }
  return "?";
}

// Encoded slots [n, slot_bytes] of k, v [n, dim].
nb::ndarray<nb::numpy, uint8_t> encode(const SlotCodec& codec, const AnyArray& k, const AnyArray& v) {
  const Floats kf = float_input(k, "k", {kAny, codec.dim()}, "[n, dim]");
  const Floats vf = float_input(v, "v", {static_cast<int64_t>(kf.shape[0]), codec.dim()}, "[n (as k), dim]");
  auto out = new_array<uint8_t>({kf.shape[0], codec.slot_bytes()});
  encode_slots(codec, kf.data, vf.data, static_cast<int>(kf.shape[0]), out.data(), codec.slot_bytes());
  return out;
}

nb::ndarray<nb::numpy, float> decode(const SlotCodec& codec, const AnyArray& slots, bool keys) {
  const size_t n = slot_input(slots, "slots", codec.slot_bytes());
  auto out = new_array<float>({n, static_cast<size_t>(codec.dim())});
  decode_slots(codec, static_cast<const uint8_t*>(slots.data()), codec.slot_bytes(), static_cast<int>(n), keys,
               out.data());
  return out;
}

}  // namespace

Format to_format(nb::handle h) {
  if (nb::isinstance<Format>(h)) return nb::cast<Format>(h);
  if (nb::isinstance<nb::str>(h)) return Format::parse(nb::cast<std::string>(h));
  throw Error(ErrorCode::InvalidArgument, "format: expected a tqkv.Format or a format name (str)");
}

PageLayout parse_layout(const std::string& s) {
  if (s == "slot") return PageLayout::Slot;
  if (s == "page") return PageLayout::Page;
  std::string msg = "layout: expected 'slot' or 'page', got '";
  msg.append(s).append("'");
  throw Error(ErrorCode::InvalidArgument, msg);
}

std::vector<Format> to_layer_formats(nb::handle h, int n_layers) {
  if (nb::isinstance<Format>(h) || nb::isinstance<nb::str>(h)) return std::vector<Format>(std::max(n_layers, 0), to_format(h));
  if (!nb::isinstance<nb::sequence>(h))
    throw Error(ErrorCode::InvalidArgument, "formats: expected a format, a name, or one of them per layer");
  std::vector<Format> out;
  for (nb::handle item : nb::borrow<nb::sequence>(h)) out.push_back(to_format(item));
  return out;  // the cache checks that there is one per layer
}

void bind_format(nb::module_& m) {
  m.attr("DEFAULT_SEED") = kDefaultSeed;
  m.attr("DEFAULT_FORMAT") = std::string(kDefaultFormat);

  nb::class_<Format>(m, "Format",
                     "A KV-cache format as a value: key and value codecs and bits, how the Mse codes are built.\n"
                     "Format(name) takes a named format (f16, turboquant_4bit_nc, tq-k4v2, ...) or a variant\n"
                     "spelling [tq-]k<K>v<V>[+gauss][+had][+vu][+raw] (docs/FORMAT.md); two formats are equal\n"
                     "when they produce the same bytes.")
      .def(
          "__init__", [](Format* f, const std::string& name) { new (f) Format(Format::parse(name)); },
          nb::arg("name"))
      .def_prop_ro("name", &Format::name, "The named format's name, else the canonical variant spelling.")
      .def_prop_ro(
          "summary", [](const Format& f) { return std::string(f.summary()); }, "The named format's summary, else 'variant'.")
      .def_prop_ro(
          "key_codec", [](const Format& f) { return codec_name(f.key); }, "f32, f16, bf16, fp8 or mse.")
      .def_ro("key_bits", &Format::key_bits, "Bits per element of the key codes.")
      .def_prop_ro(
          "value_codec", [](const Format& f) { return codec_name(f.value); }, "f32, f16, bf16, fp8, uniform or mse.")
      .def_ro("value_bits", &Format::value_bits, "Bits per element of the value codes.")
      .def_ro("norm_correction", &Format::norm_correction, "Mse codecs store |x| / |decoded| so norms are kept.")
      .def_prop_ro(
          "law", [](const Format& f) { return std::string(law_name(f.law)); }, "Codebook law of the Mse codes.")
      .def_prop_ro(
          "rotation", [](const Format& f) { return std::string(rotation_name(f.rotation)); },
          "Preferred rotation of the Mse codes (dense where dim is not a power of 2).")
      .def_prop_ro("compressed", &Format::compressed, "False for f32, f16 and bf16 keys.")
      .def("slot_bytes", &Format::slot_bytes, nb::arg("dim"), "Bytes of one (token, kv-head) slot: key, value, pad to even.")
      .def("key_bytes", &Format::key_bytes, nb::arg("dim"), "Bytes of the key part of a slot (codes and metadata).")
      .def("value_bytes", &Format::value_bytes, nb::arg("dim"), "Bytes of the value part of a slot.")
      .def("bits_per_element", &Format::bits_per_element, nb::arg("dim"),
           "slot_bytes(dim) * 8 / (2 * dim): bits per cached element, metadata included.")
      .def(nb::self == nb::self)
      .def("__hash__", [](const Format& f) { return nb::hash(nb::str(f.name().c_str())); })
      .def("__repr__", [](const Format& f) {
        std::string s = "tqkv.Format('";
        s += f.name();
        s += "')";
        return s;
      });

  m.def(
      "named_formats",
      [] {
        std::vector<Format> out;
        for (const NamedFormat& nf : named_formats()) out.push_back(nf.format);
        return out;
      },
      "Every named format (uncompressed ones, vLLM's presets, the spec's K/V pairs), in a stable order.");
  m.def(
      "boundary_layer_formats",
      [](int n_layers, nb::handle inner, int skip, nb::handle boundary) {
        return boundary_layer_formats(n_layers, to_format(inner), skip, to_format(boundary));
      },
      nb::arg("n_layers"), nb::arg("inner"), nb::arg("skip") = -1, nb::arg("boundary") = "f16",
      nb::sig("def boundary_layer_formats(n_layers: int, inner: Format | str, skip: int = -1, "
              "boundary: Format | str = 'f16') -> list[Format]"),
      "Formats per layer: the first and last `skip` layers `boundary`, the rest `inner` (skip < 0: the "
      "default, 2 for compressed formats, at most n_layers / 2).");

  nb::class_<SlotCodec>(m, "SlotCodec",
                        "Encodes and decodes (key, value) pairs of one head dim into slots of a format (the CPU slot "
                        "encoder: byte for byte the scalar reference).")
      .def(
          "__init__",
          [](SlotCodec* c, nb::handle format, int dim, uint64_t seed) { new (c) SlotCodec(to_format(format), dim, seed); },
          nb::arg("format"), nb::arg("dim"), nb::arg("seed") = kDefaultSeed,
          nb::sig("def __init__(self, format: Format | str, dim: int, seed: int = DEFAULT_SEED) -> None"))
      .def_prop_ro("format", &SlotCodec::format)
      .def_prop_ro("dim", &SlotCodec::dim)
      .def_prop_ro("slot_bytes", &SlotCodec::slot_bytes)
      .def_prop_ro("key_bytes", &SlotCodec::key_bytes)
      .def_prop_ro("value_bytes", &SlotCodec::value_bytes)
      .def("encode", &encode, nb::arg("k"), nb::arg("v"),
           "k, v: [n, dim] float32/float16 -> slots: [n, slot_bytes] uint8. Raises Error on NaN/Inf or fp16 "
           "overflow (nothing returned).")
      .def(
          "decode_keys", [](const SlotCodec& c, const AnyArray& s) { return decode(c, s, true); }, nb::arg("slots"),
          "slots: [n, slot_bytes] uint8 -> keys [n, dim] float32 in the original domain.")
      .def(
          "decode_values", [](const SlotCodec& c, const AnyArray& s) { return decode(c, s, false); },
          nb::arg("slots"), "slots: [n, slot_bytes] uint8 -> values [n, dim] float32 in the original domain.");
}

}  // namespace tqkv::python
