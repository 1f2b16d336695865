// Gemma 3 (text): Llama-like attention with GQA and NeoX RoPE, plus
//  - the embedding scaled by sqrt(d_model);
//  - per-head RMSNorm of q and k before RoPE (attn_q_norm, attn_k_norm, [head_dim]);
//  - "sandwich" norms: RMSNorm of the attention output and of the FFN output before each
//    residual add (post_attention_norm, post_ffw_norm), next to the usual pre-norms;
//  - GeGLU FFN with the tanh approximation of GELU;
//  - local/global layers: five of every six layers attend within a sliding window
//    (gemma3.attention.sliding_window) with RoPE base rope.freq_base_swa (10000 when absent),
//    every sixth (or as attention.sliding_window_pattern says) attends to all positions with
//    rope.freq_base and the RoPE scaling (linear on the larger sizes);
//  - the output head tied to the embeddings.
// RMSNorm weights are used as stored: llama.cpp's converter writes Gemma's (1 + w). The
// attention scale 1/sqrt(query_pre_attn_scalar) is 1/sqrt(head_dim) for every size but 27B,
// which the GGUF does not say; the cache applies 1/sqrt(head_dim).
#include <cmath>
#include <string>

#include "engine/model/architecture.h"
#include "engine/gguf/gguf.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

constexpr int kGlobalEvery = 6;              // layers l with (l + 1) % 6 == 0 are global
constexpr float kLocalRopeBase = 10000.0f;  // Gemma 3's rope_local_base_freq

[[noreturn]] void bad(const std::string& what) { throw Error(ErrorCode::Format, "model: " + what); }

void configure(const GgufFile& f, ModelConfig& c) {
  c.rope.layout = RopeLayout::Halves;
  const int64_t window = f.get_int("gemma3.attention.sliding_window");
  if (window <= 0 || window > (1 << 24)) bad("gemma3.attention.sliding_window = " + std::to_string(window) + " is out of range");
  c.layer_window.assign(c.n_layers, 0);
  if (f.has("gemma3.attention.sliding_window_pattern")) {
    const std::vector<int64_t>& local = f.get_int_array("gemma3.attention.sliding_window_pattern");
    if (static_cast<int>(local.size()) != c.n_layers) bad("gemma3.attention.sliding_window_pattern does not give one flag per layer");
    for (int l = 0; l < c.n_layers; ++l) c.layer_window[l] = local[l] ? static_cast<int>(window) : 0;
  } else {
    for (int l = 0; l < c.n_layers; ++l)
      if ((l + 1) % kGlobalEvery != 0) c.layer_window[l] = static_cast<int>(window);
  }
  // The local layers turn at their own base without the scaling, which (transformers' Gemma 3,
  // llama.cpp's freq_scale_swa = 1) applies to the global layers only.
  c.rope_local = c.rope;
  c.rope_local.base = static_cast<float>(f.get_float("gemma3.rope.freq_base_swa", kLocalRopeBase));
  c.rope_local.scaling = RopeScaling{};
  if (f.has("gemma3.final_logit_softcapping")) bad("gemma3 with final_logit_softcapping is not supported");
  if (f.has("gemma3.attn_logit_softcapping")) bad("gemma3 with attn_logit_softcapping is not supported");
}

constexpr std::string_view kKeys[] = {"rope.freq_base_swa", "final_logit_softcapping", "attn_logit_softcapping"};

void load(const WeightLoader& w, const ModelConfig& c, ModelWeights& out) {
  const int d = c.d_model, hd = c.head_dim, q_dim = c.n_heads * hd, kv_dim = c.n_kv_heads * hd;
  if (!c.tied_embeddings) bad("gemma3 with an untied output head (output.weight) is not supported");
  out.layers.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    LayerWeights& L = out.layers[l];
    L.attn_norm = w.vec(p + "attn_norm.weight", d);
    L.wq = w.matrix(p + "attn_q.weight", d, q_dim);
    L.wk = w.matrix(p + "attn_k.weight", d, kv_dim);
    L.wv = w.matrix(p + "attn_v.weight", d, kv_dim);
    L.q_norm = w.vec(p + "attn_q_norm.weight", hd);
    L.k_norm = w.vec(p + "attn_k_norm.weight", hd);
    L.wo = w.matrix(p + "attn_output.weight", q_dim, d);
    L.post_attn_norm = w.vec(p + "post_attention_norm.weight", d);
    L.ffn_norm = w.vec(p + "ffn_norm.weight", d);
    L.w_gate = w.matrix(p + "ffn_gate.weight", d, c.d_ff);
    L.w_up = w.matrix(p + "ffn_up.weight", d, c.d_ff);
    L.w_down = w.matrix(p + "ffn_down.weight", c.d_ff, d);
    L.post_ffn_norm = w.vec(p + "post_ffw_norm.weight", d);
  }
}

void forward(const ModelConfig& c, const ModelWeights& w, Device& dev, const Batch& batch, KvCache& cache,
             const LogitsOut& logits) {
  const int n = batch.size();
  const int d = c.d_model, hd = c.head_dim, q_dim = c.n_heads * hd, kv_dim = c.n_kv_heads * hd, ff = c.d_ff;
  const size_t N = static_cast<size_t>(n);
  DeviceBuffer x = dev.alloc(N * d), xn = dev.alloc(N * d), q = dev.alloc(N * q_dim), k = dev.alloc(N * kv_dim),
               v = dev.alloc(N * kv_dim), att = dev.alloc(N * q_dim), gate = dev.alloc(N * ff), up = dev.alloc(N * ff);
  const StepProducts P(dev, batch);
  dev.embed(*w.tok_embd, batch.tokens.data(), n, std::sqrt(static_cast<float>(d)), x.data());

  // As in arch_llama.cpp: each pre-norm follows the residual add before it in one operation
  // (after the post-norm of what is added), and the norms and GeGLU feed their products.
  dev.add_rmsnorm(x.data(), nullptr, w.layers[0].attn_norm.data(), n, d, c.rms_eps, xn.data(), true);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    const RopeParams& rope = c.rope_at(l);
    P.qkv(xn.data(), L, q.data(), k.data(), v.data());
    dev.rmsnorm(q.data(), L.q_norm.data(), n * c.n_heads, hd, c.rms_eps, q.data());  // each head its own row
    dev.rmsnorm(k.data(), L.k_norm.data(), n * c.n_kv_heads, hd, c.rms_eps, k.data());
    dev.rope_qk(q.data(), c.n_heads, k.data(), c.n_kv_heads, n, hd, batch.positions.data(), rope);
    dev.attention_begin();
    cache.attend(l, batch, q.data(), k.data(), v.data(), att.data());
    dev.attention_end();
    P.matmul(att.data(), *L.wo, xn.data());
    dev.rmsnorm(xn.data(), L.post_attn_norm.data(), n, d, c.rms_eps, xn.data());
    dev.add_rmsnorm(x.data(), xn.data(), L.ffn_norm.data(), n, d, c.rms_eps, xn.data(), true);

    P.gate_up_glu(Device::Glu::Gelu, xn.data(), L, gate.data(), up.data());
    P.matmul(gate.data(), *L.w_down, xn.data());
    dev.rmsnorm(xn.data(), L.post_ffn_norm.data(), n, d, c.rms_eps, xn.data());
    if (l + 1 < c.n_layers)
      dev.add_rmsnorm(x.data(), xn.data(), w.layers[l + 1].attn_norm.data(), n, d, c.rms_eps, xn.data(), true);
    else
      dev.add(x.data(), xn.data(), N * d);
  }
  output_logits(c, w, dev, P, batch, x.data(), xn.data(), logits);
}

}  // namespace

const Architecture kGemma3Architecture{"gemma3", configure, load, forward, kKeys};

}  // namespace tqkv::engine
