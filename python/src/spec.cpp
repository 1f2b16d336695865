// Cache specs by name (src/engine/cache/cache_spec.h) and their key centring (key_centring.h): the
// engine's code, compiled into the module on its own (it needs only the core's formats), so that
// a spec means the same per-layer formats and the same channel means here as in `tqkv generate
// --kv-cache-dtype`. Recipe names and key statistics come from recipes/*.json, read by the caller
// (tqkv.transformers) and passed in.
#include <map>
#include <memory>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "arrays.h"
#include "bindings.h"
#include "engine/cache/cache_spec.h"
#include "engine/cache/key_centring.h"
#include "model_spec.h"
#include "tqkv/error.h"

namespace tqkv::python {

namespace {

using FloatArray = nb::ndarray<nb::numpy, float>;

// [n_layers, n_kv_heads, head_dim] of one of KeyCentring's per-layer tables.
template <typename Get>
FloatArray per_layer(int n_layers, int n_kv_heads, int head_dim, Get get) {
  FloatArray out = new_array<float>({static_cast<size_t>(n_layers), static_cast<size_t>(n_kv_heads),
                                     static_cast<size_t>(head_dim)});
  const size_t per = static_cast<size_t>(n_kv_heads) * head_dim;
  for (int l = 0; l < n_layers; ++l) std::copy_n(get(l), per, out.data() + l * per);
  return out;
}

}  // namespace

engine::ModelConfig model_config(int n_layers, int n_heads, int n_kv_heads, int head_dim, float rope_base,
                                 bool rope_halves, std::vector<int> layer_windows) {
  if (n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0)
    throw Error(ErrorCode::InvalidArgument, "n_heads: must be a positive multiple of n_kv_heads");
  if (!layer_windows.empty() && static_cast<int>(layer_windows.size()) != n_layers)
    throw Error(ErrorCode::InvalidArgument, "layer_windows: expected one per layer (0: full attention)");
  engine::ModelConfig cfg;
  cfg.n_layers = n_layers;
  cfg.n_kv_heads = n_kv_heads;
  cfg.n_heads = n_heads;
  cfg.head_dim = head_dim;
  cfg.rope.n_rot = head_dim;
  cfg.rope.base = rope_base;
  cfg.rope.layout = rope_halves ? engine::RopeLayout::Halves : engine::RopeLayout::Adjacent;
  cfg.layer_window = std::move(layer_windows);
  return cfg;
}

engine::SpecSources spec_sources(const engine::ModelConfig& cfg, const std::map<std::string, std::string>& recipes,
                                 std::vector<float> key_mean, std::vector<float> key_sq, std::vector<float> query_sq) {
  engine::SpecSources sources;
  for (const auto& [name, s] : recipes) sources.recipes.push_back({name, s});
  if (key_mean.empty()) return sources;
  auto stats = std::make_shared<engine::KeyStats>();
  stats->n_layers = cfg.n_layers;
  stats->n_kv_heads = cfg.n_kv_heads;
  stats->head_dim = cfg.head_dim;
  stats->tokens = 1;
  for (const auto* v : {&key_mean, &key_sq, &query_sq})
    if (v->size() != stats->size())
      throw Error(ErrorCode::InvalidArgument, "key statistics: expected n_layers * n_kv_heads * head_dim = " +
                                                  std::to_string(stats->size()) + " values each");
  stats->key_mean = std::move(key_mean);
  stats->key_sq = std::move(key_sq);
  stats->query_sq = std::move(query_sq);
  sources.key_stats = stats;
  return sources;
}

void bind_spec(nb::module_& m) {
  m.def(
      "resolve_cache_spec",
      [](const std::string& spec, int n_layers, int n_kv_heads, int head_dim,
         const std::map<std::string, std::string>& recipes) {
        engine::ModelConfig cfg;
        cfg.n_layers = n_layers;
        cfg.n_kv_heads = n_kv_heads;
        cfg.head_dim = head_dim;
        engine::SpecSources sources;
        for (const auto& [name, s] : recipes) sources.recipes.push_back({name, s});
        // Centring (+c/+s) is reported, not applied here: statistics of the right shape stand in
        // so that the resolver accepts the spec; the caller decides what it supports.
        auto stats = std::make_shared<engine::KeyStats>();
        stats->n_layers = n_layers;
        stats->n_kv_heads = n_kv_heads;
        stats->head_dim = head_dim;
        sources.key_stats = stats;
        const engine::CacheSpec r = engine::resolve_cache_spec(spec, cfg, sources);
        nb::dict out;
        out["name"] = r.name;
        out["detail"] = r.detail;
        out["layers"] = r.layers;
        out["centre_keys"] = r.centre_keys;
        out["scale_channels"] = r.scale_channels;
        out["recent_window"] = r.recent_window;
        out["sinks"] = r.sinks;
        out["fill_bits"] = r.fill_bits;
        out["window_format"] = r.window_format ? nb::cast(*r.window_format) : nb::none();
        out["bits"] = r.bits;
        out["bits_all"] = r.bits_all;
        return out;
      },
      nb::arg("spec"), nb::arg("n_layers"), nb::arg("n_kv_heads"), nb::arg("head_dim"),
      nb::arg("recipes") = std::map<std::string, std::string>{},
      "Resolves a cache spec (a format name, k<K>v<V>, a recipe name from `recipes` (name -> spec), with\n"
      "+options; docs/FORMAT.md, \"Cache specs\") for a model of that shape, as the engine does. Returns a\n"
      "dict: name, detail, layers (one Format per layer, boundary layers included), centre_keys,\n"
      "scale_channels, recent_window, sinks, fill_bits, window_format, bits (compressed layers' bits per\n"
      "element), bits_all (every layer's). Raises Error for an unknown name or a malformed spec.");

  m.def(
      "key_centring",
      [](const std::string& spec, int n_layers, int n_kv_heads, int head_dim, int n_heads, float rope_base,
         bool rope_halves, std::vector<float> key_mean, std::vector<float> key_sq, std::vector<float> query_sq,
         int capacity, const std::map<std::string, std::string>& recipes) -> nb::object {
        const engine::ModelConfig cfg = model_config(n_layers, n_heads, n_kv_heads, head_dim, rope_base, rope_halves);
        const engine::SpecSources sources =
            spec_sources(cfg, recipes, std::move(key_mean), std::move(key_sq), std::move(query_sq));
        const engine::KeyCentring kc(engine::resolve_cache_spec(spec, cfg, sources), capacity);
        if (!kc.active()) return nb::none();
        FloatArray mean = per_layer(n_layers, n_kv_heads, head_dim, [&](int l) { return kc.mean(l); });
        if (!kc.scales()) return nb::make_tuple(mean, nb::none());
        return nb::make_tuple(mean, per_layer(n_layers, n_kv_heads, head_dim, [&](int l) { return kc.scale(l); }));
      },
      nb::arg("spec"), nb::arg("n_layers"), nb::arg("n_kv_heads"), nb::arg("head_dim"), nb::arg("n_heads"),
      nb::arg("rope_base"), nb::arg("rope_halves"), nb::arg("key_mean"), nb::arg("key_sq"), nb::arg("query_sq"),
      nb::arg("capacity"), nb::arg("recipes") = std::map<std::string, std::string>{},
      "The key centring of a spec with +c or +s, as the engine applies it to a cache of `capacity`\n"
      "positions (src/engine/cache/key_centring.h): None without +c/+s, else (mean, scale), each\n"
      "[n_layers, n_kv_heads, head_dim] float32 (scale None without +s). Keys are cached as\n"
      "(k - mean) / scale and queries multiplied by scale. The statistics (a recipe file's key_stats,\n"
      "flat [n_layers * n_kv_heads * head_dim]) and the result use RoPE's channel order: adjacent pairs\n"
      "(2i, 2i+1) or, with rope_halves, halves (i, i + head_dim / 2).");
}

}  // namespace tqkv::python
