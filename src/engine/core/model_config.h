// What the engine reads about a model from its GGUF metadata: sizes, RoPE, norms and the type
// of every layer. Shared by the model definition, the cache layer and the recipes.
#pragma once
#include <string>
#include <vector>

#include "engine/core/rope.h"

namespace tqkv::engine {

struct ModelConfig {
  std::string arch;
  int n_layers = 0;
  int d_model = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int d_ff = 0;
  int n_vocab = 0;
  int ctx_train = 0;
  float rms_eps = 1e-5f;
  RopeParams rope;
  bool tied_embeddings = false;
  bool qkv_bias = false;
  // Layer types: the sliding window of each layer, 0 for a full-attention layer. [n_layers]
  std::vector<int> layer_window;
  // RoPE of the sliding-window layers when it differs from `rope` (Gemma 3: base 10000 and no
  // scaling there, rope.freq_base and the scaling on the global layers); n_rot 0 = the same as `rope`.
  RopeParams rope_local = no_rope();

  static RopeParams no_rope() {
    RopeParams p;
    p.n_rot = 0;
    return p;
  }

  int window(int layer) const { return layer_window.empty() ? 0 : layer_window[layer]; }
  const RopeParams& rope_at(int layer) const { return window(layer) > 0 && rope_local.n_rot > 0 ? rope_local : rope; }
};

}  // namespace tqkv::engine
