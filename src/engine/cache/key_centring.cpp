#include "engine/cache/key_centring.h"

#include <cmath>

namespace tqkv::engine {

int rope_partner(const RopeParams& rope, const std::vector<float>& inv_freq, int j, double* theta) {
  *theta = 0;
  const int n_rot = rope.n_rot;
  if (j >= n_rot) return j;
  const int half = n_rot / 2;
  const int i = rope.layout == RopeLayout::Adjacent ? j / 2 : j % half;
  *theta = inv_freq[i];
  if (rope.layout == RopeLayout::Adjacent) return j ^ 1;
  return j < half ? j + half : j - half;
}

KeyCentring::KeyCentring(const CacheSpec& spec, int capacity) {
  active_ = spec.centre_keys && spec.key_stats;
  if (!active_) return;
  scales_ = spec.scale_channels;
  const ModelConfig& c = spec.model;
  const KeyStats& ks = *spec.key_stats;
  n_kv_heads_ = c.n_kv_heads;
  group_ = c.n_heads / c.n_kv_heads;
  head_dim_ = c.head_dim;
  per_layer_ = static_cast<size_t>(n_kv_heads_) * head_dim_;
  const size_t total = per_layer_ * c.n_layers;
  mean_.assign(total, 0.0f);
  scale_.assign(total, 1.0f);
  const int hd = head_dim_;
  // The frequencies as the devices turn them, scaling applied. Every layer takes the model's
  // (global) RoPE, Gemma 3's local layers too: the recipes' statistics were fitted so, and the
  // choice changes only which channels are centred, never the attention (a constant shift of
  // every key leaves the softmax unchanged).
  const std::vector<float> inv_freq = c.rope.inv_freq();
  auto partner = [&](size_t /*flat*/, int j, double* theta) { return rope_partner(c.rope, inv_freq, j, theta); };
  for (size_t i = 0; i < total; ++i) {
    double theta = 0;
    partner(i, static_cast<int>(i % hd), &theta);
    mean_[i] = theta * capacity <= 1.0 ? ks.key_mean[i] : 0.0f;
  }
  if (!scales_) return;
  for (size_t head = 0; head < total / hd; ++head) {
    const size_t base = head * hd;
    // E[(k - mu)^2] from the first two moments, per channel.
    auto key_energy = [&](int i) {
      const double m = mean_[base + i], e1 = ks.key_mean[base + i], e2 = ks.key_sq[base + i];
      return std::max(0.0, e2 - 2.0 * m * e1 + m * m);
    };
    double log_sum = 0;
    for (int i = 0; i < hd; ++i) {
      double theta = 0;
      const int p = partner(base, i, &theta);
      const double ek = p == i ? key_energy(i) : (key_energy(i) + key_energy(p)) / 2.0;
      const double eq = p == i ? ks.query_sq[base + i] : (ks.query_sq[base + i] + ks.query_sq[base + p]) / 2.0;
      const double rk = std::sqrt(ek) + 1e-6, rq = std::sqrt(eq) + 1e-6;
      scale_[base + i] = static_cast<float>(std::sqrt(rk / rq));
      log_sum += std::log(scale_[base + i]);
    }
    const float norm = static_cast<float>(std::exp(-log_sum / hd));
    for (int i = 0; i < hd; ++i) scale_[base + i] *= norm;
  }
}

void KeyCentring::apply(int layer, int n, float* k, float* q) const {
  if (!active_) return;
  const float* mu = mean(layer);
  const float* sc = scale(layer);
  if (k)
    for (int t = 0; t < n; ++t)
      for (size_t i = 0; i < per_layer_; ++i) k[t * per_layer_ + i] = (k[t * per_layer_ + i] - mu[i]) / sc[i];
  if (!scales_ || !q) return;
  const size_t q_row = per_layer_ * group_;
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < n_kv_heads_; ++h)
      for (int g = 0; g < group_; ++g)
        for (int i = 0; i < head_dim_; ++i)
          q[t * q_row + (static_cast<size_t>(h) * group_ + g) * head_dim_ + i] *= sc[static_cast<size_t>(h) * head_dim_ + i];
}

void KeyCentring::restore(int layer, int n, float* k) const {
  if (!active_) return;
  const float* mu = mean(layer);
  const float* sc = scale(layer);
  for (int t = 0; t < n; ++t)
    for (size_t i = 0; i < per_layer_; ++i) k[t * per_layer_ + i] = k[t * per_layer_ + i] * sc[i] + mu[i];
}

}  // namespace tqkv::engine
