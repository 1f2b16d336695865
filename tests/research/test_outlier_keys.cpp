// Issue 6, the outlier-channel study (+o<N>): the split codec codes the chosen channels and the
// rest as two independent Mse vectors; its bits are counted; the f16 copies of a recent window
// still get the exact keys.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "../engine/real_models.h"
#include "engine/model.h"
#include "outlier_keys.h"
#include "tqkv/error.h"

namespace tqkv::research {
namespace {

using namespace tqkv::engine;

ModelConfig small_config() {
  ModelConfig c;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.rope.n_rot = 64;
  c.rope.layout = RopeLayout::Adjacent;
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

// On the real model, through the cache layer's key hook (the seam studies use): the split's
// reconstruction goes into 8-bit key slots, and it moves the logits away from the plain 8-bit
// keys' (the split codes at 2 bits are much coarser).
class SmolOutliers : public testing_util::SmolModelTest {};

TEST_F(SmolOutliers, SplitThroughTheKeyHook) {
  const std::vector<int32_t> ids = tok_->encode("And God said, Let there be light: and there was light.", false);
  const int n = static_cast<int>(ids.size()), V = model_->config().n_vocab;
  auto run = [&](bool split) {
    auto cache = model_->make_cache("k8v2", 64);
    std::vector<int> bits(model_->config().n_layers, 2);
    OutlierKeySplit study(model_->config(), 16, bits);
    if (split) cache->set_key_hook([&](int layer, int m, float* k, const float*) { study.apply(layer, m, k); });
    std::vector<float> logits(static_cast<size_t>(n) * V);
    model_->forward(cache->add_sequence(), ids.data(), n, *cache, logits.data(), true);
    if (split) {
      EXPECT_EQ(study.outliers(5, 0).size(), 16u);
    }
    return logits;
  };
  const std::vector<float> a = run(false), b = run(true);
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(std::isfinite(b[i]));
    m = std::max(m, std::abs(double(a[i]) - b[i]));
  }
  EXPECT_GT(m, 1e-2);
}

}  // namespace
}  // namespace tqkv::research
