#include "tqkv/codebook.h"

#include <boost/math/special_functions/beta.hpp>
#include <boost/math/special_functions/erf.hpp>
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "tqkv/error.h"

namespace tqkv {

std::string_view law_name(Law law) { return law == Law::Sphere ? "sphere" : "gauss"; }

Law parse_law(std::string_view name) {
  if (name == "sphere" || name == "beta") return Law::Sphere;
  if (name == "gauss" || name == "gaussian") return Law::Gauss;
  throw Error(ErrorCode::InvalidArgument, "unknown law '" + std::string(name) + "' (valid: sphere, gauss)");
}

namespace {

// Probability mass and first moment of the law on an interval [lo, hi]; both in closed form
// except the sphere law's mass, which is a regularized incomplete beta function.
struct LawMoments {
  Law law;
  int dim;
  double sigma = 0;     // Gauss: 1/sqrt(d)
  double a = 0;         // Sphere: (t+1)/2 ~ Beta(a, a), a = (d-1)/2
  double log_norm = 0;  // Sphere: log of 1 / (2^(2a-1) B(a, a))

  LawMoments(Law l, int d) : law(l), dim(d) {
    if (law == Law::Gauss) {
      sigma = 1.0 / std::sqrt(static_cast<double>(d));
    } else {
      a = 0.5 * (d - 1);
      log_norm = -(2 * a - 1) * std::log(2.0) - (2 * std::lgamma(a) - std::lgamma(2 * a));
    }
  }

  double cdf(double t) const {
    if (law == Law::Gauss) return 0.5 * std::erfc(-t / (sigma * std::sqrt(2.0)));
    if (t <= -1) return 0;
    if (t >= 1) return 1;
    return boost::math::ibeta(a, a, 0.5 * (t + 1));
  }
  double mass(double lo, double hi) const {
    // Use the upper tail on the right half for accuracy far from the centre.
    if (lo >= 0) return cdf(-lo) - cdf(-hi);
    return cdf(hi) - cdf(lo);
  }
  // Antiderivative G with G' = t f(t).
  double first_moment_antiderivative(double t) const {
    if (law == Law::Gauss) {
      if (std::isinf(t)) return 0;
      return -sigma / std::sqrt(2 * M_PI) * std::exp(-0.5 * t * t / (sigma * sigma));
    }
    if (t <= -1 || t >= 1) return 0;
    return -std::exp(log_norm + a * std::log1p(-t * t)) / (2 * a);
  }
  double first_moment(double lo, double hi) const {
    return first_moment_antiderivative(hi) - first_moment_antiderivative(lo);
  }
  double density(double t) const {
    if (law == Law::Gauss) return std::exp(-0.5 * t * t / (sigma * sigma)) / (sigma * std::sqrt(2 * M_PI));
    if (t <= -1 || t >= 1) return 0;
    return std::exp(log_norm + (a - 1) * std::log1p(-t * t));
  }
  double lower() const { return law == Law::Gauss ? -INFINITY : -1.0; }
  double upper() const { return law == Law::Gauss ? INFINITY : 1.0; }
  // Starting levels: quantiles of the high-rate optimal point density, proportional to
  // f^(1/3) (Panter-Dite); for N(0, 1/d) that is N(0, 3/d). Starting close to the optimum
  // matters: Lloyd's algorithm converges slowly at 7-8 bits.
  double initial_level(double p, int bits) const {
    const double spread = bits >= 3 ? 3.0 : 1.0;
    const double t = std::sqrt(2.0 * spread / dim) * boost::math::erf_inv(2 * p - 1);
    return law == Law::Sphere ? std::clamp(t, -0.999, 0.999) : t;
  }
};

}  // namespace

Codebook solve_codebook(Law law, int dim, int bits) {
  if (dim < 2) throw Error(ErrorCode::InvalidArgument, "codebook dim must be >= 2, got " + std::to_string(dim));
  if (bits < 1 || bits > 8)
    throw Error(ErrorCode::InvalidArgument, "codebook bits must be in 1..8, got " + std::to_string(bits));
  const LawMoments law_m(law, dim);
  const int n = 1 << bits;
  std::vector<double> c(n), t(n - 1), p(n);
  for (int i = 0; i < n; ++i) c[i] = law_m.initial_level((i + 0.5) / n, bits);

  // Lloyd's algorithm (thresholds at midpoints, levels at conditional means) to get close,
  // then Newton's method on the same fixed-point equations c_i = E[X | t_{i-1} <= X < t_i],
  // whose Jacobian is tridiagonal; plain Lloyd needs ~1e5 iterations at 8 bits. Only the
  // upper half is solved; the lower half is its mirror image, so symmetry is exact.
  const int half = n / 2;
  const double tol = 1e-14 / std::sqrt(static_cast<double>(dim));
  const double newton_start = 1e-6 / std::sqrt(static_cast<double>(dim));
  auto cell = [&](int i, double& lo, double& hi) {  // i in [half, n)
    lo = i == half ? 0.0 : 0.5 * (c[i - 1] + c[i]);
    hi = i == n - 1 ? law_m.upper() : 0.5 * (c[i] + c[i + 1]);
  };
  auto conditional_mean = [&](double lo, double hi, double& mass) {
    mass = law_m.mass(lo, hi);
    return mass > 1e-300 ? law_m.first_moment(lo, hi) / mass : 0.5 * (lo + (std::isinf(hi) ? lo : hi));
  };
  auto mirror = [&] {
    for (int i = half; i < n; ++i) c[n - 1 - i] = -c[i];
  };
  int it = 0;
  for (; it < 300; ++it) {
    double change = 0;
    std::vector<double> next(n);
    for (int i = half; i < n; ++i) {
      double lo, hi, m;
      cell(i, lo, hi);
      next[i] = conditional_mean(lo, hi, m);
      change = std::max(change, std::abs(next[i] - c[i]));
    }
    for (int i = half; i < n; ++i) c[i] = next[i];
    mirror();
    // Lloyd only has to bring Newton into its basin: each iteration costs 2^(bits-1)
    // incomplete-beta evaluations for the sphere law (~0.4 s at 8 bits), and near the fixed
    // point it gains little per step, while Newton finishes in a few.
    if (change < newton_start) break;
  }
  // Newton on F_i(c) = c_i - m_i(c) for the upper half (n/2 unknowns; c_{half-1} = -c_half).
  const int m_count = n - half;
  for (int newton = 0; newton < 60 && n > 2; ++newton, ++it) {
    std::vector<double> F(m_count), diag(m_count), lower(m_count, 0.0), upper(m_count, 0.0);
    double worst = 0;
    for (int j = 0; j < m_count; ++j) {
      const int i = half + j;
      double lo, hi, mass;
      cell(i, lo, hi);
      const double mean = conditional_mean(lo, hi, mass);
      F[j] = c[i] - mean;
      worst = std::max(worst, std::abs(F[j]));
      // d mean / d lo = f(lo) (mean - lo) / mass ; d mean / d hi = f(hi) (hi - mean) / mass
      const double dlo = mass > 1e-300 ? law_m.density(lo) * (mean - lo) / mass : 0.0;
      const double dhi = mass > 1e-300 && !std::isinf(hi) ? law_m.density(hi) * (hi - mean) / mass : 0.0;
      diag[j] = 1.0 - 0.5 * dhi - (j == 0 ? 0.0 : 0.5 * dlo);  // lo = (c_{i-1} + c_i) / 2
      if (j == 0) {
        // lo = (c_{half-1} + c_half) / 2 = 0 by symmetry: no dependence.
      } else {
        lower[j] = -0.5 * dlo;
      }
      if (j + 1 < m_count) upper[j] = -0.5 * dhi;
    }
    if (worst < tol) break;
    // Thomas algorithm for the tridiagonal system J delta = F.
    std::vector<double> cp(m_count), dp(m_count);
    cp[0] = upper[0] / diag[0];
    dp[0] = F[0] / diag[0];
    for (int j = 1; j < m_count; ++j) {
      const double den = diag[j] - lower[j] * cp[j - 1];
      cp[j] = upper[j] / den;
      dp[j] = (F[j] - lower[j] * dp[j - 1]) / den;
    }
    std::vector<double> delta(m_count);
    delta[m_count - 1] = dp[m_count - 1];
    for (int j = m_count - 2; j >= 0; --j) delta[j] = dp[j] - cp[j] * delta[j + 1];
    // Damped step that keeps the levels strictly increasing (and inside the support).
    double step = 1.0;
    for (int tries = 0; tries < 30; ++tries, step *= 0.5) {
      bool ok = c[half] - step * delta[0] > 0;
      for (int j = 1; j < m_count && ok; ++j)
        ok = c[half + j] - step * delta[j] > c[half + j - 1] - step * delta[j - 1];
      if (law == Law::Sphere) ok = ok && c[n - 1] - step * delta[m_count - 1] < 1.0;
      if (ok) break;
    }
    for (int j = 0; j < m_count; ++j) c[half + j] -= step * delta[j];
    mirror();
  }
  for (int i = 0; i + 1 < n; ++i) t[i] = 0.5 * (c[i] + c[i + 1]);

  // MSE = E[X^2] - sum_i P_i c_i^2 (levels are conditional means); E[X^2] = 1/d for both laws.
  double explained = 0;
  for (int i = 0; i < n; ++i) {
    const double lo = i == 0 ? law_m.lower() : t[i - 1];
    const double hi = i == n - 1 ? law_m.upper() : t[i];
    explained += law_m.mass(lo, hi) * c[i] * c[i];
  }
  Codebook cb;
  cb.law = law;
  cb.dim = dim;
  cb.bits = bits;
  cb.levels = c;
  cb.thresholds = t;
  cb.levels_f32.assign(c.begin(), c.end());
  cb.thresholds_f32.assign(t.begin(), t.end());
  cb.mse = std::max(0.0, 1.0 - dim * explained);
  cb.iterations = it;
  return cb;
}

const Codebook& get_codebook(Law law, int dim, int bits) {
  static std::mutex mu;
  static std::map<std::tuple<Law, int, int>, std::unique_ptr<Codebook>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[{law, dim, bits}];
  if (!slot) slot = std::make_unique<Codebook>(solve_codebook(law, dim, bits));
  return *slot;
}

uint8_t Codebook::quantize(float x) const {
  // Branch-free lower bound over the (at most 255) float thresholds.
  int lo = 0;
  int count = static_cast<int>(thresholds_f32.size());
  while (count > 0) {
    const int half = count / 2;
    if (x >= thresholds_f32[lo + half]) {
      lo += half + 1;
      count -= half + 1;
    } else {
      count = half;
    }
  }
  return static_cast<uint8_t>(lo);
}

}  // namespace tqkv
