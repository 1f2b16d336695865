#include "perplexity.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "engine/cache/cache_spec.h"
#include "engine/core/sampler.h"
#include "tqkv/error.h"

namespace tqkv::eval {
namespace {

// Runs one chunk through a fresh cache in micro-batches; logits [n, V].
void run_chunk(const Model& model, const int32_t* toks, int n, const engine::CacheSpec& spec, int batch,
               std::vector<float>& logits) {
  const int V = model.config().n_vocab;
  std::unique_ptr<engine::KvCache> cache = model.make_cache(spec, n);
  const int64_t seq = cache->add_sequence();
  logits.resize(static_cast<size_t>(n) * V);
  for (const auto& [p, end] : scored_context_passes(n, batch))
    model.forward(seq, toks + p, end - p, *cache, logits.data() + static_cast<size_t>(p) * V, true);
}

}  // namespace

std::vector<std::pair<int, int>> scored_context_passes(int ctx, int batch) {
  if (ctx < 2 || batch < 1) throw Error(ErrorCode::InvalidArgument, "a scored context needs 2 tokens and batch >= 1");
  std::vector<std::pair<int, int>> passes;
  const int first = ctx / 2;
  for (int p = 0; p < first; p += batch) passes.emplace_back(p, std::min(p + batch, first));
  for (int p = first; p < ctx; p += batch) passes.emplace_back(p, std::min(p + batch, ctx));
  return passes;
}

void log_softmax(float* v, int n) {
  float mx = v[0];
  for (int i = 1; i < n; ++i) mx = std::max(mx, v[i]);
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(static_cast<double>(v[i] - mx));
  const float lse = mx + static_cast<float>(std::log(s));
  for (int i = 0; i < n; ++i) v[i] -= lse;
}

double kl_divergence(const float* logp_ref, const float* logp, int n) {
  double k = 0;
  for (int i = 0; i < n; ++i) k += std::exp(static_cast<double>(logp_ref[i])) * (logp_ref[i] - logp[i]);
  return k;
}

PerplexityResult perplexity(const Model& model, const std::vector<int32_t>& tokens, const PerplexityOptions& opt,
                            const std::function<void(int, int, double)>& progress) {
  if (opt.ctx < 16) throw Error(ErrorCode::InvalidArgument, "--ctx must be at least 16");
  if (opt.batch < 1) throw Error(ErrorCode::InvalidArgument, "batch must be >= 1");
  const int64_t n_chunks_avail = static_cast<int64_t>(tokens.size()) / opt.ctx;
  if (n_chunks_avail == 0)
    throw Error(ErrorCode::InvalidArgument, "the text has " + std::to_string(tokens.size()) +
                                                " tokens, fewer than one chunk of --ctx " + std::to_string(opt.ctx));
  const int n_chunks =
      static_cast<int>(opt.max_chunks > 0 ? std::min<int64_t>(opt.max_chunks, n_chunks_avail) : n_chunks_avail);
  // A bad spec fails before any work.
  const engine::CacheSpec spec =
      model.resolve(opt.skip_layers >= 0 ? opt.format + "+skip" + std::to_string(opt.skip_layers) : opt.format);
  const engine::CacheSpec f32 = model.resolve("f32");
  const bool compare = opt.compare_to_f32 && opt.format != "f32";
  const int V = model.config().n_vocab, ctx = opt.ctx, first = ctx / 2;
  auto t0 = std::chrono::steady_clock::now();

  PerplexityResult r;
  double nll = 0, kl = 0;
  int64_t agree = 0;
  std::vector<float> lt, lb;
  std::vector<int32_t> chunk(ctx);
  for (int c = 0; c < n_chunks; ++c) {
    std::copy_n(tokens.begin() + static_cast<int64_t>(c) * ctx, ctx, chunk.begin());
    if (opt.bos >= 0) chunk[0] = opt.bos;
    run_chunk(model, chunk.data(), ctx, spec, opt.batch, lt);
    if (c == 0 && opt.first_chunk_logits) *opt.first_chunk_logits = lt;
    if (compare) run_chunk(model, chunk.data(), ctx, f32, opt.batch, lb);
    for (int j = first; j < ctx - 1; ++j) {
      float* pt = lt.data() + static_cast<size_t>(j) * V;
      log_softmax(pt, V);
      nll -= pt[chunk[j + 1]];
      if (compare) {
        float* pb = lb.data() + static_cast<size_t>(j) * V;
        log_softmax(pb, V);
        kl += kl_divergence(pb, pt, V);
        agree += engine::argmax(pb, V) == engine::argmax(pt, V);
      }
      ++r.tokens;
    }
    if (progress) progress(c + 1, n_chunks, std::exp(nll / r.tokens));
  }
  r.chunks = n_chunks;
  r.ppl = std::exp(nll / r.tokens);
  r.kld = compare ? kl / r.tokens : 0.0;
  r.top1 = compare ? static_cast<double>(agree) / r.tokens : 1.0;
  r.kv_bytes_per_token = spec.bytes(ctx, ctx).per_token();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace tqkv::eval
