#include "engine/core/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "tqkv/error.h"

namespace tqkv::engine {

int32_t argmax(const float* v, int n) {
  int32_t best = 0;
  float top = n > 0 && !std::isnan(v[0]) ? v[0] : -std::numeric_limits<float>::infinity();
  for (int i = 1; i < n; ++i)
    if (v[i] > top) {  // false for NaN
      top = v[i];
      best = i;
    }
  return best;
}

Sampler::Sampler(const SamplerParams& p) : p_(p), rng_(p.seed) {
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature))
    throw Error(ErrorCode::InvalidArgument, "temperature must be a finite number >= 0");
  if (!(p.top_p > 0 && p.top_p <= 1)) throw Error(ErrorCode::InvalidArgument, "top-p must be in (0, 1]");
}

int32_t Sampler::sample(const float* logits, int n) {
  if (p_.temperature == 0.0f) return argmax(logits, n);
  cand_.resize(n);
  for (int i = 0; i < n; ++i) cand_[i] = {logits[i], i};
  const int k = p_.top_k > 0 ? std::min(p_.top_k, n) : n;
  std::partial_sort(cand_.begin(), cand_.begin() + k, cand_.end(), [](auto& a, auto& b) { return a.first > b.first; });
  cand_.resize(k);
  const float mx = cand_[0].first;
  double sum = 0;
  for (auto& c : cand_) sum += (c.first = std::exp((c.first - mx) / p_.temperature));
  // Nucleus: keep the smallest prefix whose mass reaches top_p.
  double acc = 0;
  size_t keep = cand_.size();
  for (size_t i = 0; i < cand_.size(); ++i) {
    acc += cand_[i].first / sum;
    if (acc >= p_.top_p) {
      keep = i + 1;
      break;
    }
  }
  cand_.resize(keep);
  double total = 0;
  for (auto& c : cand_) total += c.first;
  double r = std::uniform_real_distribution<double>(0.0, total)(rng_);
  for (auto& c : cand_) {
    r -= c.first;
    if (r <= 0) return c.second;
  }
  return cand_.back().second;
}

}  // namespace tqkv::engine
