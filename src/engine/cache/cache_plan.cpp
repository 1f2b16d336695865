#include "engine/cache/cache_plan.h"

#include <algorithm>
#include <string>

#include "tqkv/error.h"

namespace tqkv::engine {

bool CachePlan::rings() const {
  return std::any_of(layers.begin(), layers.end(), [](const LayerPlan& L) { return L.ring > 0; });
}

void CachePlan::check_steps(const std::vector<Batch::Run>& runs) const {
  for (const Batch::Run& r : runs)
    if (r.count > step_limit(r.pos0))
      throw Error(ErrorCode::Capacity, "cache: " + std::to_string(r.count) + " tokens of one sequence in one step; " +
                                           "this cache takes at most " + std::to_string(step_limit(r.pos0)) +
                                           (r.pos0 == 0 ? " of a fresh sequence" : " after the first step"));
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
