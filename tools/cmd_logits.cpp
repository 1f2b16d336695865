// tqkv logits -m MODEL --tokens 1,2,3 -o OUT [--step N] [--kv-cache-dtype F] [--device D]: the
// model's logits at every position of a token sequence, [n, n_vocab] float32 little-endian, raw.
// For checking the engine against an independent implementation (tests/python/
// test_architectures.py holds it to transformers): token ids in, so no tokenizer stands between.
// --step N feeds the sequence N tokens per forward (1: one decode step per token), so prefill,
// chunked prefill and decode are each checked, not only one whole forward.
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "cli_util.h"
#include "commands.h"
#include "engine/cache/cache_spec.h"
#include "engine/cache/model_recipes.h"
#include "engine_cli.h"
#include "tqkv/error.h"

namespace {

std::vector<int32_t> parse_tokens(const std::string& list) {
  std::vector<int32_t> ids;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || v < 0 || v > INT32_MAX)
      throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "--tokens: '" + item + "' is not a token id");
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "--tokens: no token ids");
  return ids;
}

}  // namespace

void register_logits(CLI::App& app) {
  auto* cmd = app.add_subcommand("logits", "Logits at every position of a token sequence, raw float32, to a file");
  struct Opts {
    std::string device = "cpu";
    std::string model, tokens, out, format = "f32";
    int threads = 0, step = 0;
  };
  static Opts o;
  add_model_options(cmd, o.model, o.threads, o.device);
  cmd->add_option("--tokens", o.tokens, "token ids, comma-separated")->required();
  cmd->add_option("-o,--out", o.out, "output file: [n, n_vocab] float32 little-endian")->required();
  cmd->add_option("--step", o.step, "tokens per forward (0: all at once; 1: one decode step per token)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--kv-cache-dtype", o.format, tqkv::engine::cache_spec_help(tqkv::engine::known_recipe_names()))
      ->capture_default_str();
  cmd->callback([] {
    using namespace tqkv::engine;
    check_cache_spec(o.format, known_recipe_names());  // a bad spec fails before the model loads
    const std::vector<int32_t> ids = parse_tokens(o.tokens);
    LoadedModel lm = load_model(o.model, o.threads, o.device);
    const Model& model = lm.model;
    const int n = static_cast<int>(ids.size()), vocab = model.config().n_vocab;
    std::unique_ptr<KvCache> cache = model.make_cache(o.format, n);
    const int64_t seq = cache->add_sequence();
    std::vector<float> logits(static_cast<size_t>(n) * vocab);
    const int step = o.step > 0 ? o.step : n;
    for (int t0 = 0; t0 < n; t0 += step) {
      const int m = std::min(step, n - t0);
      model.forward(seq, ids.data() + t0, m, *cache, LogitsOut(logits.data() + static_cast<size_t>(t0) * vocab), true);
    }
    std::FILE* f = std::fopen(o.out.c_str(), "wb");
    bool ok = f && std::fwrite(logits.data(), sizeof(float), logits.size(), f) == logits.size();
    ok = f && std::fclose(f) == 0 && ok;
    if (!ok) throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "-o: cannot write '" + o.out + "'");
  });
}
