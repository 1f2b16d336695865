// The Llama family: Llama, SmolLM2, Mistral, Qwen2 (QKV bias, NeoX RoPE).
//
// Per layer: RMSNorm -> Q, K, V (+ bias) -> RoPE -> attention through the cache -> output
// projection + residual -> RMSNorm -> SwiGLU FFN + residual. Final RMSNorm, output head.
#include <string>

#include "engine/model/architecture.h"
#include "engine/gguf/gguf.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

[[noreturn]] void bad(const std::string& what) { throw Error(ErrorCode::Format, "model: " + what); }

void configure(const GgufFile& f, ModelConfig& c) {
  // Llama GGUFs carry q/k rows permuted by the converter to rotate adjacent pairs; Qwen2's
  // are in the model's own NeoX order.
  c.rope.layout = c.arch == "qwen2" ? RopeLayout::Halves : RopeLayout::Adjacent;
  // Every layer attends to all positions, unless the file gives a sliding window (Mistral v0.1,
  // Qwen2 with use_sliding_window): then the layers the pattern marks (all, without one) attend
  // to the last `window` positions, as transformers' sliding-window mask does.
  const std::string k = c.arch + ".attention.sliding_window";
  const int64_t window = f.get_int(k, 0);
  if (window < 0 || window > (1 << 24)) bad(k + " = " + std::to_string(window) + " is out of range");
  c.layer_window.assign(c.n_layers, 0);
  if (window == 0) return;
  std::vector<int64_t> pattern(c.n_layers, 1);
  if (f.has(k + "_pattern")) pattern = f.get_int_array(k + "_pattern");
  if (static_cast<int>(pattern.size()) != c.n_layers) bad(k + "_pattern does not give one flag per layer");
  for (int l = 0; l < c.n_layers; ++l) c.layer_window[l] = pattern[l] ? static_cast<int>(window) : 0;
}

void load(const WeightLoader& w, const ModelConfig& c, ModelWeights& out) {
  const int d = c.d_model, q_dim = c.n_heads * c.head_dim, kv_dim = c.n_kv_heads * c.head_dim;
  out.layers.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    LayerWeights& L = out.layers[l];
    L.attn_norm = w.vec(p + "attn_norm.weight", d);
    L.wq = w.matrix(p + "attn_q.weight", d, q_dim);
    L.wk = w.matrix(p + "attn_k.weight", d, kv_dim);
    L.wv = w.matrix(p + "attn_v.weight", d, kv_dim);
    L.wo = w.matrix(p + "attn_output.weight", q_dim, d);
    L.bq = w.optional_vec(p + "attn_q.bias", q_dim);
    L.bk = w.optional_vec(p + "attn_k.bias", kv_dim);
    L.bv = w.optional_vec(p + "attn_v.bias", kv_dim);
    L.ffn_norm = w.vec(p + "ffn_norm.weight", d);
    L.w_gate = w.matrix(p + "ffn_gate.weight", d, c.d_ff);
    L.w_up = w.matrix(p + "ffn_up.weight", d, c.d_ff);
    L.w_down = w.matrix(p + "ffn_down.weight", c.d_ff, d);
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
  dev.embed(*w.tok_embd, batch.tokens.data(), n, 1.0f, x.data());

  // The layer's norm follows the previous layer's last residual add in one operation
  // (Device::add_rmsnorm); each norm and the SwiGLU feed the products that follow them.
  dev.add_rmsnorm(x.data(), nullptr, w.layers[0].attn_norm.data(), n, d, c.rms_eps, xn.data(), true);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    P.qkv(xn.data(), L, q.data(), k.data(), v.data());
    dev.rope_qk(q.data(), c.n_heads, k.data(), c.n_kv_heads, n, hd, batch.positions.data(), c.rope);
    dev.attention_begin();
    cache.attend(l, batch, q.data(), k.data(), v.data(), att.data());
    dev.attention_end();
    P.matmul(att.data(), *L.wo, xn.data());
    dev.add_rmsnorm(x.data(), xn.data(), L.ffn_norm.data(), n, d, c.rms_eps, xn.data(), true);

    P.gate_up_glu(Device::Glu::Silu, xn.data(), L, gate.data(), up.data());
    P.matmul(gate.data(), *L.w_down, xn.data());
    if (l + 1 < c.n_layers)
      dev.add_rmsnorm(x.data(), xn.data(), w.layers[l + 1].attn_norm.data(), n, d, c.rms_eps, xn.data(), true);
    else
      dev.add(x.data(), xn.data(), N * d);
  }
  output_logits(c, w, dev, P, batch, x.data(), xn.data(), logits);
}

}  // namespace

const Architecture kLlamaArchitecture{"llama", configure, load, forward};

}  // namespace tqkv::engine
