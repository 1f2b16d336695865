// Sampler: greedy is argmax; sampling respects top-k / top-p and is reproducible by seed.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "engine/sampler.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

TEST(Sampler, GreedyIsArgmaxWithLowestIdOnTies) {
  const std::vector<float> l = {0.5f, 2.0f, -1.0f, 2.0f};
  Sampler s({0.0f, 40, 0.95f, 1});
  EXPECT_EQ(s.sample(l.data(), 4), 1);
}

TEST(Sampler, ArgmaxSkipsNaNAndKeepsTheLowestIdOnTies) {
  const float nan = std::nanf(""), inf = INFINITY;
  const std::vector<float> lead_nan = {nan, 1.0f, 3.0f, nan, 3.0f};
  EXPECT_EQ(argmax(lead_nan.data(), 5), 2);  // a NaN first does not block the rest
  const std::vector<float> all_nan = {nan, nan, nan};
  EXPECT_EQ(argmax(all_nan.data(), 3), 0);
  const std::vector<float> all_neg_inf = {-inf, -inf};
  EXPECT_EQ(argmax(all_neg_inf.data(), 2), 0);
  const std::vector<float> pos_inf = {1.0f, inf, inf, nan};
  EXPECT_EQ(argmax(pos_inf.data(), 4), 1);
}

TEST(Sampler, TopKAndTopPLimitTheChoice) {
  const std::vector<float> l = {3.0f, 2.9f, 2.8f, -5.0f, -6.0f};
  std::map<int, int> seen;
  Sampler k2({1.0f, 2, 1.0f, 42});
  for (int i = 0; i < 2000; ++i) ++seen[k2.sample(l.data(), 5)];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_GT(seen[0], seen[1]);  // exp(3)/exp(2.9) = 1.105: id 0 a bit more often
  seen.clear();
  // p(0) = 0.36 of the mass: top-p 0.3 keeps id 0 only.
  Sampler p({1.0f, 0, 0.3f, 42});
  for (int i = 0; i < 200; ++i) ++seen[p.sample(l.data(), 5)];
  EXPECT_EQ(seen.size(), 1u);
}

TEST(Sampler, SeedReproducible) {
  std::vector<float> l(100);
  for (int i = 0; i < 100; ++i) l[i] = std::sin(i * 0.7f);
  Sampler a({0.8f, 50, 0.9f, 9}), b({0.8f, 50, 0.9f, 9}), c({0.8f, 50, 0.9f, 10});
  int same_c = 0;
  for (int i = 0; i < 50; ++i) {
    const int x = a.sample(l.data(), 100);
    EXPECT_EQ(x, b.sample(l.data(), 100));
    same_c += x == c.sample(l.data(), 100);
  }
  EXPECT_LT(same_c, 50);
}

TEST(Sampler, RejectsBadParameters) {
  EXPECT_THROW(Sampler({-1.0f, 40, 0.9f, 1}), Error);
  EXPECT_THROW(Sampler({1.0f, 40, 0.0f, 1}), Error);
  EXPECT_THROW(Sampler({NAN, 40, 0.9f, 1}), Error);
}

}  // namespace
}  // namespace tqkv::engine
