// The recipes and key statistics of a loaded model: the recipe files (recipe.h) fitted to it,
// found by its key (architecture, shape, weights hash), turned into the SpecSources that cache
// specs resolve against.
#pragma once
#include <string>
#include <vector>

#include "cache_spec.h"
#include "recipe.h"

namespace tqkv::engine {

class GgufFile;

// The model's recipes (every file fitted to it; the first file with a name wins) and the first
// key statistics among them. A recipe name fitted only to other models resolves to a clear
// error (RecipeBook::why_not). Throws tqkv::Error(Format) for a corrupt recipe file.
SpecSources spec_sources(const RecipeBook& book, const ModelKey& key);
SpecSources model_spec_sources(const GgufFile& f, const ModelConfig& cfg);
// Every recipe name of every recipe file, for --help and the checks before a model loads
// (empty when a recipe file cannot be read: the load that follows reports it).
std::vector<std::string> known_recipe_names();
// Writes key statistics into the model's recipe file (found by its key; created as
// recipes/<model file stem>.json under the current directory when it has none), or into `path`
// when given (created if absent). Returns the path written.
std::string store_key_stats(const GgufFile& f, const ModelConfig& cfg, const std::string& model_path,
                            const KeyStats& stats, const std::string& path = "");

}  // namespace tqkv::engine
