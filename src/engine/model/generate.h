// The generation loop: batched prefill of the prompt, then one token at a time, streaming
// each new token to a callback, with timings for the tokens/s report.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "engine/model/model.h"
#include "engine/core/sampler.h"
#include "engine/gguf/tokenizer.h"

namespace tqkv::engine {

struct GenerateOptions {
  int n_predict = 128;
  SamplerParams sampler;
  bool stop_at_end_of_generation = true;
};

struct GenerateStats {
  int n_prompt = 0;
  int n_decoded = 0;        // tokens produced (the first comes from the prefill's logits)
  double prompt_seconds = 0;
  double decode_seconds = 0;  // time of the decode forward passes (n_decoded - 1 of them)
  // Process CPU time (all threads) of the same two phases: on a shared machine wall time
  // depends on the neighbours, CPU time much less.
  double prompt_cpu_seconds = 0;
  double decode_cpu_seconds = 0;
  CacheBytes kv;  // cache memory holding the sequence's positions, copies included (CacheSpec::bytes)
  double prompt_tokens_per_second() const { return prompt_seconds > 0 ? n_prompt / prompt_seconds : 0; }
  double decode_tokens_per_second() const {
    return decode_seconds > 0 && n_decoded > 1 ? (n_decoded - 1) / decode_seconds : 0;
  }
  double prompt_tokens_per_cpu_second() const { return prompt_cpu_seconds > 0 ? n_prompt / prompt_cpu_seconds : 0; }
  double decode_tokens_per_cpu_second() const {
    return decode_cpu_seconds > 0 && n_decoded > 1 ? (n_decoded - 1) / decode_cpu_seconds : 0;
  }
};

// Runs prompt + up to n_predict new tokens through model on sequence seq of cache (which must
// be empty and large enough for the prompt; decoding stops when it is full). on_token gets each
// new id; generation stops early at an end-of-generation token (not passed to on_token).
// Throws tqkv::Error(InvalidArgument) for an empty prompt or one that does not fit the cache.
GenerateStats generate(const Model& model, const Tokenizer& tok, KvCache& cache, int64_t seq,
                       const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                       const std::function<void(int32_t)>& on_token);

}  // namespace tqkv::engine
