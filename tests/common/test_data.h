// Helpers shared by the CPU test suites: seeded random data, error measures, SIMD levels.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "tqkv/simd.h"
#include "tqkv/threads.h"

namespace tqkv::testing_util {

// n samples of N(0, sigma^2) from a seeded generator.
inline std::vector<float> gaussian(size_t n, uint64_t seed, float sigma = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = g(rng);
  return v;
}

// ||a - b|| / ||b||
inline double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// Every SIMD level this CPU runs, scalar first.
inline std::vector<SimdLevel> supported_levels() {
  std::vector<SimdLevel> out;
  for (SimdLevel l : {SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512})
    if (simd_level_supported(l)) out.push_back(l);
  return out;
}

// Restores the process-wide SIMD level, thread count and parallel threshold after a
// test; while alive, even small attention calls are threaded.
struct LevelGuard {
  SimdLevel level = active_simd_level();
  LevelGuard() { set_attention_parallel_threshold(0); }
  ~LevelGuard() {
    set_simd_level(level);
    set_num_threads(0);
    set_attention_parallel_threshold(-1);
  }
};

// Sets how the kernels score keys for a test's duration (tqkv/simd.h KeyScores): tests that
// compare with the exact reference at 1e-5 run Exact; the int8 scores are checked against a
// bound derived from their quantization steps (test_int8_scores.cpp).
struct ScoresGuard {
  KeyScores saved = active_key_scores();
  explicit ScoresGuard(KeyScores s) { set_key_scores(s); }
  ~ScoresGuard() { set_key_scores(saved); }
};

}  // namespace tqkv::testing_util
