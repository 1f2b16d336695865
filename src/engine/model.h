// A Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral-style GGUFs) whose attention runs on
// a tqkv::ContiguousCache, so every KV-cache format tqkv offers is usable.
//
// Weights are expanded to float32 at load time. Why: the prefill is a batch of GEMMs that
// OpenBLAS runs near peak on float32, and the result is bit-for-bit the dequantized model the
// independent NumPy reference computes (tests/integration/reference_forward.py), which is what
// the KV-cache quality numbers must be measured against. The price is memory (4 bytes per
// weight: ~0.54 GB for SmolLM2-135M) and decode speed, which is bound by streaming those
// weights once per token; quantized dot kernels would cut that ~7x and are the next step.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tqkv/contiguous_cache.h"

namespace tqkv::engine {

class GgufFile;

// How RoPE pairs the coordinates of a head: Llama GGUFs (whose q/k rows the converter
// permuted) rotate adjacent pairs (2i, 2i+1); NeoX-style models (Qwen2, Gemma, ...) rotate
// (i, i + n_rot/2).
enum class RopeLayout { Adjacent, Halves };

struct ModelConfig {
  std::string arch;
  int n_layers = 0;
  int d_model = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int n_rot = 0;  // leading dims of each head that RoPE rotates
  int d_ff = 0;
  int n_vocab = 0;
  int ctx_train = 0;
  float rms_eps = 1e-5f;
  float rope_base = 10000.0f;
  RopeLayout rope = RopeLayout::Adjacent;
  bool tied_embeddings = false;
  bool qkv_bias = false;
};

class Model {
 public:
  // Reads the config and expands every weight. Throws tqkv::Error(Format) for a missing or
  // mis-shaped tensor or an unsupported architecture.
  static Model load(const GgufFile& f);

  const ModelConfig& config() const { return cfg_; }
  size_t weight_bytes() const;

  // A cache shaped for this model: capacity positions, `format` in the inner layers and the
  // first/last `skip_layers` layers in f16 (skip < 0: the formats' default).
  ContiguousCache make_cache(const std::string& format, int capacity, int skip_layers = -1) const;

  // Runs n tokens at absolute positions pos0 .. pos0 + n - 1 (the cache must hold exactly
  // [first_pos, pos0) before the call) and appends their keys and values to the cache.
  // logits: [n, n_vocab] when all_logits, else [n_vocab] for the last token only.
  void forward(const int32_t* tokens, int n, int64_t pos0, ContiguousCache& cache, float* logits,
               bool all_logits) const;

 private:
  struct Layer {
    std::vector<float> attn_norm, wq, wk, wv, wo, bq, bk, bv, ffn_norm, w_gate, w_up, w_down;
  };
  ModelConfig cfg_;
  std::vector<float> tok_embd_;  // [n_vocab, d_model]
  std::vector<float> out_norm_;  // [d_model]
  std::vector<float> output_;    // [n_vocab, d_model]; empty when tied to tok_embd_
  std::vector<Layer> layers_;
};

// Threads for BLAS and the OpenMP loops; n <= 0 keeps the libraries' defaults (all cores).
void set_num_threads(int n);

// y[n, out] = x[n, in] * W[out, in]^T (+ bias), on OpenBLAS.
void matmul(const float* x, int n, int in, const float* w, int out, float* y, const float* bias = nullptr);

}  // namespace tqkv::engine
