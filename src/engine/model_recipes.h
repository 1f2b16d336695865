// The recipes and key statistics of a loaded model, found by its key in the recipe files.
#pragma once
#include "cache_spec.h"

namespace tqkv::engine {

class GgufFile;

SpecSources model_spec_sources(const GgufFile& f, const ModelConfig& cfg);
// Every recipe name of every recipe file (for --help and checks before a model loads).
std::vector<std::string> known_recipe_names();
SpecSources model_spec_sources_for_tests(const ModelConfig& cfg);
// Writes key statistics into the model's recipe file (found by its key; created as
// recipes/<model file stem>.json when it has none), or into `path` when given. Returns the path
// written.
std::string store_key_stats(const GgufFile& f, const ModelConfig& cfg, const std::string& model_path,
                            const KeyStats& stats, const std::string& path = "");

}  // namespace tqkv::engine
