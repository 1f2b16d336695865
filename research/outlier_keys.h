// Outlier key channels at one more bit (issue 6, the cache-spec option +o<N>) — a quality
// study, not a cache format: it answers whether splitting each key into its N highest-energy
// channels and the rest, and coding the two parts as separate Mse vectors (own rotation, own
// fp16 norm) at b + 1 and b bits, beats spending the same bits elsewhere.
//
// The split codec really encodes and decodes (SlotCodec on each part); what is simulated is
// only the storage: the decoded key goes into the layer's cache through 8-bit Mse key codes,
// whose error is ~1/64 of the 5-bit error and negligible next to the b-bit one.
// CacheSpec counts the split's bits (b bits per channel + N extra bits + two fp16 norms),
// not the 8-bit storage. The channels are chosen per (layer, kv head) from the first batch a
// cache sees (the prompt), like key centring's means, by key energy after centring; the two
// channels of a RoPE pair are chosen together (RoPE moves energy within a pair).
#pragma once
#include <deque>
#include <memory>
#include <vector>

#include "engine/model_config.h"
#include "tqkv/codec.h"

namespace tqkv::research {

using engine::ModelConfig;

class OutlierKeySplit {
 public:
  // key_bits: [n_layers], the b of each layer (0 = the layer is not split). Throws
  // tqkv::Error(InvalidArgument) unless 2 <= n < head_dim, n even, and every b in 0 or 1..7.
  OutlierKeySplit(const ModelConfig& cfg, int n, std::vector<int> key_bits);

  int channels() const { return n_; }
  // Replaces the n keys [n, n_kv_heads, head_dim] of a layer by their split-coded
  // reconstruction (choosing the channels first, from these keys, on the layer's first call).
  void apply(int layer, int n, float* k);
  // The chosen channels of (layer, head), ascending; empty before the layer's first call.
  std::vector<int> outliers(int layer, int head) const;

 private:
  const SlotCodec& codec(int bits, int dim);

  ModelConfig cfg_;
  int n_;
  std::vector<int> key_bits_;
  std::vector<std::vector<uint8_t>> is_outlier_;  // [layer * heads + head][head_dim]
  std::deque<SlotCodec> codecs_;
};

}  // namespace tqkv::research
