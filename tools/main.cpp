// The `tqkv` command-line program: one subcommand per file (cmd_<name>.cpp), each registered
// here through its register_<name>(CLI::App&).
#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>
#include <string_view>

#include "commands.h"
#include "tqkv/options.h"

int main(int argc, char** argv) {
  CLI::App app{"tqkv: TurboQuant-style compressed KV caches — formats, codebooks, quality, engine"};
  app.require_subcommand(1);
  register_formats(app);
  register_env(app);
  register_bench(app);
  register_codebook(app);
  register_quality(app);
#ifdef TQKV_HAVE_ENGINE
  register_generate(app);
  register_perplexity(app);
  register_logits(app);
  register_synth(app);
  register_eval(app);
  register_passkey(app);
  register_calibrate(app);
#endif
#ifdef TQKV_HAVE_SERVE
  register_serve(app);
#endif
  try {
    // Every TQKV_* variable checked before any work (`tqkv env` shows a bad one, then fails).
    if (argc < 2 || std::string_view(argv[1]) != "env") tqkv::check_options();
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::cerr << "tqkv: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
