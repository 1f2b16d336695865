#include "model.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "gguf.h"
#include "model_recipes.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

[[noreturn]] void bad(const std::string& what) { throw Error(ErrorCode::Format, "model: " + what); }

// The config keys every architecture shares ({arch}.block_count, ...); the architecture then
// adds what its family needs (RoPE layout, layer windows, ...).
ModelConfig read_config(const GgufFile& f, const Architecture& arch) {
  ModelConfig c;
  c.arch = f.get_string("general.architecture");
  const std::string& a = c.arch;
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
  if (c.n_heads % c.n_kv_heads != 0) bad("head_count is not a multiple of head_count_kv");
  if (c.rope.n_rot > c.head_dim || c.rope.n_rot % 2 != 0) bad("rope.dimension_count must be even and <= head_dim");
  const GgufTensor& emb = f.tensor("token_embd.weight");
  if (emb.shape.size() != 2) bad("token_embd.weight is not a matrix");
  c.n_vocab = static_cast<int>(emb.shape[1]);
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  arch.configure(f, c);
  if (static_cast<int>(c.layer_window.size()) != c.n_layers) bad("architecture '" + a + "' set no layer types");
  return c;
}

}  // namespace

Model Model::load(const GgufFile& f, std::shared_ptr<Device> device) {
  Model m;
  m.device_ = device ? std::move(device) : make_device("cpu");
  m.arch_ = &find_architecture(f.get_string("general.architecture"));
  ModelConfig& c = m.cfg_;
  c = read_config(f, *m.arch_);
  const WeightLoader w(f, *m.device_);
  m.weights_.tok_embd = w.matrix("token_embd.weight", c.d_model, c.n_vocab);
  m.weights_.out_norm = w.vec("output_norm.weight", c.d_model);
  if (!c.tied_embeddings) m.weights_.output = w.matrix("output.weight", c.d_model, c.n_vocab);
  m.arch_->load(w, c, m.weights_);
  for (const LayerWeights& L : m.weights_.layers) c.qkv_bias = c.qkv_bias || L.bq.data();
  m.sources_ = model_spec_sources(f, c);
  return m;
}

size_t Model::weight_bytes() const { return weights_.bytes(); }

CacheSpec Model::resolve(const std::string& spec) const { return resolve_cache_spec(spec, cfg_, sources_); }

std::unique_ptr<KvCache> Model::make_cache(const CacheSpec& spec, int capacity, int max_seqs) const {
  return device_->make_cache(spec, CacheShape{capacity, max_seqs});
}

void Model::forward(int64_t seq, const int32_t* tokens, int n, KvCache& cache, const LogitsOut& logits, bool all_logits) const {
  if (n <= 0) throw Error(ErrorCode::InvalidArgument, "forward: no tokens");
  Batch b;
  b.add(seq, tokens, n, cache.seq_len(seq), all_logits);
  forward(b, cache, logits);
}

void Model::forward(const Batch& batch, KvCache& cache, const LogitsOut& logits) const {
  const int n = batch.size();
  if (n <= 0) throw Error(ErrorCode::InvalidArgument, "forward: no tokens");
  for (int t = 0; t < n; ++t)
    if (batch.tokens[t] < 0 || batch.tokens[t] >= cfg_.n_vocab)
      throw Error(ErrorCode::OutOfRange, "forward: token id " + std::to_string(batch.tokens[t]) + " out of range");
  cache.check(batch);  // the whole batch's room, before anything changes
  const int step = cache.max_step_tokens();
  const std::vector<Batch::Run> runs = batch.runs();
  int longest = 0;
  for (const Batch::Run& r : runs) longest = std::max(longest, r.count);
  if (longest <= step) {
    device_->run_step(batch, cache, &weights_, logits, [&](const Batch& b, const LogitsOut& out) {
      arch_->forward(cfg_, weights_, *device_, b, cache, out);
    });
    return;
  }
  // The cache takes at most `step` new tokens of a sequence at a time (its copies' ring): run
  // the batch in pieces of at most `step` tokens; a later piece attends to the earlier ones
  // through the cache.
  size_t logit_row = 0;
  for (int t0 = 0; t0 < n; t0 += step) {
    const int m = std::min(step, n - t0);
    Batch piece;
    piece.tokens.assign(batch.tokens.begin() + t0, batch.tokens.begin() + t0 + m);
    piece.positions.assign(batch.positions.begin() + t0, batch.positions.begin() + t0 + m);
    piece.seqs.assign(batch.seqs.begin() + t0, batch.seqs.begin() + t0 + m);
    piece.logits.assign(batch.logits.begin() + t0, batch.logits.begin() + t0 + m);
    arch_->forward(cfg_, weights_, *device_, piece, cache, logits.from_row(logit_row, cfg_.n_vocab));
    logit_row += piece.n_logits();
  }
}

}  // namespace tqkv::engine
