// Picks the next token from logits: greedy (temperature 0) or temperature + top-k + top-p.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace tqkv::engine {

struct SamplerParams {
  float temperature = 0.0f;  // 0: greedy (argmax, ties to the lowest id)
  int top_k = 40;            // <= 0: no limit
  float top_p = 0.95f;       // 1: no nucleus cut
  uint64_t seed = 1;
};

class Sampler {
 public:
  explicit Sampler(const SamplerParams& p);
  int32_t sample(const float* logits, int n_vocab);

 private:
  SamplerParams p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> cand_;
};

// The index of the largest of v[0..n): ties to the lowest index, NaN never wins (a row of NaN
// and -inf gives 0). The GPU's cuda::argmax_rows picks the same.
int32_t argmax(const float* v, int n);

}  // namespace tqkv::engine
