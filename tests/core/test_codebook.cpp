#include <gtest/gtest.h>

#include <cmath>

#include "tqkv/codebook.h"
#include "tqkv/error.h"

namespace tqkv {
namespace {

// Lloyd-Max for a unit-variance Gaussian: the MSE of N(0, 1/d) scaled by d, i.e. cb.mse.
TEST(Codebook, GaussianAnchors) {
  const double expected[] = {0.3634, 0.1175, 0.03454, 0.009497};
  for (int b = 1; b <= 4; ++b) {
    const Codebook& cb = get_codebook(Law::Gauss, 128, b);
    EXPECT_NEAR(cb.mse, expected[b - 1], 1e-4) << "bits " << b;
  }
}

TEST(Codebook, GaussianTwoBitLevels) {
  const Codebook& cb = get_codebook(Law::Gauss, 64, 2);
  const double s = std::sqrt(64.0);
  EXPECT_NEAR(cb.levels[2] * s, 0.4528, 1e-4);
  EXPECT_NEAR(cb.levels[3] * s, 1.5104, 1e-4);
  EXPECT_NEAR(cb.thresholds[2] * s, (0.4528 + 1.5104) / 2, 1e-4);
}

TEST(Codebook, SymmetricWithMidpointThresholds) {
  for (Law law : {Law::Sphere, Law::Gauss}) {
    for (int d : {64, 128}) {
      for (int b = 1; b <= 8; ++b) {
        const Codebook& cb = get_codebook(law, d, b);
        ASSERT_EQ(cb.size(), 1 << b);
        ASSERT_EQ(cb.thresholds.size(), static_cast<size_t>((1 << b) - 1));
        for (int i = 0; i < cb.size(); ++i) {
          EXPECT_NEAR(cb.levels[i], -cb.levels[cb.size() - 1 - i], 1e-15);
          if (i + 1 < cb.size()) {
            EXPECT_LT(cb.levels[i], cb.levels[i + 1]);
            EXPECT_DOUBLE_EQ(cb.thresholds[i], 0.5 * (cb.levels[i] + cb.levels[i + 1]));
          }
        }
        if (law == Law::Sphere) {
          EXPECT_LT(cb.levels.back(), 1.0);
        }
      }
    }
  }
}

TEST(Codebook, LevelsAreConditionalMeans) {
  // Lloyd optimality: each level is the mean of the law over its cell. Checked by direct
  // numerical integration (midpoint rule) of the sphere density, independent of the solver.
  const int d = 64, b = 3;
  const Codebook& cb = get_codebook(Law::Sphere, d, b);
  const int n = 400000;
  std::vector<double> mass(cb.size(), 0), moment(cb.size(), 0);
  for (int i = 0; i < n; ++i) {
    const double t = -1 + (i + 0.5) * 2.0 / n;
    const double w = std::pow(1 - t * t, (d - 3) / 2.0);
    int c = 0;
    while (c < cb.size() - 1 && t >= cb.thresholds[c]) ++c;
    mass[c] += w;
    moment[c] += w * t;
  }
  for (int c = 0; c < cb.size(); ++c) EXPECT_NEAR(moment[c] / mass[c], cb.levels[c], 5e-6);
}

TEST(Codebook, SphereApproachesGaussAsDimGrows) {
  double prev = 1e9;
  for (int d : {16, 64, 256, 1024}) {
    const Codebook& s = get_codebook(Law::Sphere, d, 3);
    const Codebook& g = get_codebook(Law::Gauss, d, 3);
    double diff = 0;
    for (int i = 0; i < s.size(); ++i) diff = std::max(diff, std::abs(s.levels[i] - g.levels[i]) * std::sqrt(d));
    EXPECT_LT(diff, prev);
    prev = diff;
  }
  EXPECT_LT(prev, 4e-3);
}

TEST(Codebook, SphereMseBelowGaussMseAtSmallDims) {
  // The exact law has lighter tails than the Gaussian; its optimal codebook does better on it.
  for (int b = 1; b <= 4; ++b) EXPECT_LT(get_codebook(Law::Sphere, 64, b).mse, get_codebook(Law::Gauss, 64, b).mse);
}

TEST(Codebook, QuantizeMatchesThresholdsAndTiesGoUp) {
  const Codebook& cb = get_codebook(Law::Sphere, 128, 4);
  for (int i = 0; i < cb.size() - 1; ++i) {
    const float t = cb.thresholds_f32[i];
    EXPECT_EQ(cb.quantize(t), i + 1);
    EXPECT_EQ(cb.quantize(std::nextafter(t, -1.0f)), i);
  }
  EXPECT_EQ(cb.quantize(-1.0f), 0);
  EXPECT_EQ(cb.quantize(1.0f), cb.size() - 1);
}

TEST(Codebook, DeterministicAndCached) {
  const Codebook a = solve_codebook(Law::Sphere, 96, 3);
  const Codebook b = solve_codebook(Law::Sphere, 96, 3);
  EXPECT_EQ(a.levels, b.levels);
  EXPECT_EQ(&get_codebook(Law::Sphere, 96, 3), &get_codebook(Law::Sphere, 96, 3));
}

TEST(Codebook, RejectsBadArguments) {
  EXPECT_THROW(solve_codebook(Law::Gauss, 1, 2), Error);
  EXPECT_THROW(solve_codebook(Law::Gauss, 64, 0), Error);
  EXPECT_THROW(solve_codebook(Law::Gauss, 64, 9), Error);
  EXPECT_THROW(parse_law("beta2"), Error);
}

}  // namespace
}  // namespace tqkv
