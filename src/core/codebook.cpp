#include "tqkv/codebook.h"

#include <boost/math/special_functions/beta.hpp>
#include <boost/math/special_functions/erf.hpp>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

namespace tqkv {

std::string_view law_name(Law law) { return law == Law::Sphere ? "sphere" : "gauss"; }

Law parse_law(std::string_view name) {
  if (name == "sphere" || name == "beta") return Law::Sphere;
  if (name == "gauss" || name == "gaussian") return Law::Gauss;
  throw std::invalid_argument("unknown law '" + std::string(name) + "' (valid: sphere, gauss)");
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
  double lower() const { return law == Law::Gauss ? -INFINITY : -1.0; }
  double upper() const { return law == Law::Gauss ? INFINITY : 1.0; }
  // Quantile of N(0, 1/d): a good starting point for either law.
  double initial_quantile(double p) const {
    return std::sqrt(2.0 / dim) * boost::math::erf_inv(2 * p - 1);
  }
};

}  // namespace

Codebook solve_codebook(Law law, int dim, int bits) {
  if (dim < 2) throw std::invalid_argument("codebook dim must be >= 2, got " + std::to_string(dim));
  if (bits < 1 || bits > 8)
    throw std::invalid_argument("codebook bits must be in 1..8, got " + std::to_string(bits));
  const LawMoments law_m(law, dim);
  const int n = 1 << bits;
  std::vector<double> c(n), t(n - 1), p(n);
  for (int i = 0; i < n; ++i) c[i] = law_m.initial_quantile((i + 0.5) / n);

  // Lloyd's algorithm: thresholds at midpoints, levels at conditional means. Symmetry is kept
  // exactly by solving the upper half and mirroring.
  int it = 0;
  const int max_iterations = 100000;
  for (; it < max_iterations; ++it) {
    for (int i = 0; i + 1 < n; ++i) t[i] = 0.5 * (c[i] + c[i + 1]);
    double change = 0;
    for (int i = n / 2; i < n; ++i) {
      const double lo = i == n / 2 ? 0.0 : t[i - 1];
      const double hi = i == n - 1 ? law_m.upper() : t[i];
      const double m = law_m.mass(lo, hi);
      const double next = m > 1e-300 ? law_m.first_moment(lo, hi) / m : 0.5 * (lo + (std::isinf(hi) ? lo : hi));
      change = std::max(change, std::abs(next - c[i]));
      c[i] = next;
      c[n - 1 - i] = -next;
    }
    if (change < 1e-13 * std::sqrt(1.0 / dim)) break;
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
