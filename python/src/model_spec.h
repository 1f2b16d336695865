// A model's shape and key statistics as the engine's cache specs need them (spec.cpp builds
// them from the arguments tqkv.transformers passes; model_cache.cpp uses them too).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/cache/cache_spec.h"

namespace tqkv::python {

// Shape, RoPE (base; halves or adjacent pairs) and per-layer sliding windows (empty: none).
// Throws tqkv::Error(InvalidArgument) for n_heads that is not a positive multiple of n_kv_heads.
engine::ModelConfig model_config(int n_layers, int n_heads, int n_kv_heads, int head_dim, float rope_base,
                                 bool rope_halves, std::vector<int> layer_windows = {});
// Recipes and, when key_mean is not empty, key statistics (each [n_layers * n_kv_heads * head_dim],
// a recipe file's key_stats). Throws tqkv::Error(InvalidArgument) for statistics of another size.
engine::SpecSources spec_sources(const engine::ModelConfig& cfg, const std::map<std::string, std::string>& recipes,
                                 std::vector<float> key_mean = {}, std::vector<float> key_sq = {},
                                 std::vector<float> query_sq = {});

}  // namespace tqkv::python
