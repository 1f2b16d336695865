// tqkv generate [-m MODEL] [-p PROMPT] [-n N] [--kv-cache-dtype SPEC]: runs a GGUF model with
// the KV cache in any tqkv format or cache spec, streams the answer, then reports prompt and decode speed and
// the cache's size. With no -m / -p it uses the default model (scripts/fetch_model.sh) and a
// default question, so it works right after the set-up.
#include <cstdio>
#include <iostream>
#include <string>

#include "cli_util.h"
#include "commands.h"
#include "engine_cli.h"
#include "engine/model/generate.h"
#include "engine/cache/cache_spec.h"
#include "engine/cache/model_recipes.h"
#include "engine/gguf/gguf.h"
#include "engine/model/paths.h"
#include "tqkv/format.h"
#include "tqkv/threads.h"

namespace {
constexpr const char* kDefaultPrompt = "What are the three primary colors? Answer briefly.";
// Without --kv-cache-dtype: the model's best calibrated recipe where it has one and the device
// runs it (tq-4.375: KL 0.011 vs the f32 cache on SmolLM2 at 4.375 bits over every layer,
// docs/journal/RESULTS-journal.md), else vLLM's turboquant_k8v4, the most compressed preset whose
// next-token choice agrees with the f32 cache's more than 90% of the time on SmolLM2 (KL 0.02); the
// 4-bit-key presets (KL ~0.07) visibly degrade a small model's answers.
constexpr const char* kBestRecipe = "tq-4.375";
constexpr const char* kFallbackFormat = "turboquant_k8v4";
}

void register_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Generate text with a GGUF model, the KV cache in any tqkv format");
  struct Opts {
    std::string device = "cpu", graphs = "on";
    std::string model, prompt = kDefaultPrompt, format;
    int n = 128, ctx = 2048, skip = -1, threads = 0, top_k = 40;
    float temp = 0.0f, top_p = 0.95f;
    uint64_t seed = 1;
    bool raw = false, quiet = false, ignore_eos = false;
  };
  static Opts o;
  add_model_options(cmd, o.model, o.threads, o.device);
  add_graphs_option(cmd, o.graphs, {"on", "off"});
  cmd->add_option("-p,--prompt", o.prompt, "prompt text (wrapped in the model's chat template unless --raw)")
      ->capture_default_str();
  cmd->add_option("-n,--n-predict", o.n, "tokens to generate")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  cmd->add_option("--kv-cache-dtype", o.format,
                  tqkv::engine::cache_spec_help(tqkv::engine::known_recipe_names()) +
                      " (default: the model's tq-4.375 recipe where it has one, else turboquant_k8v4)");
  cmd->add_option("--kv-skip-layers", o.skip,
                  "first and last N layers keep an f16 cache (default: 2 for compressed formats, capped at half)");
  cmd->add_option("-c,--ctx", o.ctx, "context length (cache capacity), capped at the model's")
      ->check(CLI::Range(16, 1 << 20))->capture_default_str();
  cmd->add_option("--temp", o.temp, "sampling temperature; 0 = greedy")->capture_default_str();
  cmd->add_option("--top-k", o.top_k, "top-k cut when sampling")->capture_default_str();
  cmd->add_option("--top-p", o.top_p, "nucleus cut when sampling")->capture_default_str();
  cmd->add_option("--seed", o.seed, "sampling seed")->capture_default_str();
  cmd->add_flag("--raw", o.raw, "feed the prompt as is, without the chat template");
  cmd->add_flag("-q,--quiet", o.quiet, "print only the generated text and the stats line");
  cmd->add_flag("--ignore-eos", o.ignore_eos, "generate all -n tokens even past end of turn (for timing)");
  cmd->callback([] {
    using namespace tqkv::engine;
    if (!o.format.empty()) check_cache_spec(o.format, known_recipe_names());  // fails before the model loads
    LoadedModel lm = load_model(o.model, o.threads, o.device);
    lm.model.device().set_step_graphs(o.graphs == "on");
    const std::string& mpath = lm.path;
    const Tokenizer& tok = lm.tok;
    Model& model = lm.model;
    const ModelConfig& c = model.config();
    const int ctx = std::min(o.ctx, c.ctx_train);
    std::string format = o.format, why;
    if (format.empty()) {  // the best the model and the device have
      format = kFallbackFormat;
      why = " (default: the model has no calibrated recipe the device runs)";
      try {
        if (!model.spec_sources().is_rule_based(kBestRecipe)) {  // the rule's recipes are not calibrated
          model.make_cache(kBestRecipe, 16);
          format = kBestRecipe;
          why = " (default: the model's best calibrated recipe)";
        }
      } catch (const std::exception&) {  // a recipe the model lacks, or one the device cannot run
      }
    }
    const CacheSpec spec = model.resolve(o.skip >= 0 ? format + "+skip" + std::to_string(o.skip) : format);
    std::unique_ptr<KvCache> cache = model.make_cache(spec, ctx);
    const int64_t seq = cache->add_sequence();
    std::string text = o.raw ? o.prompt : tok.apply_chat_template({{"user", o.prompt}}, true);
    // Templates that spell out the BOS marker (Llama 3) must not get a second one.
    const bool bos_in_text = tok.bos() >= 0 && text.rfind(tok.piece(tok.bos()), 0) == 0;
    const std::vector<int32_t> prompt = tok.encode(text, true, tok.add_bos() && !bos_in_text);
    if (!o.quiet) {
      // bits_at: the slots plus any copies (sinks, window) spread over the full context.
      std::fprintf(stderr, "kv cache: %s%s: %s; %.4g bits/element in the compressed layers, ctx %d\n", format.c_str(),
                   why.c_str(), spec.detail.c_str(), spec.bits_at(ctx), ctx);
      std::fprintf(stderr,
                   "model: %s (%s, %d layers, %d/%d heads, head_dim %d), weights in memory %.0f MiB, process RSS %.0f "
                   "MiB\n\n",
                   mpath.c_str(), c.arch.c_str(), c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
                   model.weight_bytes() / 1048576.0, resident_mib());
      if (!o.raw) std::printf("%s\n\n", o.prompt.c_str());
      std::fflush(stdout);
    }
    GenerateOptions g;
    g.n_predict = o.n;
    g.sampler = {o.temp, o.top_k, o.top_p, o.seed};
    g.stop_at_end_of_generation = !o.ignore_eos;
    const GenerateStats st = generate(model, tok, *cache, seq, prompt, g, [&](int32_t id) {
      if (tok.is_control(id)) return;
      const std::string p = tok.piece(id);
      std::fwrite(p.data(), 1, p.size(), stdout);
      std::fflush(stdout);
    });
    std::fputs("\n", stdout);
    std::fflush(stdout);
    std::fprintf(stderr,
                 "\nprompt: %d tokens, %.1f tokens/s | decode: %d tokens, %.1f tokens/s | kv cache (%s): %zu bytes "
                 "(%.0f bytes/token, copies included) | per CPU-second: prompt %.1f, decode %.1f tokens\n",
                 st.n_prompt, st.prompt_tokens_per_second(), st.n_decoded, st.decode_tokens_per_second(),
                 format.c_str(), st.kv.total(), st.kv.per_token(), st.prompt_tokens_per_cpu_second(),
                 st.decode_tokens_per_cpu_second());
  });
}
