// Issue 6, the outlier-channel study (+o<N>): the split codec codes the chosen channels and the
// rest as two independent Mse vectors; its bits are counted; the f16 copies of a recent window
// still get the exact keys.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "engine/cache_spec.h"
#include "engine/outlier_keys.h"
#include "smol_model.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

ModelConfig small_config() {
  ModelConfig c;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.n_rot = 64;
  c.rope = RopeLayout::Adjacent;
  return c;
}

// Keys whose RoPE pairs (10, 11) and (40, 41) carry most of the energy.
std::vector<float> keys_with_outliers(const ModelConfig& c, int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> k(static_cast<size_t>(n) * c.n_kv_heads * c.head_dim);
  for (size_t i = 0; i < k.size(); ++i) {
    const int ch = static_cast<int>(i % c.head_dim);
    k[i] = g(rng) * ((ch == 10 || ch == 11 || ch == 40 || ch == 41) ? 20.0f : 1.0f);
  }
  return k;
}

double sq_error(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0;
  for (size_t i = 0; i < a.size(); ++i) e += (a[i] - b[i]) * double(a[i] - b[i]);
  return e;
}

TEST(OutlierKeySplit, ChoosesTheHighEnergyPairsAndCodesEachPartOnItsOwn) {
  const ModelConfig c = small_config();
  const int n = 24, d = c.head_dim, N = 4, b = 3;
  OutlierKeySplit split(c, N, {0, b, 0});
  const auto k = keys_with_outliers(c, n, 7);
  auto y = k;
  split.apply(0, n, y.data());  // layer 0 is not split: unchanged
  EXPECT_EQ(y, k);
  split.apply(1, n, y.data());
  for (int h = 0; h < c.n_kv_heads; ++h) EXPECT_EQ(split.outliers(1, h), (std::vector<int>{10, 11, 40, 41}));
  // The same as coding the two gathered parts with their own codecs.
  Format hi_f{KeyCodec::Mse, b + 1, ValueCodec::F16, 16, true, Law::Sphere, RotationKind::Srht};
  Format lo_f{KeyCodec::Mse, b, ValueCodec::F16, 16, true, Law::Sphere, RotationKind::Srht};
  const SlotCodec hi(hi_f, N), lo(lo_f, d - N);
  std::vector<float> xo(N), xr(d - N), yo(N), yr(d - N);
  std::vector<uint8_t> bo(hi.key_bytes()), br(lo.key_bytes());
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const float* x = k.data() + (static_cast<size_t>(t) * c.n_kv_heads + h) * d;
      int a = 0, r = 0;
      for (int i = 0; i < d; ++i) (i == 10 || i == 11 || i == 40 || i == 41 ? xo[a++] : xr[r++]) = x[i];
      hi.encode_key(xo.data(), bo.data());
      hi.decode_key(bo.data(), yo.data());
      lo.encode_key(xr.data(), br.data());
      lo.decode_key(br.data(), yr.data());
      a = r = 0;
      const float* got = y.data() + (static_cast<size_t>(t) * c.n_kv_heads + h) * d;
      for (int i = 0; i < d; ++i) ASSERT_EQ(got[i], i == 10 || i == 11 || i == 40 || i == 41 ? yo[a++] : yr[r++]);
    }
  // On such keys the split beats one b-bit Mse vector by far.
  Format whole_f{KeyCodec::Mse, b, ValueCodec::F16, 16, true, Law::Sphere, RotationKind::Srht};
  const SlotCodec whole(whole_f, d);
  std::vector<float> z(k.size());
  std::vector<uint8_t> bw(whole.key_bytes());
  for (size_t off = 0; off < k.size(); off += d) {
    whole.encode_key(k.data() + off, bw.data());
    whole.decode_key(bw.data(), z.data() + off);
  }
  EXPECT_LT(sq_error(y, k), 0.5 * sq_error(z, k));
}

TEST(OutlierKeySplit, BadArgumentsThrow) {
  const ModelConfig c = small_config();
  EXPECT_THROW(OutlierKeySplit(c, 3, {3, 3, 3}), tqkv::Error);
  EXPECT_THROW(OutlierKeySplit(c, 0, {3, 3, 3}), tqkv::Error);
  EXPECT_THROW(OutlierKeySplit(c, 64, {3, 3, 3}), tqkv::Error);
  EXPECT_THROW(OutlierKeySplit(c, 16, {3, 3}), tqkv::Error);
  EXPECT_THROW(OutlierKeySplit(c, 16, {3, 8, 3}), tqkv::Error);
  OutlierKeySplit ok(c, 16, {3, 3, 3});
  auto k = keys_with_outliers(c, 2, 9);
  k[5] = NAN;
  EXPECT_THROW(ok.apply(1, 2, k.data()), tqkv::Error);
}

TEST(CacheSpec, OutlierSplitCountsTheSplitCodecsBits) {
  ModelConfig c = small_config();
  c.n_layers = 30;
  const CacheSpec s = resolve_cache_spec("k3v3+c+o16", c);
  EXPECT_EQ(s.outliers, 16);
  EXPECT_DOUBLE_EQ(s.bits, 3.25 + (16 + 16) / 128.0);  // 16 more code bits and a second norm
  ASSERT_EQ(s.split_key_bits.size(), 30u);
  EXPECT_EQ(s.split_key_bits[0], 0);   // f16 boundary layer
  EXPECT_EQ(s.split_key_bits[10], 3);
  EXPECT_EQ(s.layers[10].key_bits, 8);  // the study's storage
  for (const char* bad : {"k3v3+o0", "k3v3+o3", "k3v3+o64", "turboquant_k8v4+o16", "k8v3+o16", "k3v3+o16x"})
    EXPECT_THROW(resolve_cache_spec(bad, c), tqkv::Error) << bad;
}

// On the real model: the split moves compressed logits, and a window that covers the whole
// text makes the cache irrelevant again (its copies hold the exact keys, not the split ones).
class SmolOutliers : public testing_util::SmolModelTest {};

TEST_F(SmolOutliers, WindowCopiesKeepExactKeys) {
  const std::vector<int32_t> ids = tok_->encode("And God said, Let there be light: and there was light.", false);
  const int n = static_cast<int>(ids.size()), V = model_->config().n_vocab;
  auto run = [&](const std::string& name) {
    const CacheSpec spec = resolve_cache_spec(name, model_->config());
    ContiguousCache cache = make_spec_cache(spec, model_->config(), 64);
    SpecState st(spec, cache);
    std::vector<float> logits(static_cast<size_t>(n) * V);
    model_->forward(ids.data(), n, 0, cache, logits.data(), true, st.centring(), st.recent());
    return logits;
  };
  auto max_diff = [](const std::vector<float>& a, const std::vector<float>& b) {
    double m = 0;
    for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - b[i]));
    return m;
  };
  EXPECT_GT(max_diff(run("k2v2+c+o16"), run("k2v2+c")), 1e-2);
  EXPECT_LT(max_diff(run("k2v2+c+o16+w1000"), run("k2v2+c+w1000")), 1e-4);
}

}  // namespace
}  // namespace tqkv::engine
