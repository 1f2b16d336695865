// An uncompressed window of the most recent tokens next to a compressed cache (issue 6, the
// cache-spec option +w<N>): a query at position p reads the keys and values of (p - N, p]
// from f16 copies and only the older positions from the compressed slots, so the tokens a
// model attends to most sharply (its neighbours) lose nothing.
//
// The compressed cache still holds every position (the window is a copy, not a move), and
// the copies live in an f16 ring of N + max_batch positions, so that every query of a prefill
// batch of up to max_batch tokens still finds its N predecessors. The two parts are merged
// exactly by their log-sum-exps (AttentionParams::exclude_recent / window / lse). Only the
// compressed layers get a window; uncompressed layers attend as usual.
//
// Memory: N * 2 * head_dim * 2 bytes per compressed (layer, kv head) on top of the cache
// (plus max_batch positions of prefill workspace); docs/FORMAT.md counts the N positions.
#pragma once
#include <cstdint>
#include <vector>

#include "tqkv/attention.h"
#include "tqkv/contiguous_cache.h"

namespace tqkv::engine {

class RecentWindow {
 public:
  // Throws tqkv::Error(InvalidArgument) for window < 1 or max_batch < 1.
  RecentWindow(const ContiguousCache& main, int window, int max_batch = 512);

  int window() const { return window_; }
  int max_batch() const { return max_batch_; }
  bool covers(int layer) const { return covered_.at(layer) != 0; }

  // Mirrors what was just written to the main cache for one layer (same positions, same
  // centred keys). Positions must follow on from the previous call; a batch of more than
  // max_batch tokens throws (Model::forward splits its input instead).
  void write(int layer, int64_t pos0, int n, const float* k, const float* v);

  // Attention of n queries at pos0.. for one covered layer: the main cache's positions up to
  // p - window, the window's (p - window, p], merged.
  void attention(const ContiguousCache& main, int layer, const float* q, int n, int64_t pos0,
                 const AttentionParams& params, float* out);

  // Bytes of the window's copies for one position of every covered (layer, kv head).
  size_t bytes_per_window_position() const;

 private:
  int window_, max_batch_;
  std::vector<uint8_t> covered_;  // [n_layers]
  ContiguousCache copies_;        // f16, capacity window + max_batch
  std::vector<float> out_recent_, lse_main_, lse_recent_;
};

}  // namespace tqkv::engine
