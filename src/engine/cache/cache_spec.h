// Cache specs: what a model's KV cache does in every layer, by name — a format from the
// traits table (format.h) or a variant of one, plus options. Every command that makes a
// model's cache (generate, perplexity, eval, passkey) takes one for --kv-cache-dtype; the cache
// layer (kv_cache.h) of every device implements what it asks for. Grammar:
//
//   spec := base ('+' option)*
//   base := a traits-table name (f16, turboquant_4bit_nc, tq-k4v3, ...), a recipe fitted to the
//           model (tq-4.375, ...; recipes/*.json, recipe.h), or k<K>v<V> (= tq-k<K>v<V>, K, V in 1..8)
//   option :=
//     c              centre the keys by the model's key statistics (key_centring.h)
//     s              centre the keys and balance key/query channel scales
//     gauss|sphere   codebook law of the Mse codes
//     had|srht       rotation of the Mse codes
//     vu             values with the Uniform (min/max, vLLM) codec instead of Mse, same bits
//     vm             values with the Mse codec
//     raw            no norm correction
//     skip<N>        the first and last N layers in f16 (default: the format's, 2)
//     L<i>.<j>..=k<K>v<V>   those layers use K/V bits instead (same law/rotation/codecs)
//     only<i>.<j>..  only those layers compressed, every other one f16 (per-layer sensitivity)
//     w<N>           the compressed layers read their N most recent tokens from f16 copies
//     sink<N>        ... and their first N positions (attention sinks, N <= 64) too
//     wq<B>          the window's copies as B-bit Mse codes (k<B>v<B>, B in 4..8) instead of f16
//     fill<B>        a recent window as long as fits in B bits per element at the cache's
//                    capacity (instead of w<N>: the window grows with the context, the bits
//                    per element stay at most B)
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/model_config.h"
#include "engine/cache/recipe.h"
#include "tqkv/format.h"

namespace tqkv::engine {

// Memory of a cache's positions: the slots of every layer and the copies (sinks, window) next
// to the compressed ones. The one accounting that generate, perplexity, eval and the server
// report.
struct CacheBytes {
  size_t slots = 0;
  size_t copies = 0;
  int64_t positions = 0;
  size_t total() const { return slots + copies; }
  double per_token() const { return positions > 0 ? static_cast<double>(total()) / positions : 0.0; }
};

// Where a spec's recipe names and key statistics come from: the recipe file fitted to the
// model (recipe.h), or nothing for a model without one.
struct SpecSources {
  std::vector<std::pair<std::string, std::string>> recipes;  // name -> spec
  std::shared_ptr<const KeyStats> key_stats;
  // Says why a recipe name is not available for this model (it was fitted to another), or "".
  std::function<std::string(const std::string&)> why_not;
  // The names in `recipes` that come from the rule (recipe_fit.h rule_recipe: a named budget on a
  // model without a calibrated recipe of that name), not from a recipe file.
  std::vector<std::string> rule_based;
  bool is_rule_based(const std::string& name) const;
};

struct CacheSpec {
  std::string name;                  // as asked for
  std::string detail;                // resolved: per-layer formats and options
  std::vector<Format> layers;        // [n_layers]
  bool centre_keys = false;
  bool scale_channels = false;
  int recent_window = 0;  // w<N>: uncompressed copies of the N most recent tokens
  int sinks = 0;          // sink<N>: uncompressed copies of the first N tokens
  double fill_bits = 0;   // fill<B>: the window is as long as B bits per element allow (0: off)
  std::optional<Format> window_format;  // wq<B>: how the window is stored (none: f16)
  std::shared_ptr<const KeyStats> key_stats;  // set when centre_keys
  ModelConfig model;      // the config the spec was resolved for
  double bits = 0;      // bits per element of the compressed layers' slots (metadata included)
  double bits_all = 0;  // the same averaged over every layer (boundary layers included)

  static constexpr int kMaxSinks = 64;

  // Bits per element of the compressed layers with the copies (recent window and sinks)
  // spread over a full cache of ctx positions (= bits without copies).
  double bits_at(int ctx) const { return bits + window_bits(ctx); }
  double bits_all_at(int ctx) const;
  double window_bits(int ctx) const;
  // The recent window of a cache of ctx positions: w<N>'s N, or what fill<B> leaves room for;
  // at most the shortest sliding window of the model's layers.
  int window_at(int ctx) const;
  // Positions a sliding-window layer (ModelConfig::layer_window) keeps in a cache of
  // `capacity` positions: a ring of its window plus the most tokens one step may append
  // (kWindowStepTokens - 1), or 0 for all positions — full-attention layers, models without a
  // full-attention layer, rings no smaller than the capacity. Copies (sinks, recent window) keep
  // the rings: the window copy is no longer than the layer's window (window_at) and a sink is
  // read only while it is inside it. bytes() counts this many.
  static constexpr int kWindowStepTokens = 256;
  int64_t ring_positions(int layer, int capacity) const;
  // Bytes of a sequence holding `held` positions in a cache of `capacity` positions.
  CacheBytes bytes(int64_t held, int capacity) const;
};

// Throws tqkv::Error(InvalidArgument) for a malformed spec, an unknown name, a recipe fitted to
// another model, or centring without key statistics for the model.
CacheSpec resolve_cache_spec(const std::string& spec, const ModelConfig& cfg, const SpecSources& sources = {});
// The same checks that need no model (names, syntax; not layer ranges or statistics), so that a
// command fails on a bad --kv-cache-dtype before it loads the model. known_recipes: every recipe
// name of every recipe file.
void check_cache_spec(const std::string& spec, const std::vector<std::string>& known_recipes = {});
// One line for --help: the format names, the recipes and where the grammar is documented.
std::string cache_spec_help(const std::vector<std::string>& known_recipes = {});

}  // namespace tqkv::engine
