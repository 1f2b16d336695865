#include "engine/model/model.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <string_view>

#include "engine/weights/dequant.h"
#include "engine/gguf/gguf.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

[[noreturn]] void bad(const std::string& what) { throw Error(ErrorCode::Format, "model: " + what); }

// {arch}.rope.scaling.* and the rope_freqs.weight tensor, as transformers' rope_type of the same
// name computes them. A form the engine does not implement is refused by name: run without it,
// a scaled model gives silently wrong output.
RopeScaling read_rope_scaling(const GgufFile& f, const std::string& a, int n_rot, int ctx_train) {
  RopeScaling s;
  const std::string k = a + ".rope.scaling.";
  // llama.cpp reads a factor without a type as linear scaling (rope.scale_linear is its older key).
  const double factor = f.get_float(k + "factor", f.get_float(a + ".rope.scale_linear", 0.0));
  const std::string type = f.get_string(k + "type", factor > 0 ? "linear" : "none");
  if (type == "linear") {
    s.kind = RopeScaling::Kind::Linear;
    s.factor = factor;
  } else if (type == "yarn") {
    s.kind = RopeScaling::Kind::Yarn;
    s.factor = factor;
    s.original_context = static_cast<int>(f.get_int(k + "original_context_length", ctx_train));
    s.beta_fast = f.get_float(k + "yarn_beta_fast", 32.0);
    s.beta_slow = f.get_float(k + "yarn_beta_slow", 1.0);
    s.ext_factor = f.get_float(k + "yarn_ext_factor", 1.0);
    // transformers' attention_factor, which llama.cpp's converter writes here when a config sets it.
    s.attn_factor = f.get_float(k + "yarn_attn_factor", 0.0);
  } else if (type != "none") {
    bad("RoPE scaling '" + type + "' (" + k + "type) is not supported (linear, yarn and llama3 are)");
  }
  if (s.kind == RopeScaling::Kind::Linear && factor == 1.0) s.kind = RopeScaling::Kind::None;
  if (f.get_float(k + "yarn_log_multiplier", 0.0) != 0.0)
    bad("RoPE scaling with yarn_log_multiplier (DeepSeek's mscale_all_dim) is not supported");
  if (f.has(k + "alpha")) bad("RoPE scaling alpha (" + k + "alpha, NTK-aware) is not supported");
  if (f.get_float(k + "attn_factor", 1.0) != 1.0) bad(k + "attn_factor (LongRoPE's) is not supported");
  if (const GgufTensor* t = f.find_tensor("rope_freqs.weight")) {
    if (t->n_elements() != n_rot / 2)
      bad("rope_freqs.weight has " + std::to_string(t->n_elements()) + " factors for " + std::to_string(n_rot / 2) +
          " RoPE pairs");
    s.freq_factors = expand_tensor(*t, n_rot / 2);
    if (s.kind != RopeScaling::Kind::None) bad("rope_freqs.weight together with RoPE scaling '" + type + "' is not supported");
  }
  return s;
}

// Every {arch}.* key the engine reads, or knows to change nothing it computes. Any other key of
// the architecture's namespace may change the computation in a way the engine does not do, so a
// model carrying one is refused, naming it (general.* and tokenizer.* describe, never compute).
constexpr std::string_view kSharedKeys[] = {
    "block_count", "embedding_length", "feed_forward_length", "context_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon",
    "attention.causal", "rope.dimension_count", "rope.freq_base", "rope.scale_linear", "rope.scaling.type",
    "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor",
    "rope.scaling.yarn_log_multiplier", "rope.scaling.attn_factor", "rope.scaling.alpha",
    "attention.sliding_window", "attention.sliding_window_pattern", "expert_count", "expert_used_count",
    // Inert: the vocabulary's size (the embedding's shape decides), the source checkpoint's layout
    // (the converter already permuted), whether the scaled model was fine-tuned, and pooling for
    // embedding use (logits are unchanged).
    "vocab_size", "tensor_data_layout", "rope.scaling.finetuned", "pooling_type"};

void check_keys(const GgufFile& f, const Architecture& arch, const std::string& a) {
  const std::string prefix = a + ".";
  for (const auto& [key, value] : f.metadata()) {
    if (key.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string_view rest = std::string_view(key).substr(prefix.size());
    bool known = false;
    for (std::string_view k : kSharedKeys) known = known || rest == k;
    for (std::string_view k : arch.keys) known = known || rest == k;
    if (!known)
      bad("metadata " + key + " is not supported: it may change the computation, and the engine does not read it");
  }
  if (!f.get_bool(prefix + "attention.causal", true)) bad(prefix + "attention.causal = false is not supported");
  if (f.get_int(prefix + "expert_count", 0) != 0) bad("mixture-of-experts models (" + prefix + "expert_count) are not supported");
}

// The config keys every architecture shares ({arch}.block_count, ...); the architecture then
// adds what its family needs (RoPE layout, layer windows, ...).
ModelConfig read_config(const GgufFile& f, const Architecture& arch) {
  ModelConfig c;
  c.arch = f.get_string("general.architecture");
  const std::string& a = c.arch;
  check_keys(f, arch, a);
  auto cfg_int = [&](const std::string& key) {
    const int64_t v = f.get_int(a + "." + key);
    if (v <= 0 || v > (1 << 24)) bad("metadata " + a + "." + key + " = " + std::to_string(v) + " is out of range");
    return static_cast<int>(v);
  };
  c.n_layers = cfg_int("block_count");
  // Every layer has tensors of its own, so a count beyond the file's tensors is a damaged
  // header, refused before anything is sized by it (a small file claiming 2^24 layers had
  // 2 GB allocated for their weights before the first missing tensor was noticed).
  if (static_cast<size_t>(c.n_layers) > f.tensors().size())
    bad("metadata " + a + ".block_count = " + std::to_string(c.n_layers) + " but the file holds only " +
        std::to_string(f.tensors().size()) + " tensors");
  c.d_model = cfg_int("embedding_length");
  c.n_heads = cfg_int("attention.head_count");
  c.n_kv_heads = f.has(a + ".attention.head_count_kv") ? cfg_int("attention.head_count_kv") : c.n_heads;
  c.d_ff = cfg_int("feed_forward_length");
  c.ctx_train = cfg_int("context_length");
  c.head_dim = f.has(a + ".attention.key_length") ? cfg_int("attention.key_length") : c.d_model / c.n_heads;
  if (f.has(a + ".attention.value_length") && cfg_int("attention.value_length") != c.head_dim)
    bad("attention.value_length differs from attention.key_length: not supported");
  c.rope.n_rot = f.has(a + ".rope.dimension_count") ? cfg_int("rope.dimension_count") : c.head_dim;
  const double eps = f.get_float(a + ".attention.layer_norm_rms_epsilon", 1e-5);
  if (!(eps > 0 && eps < 1)) bad("attention.layer_norm_rms_epsilon = " + std::to_string(eps) + " is out of range (0, 1)");
  c.rms_eps = static_cast<float>(eps);
  c.rope.base = static_cast<float>(f.get_float(a + ".rope.freq_base", 10000.0));
  if (c.n_heads % c.n_kv_heads != 0) bad("head_count is not a multiple of head_count_kv");
  if (c.rope.n_rot > c.head_dim || c.rope.n_rot % 2 != 0) bad("rope.dimension_count must be even and <= head_dim");
  c.rope.scaling = read_rope_scaling(f, a, c.rope.n_rot, c.ctx_train);
  c.rope.validate();
  const GgufTensor& emb = f.tensor("token_embd.weight");
  if (emb.shape.size() != 2) bad("token_embd.weight is not a matrix");
  c.n_vocab = static_cast<int>(emb.shape[1]);
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  arch.configure(f, c);
  if (static_cast<int>(c.layer_window.size()) != c.n_layers) bad("architecture '" + a + "' set no layer types");
  if (c.rope_local.n_rot > 0) c.rope_local.validate();
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
  w.check_all_used(c.arch);
  for (const LayerWeights& L : m.weights_.layers) c.qkv_bias = c.qkv_bias || L.bq.data();
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
  const CachePlan& plan = cache.plan();
  const std::vector<Batch::Run> runs = batch.runs();
  bool fits = true;
  for (const Batch::Run& r : runs) fits = fits && r.count <= plan.step_limit(r.pos0);
  if (fits) {
    device_->run_step(batch, cache, &weights_, logits, [&](const Batch& b, const LogitsOut& out) {
      arch_->forward(cfg_, weights_, *device_, b, cache, out);
    });
    return;
  }
  // The cache takes at most plan.step_limit(pos0) new tokens of a sequence at a time (the rings
  // of its copies and sliding-window layers): the batch runs in pieces, each a span of its
  // tokens in batch order, cut where a run reaches its limit; a later piece attends to the
  // earlier ones through the cache.
  std::vector<int> cuts;  // token offsets where a piece ends
  for (const Batch::Run& r : runs) {
    int64_t pos = r.pos0;
    for (int done = 0; done < r.count;) {
      const int take = static_cast<int>(std::min<int64_t>(r.count - done, plan.step_limit(pos)));
      done += take;
      pos += take;
      if (done < r.count) cuts.push_back(r.begin + done);
    }
  }
  cuts.push_back(n);
  size_t logit_row = 0;
  int t0 = 0;
  for (int t1 : cuts) {
    if (t1 <= t0) continue;
    Batch piece;
    piece.tokens.assign(batch.tokens.begin() + t0, batch.tokens.begin() + t1);
    piece.positions.assign(batch.positions.begin() + t0, batch.positions.begin() + t1);
    piece.seqs.assign(batch.seqs.begin() + t0, batch.seqs.begin() + t1);
    piece.logits.assign(batch.logits.begin() + t0, batch.logits.begin() + t1);
    arch_->forward(cfg_, weights_, *device_, piece, cache, logits.from_row(logit_row, cfg_.n_vocab));
    logit_row += piece.n_logits();
    t0 = t1;
  }
}

}  // namespace tqkv::engine
