// Sampler: greedy is argmax; the draws follow softmax(logits / T) cut by top-k and top-p, and
// the seed decides them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "../common/test_seed.h"
#include "engine/core/sampler.h"
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

// The sampler's distribution, tested for real: N draws from known logits against the exact
// distribution the parameters define, by their total variation distance TV = 1/2 sum |p^_i - p_i|.
// The arithmetic (n = 6 tokens, N = 40,000 draws per case):
//   E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / N) <= 1/2 sqrt(n / N) = 0.0061 (Cauchy-Schwarz);
//   one draw moves TV by at most 1/N, so (McDiarmid) P(TV >= E[TV] + e) <= exp(-2 N e^2), and
//   e = sqrt(ln(1e6) / 2N) = 0.0131 makes that 1e-6. The threshold tau = 0.0061 + 0.0131 = 0.0193:
//   a correct sampler fails a case with probability < 1e-6.
//   A faulty sampler draws from q with TV(q, p) = D. It passes only if TV(p^, p) < tau, which needs
//   TV(p^, q) > D - tau >= tau when D >= 2 tau = 0.0385: by the same bound around q, probability
//   < 1e-6, so the fault fails with probability > 1 - 1e-6. Each case asserts D >= 2 tau for the
//   faults it is there to catch (temperature ignored: D = 0.17; top-k off by one: 0.16, 0.25;
//   top-p keeping one token too many: 0.25), computed from the same reference: the power is
//   checked, not assumed. The seed is fresh every run (TQKV_TEST_SEED replays a failure).
constexpr int kDraws = 40000;
const double kTau = 0.5 * std::sqrt(6.0 / kDraws) + std::sqrt(std::log(1e6) / (2.0 * kDraws));

// Six tokens of probabilities 0.30, 0.22, 0.17, 0.13, 0.10, 0.08 at temperature 1, out of order
// (an id mixed up with a rank shows).
const std::vector<float> kLogits = {std::log(0.17f), std::log(0.30f), std::log(0.08f),
                                    std::log(0.22f), std::log(0.10f), std::log(0.13f)};

// What SamplerParams define: softmax(logits / T) over the top_k largest (all for top_k <= 0),
// renormalised, then the smallest prefix in descending order whose mass reaches top_p,
// renormalised. extra_nucleus keeps that many tokens more past the top-p cut (a fault model).
std::vector<double> exact_distribution(const std::vector<float>& logits, double T, int top_k, double top_p,
                                       int extra_nucleus = 0) {
  const int n = static_cast<int>(logits.size());
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  order.resize(top_k > 0 ? std::min(top_k, n) : n);
  std::vector<double> w;
  for (int i : order) w.push_back(std::exp((logits[i] - logits[order[0]]) / T));
  const double total = std::accumulate(w.begin(), w.end(), 0.0);
  size_t keep = w.size();
  double acc = 0;
  for (size_t i = 0; i < w.size(); ++i)
    if ((acc += w[i] / total) >= top_p) {
      keep = i + 1;
      break;
    }
  keep = std::min(keep + extra_nucleus, w.size());
  const double kept = std::accumulate(w.begin(), w.begin() + static_cast<std::ptrdiff_t>(keep), 0.0);
  std::vector<double> p(n, 0.0);
  for (size_t i = 0; i < keep; ++i) p[order[i]] = w[i] / kept;
  return p;
}

double total_variation(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += std::fabs(a[i] - b[i]);
  return s / 2;
}

// kDraws draws of a sampler: their frequencies.
std::vector<double> frequencies(const SamplerParams& params, const std::vector<float>& logits) {
  Sampler s(params);
  std::vector<double> f(logits.size(), 0.0);
  for (int i = 0; i < kDraws; ++i) f.at(s.sample(logits.data(), static_cast<int>(logits.size()))) += 1.0 / kDraws;
  return f;
}

struct Fault {
  const char* what;
  std::vector<double> draws_from;  // the distribution a sampler with this fault draws from
};

void expect_distribution(const SamplerParams& params, const std::vector<Fault>& faults) {
  const std::vector<double> want = exact_distribution(kLogits, params.temperature, params.top_k, params.top_p);
  for (const Fault& f : faults)  // the test's power against the faults it is for
    ASSERT_GE(total_variation(f.draws_from, want), 2 * kTau) << f.what << ": too close to tell apart";
  const std::vector<double> got = frequencies(params, kLogits);
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] == 0) {
      EXPECT_EQ(got[i], 0.0) << "token " << i << " is outside top-k / top-p";
    }
  }
  EXPECT_LT(total_variation(got, want), kTau) << "draws unlike softmax(logits / T) cut by top-k and top-p";
}

TEST(Sampler, TemperatureScalesTheLogits) {
  const testing_util::TestSeed seed;
  SamplerParams p{0.5f, 0, 1.0f, seed.value()};
  expect_distribution(p, {{"temperature ignored", exact_distribution(kLogits, 1.0, 0, 1.0)}});
  p.temperature = 2.0f;  // D = 0.094 for "ignored"
  expect_distribution(p, {{"temperature ignored", exact_distribution(kLogits, 1.0, 0, 1.0)}});
}

TEST(Sampler, TopKKeepsExactlyKTokens) {
  const testing_util::TestSeed seed;
  const SamplerParams p{1.0f, 3, 1.0f, seed.value()};
  expect_distribution(p, {{"top-k + 1", exact_distribution(kLogits, 1.0, 4, 1.0)},
                          {"top-k - 1", exact_distribution(kLogits, 1.0, 2, 1.0)}});
}

TEST(Sampler, TopPKeepsTheSmallestPrefixReachingP) {
  const testing_util::TestSeed seed;
  // Cumulative 0.30, 0.52: top-p 0.45 keeps two tokens, far from either sum.
  const SamplerParams p{1.0f, 0, 0.45f, seed.value()};
  expect_distribution(p, {{"top-p keeps one token more", exact_distribution(kLogits, 1.0, 0, 0.45, 1)}});
}

// All three at once: top-p cuts the tempered distribution already cut to the top k.
TEST(Sampler, TemperatureTopKAndTopPTogether) {
  const testing_util::TestSeed seed;
  const SamplerParams p{0.7f, 4, 0.8f, seed.value()};
  expect_distribution(p, {{"temperature ignored", exact_distribution(kLogits, 1.0, 4, 0.8)},
                          {"top-p keeps one token more", exact_distribution(kLogits, 0.7, 4, 0.8, 1)}});
}

// Same seed, same draws; another seed, other draws: 64 draws of two independent samplers agree
// everywhere with probability (sum p_i^2)^64 = 0.2006^64 ~ 2e-45.
TEST(Sampler, SeedGivesTheDraws) {
  const testing_util::TestSeed seed;
  const SamplerParams p{1.0f, 0, 1.0f, seed.value()};
  SamplerParams other = p;
  other.seed = p.seed + 1;
  Sampler a(p), b(p), c(other);
  std::vector<int32_t> da, db, dc;
  for (int i = 0; i < 64; ++i) {
    da.push_back(a.sample(kLogits.data(), 6));
    db.push_back(b.sample(kLogits.data(), 6));
    dc.push_back(c.sample(kLogits.data(), 6));
  }
  EXPECT_EQ(da, db);
  EXPECT_NE(da, dc);
}

TEST(Sampler, RejectsBadParameters) {
  EXPECT_THROW(Sampler({-1.0f, 40, 0.9f, 1}), Error);
  EXPECT_THROW(Sampler({1.0f, 40, 0.0f, 1}), Error);
  EXPECT_THROW(Sampler({NAN, 40, 0.9f, 1}), Error);
}

}  // namespace
}  // namespace tqkv::engine
