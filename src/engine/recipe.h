// TEMPORARY (replaced by the recipe-file work): key statistics of a model.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tqkv::engine {

struct KeyStats {
  std::string source;
  int64_t tokens = 0;
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
  std::vector<float> key_mean, key_sq, query_sq;
};

}  // namespace tqkv::engine
