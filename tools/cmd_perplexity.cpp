// tqkv perplexity [-m MODEL] [-f TEXT] [--ctx N] [--kv-cache-dtype T] [--json]: perplexity of
// a GGUF model on a text with the KV cache in a tqkv format, plus KL divergence and top-1
// agreement against the f32-cache run of the same model on the same text.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_util.h"
#include "commands.h"
#include "engine_cli.h"
#include "engine/cache/cache_spec.h"
#include "engine/cache/model_recipes.h"
#include "engine/gguf/gguf.h"
#include "engine/model/paths.h"
#include "eval/perplexity.h"
#include "engine/gguf/tokenizer.h"
#include "tqkv/error.h"
#include "tqkv/format.h"
#include "tqkv/threads.h"

void register_perplexity(CLI::App& app) {
  auto* cmd = app.add_subcommand("perplexity", "Perplexity and KL/top-1 vs the f32 cache of a GGUF model on a text");
  struct Opts {
    std::string device = "cpu";
    std::string model, text, format = "f32", logits;
    int ctx = 512, chunks = 0, skip = -1, threads = 0, batch = 512;
    bool json = false, no_compare = false;
  };
  static Opts o;
  add_model_options(cmd, o.model, o.threads, o.device);
  cmd->add_option("-f,--file", o.text, "text file (default: $TQKV_TEXT or data/kjv-genesis.txt)");
  cmd->add_option("-c,--ctx", o.ctx, "tokens per chunk")->check(CLI::Range(16, 1 << 20))->capture_default_str();
  cmd->add_option("--chunks", o.chunks, "score at most this many chunks (0: all)")->capture_default_str();
  cmd->add_option("-b,--batch", o.batch, "most tokens of a forward pass (the unscored first half runs as a fresh prompt, the scored half as chunks reading the cache)")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  cmd->add_option("--kv-cache-dtype", o.format, tqkv::engine::cache_spec_help(tqkv::engine::known_recipe_names()))->capture_default_str();
  cmd->add_option("--kv-skip-layers", o.skip, "first and last N layers keep an f16 cache (default: the formats')");
  cmd->add_flag("--no-compare", o.no_compare, "skip the f32-cache run (no KL / top-1)");
  cmd->add_option("--save-logits", o.logits,
                  "write the first chunk's logits, [ctx, n_vocab] float32 little-endian, raw, to this file");
  cmd->add_flag("--json", o.json, "print one JSON object: ppl, kld, top1, tokens, kv_bytes_per_token");
  cmd->callback([] {
    using namespace tqkv::engine;
    using namespace tqkv::eval;
    check_cache_spec(o.format, known_recipe_names());  // a bad spec fails before the model loads
    const std::string tpath = o.text.empty() ? default_text_path() : o.text;
    const std::string text = read_text(tpath);
    LoadedModel lm = load_model(o.model, o.threads, o.device);
    const Tokenizer& tok = lm.tok;
    Model& model = lm.model;
    // The text is data, not a prompt: special-token markup in it stays plain text.
    const std::vector<int32_t> tokens = tok.encode(text, false, false);
    PerplexityOptions p;
    p.ctx = std::min(o.ctx, model.config().ctx_train);
    p.max_chunks = o.chunks;
    p.format = o.format;
    p.skip_layers = o.skip;
    p.compare_to_f32 = !o.no_compare;
    p.batch = o.batch;
    p.bos = tok.add_bos() ? tok.bos() : -1;
    std::vector<float> first_logits;
    if (!o.logits.empty()) p.first_chunk_logits = &first_logits;
    const PerplexityResult r = perplexity(model, tokens, p, [](int done, int total, double ppl) {
      const int width = 30, fill = done * width / total;
      std::fprintf(stderr, "\r[%s%s] %d/%d chunks  ppl %.4f", std::string(fill, '#').c_str(),
                   std::string(width - fill, ' ').c_str(), done, total, ppl);
      if (done == total) std::fputc('\n', stderr);
      std::fflush(stderr);
    });
    if (!o.logits.empty()) {
      std::FILE* f = std::fopen(o.logits.c_str(), "wb");
      bool ok = f && std::fwrite(first_logits.data(), sizeof(float), first_logits.size(), f) == first_logits.size();
      ok = f && std::fclose(f) == 0 && ok;
      if (!ok) throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "--save-logits: cannot write '" + o.logits + "'");
    }
    if (o.json) {
      nlohmann::json j = {{"ppl", r.ppl},
                          {"kld", r.kld},
                          {"top1", r.top1},
                          {"tokens", r.tokens},
                          {"kv_bytes_per_token", r.kv_bytes_per_token},
                          {"format", o.format},
                          {"ctx", p.ctx},
                          {"chunks", r.chunks},
                          {"seconds", r.seconds}};
      std::cout << j.dump() << "\n";
    } else {
      std::printf("format %s  ctx %d  chunks %d  scored tokens %lld (of %zu in the text)\n", o.format.c_str(), p.ctx,
                  r.chunks, static_cast<long long>(r.tokens), tokens.size());
      std::printf("perplexity %.4f  KL vs f32 %.6f  top-1 agreement %.4f  kv bytes/token %.0f  (%.1f s)\n", r.ppl,
                  r.kld, r.top1, r.kv_bytes_per_token, r.seconds);
    }
  });
}
