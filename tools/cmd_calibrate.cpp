// tqkv calibrate [-m MODEL] [-f TEXT] [--budget B,...] [--name NAME] [-o FILE]: fits a model's
// recipes on calibration text. It measures the key statistics (the per-channel key means and
// key/query energies that key centring uses, eval/calibrate.h); with --budget it also scans
// every compressed layer's sensitivity and allocates per-layer key/value bits under each budget
// (engine/recipe_fit.h). Both go into the model's recipe file, which --kv-cache-dtype reads.
#include <cstdio>
#include <optional>
#include <sstream>
#include <string>

#include "cli_util.h"
#include "commands.h"
#include "engine_cli.h"
#include "engine/device/cpu_device.h"
#include "engine/gguf/gguf.h"
#include "engine/cache/model_recipes.h"
#include "engine/cache/recipe.h"
#include "engine/model/paths.h"
#include "engine/cache/recipe_fit.h"
#include "engine/gguf/tokenizer.h"
#include "eval/calibrate.h"
#include "eval/scan_file.h"
#include "tqkv/error.h"
#include "tqkv/threads.h"

namespace {

std::string number_text(double x) {
  std::ostringstream os;
  os.precision(10);
  os << x;
  return os.str();
}
// "\rcalibrate: scan [######......]  12/41" on stderr, a newline when done.
void bar(const char* what, int64_t done, int64_t total) {
  constexpr int kWidth = 30;
  const int fill = total > 0 ? static_cast<int>(kWidth * done / total) : kWidth;
  std::fprintf(stderr, "\rcalibrate: %s [%s%s] %lld/%lld", what, std::string(static_cast<size_t>(fill), '#').c_str(),
               std::string(static_cast<size_t>(kWidth - fill), '.').c_str(), static_cast<long long>(done),
               static_cast<long long>(total));
  if (done == total) std::fputc('\n', stderr);
}

}  // namespace

void register_calibrate(CLI::App& app) {
  auto* cmd = app.add_subcommand("calibrate",
                                 "Fit a model's recipes: key statistics (for +c/+s) and, with --budget, per-layer bits "
                                 "from a sensitivity scan; written into its recipe file");
  struct Opts {
    std::string device = "cpu";
    std::string model, text, out, name;
    std::vector<std::string> budgets;
    std::string save_scan, load_scan;
    int ctx = 256, tokens = 4096, scan_tokens = 256, threads = 0, max_pairs = 0;
    double copy_reserve = tqkv::engine::kCopyReserve;
    bool boundary_in_budget = false, balance = false;
  };
  static Opts o;
  add_model_options(cmd, o.model, o.threads, o.device);
  cmd->add_option("-f,--file", o.text, "calibration text, not the evaluation text (default: data/kjv-exodus.txt)");
  cmd->add_option("-o,--output", o.out,
                  "recipe file to write (default: the model's recipe file, or recipes/<model file name>.json)");
  cmd->add_option("-c,--ctx", o.ctx, "tokens per chunk (statistics and scan)")
      ->check(CLI::Range(16, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--tokens", o.tokens, "text tokens for the key statistics")
      ->check(CLI::Range(16, 1 << 30))
      ->capture_default_str();
  cmd->add_option("--budget", o.budgets,
                  "bit budgets to fit recipes to, comma-separated: bits per element (metadata and copies included), "
                  "or tq-4.375 / tq-3.375 / tq-2.5 (vLLM's preset sizes at the model's head_dim)")
      ->delimiter(',');
  cmd->add_option("--name", o.name, "recipe name for a single --budget (default: tq-<budget>)");
  cmd->add_option("--scan-tokens", o.scan_tokens,
                  "text tokens for the sensitivity scan (it costs 1 + 2 x compressed layers forward passes per chunk)")
      ->check(CLI::Range(16, 1 << 30))
      ->capture_default_str();
  cmd->add_option("--max-pairs", o.max_pairs,
                  "at most this many distinct key/value bit pairs per recipe (each is its own decode kernel on the "
                  "GPU; few kernels are faster at batch 1), the best such widths under the same model of KL")
      ->check(CLI::Range(1, tqkv::engine::kMaxPairsCap));
  cmd->add_option("--copy-reserve", o.copy_reserve,
                  "bits per element the slots leave to the f16 sink and the 6-bit recent window (fill<B> sizes the "
                  "window from what is left)")
      ->check(CLI::Range(0.01, 8.0))
      ->capture_default_str();
  auto* save = cmd->add_option("--save-scan", o.save_scan, "write the sensitivity scan to this JSON file (for --load-scan)");
  auto* load = cmd->add_option("--load-scan", o.load_scan,
                  "take the sensitivity scan from a --save-scan file of the same model and options instead of "
                  "running it");
  load->excludes(save);
  cmd->add_flag("--boundary-in-budget", o.boundary_in_budget,
               "compress the boundary layers too (first and last 2, f16 otherwise): the scan covers every layer "
               "and the budget counts the whole cache (+skip0 in the spec)");
  cmd->add_flag("--balance", o.balance,
               "+s instead of +c in the scan and the recipes: centred keys and key/query channel scales balanced "
               "(for models whose keys carry a few large channels, e.g. after QK-norm)");
  cmd->callback([] {
    using namespace tqkv::engine;
    using namespace tqkv::eval;
    const std::string tpath = o.text.empty() ? default_calibration_text_path() : o.text;
    LoadedModel lm = load_model(o.model, o.threads, o.device);
    const std::string& mpath = lm.path;
    const GgufFile& file = lm.file;
    const Tokenizer& tok = lm.tok;
    Model& model = lm.model;
    const ModelConfig& cfg = model.config();
    const std::vector<BudgetRequest> budgets = parse_budgets(o.budgets, o.name, cfg.head_dim);
    const std::string tname = tpath.substr(tpath.find_last_of('/') + 1);
    const std::vector<int32_t> tokens = tok.encode(read_text(tpath), false, false);
    CalibrateOptions c;
    c.ctx = std::min(o.ctx, cfg.ctx_train);
    c.max_tokens = o.tokens;
    c.bos = tok.add_bos() ? tok.bos() : -1;
    KeyStats ks = calibrate_keys(model, tokens, c, [](int done, int total) { bar("key statistics", done, total); });
    ks.source = tname + ", " + std::to_string(ks.tokens) + " tokens in chunks of " + std::to_string(c.ctx) + ", f32 cache";

    std::vector<Recipe> recipes;
    if (!budgets.empty()) {
      SpecSources src = model.spec_sources();  // the scan centres keys by the statistics just measured
      src.key_stats = std::make_shared<KeyStats>(ks);
      model.set_spec_sources(src);
      ScanOptions so;
      so.ctx = c.ctx;
      so.max_tokens = o.scan_tokens;
      so.bos = c.bos;
      so.suffix = "+sink1+w8";
      so.all_layers = o.boundary_in_budget;
      so.balance = o.balance;
      const int chunks = std::max(1, std::min(o.scan_tokens / so.ctx, static_cast<int>(tokens.size() / so.ctx)));
      const ScanHeader header{weights_hash(file), cfg.n_layers, tname,      c.ctx,          chunks, so.key_bits,
                              so.value_bits,      so.suffix,    so.all_layers, so.balance};
      std::vector<LayerSensitivity> scan;
      if (!o.load_scan.empty()) {
        scan = load_scan(o.load_scan, header);
      } else {
        scan = scan_layers(model, tokens, so, [](int64_t done, int64_t total) { bar("scan", done, total); });
        if (!o.save_scan.empty()) save_scan(o.save_scan, header, scan);
      }
      const std::string only = std::string(so.balance ? "+s" : "+c") + (so.all_layers ? "+skip0+only<l>" : "+only<l>");
      std::ostringstream fitted;
      fitted << "tqkv calibrate" << (so.all_layers ? " --boundary-in-budget" : "") << (so.balance ? " --balance" : "")
             << (o.max_pairs > 0 ? " --max-pairs " + std::to_string(o.max_pairs) : "")
             << (o.copy_reserve != tqkv::engine::kCopyReserve ? " --copy-reserve " + number_text(o.copy_reserve) : "")
             << " on " << tname
             << ": per-layer scan k" << so.key_bits << "v8" << only << so.suffix << ", k8v" << so.value_bits << only
             << so.suffix << " (" << chunks << " chunk" << (chunks > 1 ? "s" : "") << " of " << so.ctx << ")";
      std::printf("layer  KL keys at %d bits  KL values at %d bits\n", so.key_bits, so.value_bits);
      for (const LayerSensitivity& s : scan) std::printf("%5d  %18.5f  %20.5f\n", s.layer, s.key_kl, s.value_kl);
      for (const BudgetRequest& b : budgets) {
        const FitResult r = allocate_bits(cfg, scan, so.key_bits, so.value_bits, b.bits, true, so.balance, o.max_pairs,
                                          o.copy_reserve);
        model.resolve(r.spec);  // resolvable, with the statistics
        std::ostringstream note;
        note << (o.max_pairs > 0 ? "Allocation (at most " + std::to_string(o.max_pairs) + " distinct key/value pairs) under "
                                 : std::string("Greedy allocation under "))
             << number_text(b.bits) << " bits per element at head_dim " << cfg.head_dim
             << (so.all_layers ? " over every layer" : " over the compressed layers (the first and last 2 stay f16)")
             << " (slots + f16 sink + 6-bit recent window"
             << ", CacheSpec::bytes at every context): " << r.bits << " bits; predicted KL " << r.predicted_kl
             << " (additive model)";
        if (o.max_pairs > 0) note << "; " << distinct_pairs(r.widths) << " pairs used";
        note << ".";
        recipes.push_back(Recipe{b.name, r.spec, fitted.str() + "; budget " + number_text(b.bits), note.str()});
        std::printf("%s = %s  (%.4f bits, predicted KL %.4f)\n", b.name.c_str(), r.spec.c_str(), r.bits, r.predicted_kl);
        // The rule's recipe for the same budget, to compare against (tqkv eval --formats SPEC).
        std::string why;
        if (const std::optional<FitResult> rule = rule_recipe(cfg, b.bits, true, &why))
          std::printf("  without the scan (the rule%s): %s  (%.4f bits)\n",
                      so.all_layers ? ", boundary layers f16 outside the budget" : "", rule->spec.c_str(), rule->bits);
      }
    }
    const std::string written = store_calibration(file, cfg, mpath, ks, recipes, o.out);
    std::printf("key statistics of %s (%lld tokens)%s written to %s\n", mpath.c_str(), static_cast<long long>(ks.tokens),
                recipes.empty() ? "" : " and its recipes", written.c_str());
  });
}
