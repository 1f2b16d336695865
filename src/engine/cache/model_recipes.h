// The recipes and key statistics of a loaded model: the recipe files (recipe.h) fitted to it,
// found by its key (architecture, shape, weights hash), turned into the SpecSources that cache
// specs resolve against.
#pragma once
#include <string>
#include <vector>

#include "engine/cache/cache_spec.h"
#include "engine/cache/recipe.h"

namespace tqkv::engine {

class GgufFile;

// The model's recipes (every file fitted to it; the first file with a name wins) and the first
// key statistics among them; then each named budget (tq-4.375, tq-3.375, tq-2.5) that no file
// gives this model resolves to the rule's recipe for cfg (recipe_fit.h rule_recipe; centred keys
// when the model has key statistics) — never to another model's layer list. A budget the rule
// cannot apply, or another recipe name fitted only to other models, resolves to a one-line
// error (RecipeBook::why_not). Throws tqkv::Error(Format) for a corrupt recipe file.
SpecSources spec_sources(const RecipeBook& book, const ModelKey& key, const ModelConfig& cfg);
SpecSources model_spec_sources(const GgufFile& f, const ModelConfig& cfg);
// Every recipe name of every recipe file and the named budgets, for --help and the checks
// before a model loads (only the budgets when a recipe file cannot be read: the load that
// follows reports it).
std::vector<std::string> known_recipe_names();
// Writes key statistics and recipes into the model's recipe file (found by its key; created as
// recipes/<model file stem>.json under the current directory, named by the GGUF's general.name,
// when it has none), or into `path`
// when given (created if absent): the statistics replace the file's, each recipe replaces the
// file's recipe of that name or is appended. Throws Error(InvalidArgument) when `path` is another
// model's file. Returns the path written.
std::string store_calibration(const GgufFile& f, const ModelConfig& cfg, const std::string& model_path,
                              const KeyStats& stats, const std::vector<Recipe>& recipes, const std::string& path = "");

}  // namespace tqkv::engine
