#include "eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>

#include "perplexity.h"
#include "engine/core/sampler.h"
#include "tqkv/error.h"

namespace tqkv::eval {

using engine::argmax;

std::vector<EvalRow> evaluate(const Model& model, const std::vector<int32_t>& tokens,
                              const std::vector<CacheSpec>& specs, const EvalOptions& opt,
                              const std::function<void(int, int, const std::vector<EvalRow>&)>& progress) {
  using clock = std::chrono::steady_clock;
  const engine::ModelConfig& cfg = model.config();
  if (opt.ctx < 16) throw Error(ErrorCode::InvalidArgument, "ctx must be at least 16");
  if (opt.batch < 1) throw Error(ErrorCode::InvalidArgument, "batch must be >= 1");
  const int64_t avail = static_cast<int64_t>(tokens.size()) / opt.ctx;
  const int64_t want = std::max<int64_t>(1, opt.max_tokens / opt.ctx);
  const int n_chunks = static_cast<int>(std::min(avail, want));
  if (n_chunks == 0)
    throw Error(ErrorCode::InvalidArgument, "the text has " + std::to_string(tokens.size()) +
                                                " tokens, fewer than one chunk of " + std::to_string(opt.ctx));
  const int V = cfg.n_vocab, ctx = opt.ctx, first = ctx / 2;
  const CacheSpec ref = model.resolve("f32");
  const size_t n_rows = specs.size() + 1;
  std::vector<EvalRow> rows(n_rows);
  std::vector<double> nll(n_rows, 0), kl(n_rows, 0), kl2(n_rows, 0);
  std::vector<int64_t> agree(n_rows, 0);
  for (size_t i = 0; i < n_rows; ++i) {
    const CacheSpec& s = i == 0 ? ref : specs[i - 1];
    rows[i].format = s.name;
    rows[i].detail = s.detail;
    rows[i].ctx = ctx;
    rows[i].bits = s.bits_at(ctx);  // a recent window's f16 copies counted over a full cache
    rows[i].bits_all = s.bits_all_at(ctx);
  }
  std::vector<float> lref(static_cast<size_t>(opt.batch) * V), lt(static_cast<size_t>(opt.batch) * V);
  std::vector<int32_t> chunk(ctx);
  std::vector<int32_t> ref_top(opt.batch);
  const std::vector<std::pair<int, int>> passes_of_chunk = scored_context_passes(ctx, opt.batch);
  const int64_t total_passes = static_cast<int64_t>(n_chunks) * n_rows * static_cast<int64_t>(passes_of_chunk.size());
  int64_t passes = 0;
  for (int c = 0; c < n_chunks; ++c) {
    std::copy_n(tokens.begin() + static_cast<int64_t>(c) * ctx, ctx, chunk.begin());
    if (opt.bos >= 0) chunk[0] = opt.bos;
    std::vector<std::unique_ptr<engine::KvCache>> caches;
    std::vector<int64_t> seqs;
    for (size_t i = 0; i < n_rows; ++i) {
      const CacheSpec& s = i == 0 ? ref : specs[i - 1];
      caches.push_back(model.make_cache(s, ctx));
      seqs.push_back(caches.back()->add_sequence());
      rows[i].bytes_per_token = s.bytes(ctx, ctx).per_token();  // copies counted over a full chunk
    }
    for (const auto& [p, pass_end] : passes_of_chunk) {
      const int m = pass_end - p;
      const int j0 = std::max(p, first), j1 = std::min(p + m, ctx - 1);  // scored rows [j0, j1)
      for (size_t i = 0; i < n_rows; ++i) {
        float* out = i == 0 ? lref.data() : lt.data();
        auto t0 = clock::now();
        model.forward(seqs[i], chunk.data() + p, m, *caches[i], out, true);
        rows[i].seconds += std::chrono::duration<double>(clock::now() - t0).count();
        if (opt.on_pass) opt.on_pass(++passes, total_passes);
        for (int j = j0; j < j1; ++j) {
          float* lp = out + static_cast<size_t>(j - p) * V;
          log_softmax(lp, V);
          nll[i] -= lp[chunk[j + 1]];
          if (i == 0) {
            ref_top[j - p] = argmax(lp, V);
          } else {
            const double k = kl_divergence(lref.data() + static_cast<size_t>(j - p) * V, lp, V);
            kl[i] += k;
            kl2[i] += k * k;
            agree[i] += argmax(lp, V) == ref_top[j - p];
          }
          ++rows[i].tokens;
        }
      }
    }
    for (size_t i = 0; i < n_rows; ++i) {
      EvalRow& r = rows[i];
      const double n = static_cast<double>(r.tokens);
      r.chunks = c + 1;
      r.nll = nll[i] / n;
      r.ppl = std::exp(r.nll);
      r.kld = kl[i] / n;
      r.kld_stderr = n > 1 ? std::sqrt(std::max(0.0, kl2[i] / n - r.kld * r.kld) / (n - 1)) : 0;
      r.top1 = i == 0 ? 1.0 : static_cast<double>(agree[i]) / n;
    }
    if (progress) progress(c + 1, n_chunks, rows);
  }
  return rows;
}

std::vector<PasskeyCell> passkey(const Model& model, const Tokenizer& tok, const std::string& text,
                                 const std::vector<CacheSpec>& specs, const PasskeyOptions& opt,
                                 const std::function<void(const PasskeyCell&)>& on_cell) {
  const engine::ModelConfig& cfg = model.config();
  const std::vector<int32_t> hay = tok.encode(text, false, false);
  const std::string intro =
      "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
      "I will quiz you about the pass key.\n\n";
  const std::string question = "\n\nWhat is the pass key? Answer with the 5-digit number only.";
  const std::string answer_prefix = "";
  auto render = [&](const std::string& body) {
    return tok.apply_chat_template({{"user", intro + body + question}}, true) + answer_prefix;
  };
  const int overhead = static_cast<int>(tok.encode(render(""), true, false).size());
  std::vector<PasskeyCell> cells;
  const int V = cfg.n_vocab;
  std::vector<float> logits(V);
  for (int ctx : opt.ctx) {
    for (double depth : opt.depths) {
      // The same keys and haystack offsets for every format: a cell differs only in the cache.
      std::mt19937_64 rng(opt.seed * 1000003u + static_cast<uint64_t>(ctx) * 131 + static_cast<uint64_t>(depth * 1000));
      struct Trial {
        std::vector<int32_t> prompt;
        std::string key;
      };
      std::vector<Trial> trials;
      for (int t = 0; t < opt.trials; ++t) {
        const int key = 10000 + static_cast<int>(rng() % 90000);
        const std::string ks = std::to_string(key);
        const std::string needle = " The pass key is " + ks + ". Remember it. " + ks + " is the pass key. ";
        const int needle_tokens = static_cast<int>(tok.encode(needle, false, false).size());
        int h = ctx - overhead - needle_tokens - opt.max_new - 8;
        if (h < 16) throw Error(ErrorCode::InvalidArgument, "passkey: ctx " + std::to_string(ctx) + " is too small");
        if (h > static_cast<int>(hay.size())) h = static_cast<int>(hay.size());
        const int64_t start = static_cast<int64_t>(rng() % static_cast<uint64_t>(hay.size() - h + 1));
        const int cut = static_cast<int>(depth * h);
        const std::string before = tok.decode(std::span<const int32_t>(hay.data() + start, cut));
        const std::string after = tok.decode(std::span<const int32_t>(hay.data() + start + cut, h - cut));
        Trial tr;
        tr.prompt = tok.encode(render(before + needle + after), true, false);
        tr.key = ks;
        if (static_cast<int>(tr.prompt.size()) + opt.max_new > ctx) {  // re-tokenization merged differently
          const int extra = static_cast<int>(tr.prompt.size()) + opt.max_new - ctx;
          const std::string after2 =
              tok.decode(std::span<const int32_t>(hay.data() + start + cut, std::max(0, h - cut - extra - 4)));
          tr.prompt = tok.encode(render(before + needle + after2), true, false);
        }
        trials.push_back(std::move(tr));
      }
      for (const CacheSpec& s : specs) {
        PasskeyCell cell;
        cell.format = s.name;
        cell.ctx = ctx;
        cell.depth = depth;
        for (const Trial& tr : trials) {
          std::unique_ptr<engine::KvCache> cache = model.make_cache(s, ctx);
          const int64_t seq = cache->add_sequence();
          const int n = static_cast<int>(tr.prompt.size());
          // Prefill in batches of 512, as every recorded passkey run did.
          for (int p = 0; p < n; p += 512) {
            const int m = std::min(512, n - p);
            model.forward(seq, tr.prompt.data() + p, m, *cache, logits.data(), false);
          }
          std::vector<int32_t> out;
          int64_t pos = n;
          for (int i = 0; i < opt.max_new && pos < ctx; ++i) {
            const int32_t id = argmax(logits.data(), V);
            if (tok.is_end_of_generation(id)) break;
            out.push_back(id);
            model.forward(seq, &id, 1, *cache, logits.data(), false);
            ++pos;
          }
          const std::string said = tok.decode(out, true);
          ++cell.trials;
          cell.correct += said.find(tr.key) != std::string::npos;
          cell.answers.push_back(tr.key + " -> " + said);
        }
        if (on_cell) on_cell(cell);
        cells.push_back(std::move(cell));
      }
    }
  }
  return cells;
}

}  // namespace tqkv::eval
