// Registration functions of the tqkv subcommands (one file each). A subcommand's callback
// throws std::exception on error; main() prints it and exits 1.
#pragma once
#include <CLI/CLI.hpp>

void register_formats(CLI::App& app);
void register_env(CLI::App& app);
void register_bench(CLI::App& app);
void register_codebook(CLI::App& app);
void register_quality(CLI::App& app);
#ifdef TQKV_HAVE_ENGINE
void register_generate(CLI::App& app);
void register_perplexity(CLI::App& app);
void register_logits(CLI::App& app);
void register_synth(CLI::App& app);
void register_eval(CLI::App& app);
void register_passkey(CLI::App& app);
void register_calibrate(CLI::App& app);
void register_bench_decode(CLI::App& bench);  // under `tqkv bench`
#endif
#ifdef TQKV_HAVE_SERVE
void register_serve(CLI::App& app);
#endif
