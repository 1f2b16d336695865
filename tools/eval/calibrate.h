// Key statistics of a model (recipe.h KeyStats), measured over calibration text with an f32
// cache: the per-channel mean and mean square of the post-RoPE keys and the mean square of the
// queries that read them, for every (layer, kv head). Key centring and channel scales (+c, +s)
// are computed from them (key_centring.h), once per model rather than from whichever batch a
// cache sees first. Fit them on text that is not the evaluation text (the SmolLM2 recipes use
// Exodus; quality is scored on Genesis).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/model/model.h"
#include "engine/cache/recipe_fit.h"

namespace tqkv::eval {

struct CalibrateOptions {
  int ctx = 512;             // tokens per chunk (each chunk starts with an empty cache)
  int max_tokens = 20480;    // text tokens used: floor(max_tokens / ctx) chunks
  int batch = 512;
  int32_t bos = -1;          // replaces each chunk's first token when >= 0
  std::string source;        // recorded in the statistics (what text, how many tokens)
};

// Throws tqkv::Error(InvalidArgument) when the text is shorter than one chunk.
engine::KeyStats calibrate_keys(const engine::Model& model, const std::vector<int32_t>& tokens,
                                const CalibrateOptions& opt,
                                const std::function<void(int chunk, int chunks)>& progress = {});

// The per-layer sensitivity scan behind `tqkv calibrate --budget`: for every compressed layer l
// (recipe_fit.h compressed_layers; every layer when all_layers), the mean KL (vs the f32 cache,
// evaluate()'s scoring) when only layer l is compressed — keys at key_bits with values at 8
// (k<K>v8+c+only<l>), then values at value_bits with keys at 8 (k8v<V>+c+only<l>; with
// +skip0 before only<l> when all_layers, so that a boundary layer is compressed too) — with
// `suffix` appended to every spec (the copies the recipe will keep: "+sink1+w8", or "" on a
// model with sliding-window layers). Centred keys need the model's key statistics in its spec
// sources. With balance every spec says +s instead of +c.
struct ScanOptions {
  int ctx = 256;
  int max_tokens = 256;  // floor(max_tokens / ctx) chunks (at least one)
  int key_bits = 4, value_bits = 3;
  std::string suffix;
  int32_t bos = -1;
  bool all_layers = false;  // scan the boundary layers too (a budget over every layer)
  bool balance = false;     // +s (centred keys, balanced key/query channel scales) instead of +c
};
std::vector<engine::LayerSensitivity> scan_layers(const engine::Model& model, const std::vector<int32_t>& tokens,
                                                  const ScanOptions& opt,
                                                  const std::function<void(int64_t done, int64_t total)>& progress = {});
// The scan's specs, in the order scan_layers runs them (two per layer: keys, then values).
std::vector<std::string> scan_specs(const engine::ModelConfig& cfg, const ScanOptions& opt);

}  // namespace tqkv::eval
