#include <gtest/gtest.h>

#include "../common/test_data.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "tqkv/contiguous_cache.h"
#include "tqkv/error.h"

namespace tqkv {
namespace {

using testing_util::gaussian;

TEST(BoundaryLayers, DefaultSkipsTwoCappedAtHalf) {
  const Format& tq = find_format("turboquant_4bit_nc");
  auto f = boundary_layer_formats(30, tq);
  EXPECT_EQ(f[0].name(), "f16");
  EXPECT_EQ(f[1].name(), "f16");
  EXPECT_EQ(f[2].name(), "turboquant_4bit_nc");
  EXPECT_EQ(f[27].name(), "turboquant_4bit_nc");
  EXPECT_EQ(f[28].name(), "f16");
  EXPECT_EQ(f[29].name(), "f16");
  auto g = boundary_layer_formats(3, tq);  // capped at 3 / 2 = 1
  EXPECT_EQ(g[0].name(), "f16");
  EXPECT_EQ(g[1].name(), "turboquant_4bit_nc");
  EXPECT_EQ(g[2].name(), "f16");
  auto h = boundary_layer_formats(6, tq, 0);
  for (const auto& x : h) EXPECT_EQ(x, tq);
  auto u = boundary_layer_formats(6, find_format("f16"));
  for (const auto& x : u) EXPECT_EQ(x.name(), "f16");
}

TEST(ContiguousCache, WriteDecodeAndWindow) {
  ContiguousCacheConfig cfg;
  cfg.n_layers = 2;
  cfg.n_kv_heads = 3;
  cfg.head_dim = 64;
  cfg.capacity = 5;
  cfg.layer_formats = {find_format("f32"), find_format("tq-k4v4")};
  ContiguousCache cache(cfg);
  const auto k = gaussian(7 * 3 * 64, 1), v = gaussian(7 * 3 * 64, 2);
  cache.write(0, 0, 4, k.data(), v.data());
  cache.write(1, 0, 4, k.data(), v.data());
  EXPECT_EQ(cache.seq_len(), 4);
  std::vector<float> out(4 * 3 * 64);
  cache.decode(0, 0, 4, true, out.data());
  EXPECT_EQ(std::vector<float>(k.begin(), k.begin() + out.size()), out);  // f32 layer is exact
  cache.write(0, 4, 3, k.data() + 4 * 3 * 64, v.data() + 4 * 3 * 64);     // wraps: evicts 0, 1
  EXPECT_EQ(cache.first_pos(), 2);
  EXPECT_EQ(cache.seq_len(), 7);
  std::vector<float> one(3 * 64);
  cache.decode(0, 6, 1, false, one.data());
  EXPECT_EQ(std::vector<float>(v.begin() + 6 * 3 * 64, v.end()), one);
  EXPECT_THROW(cache.decode(0, 1, 1, true, one.data()), Error);
  EXPECT_EQ(cache.bytes_per_token(), 3 * (512 + find_format("tq-k4v4").slot_bytes(64)));
}

// Appended one position at a time, the ring holds exactly its capacity: the position one past
// it is evicted at once (its slot is the newest's), and every held one decodes as written.
TEST(ContiguousCache, TheRingHoldsExactlyItsCapacity) {
  ContiguousCacheConfig cfg;
  cfg.n_layers = 1;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.capacity = 4;
  cfg.layer_formats = {find_format("f32")};
  ContiguousCache cache(cfg);
  const size_t row = 2 * 64;
  const auto k = gaussian(10 * row, 5), v = gaussian(10 * row, 6);
  std::vector<float> out(row);
  for (int t = 0; t < 10; ++t) {
    cache.write(0, t, 1, k.data() + t * row, v.data() + t * row);
    EXPECT_EQ(cache.first_pos(), std::max(0, t + 1 - cfg.capacity)) << "after writing " << t;
    for (int p = cache.first_pos(); p <= t; ++p) {
      cache.decode(0, p, 1, true, out.data());
      EXPECT_EQ(std::vector<float>(k.begin() + p * row, k.begin() + (p + 1) * row), out) << p << " after " << t;
    }
    if (cache.first_pos() > 0) {
      EXPECT_THROW(cache.decode(0, cache.first_pos() - 1, 1, true, out.data()), Error);
    }
  }
}

TEST(ContiguousCache, BadWritesChangeNothing) {
  ContiguousCacheConfig cfg;
  cfg.n_layers = 1;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.capacity = 4;
  ContiguousCache cache(cfg);
  auto k = gaussian(3 * 2 * 64, 3), v = gaussian(3 * 2 * 64, 4);
  cache.write(0, 0, 1, k.data(), v.data());
  std::vector<float> before(2 * 64), after(2 * 64);
  cache.decode(0, 0, 1, true, before.data());
  k[2 * 64 + 7] = std::numeric_limits<float>::quiet_NaN();  // token 1 of the batch is bad
  EXPECT_THROW(cache.write(0, 0, 3, k.data(), v.data()), Error);
  EXPECT_EQ(cache.seq_len(), 1);
  cache.decode(0, 0, 1, true, after.data());
  EXPECT_EQ(before, after);
  EXPECT_THROW(cache.write(1, 1, 1, k.data(), v.data()), Error);
  EXPECT_THROW(cache.write(0, 3, 1, k.data(), v.data()), Error);
  EXPECT_THROW(cache.write(0, 1, 5, k.data(), v.data()), Error);
  EXPECT_THROW(cache.evict_oldest(2), Error);
  ContiguousCacheConfig bad = cfg;
  bad.layer_formats = {find_format("f16"), find_format("f16")};
  EXPECT_THROW(ContiguousCache{bad}, Error);
}

// Two layers (one f16 boundary layer, one turboquant_k3v4_nc) of 2 heads × 64, 16 positions.
ContiguousCacheConfig two_layers_of_16() {
  ContiguousCacheConfig cfg;
  cfg.n_layers = 2;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.capacity = 16;
  cfg.layer_formats = boundary_layer_formats(2, find_format("turboquant_k3v4_nc"), 0);
  return cfg;
}

// copy_positions (prefix sharing): the copy holds exactly the asked positions, slot for slot,
// and goes on from there; a different layout or positions not held change nothing.
TEST(ContiguousCache, CopyPositionsCopiesSlotsExactly) {
  const ContiguousCacheConfig cfg = two_layers_of_16();
  ContiguousCache src(cfg), dst(cfg);
  const auto k = gaussian(12 * 2 * 64, 7), v = gaussian(12 * 2 * 64, 8);
  for (int l = 0; l < 2; ++l) src.write(l, 0, 12, k.data(), v.data());
  dst.copy_positions(src, 0, 9);
  EXPECT_EQ(dst.seq_len(), 9);
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h)
      for (int64_t p = 0; p < 9; ++p)
        EXPECT_EQ(std::memcmp(dst.slot(l, h, p), src.slot(l, h, p), src.slot_bytes(l)), 0);
  for (int l = 0; l < 2; ++l) dst.write(l, 9, 3, k.data() + 9 * 2 * 64, v.data() + 9 * 2 * 64);
  std::vector<float> a(12 * 2 * 64), b(a.size());
  src.decode(1, 0, 12, true, a.data());
  dst.decode(1, 0, 12, true, b.data());
  EXPECT_EQ(a, b);
  ContiguousCache other(cfg);
  EXPECT_THROW(other.copy_positions(src, 0, 13), Error);
  ContiguousCacheConfig small = cfg;
  small.capacity = 8;
  ContiguousCache narrow(small);
  EXPECT_THROW(narrow.copy_positions(src, 0, 4), Error);
  EXPECT_EQ(other.seq_len(), 0);
  EXPECT_EQ(narrow.seq_len(), 0);
}

// skip_to moves the window's start past everything held: the next write appends there and the
// positions before it are gone; it never goes back.
TEST(ContiguousCache, SkipToStartsTheWindowLater) {
  ContiguousCache cache(two_layers_of_16());
  const auto k = gaussian(12 * 2 * 64, 7), v = gaussian(12 * 2 * 64, 8);
  for (int l = 0; l < 2; ++l) cache.write(l, 0, 4, k.data(), v.data());
  EXPECT_THROW(cache.skip_to(3), Error);
  cache.skip_to(30);
  EXPECT_EQ(cache.first_pos(), 30);
  EXPECT_EQ(cache.seq_len(), 30);
  std::vector<float> out(12 * 2 * 64), want(out.size());
  EXPECT_THROW(cache.decode(0, 0, 1, true, out.data()), Error);
  EXPECT_THROW(cache.write(0, 31, 1, k.data(), v.data()), Error);  // no gaps
  for (int l = 0; l < 2; ++l) cache.write(l, 30, 12, k.data(), v.data());
  EXPECT_EQ(cache.first_pos(), 30);
  EXPECT_EQ(cache.seq_len(), 42);
  ContiguousCache fresh(two_layers_of_16());
  for (int l = 0; l < 2; ++l) fresh.write(l, 0, 12, k.data(), v.data());
  cache.decode(1, 30, 12, false, out.data());
  fresh.decode(1, 0, 12, false, want.data());
  EXPECT_EQ(out, want);
}

// Evicting drops the oldest positions without touching the others: what remains decodes to the
// same floats, attention sees only the window, and clear() empties everything.
TEST(ContiguousCache, EvictOldestKeepsTheRestBitExactAndClearEmpties) {
  const ContiguousCacheConfig cfg = two_layers_of_16();
  ContiguousCache cache(cfg);
  const auto k = gaussian(12 * 2 * 64, 5), v = gaussian(12 * 2 * 64, 6);
  for (int l = 0; l < 2; ++l) cache.write(l, 0, 12, k.data(), v.data());
  std::vector<float> before(8 * 2 * 64), after(before.size());
  cache.decode(1, 4, 8, false, before.data());
  std::vector<uint8_t> slot_before(cache.slot(1, 1, 7), cache.slot(1, 1, 7) + cache.slot_bytes(1));
  cache.evict_oldest(4);
  EXPECT_EQ(cache.first_pos(), 4);
  EXPECT_EQ(cache.seq_len(), 12);
  cache.decode(1, 4, 8, false, after.data());
  EXPECT_EQ(before, after);
  EXPECT_EQ(std::vector<uint8_t>(cache.slot(1, 1, 7), cache.slot(1, 1, 7) + cache.slot_bytes(1)), slot_before);
  EXPECT_THROW(cache.decode(1, 3, 1, true, after.data()), Error);
  // Appending after an eviction reuses the freed ring slots; positions 4.. are unchanged.
  for (int l = 0; l < 2; ++l) cache.write(l, 12, 8, k.data(), v.data());
  EXPECT_EQ(cache.first_pos(), 4);
  EXPECT_EQ(cache.seq_len(), 20);
  cache.decode(1, 4, 8, false, after.data());
  EXPECT_EQ(before, after);
  cache.clear();
  EXPECT_EQ(cache.seq_len(), 0);
  EXPECT_EQ(cache.first_pos(), 0);
  EXPECT_THROW(cache.decode(0, 0, 1, true, after.data()), Error);
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ring = cache.ring(l, h);
      for (size_t i = 0; i < 16 * cache.slot_bytes(l); ++i) ASSERT_EQ(ring[i], 0);
    }
}

}  // namespace
}  // namespace tqkv
