#include "engine/cache/model_recipes.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <memory>

#include "engine/gguf/gguf.h"
#include "engine/cache/recipe_fit.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

ModelKey key_of(const GgufFile& f, const ModelConfig& cfg) {
  return ModelKey{cfg.arch, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, weights_hash(f)};
}

}  // namespace

SpecSources spec_sources(const RecipeBook& book, const ModelKey& key, const ModelConfig& cfg) {
  SpecSources s;
  for (const RecipeFile& file : book.files()) {
    if (!(file.model == key)) continue;
    for (const Recipe& r : file.recipes) {
      const bool seen = std::any_of(s.recipes.begin(), s.recipes.end(), [&](const auto& p) { return p.first == r.name; });
      if (!seen) s.recipes.push_back({r.name, r.spec});
    }
    if (!s.key_stats && file.key_stats) s.key_stats = std::make_shared<KeyStats>(*file.key_stats);
  }
  // Named budgets without a calibrated recipe: the rule's, or why it cannot apply.
  std::vector<std::pair<std::string, std::string>> rule_errors;
  for (const NamedBudget& b : named_budgets()) {
    const bool seen = std::any_of(s.recipes.begin(), s.recipes.end(), [&](const auto& p) { return p.first == b.name; });
    if (seen) continue;
    std::string why;
    if (const std::optional<FitResult> r = rule_recipe(cfg, *named_budget_bits(b.name, cfg.head_dim), s.key_stats != nullptr, &why)) {
      s.recipes.push_back({b.name, r->spec});
      s.rule_based.push_back(b.name);
    } else {
      rule_errors.push_back({b.name, why});
    }
  }
  // Only names that some file defines get a message; anything else is left to the format parser.
  auto shared = std::make_shared<RecipeBook>(book);
  const std::vector<std::string> names = book.names();
  s.why_not = [shared, key, names, rule_errors](const std::string& name) {
    for (const auto& [n, why] : rule_errors)
      if (n == name) return "no recipe file fits '" + name + "' to this model, and the rule cannot: " + why;
    return std::find(names.begin(), names.end(), name) == names.end() ? std::string() : shared->why_not(key, name);
  };
  return s;
}

SpecSources model_spec_sources(const GgufFile& f, const ModelConfig& cfg) {
  return spec_sources(RecipeBook::from_default_dirs(), key_of(f, cfg), cfg);
}

std::vector<std::string> known_recipe_names() {
  // Every subcommand's --help asks for them at start-up: read the recipe files once.
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    try {
      out = RecipeBook::from_default_dirs().names();
    } catch (const Error&) {
    }
    for (const NamedBudget& b : named_budgets())
      if (std::find(out.begin(), out.end(), b.name) == out.end()) out.push_back(b.name);
    std::sort(out.begin(), out.end());
    return out;
  }();
  return names;
}

std::string store_calibration(const GgufFile& f, const ModelConfig& cfg, const std::string& model_path,
                              const KeyStats& stats, const std::vector<Recipe>& recipes, const std::string& path) {
  namespace fs = std::filesystem;
  const ModelKey key = key_of(f, cfg);
  std::string out = path;
  if (out.empty()) {
    const RecipeBook book = RecipeBook::from_default_dirs();
    if (const RecipeFile* mine = book.for_model(key)) out = mine->path;
  }
  std::string stem = fs::path(model_path).stem().string();
  if (out.empty()) {
    std::string lower = stem;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    fs::create_directories("recipes");
    out = "recipes/" + lower + ".json";
  }
  RecipeFile file;
  if (fs::exists(out)) {
    file = load_recipe_file(out);
    if (!(file.model == key))
      throw Error(ErrorCode::InvalidArgument, "recipe file '" + out + "' was fitted to " + file.describe_model() +
                                                  ", not to this model (" + key.describe() + ")");
  } else {
    file.version = RecipeFile::kVersion;
    file.model_name = f.has("general.name") ? f.get_string("general.name") : stem;
    if (file.model_name.empty()) file.model_name = stem;
    file.model_file = fs::path(model_path).filename().string();
    file.model = key;
  }
  file.key_stats = stats;
  for (const Recipe& r : recipes) {
    auto it = std::find_if(file.recipes.begin(), file.recipes.end(), [&](const Recipe& x) { return x.name == r.name; });
    if (it != file.recipes.end()) *it = r;
    else file.recipes.push_back(r);
  }
  save_recipe_file(file, out);
  return out;
}

}  // namespace tqkv::engine
