// tqkv calibrate [-m MODEL] [-f TEXT] [-o FILE]: measures a model's key statistics (the
// per-channel key means and the key/query energies that key centring and channel scales use,
// eval/calibrate.h) over calibration text and writes them into the model's recipe file.
#include <cstdio>
#include <string>

#include "cli_util.h"
#include "commands.h"
#include "engine_cli.h"
#include "engine/cpu_device.h"
#include "engine/gguf.h"
#include "engine/paths.h"
#include "engine/model_recipes.h"
#include "engine/tokenizer.h"
#include "eval/calibrate.h"
#include "tqkv/threads.h"

void register_calibrate(CLI::App& app) {
  auto* cmd = app.add_subcommand("calibrate", "Measure a model's key statistics (for +c/+s) into its recipe file");
  struct Opts {
    std::string device = "cpu";
    std::string model, text, out;
    int ctx = 512, tokens = 20480, threads = 0;
  };
  static Opts o;
  add_model_options(cmd, o.model, o.threads, o.device);
  cmd->add_option("-f,--file", o.text, "calibration text, not the evaluation text (default: data/kjv-exodus.txt)");
  cmd->add_option("-o,--output", o.out,
                  "recipe file to write (default: the model's recipe file, or recipes/<model file name>.json)");
  cmd->add_option("-c,--ctx", o.ctx, "tokens per chunk")->check(CLI::Range(16, 1 << 20))->capture_default_str();
  cmd->add_option("--tokens", o.tokens, "text tokens used")->check(CLI::Range(16, 1 << 30))->capture_default_str();
  cmd->callback([] {
    using namespace tqkv::engine;
    using namespace tqkv::eval;
    const std::string tpath = o.text.empty() ? default_calibration_text_path() : o.text;
    LoadedModel lm = load_model(o.model, o.threads, o.device);
    const std::string& mpath = lm.path;
    const GgufFile& file = lm.file;
    const Tokenizer& tok = lm.tok;
    Model& model = lm.model;
    const std::vector<int32_t> tokens = tok.encode(read_text(tpath), false, false);
    CalibrateOptions c;
    c.ctx = std::min(o.ctx, model.config().ctx_train);
    c.max_tokens = o.tokens;
    c.bos = tok.add_bos() ? tok.bos() : -1;
    KeyStats ks = calibrate_keys(model, tokens, c, [](int done, int total) {
      std::fprintf(stderr, "\rcalibrate: chunk %d/%d", done, total);
      if (done == total) std::fputc('\n', stderr);
    });
    ks.source = tpath.substr(tpath.find_last_of('/') + 1) + ", " + std::to_string(ks.tokens) + " tokens in chunks of " +
                std::to_string(c.ctx) + ", f32 cache";
    const std::string written = store_key_stats(file, model.config(), mpath, ks, o.out);
    std::printf("key statistics of %s (%lld tokens) written to %s\n", mpath.c_str(), static_cast<long long>(ks.tokens),
                written.c_str());
  });
}
