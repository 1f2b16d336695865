// The cache plan (cache_plan.h): decided once from a spec and a shape, the same for both devices'
// caches — which layers keep copies, which keep rings, and how long a step may be.
#include <gtest/gtest.h>

#include "tiny_config.h"

#include <climits>

#include "engine/cache/cache_plan.h"
#include "engine/cache/cache_spec.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

using testing_util::tiny_config;

TEST(CachePlan, PlainFormatsHaveNoCopiesNoRingsNoStepLimit) {
  const CachePlan p = plan_cache(resolve_cache_spec("turboquant_4bit_nc", tiny_config(6)), {4096, 8});
  EXPECT_EQ(p.capacity, 4096);
  EXPECT_EQ(p.max_seqs, 8);
  EXPECT_FALSE(p.copies());
  EXPECT_FALSE(p.rings());
  EXPECT_EQ(p.step_tokens, INT_MAX);
  EXPECT_EQ(p.fresh_step_tokens, INT_MAX);
  ASSERT_EQ(p.layers.size(), 6u);
  for (const LayerPlan& L : p.layers) EXPECT_FALSE(L.copies);
}

TEST(CachePlan, CopiesCoverTheCompressedLayersAndBoundTheStep) {
  // skip1: the first and last layer in f16, the others compressed.
  const CacheSpec spec = resolve_cache_spec("k4v3+skip1+w64+sink4+wq6", tiny_config(6));
  const CachePlan p = plan_cache(spec, {1024, 1});
  EXPECT_EQ(p.sinks, 4);
  EXPECT_EQ(p.window, 64);
  ASSERT_TRUE(p.window_format.has_value());
  EXPECT_EQ(p.step_tokens, CachePlan::kCopyStepTokens);
  // A fresh sequence's run reads none of the copies: any length in one step.
  EXPECT_EQ(p.fresh_step_tokens, INT_MAX);
  EXPECT_EQ(p.step_limit(0), INT_MAX);
  EXPECT_EQ(p.step_limit(1), CachePlan::kCopyStepTokens);
  // The window's ring: the window and one step; a longer fresh run leaves it its last positions.
  EXPECT_EQ(p.copy_ring_positions(), 64 + CachePlan::kCopyStepTokens);
  EXPECT_EQ(p.copy_ring_from(0, 100), 0);
  EXPECT_EQ(p.copy_ring_from(0, 1000), 1000 - 64 - CachePlan::kCopyStepTokens);
  EXPECT_EQ(p.copy_ring_from(700, 512), 700);
  for (int l = 0; l < 6; ++l) EXPECT_EQ(p.layers[l].copies, l > 0 && l < 5) << l;
}

TEST(CachePlan, SlidingLayersKeepRingsShorterThanTheCapacity) {
  const CachePlan p = plan_cache(resolve_cache_spec("f16", tiny_config(6, 3, 128)), {8192, 1});
  for (int l = 0; l < 6; ++l) {
    EXPECT_EQ(p.layers[l].window, (l + 1) % 3 ? 128 : 0);
    EXPECT_EQ(p.layers[l].ring, (l + 1) % 3 ? 128 + CacheSpec::kWindowStepTokens - 1 : 0) << l;
  }
  EXPECT_EQ(p.step_tokens, CacheSpec::kWindowStepTokens);
  EXPECT_EQ(p.fresh_step_tokens, CacheSpec::kWindowStepTokens);  // the rings bound a fresh run too
  // A ring no shorter than the capacity: every position kept, no step limit.
  const CachePlan small = plan_cache(resolve_cache_spec("f16", tiny_config(6, 3, 128)), {256, 1});
  EXPECT_FALSE(small.rings());
  EXPECT_EQ(small.step_tokens, INT_MAX);
  EXPECT_EQ(small.fresh_step_tokens, INT_MAX);
}

TEST(CachePlan, BadShapesAreErrors) {
  const CacheSpec spec = resolve_cache_spec("f16", tiny_config(2));
  EXPECT_THROW(plan_cache(spec, {0, 1}), Error);
  EXPECT_THROW(plan_cache(spec, {16, 0}), Error);
  CacheSpec short_spec = spec;
  short_spec.layers.pop_back();
  EXPECT_THROW(plan_cache(short_spec, {16, 1}), Error);
}

}  // namespace
}  // namespace tqkv::engine
