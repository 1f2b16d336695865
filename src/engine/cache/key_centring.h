// Key centring and channel scales of one cache (the spec options +c and +s), resolved from the
// model's key statistics (recipe.h KeyStats, measured once by `tqkv calibrate` over
// calibration text) for the cache's capacity. Every device's cache applies the same numbers.
//
// Centring: the keys of each (layer, kv head) are cached minus a channel mean mu, after RoPE.
// q.(k - mu) = q.k - q.mu is the same shift for every key a query sees, so softmax is
// unchanged while the vectors the cache quantizes get shorter. A pair of channels that RoPE
// turns by more than a radian over the cache's capacity has no stable mean (it moves with the
// position): those pairs keep mu = 0.
//
// Scales (+s): keys are also divided by a per-channel scale s and the queries of the group
// multiplied by it, (q*s).((k - mu)/s) = q.(k - mu) exactly, with
// s_i = sqrt(rms_i(k - mu) / rms_i(q)), rms over both channels of a RoPE pair (the balance that
// minimises the score error of an isotropic key error, as SmoothQuant with alpha 1/2),
// normalised to geometric mean 1 per head.
#pragma once
#include <vector>

#include "engine/cache/cache_spec.h"

namespace tqkv::engine {

class KeyCentring {
 public:
  // Inactive when the spec neither centres nor scales.
  KeyCentring(const CacheSpec& spec, int capacity);

  bool active() const { return active_; }
  bool scales() const { return scales_; }
  // [n_kv_heads, head_dim] of one layer.
  const float* mean(int layer) const { return mean_.data() + layer * per_layer_; }
  const float* scale(int layer) const { return scale_.data() + layer * per_layer_; }

  // Host memory: k [n, n_kv_heads, head_dim] -> (k - mu) / s; q [n, n_heads, head_dim] *= s.
  // Either may be null (only the other is changed).
  void apply(int layer, int n, float* k, float* q) const;
  // The inverse for keys read back: k [n, n_kv_heads, head_dim] -> k * s + mu.
  void restore(int layer, int n, float* k) const;

 private:
  bool active_ = false, scales_ = false;
  int n_kv_heads_ = 0, group_ = 1, head_dim_ = 0;
  size_t per_layer_ = 0;
  std::vector<float> mean_, scale_;  // [n_layers, n_kv_heads, head_dim]
};

// RoPE partner of channel j of a head and the angle its pair turns per position (0 for the
// channels RoPE leaves alone, which have no partner: returns j). inv_freq: rope.inv_freq().
int rope_partner(const RopeParams& rope, const std::vector<float>& inv_freq, int j, double* theta);

}  // namespace tqkv::engine
