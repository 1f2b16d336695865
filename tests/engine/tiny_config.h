// A small llama-shaped ModelConfig for cache tests that need no weights (4 query heads, 2 kv
// heads, head_dim 64); window_every > 0: every layer but each window_every-th attends within
// `window` positions, as Gemma 3's local layers do.
#pragma once
#include "engine/core/model_config.h"

namespace tqkv::testing_util {

inline engine::ModelConfig tiny_config(int layers, int window_every = 0, int window = 0) {
  engine::ModelConfig c;
  c.arch = "llama";
  c.n_layers = layers;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.rope.n_rot = 64;
  c.layer_window.assign(layers, 0);
  for (int l = 0; l < layers && window_every > 0; ++l)
    if ((l + 1) % window_every != 0) c.layer_window[l] = window;
  return c;
}

}  // namespace tqkv::testing_util
