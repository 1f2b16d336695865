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

#include "engine/model.h"

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

}  // namespace tqkv::eval
