// Recipe files: named cache specs (tq-4.36, tq-3.375, ...) as versioned JSON data keyed by the
// model they were fitted to, so that a recipe is only ever applied to that model. The schema,
// the hash and the lookup order are in docs/FORMAT.md, "Recipe files"; the shipped files live in
// recipes/ at the top of the source tree.
//
// A recipe's per-layer bit widths come from a sensitivity scan of one model's layers
// (scripts/allocate_bits.py); on another model the same layer list is meaningless even when the
// layer count happens to fit. So a file names its model by architecture, shape and a hash of
// the weights, and RecipeBook hands a recipe out only on an exact match of all five.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tqkv::engine {

class GgufFile;

// What a recipe was fitted to. Two models are the same model when all five fields are equal.
struct ModelKey {
  std::string arch;       // GGUF general.architecture ("llama", "qwen2", ...)
  int n_layers = 0;       // {arch}.block_count
  int n_kv_heads = 0;     // {arch}.attention.head_count_kv (head_count when absent)
  int head_dim = 0;       // {arch}.attention.key_length (embedding_length / head_count when absent)
  std::string weights_hash;  // weights_hash() of the GGUF: "xxh3-64:" + 16 lower-case hex digits
  bool operator==(const ModelKey&) const = default;
  // "llama, 30 layers, 3 kv heads, head_dim 64, xxh3-64:0123456789abcdef"
  std::string describe() const;
};

// The hash of a GGUF's weights: "xxh3-64:" + XXH3_64bits (seed 0) as 16 lower-case hex digits,
// taken over, for every tensor in the order of the file's tensor table:
//   u64 name length, name bytes (no terminator),
//   u32 tensor type (ggml_type id), u32 number of dimensions, i64 per dimension (ne[0] first),
//   u64 data length in bytes, the data bytes,
// every integer little-endian. Metadata (tokenizer, chat template, names) is not hashed, so a
// file re-saved with other metadata keeps its recipes; a requantized one does not.
std::string weights_hash(const GgufFile& f);
// The key of a GGUF model: the four shape fields read as Model::load reads them, and
// weights_hash(f). Throws tqkv::Error(Format) when the metadata lacks them.
ModelKey model_key(const GgufFile& f);

// Key and query statistics of a model over a calibration text (optional in a file; for
// refitting centring or allocation without rerunning the model). Flat arrays of
// [n_layers * n_kv_heads * head_dim] floats indexed (layer * n_kv_heads + kv_head) * head_dim +
// channel: key_mean = mean of the post-RoPE keys, key_sq = mean of their squares, query_sq =
// mean of the squared post-RoPE queries of the query heads that share that kv head.
struct KeyStats {
  std::string source;      // the text and settings they were measured on
  int64_t tokens = 0;      // tokens averaged over (>= 1)
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;  // equal to the file's model key
  std::vector<float> key_mean, key_sq, query_sq;
  size_t size() const { return static_cast<size_t>(n_layers) * n_kv_heads * head_dim; }
};

// One named cache spec. name is "tq-" + [A-Za-z0-9._-]+; spec is a cache spec in the grammar of
// cache_spec.h (not resolved here: that needs the model's config).
struct Recipe {
  std::string name, spec;
  std::string fitted_on;  // what it was fitted on (scan, text, allocator budget); may be empty
  std::string note;       // why it is what it is; may be empty
  bool operator==(const Recipe&) const = default;
};

struct RecipeFile {
  static constexpr int kVersion = 1;  // the only schema version this build reads and writes
  int version = kVersion;
  std::string model_name;  // human name of the model, for messages
  std::string model_file;  // the GGUF file name it was fitted with (information only; may be empty)
  ModelKey model;
  std::vector<Recipe> recipes;
  std::optional<KeyStats> key_stats;
  std::string path;  // where it was loaded from ("" when built in memory); not saved
  // "SmolLM2-135M-Instruct (llama, 30 layers, ...)"
  std::string describe_model() const;
};

// Reads and validates a recipe file. Throws tqkv::Error(ErrorCode::Format) naming the path and
// the offending field ("recipe file 'x.json': recipes[2].name: ...") for invalid JSON, a version
// other than 1, a missing or mistyped field, an unknown field (keys starting with '_' are
// comments and ignored), duplicate or malformed recipe names, an empty spec, out-of-range shape
// numbers or key statistics of the wrong size, non-finite or (key_sq, query_sq) negative.
// Throws tqkv::Error(ErrorCode::InvalidArgument) when the file cannot be opened.
RecipeFile load_recipe_file(const std::string& path);
// Writes f (validated the same way: Error(Format) on anything load would reject) as pretty
// JSON in a stable field order, atomically: to a temporary file next to path, then renamed over
// it. load_recipe_file(path) gives f back (path aside). Throws Error(InvalidArgument) on I/O
// failure.
void save_recipe_file(const RecipeFile& f, const std::string& path);

// The directories searched for recipe files, highest precedence first: each entry of
// $TQKV_RECIPES (colon-separated), ./recipes, and recipes/ in the source tree tqkv was built
// from; only those that exist, each once (compared as canonical paths).
std::vector<std::string> recipe_dirs();

// Every recipe file of some directories, and the lookups the engine needs.
//
// Precedence: files of an earlier directory before those of a later one, files of one
// directory in name order, and a file given to add_file before all of them (so --recipe FILE
// overrides). When several files are for the same model, their recipes are merged and the
// first file with a name wins.
class RecipeBook {
 public:
  RecipeBook() = default;
  // Loads every *.json file in dirs (a missing directory is skipped; a corrupt file throws
  // load_recipe_file's error, naming the file — it is never skipped silently).
  explicit RecipeBook(const std::vector<std::string>& dirs);
  // RecipeBook(recipe_dirs()).
  static RecipeBook from_default_dirs();

  // Adds a file ahead of every file already in the book.
  void add_file(RecipeFile f);

  const std::vector<RecipeFile>& files() const { return files_; }
  const std::vector<std::string>& dirs() const { return dirs_; }
  // The first file fitted to exactly this model (arch, shape and weights hash), or nullptr.
  const RecipeFile* for_model(const ModelKey& key) const;
  // The recipe of that name fitted to exactly this model.
  std::optional<Recipe> find(const ModelKey& key, std::string_view name) const;
  // Every recipe name in any file, sorted, each once (for --help and "did you mean").
  std::vector<std::string> names() const;
  // Why find(key, name) finds nothing, as a message for the user ("" when it finds it): the
  // name belongs to other models (and which), or this model has recipes but not that one, or
  // no file has the name at all.
  std::string why_not(const ModelKey& key, std::string_view name) const;

 private:
  std::vector<RecipeFile> files_;
  std::vector<std::string> dirs_;
};

}  // namespace tqkv::engine
