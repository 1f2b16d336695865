// The engine's CPU cache layer (src/engine/device/cpu_kv_cache.h) for a model shape and a cache spec:
// per-layer formats, key centring and channel scales, attention sinks, the recent window and
// sliding-window rings, exactly as `tqkv generate` / `tqkv perplexity` run them. It is what
// tqkv.transformers.TQCache stores into on the CPU: Python hands it a layer's keys and values,
// then its queries, and never re-implements what the spec adds.
#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "arrays.h"
#include "bindings.h"
#include "engine/core/batch.h"
#include "engine/device/cpu_kv_cache.h"
#include "model_spec.h"
#include "tqkv/error.h"

namespace tqkv::python {
namespace {

using FloatArray = nb::ndarray<nb::numpy, float>;
constexpr const char* kRowsDims = "[n_seqs, n_tokens, heads, head_dim]";

// The engine's cache with the spec it was made from (the cache keeps a copy of the spec).
class ModelCache {
 public:
  ModelCache(const engine::CacheSpec& spec, int capacity, int max_seqs)
      : cache_(spec, engine::CacheShape{capacity, max_seqs}) {}
  engine::CpuKvCache& cache() { return cache_; }
  const engine::CpuKvCache& cache() const { return cache_; }
  const engine::ModelConfig& model() const { return cache_.spec().model; }

  // n tokens of each sequence seqs[b] from position pos0[b] (the rows of a [n_seqs, n, ...] array).
  engine::Batch batch(const std::vector<int64_t>& seqs, const std::vector<int64_t>& pos0, int n) const {
    if (pos0.size() != seqs.size()) throw Error(ErrorCode::InvalidArgument, "pos0: expected one per sequence of seqs");
    engine::Batch b;
    const std::vector<int32_t> none(static_cast<size_t>(n), 0);
    for (size_t i = 0; i < seqs.size(); ++i) b.add(seqs[i], none.data(), n, pos0[i], false);
    return b;
  }

 private:
  engine::CpuKvCache cache_;
};

// An input [n_seqs, n_tokens, heads, head_dim] copied into a float32 buffer the call may change.
std::vector<float> rows_input(const AnyArray& a, const char* name, size_t n_seqs, int64_t n_tokens, int heads,
                              int head_dim, size_t* n_out) {
  const Floats f = float_input(a, name, {static_cast<int64_t>(n_seqs), n_tokens, heads, head_dim}, kRowsDims);
  if (n_out) *n_out = f.shape[1];
  return std::vector<float>(f.data, f.data + f.size());
}

}  // namespace

void bind_model_cache(nb::module_& m) {
  nb::class_<ModelCache>(
      m, "ModelCache",
      "The engine's CPU cache layer for a model and a cache spec (src/engine/device/cpu_kv_cache.h): per-layer\n"
      "formats, key centring (+c, +s), attention sinks (+sink<N>) and the recent window (+w<N>, +wq<B>,\n"
      "+fill<B>), merged with the compressed part by log-sum-exp as the engine does. Keys and queries\n"
      "are in the engine's channel order (the GGUF's: RoPE on adjacent pairs for Llama). A call that raises\n"
      "has changed nothing.")
      .def(
          "__init__",
          [](ModelCache* self, const std::string& spec, int n_layers, int n_heads, int n_kv_heads, int head_dim,
             float rope_base, bool rope_halves, int capacity, int max_seqs, std::vector<int> layer_windows,
             const std::map<std::string, std::string>& recipes, std::vector<float> key_mean,
             std::vector<float> key_sq, std::vector<float> query_sq) {
            const engine::ModelConfig cfg =
                model_config(n_layers, n_heads, n_kv_heads, head_dim, rope_base, rope_halves, std::move(layer_windows));
            const engine::SpecSources src =
                spec_sources(cfg, recipes, std::move(key_mean), std::move(key_sq), std::move(query_sq));
            new (self) ModelCache(engine::resolve_cache_spec(spec, cfg, src), capacity, max_seqs);
          },
          nb::arg("spec"), nb::arg("n_layers"), nb::arg("n_heads"), nb::arg("n_kv_heads"), nb::arg("head_dim"),
          nb::kw_only(), nb::arg("rope_base") = 10000.0f, nb::arg("rope_halves") = false, nb::arg("capacity"),
          nb::arg("max_seqs") = 1, nb::arg("layer_windows") = std::vector<int>{},
          nb::arg("recipes") = std::map<std::string, std::string>{}, nb::arg("key_mean") = std::vector<float>{},
          nb::arg("key_sq") = std::vector<float>{}, nb::arg("query_sq") = std::vector<float>{},
          "spec: a cache spec as for resolve_cache_spec (recipes: name -> spec); the model's shape, RoPE (base,\n"
          "halves or adjacent pairs) and sliding windows ([n_layers], 0: full attention); capacity positions for\n"
          "each of max_seqs sequences; key_mean, key_sq, query_sq: the recipe file's key statistics, flat\n"
          "[n_layers * n_kv_heads * head_dim] (needed by +c / +s).")
      .def_prop_ro("capacity", [](const ModelCache& c) { return c.cache().capacity(); })
      .def_prop_ro("max_step_tokens", [](const ModelCache& c) { return c.cache().max_step_tokens(); },
                   "The most positions a sequence may take between a store and its attention (the copies' ring).")
      .def_prop_ro("detail", [](const ModelCache& c) { return c.cache().spec().detail; }, "The resolved spec.")
      .def_prop_ro("formats", [](const ModelCache& c) { return c.cache().spec().layers; })
      .def_prop_ro("centred_keys", [](const ModelCache& c) { return c.cache().centring().active(); })
      .def_prop_ro(
          "recent_window", [](const ModelCache& c) { return c.cache().spec().window_at(c.cache().capacity()); },
          "Positions of the recent window at this capacity (+w<N>'s N, or what +fill<B> leaves room for; 0: none).")
      .def_prop_ro("sinks", [](const ModelCache& c) { return c.cache().spec().sinks; },
                   "Attention sinks (+sink<N>): the first positions kept as f16 copies (0: none).")
      .def_prop_ro(
          "window_format",
          [](const ModelCache& c) {
            const auto& f = c.cache().spec().window_format;
            return f ? *f : find_format("f16");
          },
          "The format of the recent window's copies (+wq<B>; f16 without).")
      .def(
          "key_mean",
          [](const ModelCache& c, int layer) -> nb::object {
            const engine::KeyCentring& kc = c.cache().centring();
            const engine::ModelConfig& m = c.model();
            if (layer < 0 || layer >= m.n_layers) throw Error(ErrorCode::OutOfRange, "layer out of range");
            if (!kc.active()) return nb::none();
            FloatArray out = new_array<float>({static_cast<size_t>(m.n_kv_heads), static_cast<size_t>(m.head_dim)});
            std::copy_n(kc.mean(layer), out.size(), out.data());
            return nb::cast(out);
          },
          nb::arg("layer"), "The channel means the keys of a layer are cached minus, [n_kv_heads, head_dim]; None without +c/+s.")
      .def("add_sequence", [](ModelCache& c) { return c.cache().add_sequence(); }, "A new, empty sequence; its id.")
      .def("free_sequence", [](ModelCache& c, int64_t seq) { c.cache().free_sequence(seq); }, nb::arg("seq"))
      .def("seq_len", [](const ModelCache& c, int64_t seq) { return c.cache().seq_len(seq); }, nb::arg("seq"))
      .def(
          "bytes",
          [](const ModelCache& c, int64_t seq) {
            const engine::CacheBytes b = c.cache().bytes(seq);
            return std::make_pair(b.slots, b.copies);
          },
          nb::arg("seq"), "(slot bytes, copy bytes) of one sequence's positions (the engine's accounting).")
      .def(
          "store",
          [](ModelCache& c, int layer, const std::vector<int64_t>& ids, const std::vector<int64_t>& p0, const AnyArray& k,
             const AnyArray& v) {
            const engine::ModelConfig& m = c.model();
            size_t n = 0;
            std::vector<float> kf = rows_input(k, "k", ids.size(), kAny, m.n_kv_heads, m.head_dim, &n);
            const std::vector<float> vf =
                rows_input(v, "v", ids.size(), static_cast<int64_t>(n), m.n_kv_heads, m.head_dim, nullptr);
            if (layer < 0 || layer >= m.n_layers) throw Error(ErrorCode::OutOfRange, "layer out of range");
            const engine::Batch b = c.batch(ids, p0, static_cast<int>(n));
            c.cache().store(layer, b, kf.data(), vf.data());
          },
          nb::arg("layer"), nb::arg("seqs"), nb::arg("pos0"), nb::arg("k"), nb::arg("v"),
          "Stores k, v [n_seqs, n_tokens, n_kv_heads, head_dim] (float32/float16) of one layer: sequence seqs[b]\n"
          "(a list of ids) at positions pos0[b] .. pos0[b] + n_tokens - 1, pos0[b] its length (keys centred as\n"
          "the spec says). Store every layer of a position before attending from a later one.")
      .def(
          "attention",
          [](ModelCache& c, int layer, const std::vector<int64_t>& ids, const std::vector<int64_t>& p0, const AnyArray& q) {
            const engine::ModelConfig& m = c.model();
            size_t n = 0;
            std::vector<float> qf = rows_input(q, "q", ids.size(), kAny, m.n_heads, m.head_dim, &n);
            if (layer < 0 || layer >= m.n_layers) throw Error(ErrorCode::OutOfRange, "layer out of range");
            const engine::Batch b = c.batch(ids, p0, static_cast<int>(n));
            FloatArray out = new_array<float>({ids.size(), n, static_cast<size_t>(m.n_heads),
                                               static_cast<size_t>(m.head_dim)});
            c.cache().attend_stored(layer, b, qf.data(), out.data());
            return out;
          },
          nb::arg("layer"), nb::arg("seqs"), nb::arg("pos0"), nb::arg("q"),
          "Causal attention of the queries q [n_seqs, n_tokens, n_heads, head_dim] of sequence seqs[b] at\n"
          "positions pos0[b].. (already stored) over the sequence's cache, as the engine computes it (sinks,\n"
          "window, compressed part, the layer's sliding window; scale 1/sqrt(head_dim)). Returns\n"
          "[n_seqs, n_tokens, n_heads, head_dim] float32.")
      .def(
          "read",
          [](const ModelCache& c, int layer, int64_t seq, int64_t start, int count, bool keys) {
            if (count < 0) throw Error(ErrorCode::InvalidArgument, "count: must be >= 0");
            const engine::ModelConfig& m = c.model();
            FloatArray out = new_array<float>(
                {static_cast<size_t>(count), static_cast<size_t>(m.n_kv_heads), static_cast<size_t>(m.head_dim)});
            c.cache().read(layer, seq, start, count, keys, out.data());
            return out;
          },
          nb::arg("layer"), nb::arg("seq"), nb::arg("start"), nb::arg("count"), nb::arg("keys") = true,
          "Keys (or values) of positions [start, start + count) decoded from the compressed slots, centring\n"
          "undone -> [count, n_kv_heads, head_dim] float32.")
      .def(
          "slots",
          [](ModelCache& self, int64_t seq, int layer, int head) {
            const std::vector<uint8_t> bytes = self.cache().stored_slots(layer, seq, head);
            const int64_t n = self.cache().seq_len(seq);
            const size_t sb = n > 0 ? bytes.size() / static_cast<size_t>(n) : 0;
            auto out = new_array<uint8_t>({static_cast<size_t>(n), sb});
            std::copy(bytes.begin(), bytes.end(), out.data());
            return out;
          },
          nb::arg("seq"), nb::arg("layer"), nb::arg("head"),
          "A copy of the compressed slots of (sequence, layer, head) of the full-attention layers, in the\n"
          "slot layout: [seq_len, slot_bytes] uint8, keys as stored (centred).");
}

}  // namespace tqkv::python
