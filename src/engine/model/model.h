// A model: its config, its weights on a device, and its forward pass over a varlen batch and a
// KV cache. Each architecture's forward pass is written once, over the device interface
// (device.h), in its own file (architecture.h: the Llama family — Llama, SmolLM2, Mistral,
// Qwen2 — and Gemma 3); others are refused by name at load.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/model/architecture.h"
#include "engine/core/batch.h"
#include "engine/cache/cache_spec.h"
#include "engine/device/device.h"
#include "engine/cache/kv_cache.h"
#include "engine/core/model_config.h"

namespace tqkv::engine {

class GgufFile;

class Model {
 public:
  // Reads the config and loads every weight onto the device (the CPU by default), nothing else.
  // Throws tqkv::Error(Format) for a missing or mis-shaped tensor, a weight that is NaN or
  // infinite, metadata the engine does not implement, or an architecture it cannot run correctly. Recipes are a separate step: the
  // model's recipes and key statistics (model_spec_sources in model_recipes.h: the recipe files
  // keyed by the weights' hash) are given by set_spec_sources; without them only plain formats
  // and specs resolve.
  static Model load(const GgufFile& f, std::shared_ptr<Device> device = nullptr);

  const ModelConfig& config() const { return cfg_; }
  Device& device() const { return *device_; }
  size_t weight_bytes() const;
  // Recipe names and key statistics for this model's cache specs.
  const SpecSources& spec_sources() const { return sources_; }
  void set_spec_sources(SpecSources s) { sources_ = std::move(s); }

  // A cache spec resolved for this model (resolve_cache_spec with its sources).
  CacheSpec resolve(const std::string& spec) const;
  // A cache on the model's device: capacity positions for each of max_seqs sequences.
  std::unique_ptr<KvCache> make_cache(const CacheSpec& spec, int capacity, int max_seqs = 1) const;
  std::unique_ptr<KvCache> make_cache(const std::string& spec, int capacity, int max_seqs = 1) const {
    return make_cache(resolve(spec), capacity, max_seqs);
  }

  // Runs a batch (batch.h) and appends its tokens' keys and values to the cache.
  // out: logits [batch.n_logits(), n_vocab] host floats, rows in batch order of the tokens whose
  // logits flag is set, or (LogitsOut::greedy) only each such row's argmax — on a GPU picked
  // there, so that a decode step copies one id per sequence rather than its logits. Checks the whole batch (token ids, positions, capacity) before
  // anything changes; a run longer than the cache plan's step_limit() runs in pieces.
  void forward(const Batch& batch, KvCache& cache, const LogitsOut& out) const;

  // One sequence: n tokens appended at its end; logits [n, n_vocab] when all_logits, else
  // [n_vocab] for the last token (or their argmax: LogitsOut::greedy).
  void forward(int64_t seq, const int32_t* tokens, int n, KvCache& cache, const LogitsOut& out, bool all_logits) const;

 private:
  ModelConfig cfg_;
  std::shared_ptr<Device> device_;
  SpecSources sources_;
  const Architecture* arch_ = nullptr;
  ModelWeights weights_;
};

}  // namespace tqkv::engine
