// Helpers shared by the CPU test suites: seeded random data, error measures, SIMD levels.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "tqkv/contiguous_cache.h"
#include "tqkv/format.h"
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

// One layer of `format`, H kv heads of dim d and capacity T, holding the T tokens of k and v
// ([T, H, d]).
inline ContiguousCache cache_holding(const Format& format, int H, int d, int T, const std::vector<float>& k,
                                     const std::vector<float>& v) {
  ContiguousCacheConfig cfg;
  cfg.n_kv_heads = H;
  cfg.head_dim = d;
  cfg.capacity = T;
  cfg.layer_formats = {format};
  ContiguousCache cache(cfg);
  cache.write(0, 0, T, k.data(), v.data());
  return cache;
}

// One layer of `format`, H kv heads of dim d, T tokens of seeded Gaussian K/V (seed, seed + 1)
// written; the keys and values also to *k_out / *v_out where given.
inline ContiguousCache filled_cache(const char* format, int H, int d, int T, uint64_t seed,
                                    std::vector<float>* k_out = nullptr, std::vector<float>* v_out = nullptr) {
  const auto k = gaussian(static_cast<size_t>(T) * H * d, seed), v = gaussian(k.size(), seed + 1);
  ContiguousCache cache = cache_holding(find_format(format), H, d, T, k, v);
  if (k_out) *k_out = k;
  if (v_out) *v_out = v;
  return cache;
}

// Whether the AVX-512 kernel has its int8 paths here (VNNI + VBMI: kernel-avx512vnni.cpp).
inline bool avx512_has_int8() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
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
