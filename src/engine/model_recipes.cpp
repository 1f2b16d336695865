// TEMPORARY: SmolLM2's recipes until the recipe files land.
#include "model_recipes.h"

namespace tqkv::engine {
namespace {
const std::vector<std::pair<std::string, std::string>>& smol() {
  static const std::vector<std::pair<std::string, std::string>> r = {
      {"tq-4.36", "k5v4+c+L4.6.7.8.24.25=k4v3+L3.11=k4v4+L14.15.20.22.26.27=k5v3+L17=k6v3"},
      {"tq-3.36", "k3v3+c+L19.18.13.25.17.23=k4v3"},
      {"tq-4.25", "k5v3+c+L4.5.6.7.8.24.25=k4v3+L3.10.11=k4v4+L2.12.13.16.19.23=k5v4+L17=k6v3"},
      {"tq-3.12", "k4v2+c+L4.5.6.7.8.9.24.25.26=k3v2+L3.10.11=k3v3+L2=k4v3+L17=k5v2"},
      {"tq-2.75", "k3v2+c"},
      {"tq-4.375", "k5v3+c+L4.5.6.7.8.24.25=k4v3+L3.10.11=k4v4+L2.12.13.16.19.23=k5v4+L17=k6v3+sink1+wq6+fill4.375"},
      {"tq-3.375", "k3v2+c+L11=k2v2+L5.7.8.9.16.18.20.26=k4v2+L14.15.17.21.23.24=k4v3+sink1+wq6+fill3.375"},
      {"tq-2.5", "k2v2+c+L5.8.9.14.20.23=k3v2+sink1+wq6+fill2.5"},
  };
  return r;
}
}  // namespace

SpecSources model_spec_sources(const GgufFile&, const ModelConfig& cfg) {
  SpecSources s;
  if (cfg.arch == "llama" && cfg.n_layers == 30 && cfg.head_dim == 64) s.recipes = smol();
  return s;
}

SpecSources model_spec_sources_for_tests(const ModelConfig& cfg) {
  SpecSources s;
  if (cfg.arch == "llama" && cfg.n_layers == 30 && cfg.head_dim == 64) s.recipes = smol();
  return s;
}

std::vector<std::string> known_recipe_names() {
  std::vector<std::string> n;
  for (const auto& [name, spec] : smol()) n.push_back(name);
  return n;
}

std::string store_key_stats(const GgufFile&, const ModelConfig&, const std::string&, const KeyStats&,
                            const std::string&) {
  return "";
}

}  // namespace tqkv::engine
