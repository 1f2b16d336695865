// A Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral-style GGUFs) whose attention runs on
// a tqkv::ContiguousCache, so every KV-cache format tqkv offers is usable.
//
// Weights are held twice. (1) Expanded to float32 at load: a batch of tokens (prefill,
// perplexity) is a GEMM that OpenBLAS runs near peak on float32, and its result is the
// dequantized model that the independent NumPy reference computes
// (tests/integration/reference_forward.py). (2) The GGUF blocks as stored, for Q4_0, Q4_1 and
// Q8_0 matrices: decoding one token streams every weight once, so it is memory-bound, and
// qgemv.h's kernels read 0.6-1.1 bytes per weight instead of 4 (decode ~3x faster on two
// cores). Both compute the same products up to float summation order. The price is memory:
// ~0.54 GB + the file's size for SmolLM2-135M.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tqkv/contiguous_cache.h"

namespace tqkv::engine {

class GgufFile;
class RecentWindow;
class OutlierKeySplit;

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

// One weight matrix [rows (outputs), cols (inputs)].
struct Weight {
  int rows = 0, cols = 0;
  std::vector<float> f32;  // [rows, cols]
  uint32_t qtype = 0;      // GGUF tensor type of q
  std::vector<uint8_t> q;  // the GGUF blocks, when qgemv supports the type; else empty
};

// Up to this many tokens a product reads the quantized blocks once per token; beyond it one
// float32 GEMM is cheaper.
inline constexpr int kQuantizedMaxTokens = 2;

// Key centring (issue 6, src/engine/eval.h): the keys of each (layer, kv head) are cached
// minus a channel mean mu estimated from the first batch of tokens this object sees (the
// prompt), after RoPE (mu = 0 for the RoPE pairs that turn more than a radian over the
// cache's capacity: their mean moves with the position). q.(k - mu) = q.k - q.mu, the same shift for every key a query sees,
// so softmax is unchanged while the vectors the cache quantizes get shorter.
//
// With scale_channels the keys are also divided by a per-channel scale s and the queries of
// the group multiplied by it, (q*s).((k - mu)/s) = q.(k - mu) exactly, with
// s_i = sqrt(rms_i(k - mu) / rms_i(q)), rms over both channels of a RoPE pair (the balance
// that minimises the score error of an isotropic key error, as in SmoothQuant with alpha
// 1/2), normalised to geometric mean 1.
//
// outliers (the study option +o<N>, outlier_keys.h): the cache receives the centred keys'
// outlier-split reconstruction (a recent window's copies the exact centred keys).
// centre = false leaves mu at 0 (a split without centring).
struct KeyCentring {
  bool centre = true;
  bool scale_channels = false;
  OutlierKeySplit* outliers = nullptr;
  std::vector<float> mean;         // [n_layers, n_kv_heads, head_dim], filled layer by layer
  std::vector<float> scale;        // [n_layers, n_kv_heads, head_dim]; 1 without scale_channels
  std::vector<uint8_t> estimated;  // [n_layers]: mean of that layer is set
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
  // centring: when given, keys are centred before they are cached (see KeyCentring).
  // recent: when given, the compressed layers attend to their most recent tokens through its
  // uncompressed copies (recent_window.h); inputs longer than its max_batch run in pieces.
  void forward(const int32_t* tokens, int n, int64_t pos0, ContiguousCache& cache, float* logits,
               bool all_logits, KeyCentring* centring = nullptr, RecentWindow* recent = nullptr) const;

 private:
  struct Layer {
    std::vector<float> attn_norm, bq, bk, bv, ffn_norm;
    Weight wq, wk, wv, wo, w_gate, w_up, w_down;
  };
  ModelConfig cfg_;
  Weight tok_embd_;               // [n_vocab, d_model]
  std::vector<float> out_norm_;  // [d_model]
  Weight output_;                // [n_vocab, d_model]; empty when tied to tok_embd_
  std::vector<Layer> layers_;
};

// y[n, out] = x[n, in] * W[out, in]^T (+ bias): OpenBLAS on the float32 copy, or the
// quantized kernels for n <= kQuantizedMaxTokens. Rows are split over the thread pool.
void matmul(const float* x, int n, const Weight& w, float* y, const float* bias = nullptr);

}  // namespace tqkv::engine
