// tqkv synth MODEL -o OUT [--weights q4_k_m|q8_0|bf16] [--layers N] [--seed S] | --list: a GGUF of
// a named model's exact shape (synth_model.h) with random weights, for speed and memory runs on
// machines that cannot download the model. Its output is noise: never a quality figure.
#include <chrono>
#include <cstdio>
#include <string>

#include "commands.h"
#include "engine/gguf/synth_model.h"
#include "tqkv/error.h"

void register_synth(CLI::App& app) {
  auto* cmd = app.add_subcommand("synth", "Write a GGUF of a named model's shape with random weights (speed runs only)");
  struct Opts {
    std::string model, out, weights = "q4_k_m";
    int layers = 0;
    uint64_t seed = 1;
    bool list = false;
  };
  static Opts o;
  cmd->add_option("model", o.model, "a named shape (--list)");
  cmd->add_option("-o,--out", o.out, "output GGUF (default: models/MODEL-synth-WEIGHTS.gguf)");
  cmd->add_option("--weights", o.weights, "q4_k_m (Q4_K with Q6_K where llama.cpp's Q4_K_M puts it), q8_0 or bf16")
      ->capture_default_str();
  cmd->add_option("--layers", o.layers, "keep only the first N layers (a smaller model of the same layer shape)")
      ->check(CLI::Range(1, 1 << 12));
  cmd->add_option("--seed", o.seed, "random seed")->capture_default_str();
  cmd->add_flag("--list", o.list, "list the named shapes");
  cmd->callback([] {
    using namespace tqkv::engine;
    if (o.list) {
      std::printf("%-14s %-6s %6s %6s %7s %7s %7s %8s\n", "model", "arch", "layers", "d", "heads", "kv", "d_ff", "params");
      for (const SynthShape& s : synth_shapes())
        std::printf("%-14s %-6s %6d %6d %7d %7d %7d %7.2fB\n", s.name.c_str(), s.arch.c_str(), s.layers, s.d_model,
                    s.heads, s.kv_heads, s.d_ff, s.parameters() / 1e9);
      return;
    }
    if (o.model.empty()) throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "synth: name a model (--list shows them)");
    SynthShape shape = synth_shape(o.model);
    const SynthWeights weights = synth_weights(o.weights);
    if (o.layers > 0) {
      shape.layers = o.layers;
      shape.name += "-" + std::to_string(o.layers) + "layers";
    }
    const std::string out = o.out.empty() ? "models/" + shape.name + "-synth-" + o.weights + ".gguf" : o.out;
    const auto t0 = std::chrono::steady_clock::now();
    const size_t bytes = write_synthetic_model(out, shape, weights, o.seed);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("synth: %s (%.2fB parameters, %s) -> %s: %.2f GB in %.1f s\n", shape.name.c_str(),
                shape.parameters() / 1e9, o.weights.c_str(), out.c_str(), bytes / 1e9, s);
  });
}
