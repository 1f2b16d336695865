#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "tqkv/error.h"
#include "tqkv/rotation.h"

namespace tqkv {
namespace {

std::vector<float> random_vec(int d, std::mt19937& rng) {
  std::normal_distribution<float> g;
  std::vector<float> v(d);
  for (auto& x : v) x = g(rng);
  return v;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

struct Case {
  RotationKind kind;
  int dim;
};

class RotationTest : public ::testing::TestWithParam<Case> {};

TEST_P(RotationTest, OrthogonalToFloatPrecision) {
  const auto [kind, d] = GetParam();
  const Rotation r = make_rotation(kind, d, 42);
  // Columns R e_i: R R^T = I  <=>  the images of the basis are orthonormal.
  std::vector<std::vector<float>> cols(d, std::vector<float>(d, 0.0f));
  for (int i = 0; i < d; ++i) {
    cols[i][i] = 1.0f;
    r.apply(cols[i].data());
  }
  double worst = 0;
  for (int i = 0; i < d; ++i)
    for (int j = i; j < d; ++j) worst = std::max(worst, std::abs(dot(cols[i], cols[j]) - (i == j ? 1.0 : 0.0)));
  EXPECT_LT(worst, 1e-5);
}

TEST_P(RotationTest, InverseUndoesApplyAndPreservesGeometry) {
  const auto [kind, d] = GetParam();
  const Rotation r = make_rotation(kind, d, 7);
  std::mt19937 rng(d);
  for (int trial = 0; trial < 20; ++trial) {
    auto x = random_vec(d, rng), y = random_vec(d, rng);
    auto rx = x, ry = y;
    r.apply(rx.data());
    r.apply(ry.data());
    EXPECT_NEAR(dot(rx, rx), dot(x, x), 1e-4 * dot(x, x));
    EXPECT_NEAR(dot(rx, ry), dot(x, y), 1e-4 * std::sqrt(dot(x, x) * dot(y, y)));
    r.inverse(rx.data());
    for (int i = 0; i < d; ++i) EXPECT_NEAR(rx[i], x[i], 1e-5f * (1 + std::abs(x[i])));
  }
}

TEST_P(RotationTest, SameSeedSameBitsOtherSeedDiffers) {
  const auto [kind, d] = GetParam();
  std::mt19937 rng(1);
  const auto x = random_vec(d, rng);
  auto a = x, b = x, c = x;
  make_rotation(kind, d, 99).apply(a.data());
  make_rotation(kind, d, 99).apply(b.data());
  make_rotation(kind, d, 100).apply(c.data());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), sizeof(float) * d));
  if (kind != RotationKind::Hadamard || !is_power_of_two(d)) {
    EXPECT_NE(0, std::memcmp(a.data(), c.data(), sizeof(float) * d));
  }
}

INSTANTIATE_TEST_SUITE_P(All, RotationTest,
                         ::testing::Values(Case{RotationKind::Srht, 64}, Case{RotationKind::Srht, 128},
                                           Case{RotationKind::Srht, 256}, Case{RotationKind::Hadamard, 64},
                                           Case{RotationKind::Hadamard, 128}, Case{RotationKind::Srht, 96},
                                           Case{RotationKind::Srht, 160}, Case{RotationKind::Dense, 64}),
                         [](const auto& info) {
                           return std::string(rotation_name(info.param.kind)) + "_" + std::to_string(info.param.dim);
                         });

TEST(Rotation, NonPowerOfTwoFallsBackToDense) {
  EXPECT_EQ(make_rotation(RotationKind::Srht, 96).kind(), RotationKind::Dense);
  EXPECT_EQ(make_rotation(RotationKind::Srht, 128).kind(), RotationKind::Srht);
  EXPECT_THROW(Rotation(RotationKind::Hadamard, 96), Error);
}

TEST(Rotation, SrhtMatchesDefinition) {
  // R x = H (D x) / sqrt(d) with H the Sylvester matrix H[i][j] = (-1)^popcount(i & j).
  const int d = 16;
  const Rotation r(RotationKind::Srht, d, 5);
  std::mt19937 rng(3);
  auto x = random_vec(d, rng);
  auto y = x;
  r.apply(y.data());
  for (int i = 0; i < d; ++i) {
    double s = 0;
    for (int j = 0; j < d; ++j) s += ((__builtin_popcount(i & j) & 1) ? -1.0 : 1.0) * r.signs()[j] * x[j];
    EXPECT_NEAR(y[i], s / 4.0, 1e-5);
  }
  // Signs follow SplitMix64's top bit.
  SplitMix64 g(5);
  for (int i = 0; i < d; ++i) EXPECT_EQ(r.signs()[i], (g.next() >> 63) ? -1.0f : 1.0f);
}

}  // namespace
}  // namespace tqkv
