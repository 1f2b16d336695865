#include "model.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "dequant.h"
#include "gguf.h"
#include "model_recipes.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

[[noreturn]] void bad(const std::string& what) { throw Error(ErrorCode::Format, "model: " + what); }

// Architectures whose GGUFs load as the Llama family but need what this forward pass does not
// do: refused by name rather than run with silently wrong output.
struct Refused {
  const char* arch;
  const char* why;
};
constexpr Refused kRefused[] = {
    {"granite", "its embedding, residual, attention and logit scales"},
    {"smollm3", "its NoPE layers (no RoPE on every fourth layer)"},
};

ModelConfig read_config(const GgufFile& f) {
  ModelConfig c;
  c.arch = f.get_string("general.architecture");
  const std::string& a = c.arch;
  for (const Refused& r : kRefused)
    if (a == r.arch) bad("architecture '" + a + "' is not supported yet: the engine does not implement " + r.why);
  if (a != "llama" && a != "qwen2" && a != "mistral")
    bad("architecture '" + a + "' is not supported (llama, qwen2 and mistral are)");
  auto cfg_int = [&](const std::string& key) {
    const int64_t v = f.get_int(a + "." + key);
    if (v <= 0 || v > (1 << 24)) bad("metadata " + a + "." + key + " = " + std::to_string(v) + " is out of range");
    return static_cast<int>(v);
  };
  c.n_layers = cfg_int("block_count");
  c.d_model = cfg_int("embedding_length");
  c.n_heads = cfg_int("attention.head_count");
  c.n_kv_heads = f.has(a + ".attention.head_count_kv") ? cfg_int("attention.head_count_kv") : c.n_heads;
  c.d_ff = cfg_int("feed_forward_length");
  c.ctx_train = cfg_int("context_length");
  c.head_dim = f.has(a + ".attention.key_length") ? cfg_int("attention.key_length") : c.d_model / c.n_heads;
  c.rope.n_rot = f.has(a + ".rope.dimension_count") ? cfg_int("rope.dimension_count") : c.head_dim;
  c.rms_eps = static_cast<float>(f.get_float(a + ".attention.layer_norm_rms_epsilon", 1e-5));
  c.rope.base = static_cast<float>(f.get_float(a + ".rope.freq_base", 10000.0));
  c.rope.layout = a == "qwen2" ? RopeLayout::Halves : RopeLayout::Adjacent;
  if (c.n_heads % c.n_kv_heads != 0) bad("head_count is not a multiple of head_count_kv");
  if (c.rope.n_rot > c.head_dim || c.rope.n_rot % 2 != 0) bad("rope.dimension_count must be even and <= head_dim");
  const GgufTensor& emb = f.tensor("token_embd.weight");
  if (emb.shape.size() != 2) bad("token_embd.weight is not a matrix");
  c.n_vocab = static_cast<int>(emb.shape[1]);
  c.layer_window.assign(c.n_layers, 0);  // every layer of this family attends to all positions
  return c;
}

}  // namespace

Model Model::load(const GgufFile& f, std::shared_ptr<Device> device) {
  Model m;
  m.device_ = device ? std::move(device) : make_device("cpu");
  Device& dev = *m.device_;
  ModelConfig& c = m.cfg_;
  c = read_config(f);
  const int d = c.d_model, hd = c.head_dim, q_dim = c.n_heads * hd, kv_dim = c.n_kv_heads * hd;
  auto matrix = [&](const std::string& name, int cols, int rows) { return dev.load_matrix(f.tensor(name), rows, cols); };
  auto vec = [&](const std::string& name, int n) {
    const std::vector<float> v = expand_tensor(f.tensor(name), n);
    return dev.load_vector(v.data(), v.size());
  };
  auto optional_vec = [&](const std::string& name, int n) { return f.find_tensor(name) ? vec(name, n) : DeviceBuffer(); };
  m.tok_embd_ = matrix("token_embd.weight", d, c.n_vocab);
  m.out_norm_ = vec("output_norm.weight", d);
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  if (!c.tied_embeddings) m.output_ = matrix("output.weight", d, c.n_vocab);
  m.layers_.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer& L = m.layers_[l];
    L.attn_norm = vec(p + "attn_norm.weight", d);
    L.wq = matrix(p + "attn_q.weight", d, q_dim);
    L.wk = matrix(p + "attn_k.weight", d, kv_dim);
    L.wv = matrix(p + "attn_v.weight", d, kv_dim);
    L.wo = matrix(p + "attn_output.weight", q_dim, d);
    L.bq = optional_vec(p + "attn_q.bias", q_dim);
    L.bk = optional_vec(p + "attn_k.bias", kv_dim);
    L.bv = optional_vec(p + "attn_v.bias", kv_dim);
    if (L.bq.data()) c.qkv_bias = true;
    L.ffn_norm = vec(p + "ffn_norm.weight", d);
    L.w_gate = matrix(p + "ffn_gate.weight", d, c.d_ff);
    L.w_up = matrix(p + "ffn_up.weight", d, c.d_ff);
    L.w_down = matrix(p + "ffn_down.weight", c.d_ff, d);
  }
  m.sources_ = model_spec_sources(f, c);
  return m;
}

size_t Model::weight_bytes() const {
  auto mb = [](const std::unique_ptr<DeviceMatrix>& w) { return w ? w->bytes() : 0; };
  auto vb = [](const DeviceBuffer& b) { return b.size() * sizeof(float); };
  size_t n = mb(tok_embd_) + vb(out_norm_) + mb(output_);
  for (const Layer& L : layers_) {
    for (const auto* v : {&L.attn_norm, &L.bq, &L.bk, &L.bv, &L.ffn_norm}) n += vb(*v);
    for (const auto* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) n += mb(*w);
  }
  return n;
}

CacheSpec Model::resolve(const std::string& spec) const { return resolve_cache_spec(spec, cfg_, sources_); }

std::unique_ptr<KvCache> Model::make_cache(const CacheSpec& spec, int capacity, int max_seqs) const {
  return device_->make_cache(spec, CacheShape{capacity, max_seqs});
}

void Model::forward(int64_t seq, const int32_t* tokens, int n, KvCache& cache, float* logits, bool all_logits) const {
  if (n <= 0) throw Error(ErrorCode::InvalidArgument, "forward: no tokens");
  Batch b;
  b.add(seq, tokens, n, cache.seq_len(seq), all_logits);
  forward(b, cache, logits);
}

void Model::forward(const Batch& batch, KvCache& cache, float* logits) const {
  const int n = batch.size();
  if (n <= 0) throw Error(ErrorCode::InvalidArgument, "forward: no tokens");
  for (int t = 0; t < n; ++t)
    if (batch.tokens[t] < 0 || batch.tokens[t] >= cfg_.n_vocab)
      throw Error(ErrorCode::OutOfRange, "forward: token id " + std::to_string(batch.tokens[t]) + " out of range");
  const int step = cache.max_step_tokens();
  const std::vector<Batch::Run> runs = batch.runs();
  int longest = 0;
  for (const Batch::Run& r : runs) longest = std::max(longest, r.count);
  if (longest <= step) {
    cache.check(batch);
    forward_step(batch, cache, logits);
    return;
  }
  // The cache takes at most `step` new tokens of a sequence at a time (its copies' ring): run
  // the batch in pieces of at most `step` tokens; a later piece attends to the earlier ones
  // through the cache. Check the whole batch's room first, as one step would.
  for (const Batch::Run& r : runs) {
    if (r.count > cache.capacity())
      throw Error(ErrorCode::Capacity, "forward: " + std::to_string(r.count) + " tokens exceed the cache capacity of " +
                                           std::to_string(cache.capacity()));
    if (r.pos0 != cache.seq_len(r.seq))
      throw Error(ErrorCode::OutOfRange, "forward: position " + std::to_string(r.pos0) + " does not follow the cache (" +
                                             std::to_string(cache.seq_len(r.seq)) + " tokens held)");
  }
  size_t logit_row = 0;
  for (int t0 = 0; t0 < n; t0 += step) {
    const int m = std::min(step, n - t0);
    Batch piece;
    piece.tokens.assign(batch.tokens.begin() + t0, batch.tokens.begin() + t0 + m);
    piece.positions.assign(batch.positions.begin() + t0, batch.positions.begin() + t0 + m);
    piece.seqs.assign(batch.seqs.begin() + t0, batch.seqs.begin() + t0 + m);
    piece.logits.assign(batch.logits.begin() + t0, batch.logits.begin() + t0 + m);
    cache.check(piece);
    forward_step(piece, cache, logits + logit_row * cfg_.n_vocab);
    logit_row += piece.n_logits();
  }
}

void Model::forward_step(const Batch& batch, KvCache& cache, float* logits) const {
  const ModelConfig& c = cfg_;
  Device& dev = *device_;
  const int n = batch.size();
  const int d = c.d_model, hd = c.head_dim, q_dim = c.n_heads * hd, kv_dim = c.n_kv_heads * hd, ff = c.d_ff;
  const size_t N = static_cast<size_t>(n);
  DeviceBuffer x = dev.alloc(N * d), xn = dev.alloc(N * d), q = dev.alloc(N * q_dim), k = dev.alloc(N * kv_dim),
               v = dev.alloc(N * kv_dim), att = dev.alloc(N * q_dim), gate = dev.alloc(N * ff), up = dev.alloc(N * ff);
  dev.embed(*tok_embd_, batch.tokens.data(), n, 1.0f, x.data());
  // Batch invariance: on a device whose products depend on how many rows are multiplied
  // together (Device::row_count_changes_products: the CPU's quantized kernels for 1-2 rows,
  // SGEMM beyond), every run's rows get the products they would get alone, so a sequence's
  // logits do not depend on the sequences it is batched with (the server's greedy answers equal
  // generate()'s). Elsewhere, and for a batch of one sequence, one product covers every row.
  const std::vector<Batch::Run> runs = batch.runs();
  const bool per_run = runs.size() > 1 && dev.row_count_changes_products();
  auto matmul = [&](const float* in, const DeviceMatrix& w, float* out, const float* bias) {
    if (!per_run) return dev.matmul(in, n, w, out, bias);
    for (const Batch::Run& r : runs)
      dev.matmul(in + static_cast<size_t>(r.begin) * w.cols(), r.count, w, out + static_cast<size_t>(r.begin) * w.rows(),
                 bias);
  };

  for (int l = 0; l < c.n_layers; ++l) {
    const Layer& L = layers_[l];
    dev.rmsnorm(x.data(), L.attn_norm.data(), n, d, c.rms_eps, xn.data());
    matmul(xn.data(), *L.wq, q.data(), L.bq.data());
    matmul(xn.data(), *L.wk, k.data(), L.bk.data());
    matmul(xn.data(), *L.wv, v.data(), L.bv.data());
    dev.rope(q.data(), n, c.n_heads, hd, batch.positions.data(), c.rope);
    dev.rope(k.data(), n, c.n_kv_heads, hd, batch.positions.data(), c.rope);
    cache.attend(l, batch, q.data(), k.data(), v.data(), att.data());
    matmul(att.data(), *L.wo, xn.data(), nullptr);
    dev.add(x.data(), xn.data(), N * d);

    dev.rmsnorm(x.data(), L.ffn_norm.data(), n, d, c.rms_eps, xn.data());
    matmul(xn.data(), *L.w_gate, gate.data(), nullptr);
    matmul(xn.data(), *L.w_up, up.data(), nullptr);
    dev.swiglu(gate.data(), up.data(), N * ff);
    matmul(gate.data(), *L.w_down, xn.data(), nullptr);
    dev.add(x.data(), xn.data(), N * d);
  }

  // Logits only for the rows that want them (usually the last token of each sequence).
  std::vector<int32_t> rows;
  for (int t = 0; t < n; ++t)
    if (batch.logits[t]) rows.push_back(t);
  if (rows.empty()) return;
  const int r = static_cast<int>(rows.size());
  if (r < n) dev.gather_rows(x.data(), d, rows.data(), r, xn.data());
  dev.rmsnorm(r < n ? xn.data() : x.data(), out_norm_.data(), r, d, c.rms_eps, xn.data());
  const DeviceMatrix& head = c.tied_embeddings ? *tok_embd_ : *output_;
  DeviceBuffer out = dev.alloc(static_cast<size_t>(r) * c.n_vocab);
  if (!per_run) {
    dev.matmul(xn.data(), r, head, out.data());
  } else {  // each run's logit rows together: the product that run gets alone
    int row = 0;
    for (const Batch::Run& run : runs) {
      int m = 0;
      for (int t = run.begin; t < run.begin + run.count; ++t) m += batch.logits[t] != 0;
      if (m > 0)
        dev.matmul(xn.data() + static_cast<size_t>(row) * d, m, head, out.data() + static_cast<size_t>(row) * c.n_vocab);
      row += m;
    }
  }
  dev.to_host(out.data(), out.size(), logits);
}

}  // namespace tqkv::engine
