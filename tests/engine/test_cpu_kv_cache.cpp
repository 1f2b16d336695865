// The CPU engine's cache on the paged pool (cpu_kv_cache.h): memory follows the tokens held,
// prefix sharing shares pages instead of copying them, and nothing is held past the capacity.
#include <gtest/gtest.h>

#include "tiny_config.h"

#include "../common/test_data.h"

#include <vector>

#include "engine/cache/cache_spec.h"
#include "engine/device/cpu_kv_cache.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

using testing_util::gaussian;

using testing_util::tiny_config;

// One step of n tokens of seq at pos0 through every layer, random q/k/v from seed; returns the
// last layer's attention output [n, n_heads, head_dim].
std::vector<float> step(CpuKvCache& cache, int64_t seq, int64_t pos0, int n, uint64_t seed) {
  const ModelConfig& m = cache.spec().model;
  Batch b;
  const std::vector<int32_t> ids(n, 1);
  b.add(seq, ids.data(), n, pos0, false);
  cache.check(b);
  const size_t q_n = static_cast<size_t>(n) * m.n_heads * m.head_dim, kv_n = static_cast<size_t>(n) * m.n_kv_heads * m.head_dim;
  std::vector<float> out(q_n);
  for (int l = 0; l < m.n_layers; ++l) {
    auto q = gaussian(q_n, seed + 3 * l), k = gaussian(kv_n, seed + 3 * l + 1), v = gaussian(kv_n, seed + 3 * l + 2);
    cache.attend(l, b, q.data(), k.data(), v.data(), out.data());
  }
  return out;
}

int pages_for(int64_t tokens) { return static_cast<int>((tokens + CpuKvCache::kBlockSize - 1) / CpuKvCache::kBlockSize); }

TEST(CpuKvCache, PagesFollowTheTokensHeld) {
  CpuKvCache cache(resolve_cache_spec("tq-k4v2", tiny_config(3)), {4096, 4});
  const int total = cache.pages().free_blocks();
  EXPECT_EQ(total, 4 * pages_for(4096));  // address space for every sequence at capacity
  const int64_t a = cache.add_sequence(), b = cache.add_sequence(), c = cache.add_sequence();
  step(cache, a, 0, 10, 1);
  step(cache, b, 0, 70, 2);
  step(cache, c, 0, 130, 3);
  EXPECT_EQ(total - cache.pages().free_blocks(), pages_for(10) + pages_for(70) + pages_for(130));
  step(cache, a, 10, 60, 4);  // a: 70 tokens, a second page
  EXPECT_EQ(total - cache.pages().free_blocks(), 2 * pages_for(70) + pages_for(130));
  cache.free_sequence(c);
  EXPECT_EQ(total - cache.pages().free_blocks(), 2 * pages_for(70));
  cache.free_sequence(a);
  cache.free_sequence(b);
  EXPECT_EQ(cache.pages().free_blocks(), total);
}

// copy_prefix shares the source's pages (a partly filled last one too) and the copies' state;
// the target then goes on exactly as the source did with the same inputs, bit for bit, and the
// source is unchanged by the target's writes.
TEST(CpuKvCache, CopyPrefixSharesPagesAndGoesOnExactly) {
  for (const char* spec : {"tq-k4v2", "tq-k4v2+sink2+w16"}) {
    CpuKvCache cache(resolve_cache_spec(spec, tiny_config(3)), {1024, 4});
    const int64_t src = cache.add_sequence(), dst = cache.add_sequence();
    step(cache, src, 0, 90, 10);
    const int free_before = cache.pages().free_blocks();
    ASSERT_TRUE(cache.copy_prefix(src, dst, 90)) << spec;
    EXPECT_EQ(cache.seq_len(dst), 90);
    EXPECT_EQ(cache.pages().free_blocks(), free_before) << spec << ": pages shared, not copied";
    const auto from_dst = step(cache, dst, 90, 10, 20);  // copies the shared page 1 on its first write
    EXPECT_EQ(cache.pages().free_blocks(), free_before - 1) << spec;
    const auto from_src = step(cache, src, 90, 10, 20);
    EXPECT_EQ(from_dst, from_src) << spec;
    std::vector<float> ks(static_cast<size_t>(100) * 2 * 64), kd(ks.size());
    cache.read(1, src, 0, 100, true, ks.data());
    cache.read(1, dst, 0, 100, true, kd.data());
    EXPECT_EQ(ks, kd) << spec;
  }
}

TEST(CpuKvCache, NothingPastTheCapacity) {
  CpuKvCache cache(resolve_cache_spec("tq-k4v2", tiny_config(2)), {100, 2});
  const int64_t a = cache.add_sequence();
  step(cache, a, 0, 60, 1);
  const int free_before = cache.pages().free_blocks();
  EXPECT_THROW(step(cache, a, 60, 41, 2), Error);
  EXPECT_EQ(cache.seq_len(a), 60);
  EXPECT_EQ(cache.pages().free_blocks(), free_before);
  step(cache, a, 60, 40, 2);  // exactly the capacity
  EXPECT_EQ(cache.seq_len(a), 100);
  EXPECT_THROW(step(cache, a, 100, 1, 3), Error);
  cache.add_sequence();
  EXPECT_THROW(cache.add_sequence(), Error);  // max_seqs
}

}  // namespace
}  // namespace tqkv::engine
