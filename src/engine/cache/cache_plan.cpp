#include "engine/cache/cache_plan.h"

#include <algorithm>

#include "tqkv/error.h"

namespace tqkv::engine {

bool CachePlan::rings() const {
  return std::any_of(layers.begin(), layers.end(), [](const LayerPlan& L) { return L.ring > 0; });
}

CachePlan plan_cache(const CacheSpec& spec, const CacheShape& shape) {
  if (shape.capacity < 1 || shape.max_seqs < 1)
    throw Error(ErrorCode::InvalidArgument, "cache: capacity and sequence count must be at least 1");
  if (static_cast<int>(spec.layers.size()) != spec.model.n_layers)
    throw Error(ErrorCode::InvalidArgument, "cache: the spec has no format for every layer");
  CachePlan p;
  p.capacity = shape.capacity;
  p.max_seqs = shape.max_seqs;
  p.sinks = spec.sinks;
  p.window = spec.window_at(shape.capacity);
  p.window_format = spec.window_format;
  for (int l = 0; l < spec.model.n_layers; ++l) {
    const Format& f = spec.layers[l];
    p.layers.push_back({f, spec.model.window(l), spec.ring_positions(l, shape.capacity), p.copies() && f.compressed()});
  }
  if (p.copies()) p.step_tokens = CachePlan::kCopyStepTokens;
  if (p.rings()) {
    p.step_tokens = std::min(p.step_tokens, CacheSpec::kWindowStepTokens);
    p.fresh_step_tokens = CacheSpec::kWindowStepTokens;
  }
  return p;
}

}  // namespace tqkv::engine
