// Cache specs by name (src/engine/cache_spec.h): the engine's resolver, compiled into the module
// on its own (it needs only the core's formats), so that a spec means the same per-layer formats
// here as in `tqkv generate --kv-cache-dtype`. Recipe names come from recipes/*.json, read by the
// caller (tqkv.transformers) and passed in as name -> spec.
#include <map>
#include <memory>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "engine/cache_spec.h"

namespace tqkv::python {

namespace nb = nanobind;

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
}

}  // namespace tqkv::python
