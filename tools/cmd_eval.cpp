// tqkv eval: every KV-cache format side by side on a real model and text (issue 6) — bits per
// element, cache bytes per token, perplexity, KL divergence and top-1 agreement against the
// f32 cache, per context size; JSON and Markdown output.
// tqkv passkey: retrieval of a random 5-digit key hidden at several depths of real text.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "cli_util.h"
#include "commands.h"
#include "engine_cli.h"
#include "eval/eval.h"
#include "engine/gguf/gguf.h"
#include "engine/model/paths.h"
#include "engine/gguf/tokenizer.h"
#include "tqkv/error.h"
#include "tqkv/threads.h"

namespace {

const char* kDefaultFormats =
    "f16,fp8,turboquant_k8v4,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc,tq-k4v2,tq-k3v2,tq-k4v3,"
    "tq-k4v4,tq-4.36,tq-3.36,tq-2.75,tq-4.375,tq-3.375,tq-2.5";

nlohmann::json row_json(const tqkv::eval::EvalRow& r) {
  return {{"format", r.format},     {"detail", r.detail},         {"ctx", r.ctx},
          {"chunks", r.chunks},     {"scored_tokens", r.tokens},  {"bits_per_element", r.bits},
          {"bits_all_layers", r.bits_all}, {"bytes_per_token", r.bytes_per_token}, {"ppl", r.ppl},
          {"kl_mean", r.kld},       {"kl_stderr", r.kld_stderr},  {"top1", r.top1},
          {"seconds", r.seconds}};
}

std::string markdown(const nlohmann::json& runs) {
  std::ostringstream md;
  char buf[512];
  for (const auto& run : runs) {
    const auto& rows = run["rows"];
    double f16_ppl = 0;
    for (const auto& r : rows)
      if (r["format"] == "f16") f16_ppl = r["ppl"].get<double>();
    md << "\nctx " << run["ctx"].get<int>() << ", " << run["chunks"].get<int>() << " chunks, "
       << run["scored_tokens"].get<long long>() << " scored tokens; KL and top-1 against the f32 cache\n\n";
    md << "| format | bits/elem | bits/elem, all layers | cache B/token | PPL | ΔPPL vs f16 | KL vs f32 | top-1 |\n";
    md << "|---|---|---|---|---|---|---|---|\n";
    for (const auto& r : rows) {
      const double ppl = r["ppl"].get<double>();
      std::snprintf(buf, sizeof buf, "| `%s` | %.4g | %.4g | %.0f | %.4f | %+.2f%% | %.5f ± %.5f | %.4f |\n",
                    r["format"].get<std::string>().c_str(), r["bits_per_element"].get<double>(),
                    r["bits_all_layers"].get<double>(), r["bytes_per_token"].get<double>(), ppl,
                    f16_ppl > 0 ? 100.0 * (ppl / f16_ppl - 1) : 0.0, r["kl_mean"].get<double>(),
                    r["kl_stderr"].get<double>(), r["top1"].get<double>());
      md << buf;
    }
  }
  return md.str();
}

}  // namespace

void register_eval(CLI::App& app) {
  auto* cmd = app.add_subcommand("eval", "Quality per bit: every KV-cache format vs the f32 cache on a model and text");
  struct Opts {
    std::string device = "cpu";
    std::string model, text, formats = kDefaultFormats, ctx = "512,4096", json, markdown;
    int tokens = 20480, threads = 0, batch = 512;
  };
  static Opts o;
  add_model_options(cmd, o.model, o.threads, o.device);
  cmd->add_option("-f,--file", o.text, "text file (default: $TQKV_TEXT or data/kjv-genesis.txt)");
  cmd->add_option("--formats", o.formats, "comma-separated cache specs (src/engine/cache/cache_spec.h grammar)")->capture_default_str();
  cmd->add_option("--ctx", o.ctx, "comma-separated context sizes")->capture_default_str();
  cmd->add_option("--tokens", o.tokens, "text tokens per context size (floor(tokens/ctx) chunks)")->capture_default_str();
  cmd->add_option("-b,--batch", o.batch, "most tokens of a forward pass (the unscored first half runs as a fresh prompt, the scored half as chunks reading the cache)")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  cmd->add_option("--json", o.json, "write the results as JSON to this file (updated after every chunk)");
  cmd->add_option("--markdown", o.markdown, "write the Markdown table to this file");
  cmd->callback([] {
    using namespace tqkv::engine;
    using namespace tqkv::eval;
    const std::string tpath = o.text.empty() ? default_text_path() : o.text;
    const std::string text = read_text(tpath);
    LoadedModel lm = load_model(o.model, o.threads, o.device);
    const std::string& mpath = lm.path;
    const Tokenizer& tok = lm.tok;
    Model& model = lm.model;
    std::vector<CacheSpec> specs;
    for (const std::string& s : split_list(o.formats)) specs.push_back(model.resolve(s));
    const std::vector<int32_t> tokens = tok.encode(text, false, false);
    nlohmann::json out = {{"model", mpath}, {"text", tpath}, {"text_tokens", tokens.size()},
                          {"head_dim", model.config().head_dim}, {"n_layers", model.config().n_layers},
                          {"n_kv_heads", model.config().n_kv_heads}, {"runs", nlohmann::json::array()}};
    for (const std::string& cs : split_list(o.ctx)) {
      EvalOptions e;
      e.ctx = std::min(std::stoi(cs), model.config().ctx_train);
      e.max_tokens = o.tokens;
      e.batch = o.batch;
      e.bos = tok.add_bos() ? tok.bos() : -1;
      out["runs"].push_back(nlohmann::json::object());
      auto show = [&](int done, int total, const std::vector<EvalRow>& rows) {
        nlohmann::json run = {{"ctx", e.ctx}, {"chunks", done}, {"chunks_planned", total},
                              {"scored_tokens", rows[0].tokens}, {"rows", nlohmann::json::array()}};
        for (const auto& r : rows) run["rows"].push_back(row_json(r));
        out["runs"].back() = run;
        std::fprintf(stderr, "ctx %d: chunk %d/%d  (f32 ppl %.4f)\n", e.ctx, done, total, rows[0].ppl);
        if (!o.json.empty()) std::ofstream(o.json) << out.dump(1) << "\n";
      };
      evaluate(model, tokens, specs, e, show);
    }
    const std::string md = markdown(out["runs"]);
    if (!o.markdown.empty()) std::ofstream(o.markdown) << md;
    if (!o.json.empty()) std::ofstream(o.json) << out.dump(1) << "\n";
    std::cout << md;
  });
}

void register_passkey(CLI::App& app) {
  auto* cmd = app.add_subcommand("passkey", "Passkey retrieval at long context, per cache format, context and depth");
  struct Opts {
    std::string device = "cpu";
    std::string model, text, formats = "f16,turboquant_4bit_nc,turboquant_3bit_nc,tq-4.36,tq-3.36", ctx = "1024,4096",
                             depths = "0.1,0.5,0.9", json;
    int trials = 4, threads = 0;
    uint64_t seed = 6;
  };
  static Opts o;
  add_model_options(cmd, o.model, o.threads, o.device);
  cmd->add_option("-f,--file", o.text, "haystack text (default: data/kjv-genesis.txt)");
  cmd->add_option("--formats", o.formats, "comma-separated cache specs")->capture_default_str();
  cmd->add_option("--ctx", o.ctx, "comma-separated context sizes")->capture_default_str();
  cmd->add_option("--depths", o.depths, "comma-separated relative depths in [0, 1]")->capture_default_str();
  cmd->add_option("--trials", o.trials, "trials per cell")->capture_default_str();
  cmd->add_option("--seed", o.seed, "seed of the keys and haystack offsets")->capture_default_str();
  cmd->add_option("--json", o.json, "write the cells as JSON to this file (updated after every cell)");
  cmd->callback([] {
    using namespace tqkv::engine;
    using namespace tqkv::eval;
    const std::string text = read_text(o.text.empty() ? default_text_path() : o.text);
    LoadedModel lm = load_model(o.model, o.threads, o.device);
    const Tokenizer& tok = lm.tok;
    Model& model = lm.model;
    std::vector<CacheSpec> specs;
    for (const std::string& s : split_list(o.formats)) specs.push_back(model.resolve(s));
    PasskeyOptions p;
    p.ctx.clear();
    for (const auto& c : split_list(o.ctx)) p.ctx.push_back(std::stoi(c));
    p.depths.clear();
    for (const auto& d : split_list(o.depths)) p.depths.push_back(std::stod(d));
    p.trials = o.trials;
    p.seed = o.seed;
    nlohmann::json cells = nlohmann::json::array();
    passkey(model, tok, text, specs, p, [&](const PasskeyCell& c) {
      std::printf("%-24s ctx %5d depth %.2f  %d/%d\n", c.format.c_str(), c.ctx, c.depth, c.correct, c.trials);
      std::fflush(stdout);
      cells.push_back({{"format", c.format}, {"ctx", c.ctx}, {"depth", c.depth}, {"trials", c.trials},
                       {"correct", c.correct}, {"answers", c.answers}});
      if (!o.json.empty()) std::ofstream(o.json) << nlohmann::json({{"cells", cells}}).dump(1) << "\n";
    });
  });
}
