// What every engine subcommand shares: the -m / -t / --device options and loading the model
// they name (tokenizer, weights on the device, the model's recipes).
#pragma once
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "engine/device/device.h"
#include "engine/gguf/gguf.h"
#include "engine/model/model.h"
#include "engine/cache/model_recipes.h"
#include "engine/model/paths.h"
#include "engine/gguf/tokenizer.h"
#include "tqkv/threads.h"

inline void add_model_options(CLI::App* cmd, std::string& model, int& threads, std::string& device) {
  cmd->add_option("-m,--model", model, "GGUF model (default: $TQKV_MODEL or models/SmolLM2-135M-Instruct.Q4_1.gguf)");
  cmd->add_option("-t,--threads", threads, "threads (default: $TQKV_THREADS or all cores)");
  cmd->add_option("--device", device, "cpu, cuda or auto (the GPU where one is present)")->capture_default_str();
}

// --cuda-graphs: decode steps replayed from CUDA graphs (device.h run_step) or run op by op;
// `choices` are its values ("on", "off", and "both" where a command times both).
inline void add_graphs_option(CLI::App* cmd, std::string& graphs, const std::vector<std::string>& choices) {
  cmd->add_option("--cuda-graphs", graphs, "decode steps as CUDA graphs (--device cuda; ignored on the CPU)")
      ->check(CLI::IsMember(choices))
      ->capture_default_str();
}

struct LoadedModel {
  std::string path;
  tqkv::engine::GgufFile file;
  tqkv::engine::Tokenizer tok;
  tqkv::engine::Model model;
};

// Sets the thread count (0: the default), opens the model (the default one when `model` is
// empty) and loads it onto the device.
inline LoadedModel load_model(const std::string& model, int threads, const std::string& device) {
  using namespace tqkv::engine;
  tqkv::set_num_threads(threads);
  std::string path = model.empty() ? default_model_path() : model;
  GgufFile file = GgufFile::open(path);
  Tokenizer tok = Tokenizer::from_gguf(file);
  Model m = Model::load(file, make_device(device));
  m.set_spec_sources(model_spec_sources(file, m.config()));  // its recipes: the weights hashed
  file.drop_resident_pages();  // the device holds its own copy of the weights
  return LoadedModel{std::move(path), std::move(file), std::move(tok), std::move(m)};
}
