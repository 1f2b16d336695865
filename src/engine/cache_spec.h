// Cache specs: what a model's KV cache does in every layer, by name — a format from the
// traits table (format.h) or a variant of one, plus engine options. Every command that makes a
// model's cache (generate, perplexity, eval, passkey) takes one for --kv-cache-dtype. Grammar:
//
//   spec := base ('+' option)*
//   base := a traits-table name (f16, turboquant_4bit_nc, tq-k4v3, ...), a named recipe
//           (tq-4.36, ...; named_recipes()), or k<K>v<V> (= tq-k<K>v<V>, K, V in 2..8)
//   option :=
//     c              centre the keys (KeyCentring, model.h)
//     s              centre the keys and balance key/query channel scales (KeyCentring::scale_channels)
//     gauss|sphere   codebook law of the Mse codes
//     had|srht       rotation of the Mse codes
//     vu             values with the Uniform (min/max, vLLM) codec instead of Mse, same bits
//     vm             values with the Mse codec
//     raw            no norm correction
//     skip<N>        the first and last N layers in f16 (default: the format's, 2)
//     L<i>.<j>..=k<K>v<V>   those layers use K/V bits instead (same law/rotation/codecs)
//     only<i>.<j>..  only those layers compressed, every other one f16 (per-layer sensitivity)
//     w<N>           the compressed layers read their N most recent tokens from f16 copies
//                    (RecentWindow, recent_window.h)
//     sink<N>        ... and their first N positions (attention sinks, N <= 64) too
//     o<N>           study: N outlier key channels per (layer, kv head) at one more bit, each
//                    part its own rotation and norm (outlier_keys.h; quality only, simulated
//                    storage, bits counted as the split codec's)
//     wq<B>          the window's copies as B-bit Mse codes (k<B>v<B>, B in 4..8) instead of f16
//     fill<B>        a recent window as long as fits in B bits per element at the cache's
//                    capacity (instead of w<N>: the window grows with the context, the bits
//                    per element stay at most B)
//
#pragma once
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "model.h"
#include "outlier_keys.h"
#include "recent_window.h"

namespace tqkv::engine {

struct CacheSpec {
  std::string name;                  // as asked for
  std::string detail;                // resolved: per-layer formats and options
  std::vector<Format> layers;        // [n_layers]
  bool centre_keys = false;
  bool scale_channels = false;
  int recent_window = 0;  // w<N>: uncompressed copies of the N most recent tokens
  int sinks = 0;          // sink<N>: uncompressed copies of the first N tokens
  double fill_bits = 0;   // fill<B>: the window is as long as B bits per element allow (0: off)
  int outliers = 0;       // o<N>: outlier key channels (study, OutlierKeySplit)
  std::optional<Format> window_format;  // wq<B>: how the window is stored (none: f16)
  std::vector<int> split_key_bits;  // o<N>: [n_layers] each layer's b (0 = not split)
  ModelConfig model;      // the config the spec was resolved for
  double bits = 0;      // bits per element of the compressed layers' slots (metadata included)
  double bits_all = 0;  // the same averaged over every layer (boundary layers included)
  // Bits per element of the compressed layers with the f16 copies (recent window and sinks)
  // spread over a full cache of ctx positions (= bits without copies).
  double bits_at(int ctx) const { return bits + window_bits(ctx); }
  double bits_all_at(int ctx) const;
  double window_bits(int ctx) const;
  // The recent window of a cache of ctx positions: w<N>'s N, or what fill<B> leaves room for.
  int window_at(int ctx) const;
};

// Throws tqkv::Error(InvalidArgument) for a malformed spec or unknown name.
CacheSpec resolve_cache_spec(const std::string& spec, const ModelConfig& cfg);
// The same checks that need no model (names, syntax; not layer ranges), so that a command
// fails on a bad --kv-cache-dtype before it loads the model.
void check_cache_spec(const std::string& spec);
// One line for --help: the format names, the recipes and where the grammar is documented.
std::string cache_spec_help();
ContiguousCache make_spec_cache(const CacheSpec& spec, const ModelConfig& cfg, int capacity);

// The engine state a spec asks for next to its cache (fresh for every fresh cache): key
// centring and the recent window. Pass centring() and recent() to Model::forward.
class SpecState {
 public:
  SpecState(const CacheSpec& spec, const ContiguousCache& cache);
  KeyCentring* centring() { return centre_ ? &centring_ : nullptr; }
  RecentWindow* recent() { return recent_.get(); }

 private:
  bool centre_;
  KeyCentring centring_;
  std::unique_ptr<OutlierKeySplit> outliers_;
  std::unique_ptr<RecentWindow> recent_;
};

// The named recipes (name, spec) that the study selected; see docs/FORMAT.md.
const std::vector<std::pair<std::string, std::string>>& named_recipes();

}  // namespace tqkv::engine
