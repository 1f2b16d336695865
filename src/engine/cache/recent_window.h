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
// Attention sinks (the option +sink<S>): the first S positions (the BOS token and its
// neighbours, to which many heads send most of their attention whatever the query) are kept
// as f16 copies too, for good: a query reads [0, S) from them, [S, p - N] from the compressed
// slots and (p - N, p] from the window, three parts merged by log-sum-exp. Either part may be
// absent (window 0 or sinks 0), not both.
//
// Memory: (N + S) * 2 * head_dim * 2 bytes per compressed (layer, kv head) on top of the cache
// (plus max_batch positions of prefill workspace); docs/FORMAT.md counts the N + S positions.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "tqkv/attention.h"
#include "tqkv/contiguous_cache.h"

namespace tqkv::engine {

// The cache the copies sit beside: its layers' formats (the compressed ones get copies), its
// heads and the rotation seed of its codecs (a window_format's codec takes the same).
struct CopiedLayers {
  std::vector<Format> formats;  // [n_layers]
  int n_kv_heads = 1;
  int head_dim = 0;
  uint64_t seed = kDefaultSeed;
};

// The compressed part of one layer's attention for the queries RecentWindow::attention was
// given: it attends them with these params (cuts and lse set) and writes out.
using CompressedPart = std::function<void(const AttentionParams& params, float* out)>;

class RecentWindow {
 public:
  static constexpr int kMaxSinks = 64;
  // Throws tqkv::Error(InvalidArgument) for a negative window or sink count, both 0, more than
  // kMaxSinks sinks or
  // max_batch < 1.
  // window_format: how the window's copies are stored (default f16; an 8-bit Mse pair costs
  // half as much for a near-f16 window). Sinks are always f16.
  RecentWindow(const CopiedLayers& main, int window, int max_batch = 512, int sinks = 0,
               const Format* window_format = nullptr);

  int window() const { return window_; }
  int sinks() const { return sinks_; }
  int max_batch() const { return max_batch_; }
  bool covers(int layer) const { return covered_.at(layer) != 0; }

  // Mirrors what was just written to the main cache for one layer (same positions, same
  // centred keys). Positions must follow on from the previous call; a batch of more than
  // max_batch tokens throws (Model::forward splits its input instead) unless it is a fresh run
  // (pos0 0, whose queries attend to their own keys and values, not to the copies: the ring
  // keeps its last window + max_batch positions), so does a sink element beyond the fp16 range
  // (tqkv::Error(Overflow), nothing written).
  void write(int layer, int64_t pos0, int n, const float* k, const float* v);

  // Attention of n queries at pos0.. for one covered layer: the sinks' [0, S), the compressed
  // cache's positions [S, p - window] (computed by main), the window's (p - window, p], merged.
  //
  // With k_new and v_new ([n, n_kv_heads, head_dim], the keys and values just written, as the
  // layer computed them): the query at p reads its own key and value from them, exactly, and
  // every part stops at p - 1 (the main cache at p - max(window, 1)); its own position is folded
  // into the merge by its score. The query's own token is the one it attends to most sharply,
  // and a decode step then reads nothing the same step's store writes (the GPU runs the store
  // beside the decode, docs/ENGINE.md "The newest position").
  void attention(const CompressedPart& main, int layer, const float* q, int n, int64_t pos0,
                 const AttentionParams& params, float* out, const float* k_new = nullptr,
                 const float* v_new = nullptr);

  // Makes this (empty) window hold what src holds for a sequence of its first n positions:
  // the sinks and the window copies of [n - window, n). Returns false, changing nothing, when
  // src no longer holds those copies (it has moved on more than max_batch positions) or the
  // two differ in layout.
  bool copy_prefix(const RecentWindow& src, int64_t n);

  // Bytes of one window / one sink position of every covered (layer, kv head).
  size_t bytes_per_window_position() const;
  size_t bytes_per_sink_position() const;
  // Bytes of all copies once the cache holds `held` positions (the prefill workspace not counted).
  size_t copy_bytes(int64_t held) const;

 private:
  // The sink part of attention for rows [n, n_q_heads] into out/lse (scalar: S is a handful).
  // newest_out: the sinks stop at p - 1 (the query's own position is folded in apart).
  void sink_attention(int layer, const float* q, int n, int64_t pos0, const AttentionParams& params, float* out,
                      float* lse, bool newest_out) const;
  // The part of each query's own position: its key and value as computed, one key.
  void newest_attention(const float* q, int n, int64_t pos0, const AttentionParams& params, const float* k_new,
                        const float* v_new, float* out, float* lse) const;

  int window_, max_batch_, sinks_;
  int n_kv_heads_, head_dim_;
  std::vector<float> sink_k_, sink_v_;  // [n_layers][n_kv_heads][sinks][head_dim], fp16-rounded
  std::vector<float> out_sink_, lse_sink_;
  std::vector<uint8_t> covered_;  // [n_layers]
  ContiguousCache copies_;        // f16, capacity window + max_batch (unused when window is 0)
  std::vector<float> out_recent_, lse_main_, lse_recent_, out_new_, lse_new_;
};

}  // namespace tqkv::engine
