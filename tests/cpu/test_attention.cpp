#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "tqkv/attention.h"
#include "tqkv/error.h"

namespace tqkv {
namespace {

std::vector<float> gaussian(size_t n, uint64_t seed, float sigma = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = g(rng);
  return v;
}

// Exact causal attention over the original K/V, in double.
std::vector<float> exact_attention(const std::vector<float>& q, const std::vector<float>& k,
                                   const std::vector<float>& v, int n_q, int64_t q_pos0, int Hq, int H, int d,
                                   int window) {
  std::vector<float> out(static_cast<size_t>(n_q) * Hq * d);
  const int group = Hq / H;
  for (int t = 0; t < n_q; ++t) {
    const int64_t pos = q_pos0 + t;
    const int64_t begin = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    for (int h = 0; h < Hq; ++h) {
      const int kvh = h / group;
      const float* qh = &q[(static_cast<size_t>(t) * Hq + h) * d];
      std::vector<double> s;
      double mx = -1e300;
      for (int64_t p = begin; p <= pos; ++p) {
        double dot = 0;
        for (int i = 0; i < d; ++i) dot += qh[i] * k[(static_cast<size_t>(p) * H + kvh) * d + i];
        s.push_back(dot / std::sqrt(d));
        mx = std::max(mx, s.back());
      }
      std::vector<double> o(d, 0.0);
      double sum = 0;
      for (size_t j = 0; j < s.size(); ++j) {
        const double w = std::exp(s[j] - mx);
        sum += w;
        for (int i = 0; i < d; ++i) o[i] += w * v[(static_cast<size_t>(begin + j) * H + kvh) * d + i];
      }
      for (int i = 0; i < d; ++i) out[(static_cast<size_t>(t) * Hq + h) * d + i] = static_cast<float>(o[i] / sum);
    }
  }
  return out;
}

double min_cosine(const std::vector<float>& a, const std::vector<float>& b, int d) {
  double worst = 1;
  for (size_t r = 0; r < a.size() / d; ++r) {
    double ab = 0, aa = 0, bb = 0;
    for (int i = 0; i < d; ++i) {
      ab += static_cast<double>(a[r * d + i]) * b[r * d + i];
      aa += static_cast<double>(a[r * d + i]) * a[r * d + i];
      bb += static_cast<double>(b[r * d + i]) * b[r * d + i];
    }
    worst = std::min(worst, ab / std::sqrt(aa * bb));
  }
  return worst;
}

TEST(Attention, CausalPrefillGqaWindowMatchesExactForF32) {
  const int H = 2, Hq = 6, d = 64, T = 40;
  ContiguousCacheConfig cfg;
  cfg.n_kv_heads = H;
  cfg.head_dim = d;
  cfg.capacity = 64;
  cfg.layer_formats = {&find_format("f32")};
  ContiguousCache cache(cfg);
  const auto k = gaussian(static_cast<size_t>(T) * H * d, 1), v = gaussian(k.size(), 2);
  const auto q = gaussian(static_cast<size_t>(T) * Hq * d, 3);
  cache.write(0, 0, T, k.data(), v.data());
  for (int window : {0, 7}) {
    AttentionParams p;
    p.n_q_heads = Hq;
    p.window = window;
    std::vector<float> out(q.size());
    attention(cache, 0, q.data(), T, 0, p, out.data());
    const auto ref = exact_attention(q, k, v, T, 0, Hq, H, d, window);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-5) << "window " << window << " i " << i;
  }
}

TEST(Attention, CompressedFormatsCloseToExact) {
  const int H = 2, Hq = 8, d = 128, T = 256;
  const auto k = gaussian(static_cast<size_t>(T) * H * d, 4), v = gaussian(k.size(), 5);
  const auto q = gaussian(static_cast<size_t>(Hq) * d, 6, 1.5f);
  const auto ref = exact_attention(q, k, v, 1, T - 1, Hq, H, d, 0);
  for (const Format& f : all_formats()) {
    ContiguousCacheConfig cfg;
    cfg.n_kv_heads = H;
    cfg.head_dim = d;
    cfg.capacity = T;
    cfg.layer_formats = {&f};
    ContiguousCache cache(cfg);
    cache.write(0, 0, T, k.data(), v.data());
    AttentionParams p;
    p.n_q_heads = Hq;
    std::vector<float> out(q.size());
    attention(cache, 0, q.data(), 1, T - 1, p, out.data());
    const double bound = f.value_bits >= 8 ? 0.999 : f.value_bits >= 4 ? 0.99 : f.value_bits == 3 ? 0.97 : 0.9;
    EXPECT_GT(min_cosine(out, ref, d), bound) << f.name;
  }
}

// vLLM's round trip: one token, query equal to the key: the output is the value.
TEST(Attention, SingleTokenRoundTrip) {
  const int d = 128;
  for (const Format& f : all_formats()) {
    ContiguousCacheConfig cfg;
    cfg.head_dim = d;
    cfg.capacity = 4;
    cfg.layer_formats = {&f};
    ContiguousCache cache(cfg);
    const auto k = gaussian(d, 7), v = gaussian(d, 8);
    cache.write(0, 0, 1, k.data(), v.data());
    AttentionParams p;
    std::vector<float> out(d);
    attention(cache, 0, k.data(), 1, 0, p, out.data());
    const double bound = f.key == KeyCodec::Mse ? 0.85 : 0.95;
    EXPECT_GT(min_cosine(out, v, d), bound) << f.name;
  }
}

TEST(Attention, BadArgumentsThrow) {
  ContiguousCacheConfig cfg;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.capacity = 8;
  ContiguousCache cache(cfg);
  const auto k = gaussian(2 * 64, 1);
  cache.write(0, 0, 1, k.data(), k.data());
  std::vector<float> q(6 * 64), out(6 * 64, 3.0f);
  AttentionParams p;
  p.n_q_heads = 3;
  EXPECT_THROW(attention(cache, 0, q.data(), 1, 0, p, out.data()), Error);
  p.n_q_heads = 6;
  EXPECT_THROW(attention(cache, 1, q.data(), 1, 0, p, out.data()), Error);
  EXPECT_THROW(attention(cache, 0, q.data(), 1, 1, p, out.data()), Error);
  EXPECT_EQ(out[0], 3.0f);
}

}  // namespace
}  // namespace tqkv
