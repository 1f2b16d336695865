// A cache's plan: what every layer of a model's cache does, decided once from its spec
// (cache_spec.h) and shape, the same for every device. The CPU and CUDA caches (device/) build
// storage and run kernels for a plan; neither decides any of it again.
#pragma once
#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>
#include <vector>

#include "engine/cache/cache_spec.h"
#include "engine/core/batch.h"

namespace tqkv::engine {

// Sizes of a cache to make: positions per sequence and how many sequences it serves at once.
struct CacheShape {
  int capacity = 0;
  int max_seqs = 1;
};

struct LayerPlan {
  Format format;       // of its slots
  int window = 0;      // its sliding window (0: it attends to every position)
  int64_t ring = 0;    // positions its slots keep, a ring (0: every position, up to the capacity)
  bool copies = false;  // sinks and recent window kept beside its slots (the compressed layers)
};

struct CachePlan {
  // Tokens of one sequence a step may append when the copies keep a ring of the recent window:
  // the ring holds the window plus one step.
  static constexpr int kCopyStepTokens = 512;

  int capacity = 0, max_seqs = 1;
  int sinks = 0;   // first positions copied (f16)
  int window = 0;  // recent positions copied (f16, or window_format)
  std::optional<Format> window_format;
  // The most tokens of one sequence one step may append to a sequence that holds some already:
  // the copies' ring (kCopyStepTokens) and the sliding-window layers' rings
  // (CacheSpec::kWindowStepTokens) bound it; the model runs longer batches in pieces.
  int step_tokens = INT_MAX;
  // The same for a fresh sequence (it holds nothing yet): a fresh run's queries attend to the
  // run's own keys and values as computed, never to the cache (docs/ENGINE.md, "Fresh
  // prompts"), so the copies do not bound it (they keep the run's last positions); only the
  // sliding-window layers' rings do.
  int fresh_step_tokens = INT_MAX;
  std::vector<LayerPlan> layers;  // [n_layers]

  bool copies() const { return sinks > 0 || window > 0; }
  // Positions the recent window's ring of copies holds: the window and one step, so that every
  // query of a step finds its window there (0 without a window; RecentWindow's window + max_batch).
  int64_t copy_ring_positions() const { return window > 0 ? int64_t{window} + kCopyStepTokens : 0; }
  // The first position of a run [pos0, pos0 + count) the window's ring keeps: the whole run, or
  // the last copy_ring_positions() of a longer (fresh) run, whose queries read none of them.
  int64_t copy_ring_from(int64_t pos0, int count) const {
    return std::max(pos0, pos0 + count - copy_ring_positions());
  }
  bool rings() const;
  // The bound on a run of one sequence starting at pos0 (a fresh run at 0).
  int step_limit(int64_t pos0) const { return pos0 == 0 ? fresh_step_tokens : step_tokens; }
  // Throws tqkv::Error(Capacity) for a run longer than its step_limit (Model::forward splits
  // longer runs; the caches check before anything is written).
  void check_steps(const std::vector<Batch::Run>& runs) const;
};

// Throws tqkv::Error(InvalidArgument) for a capacity or sequence count below 1 or a spec without a
// format for every layer.
CachePlan plan_cache(const CacheSpec& spec, const CacheShape& shape);

}  // namespace tqkv::engine
