#include "tqkv/reference_attention.h"

#include <cmath>
#include <limits>
#include <vector>

namespace tqkv {

void reference_attention(const SlotCodec& codec, const uint8_t* const* slots, int n_keys, const float* q,
                         int group, float scale, float* out, float* lse) {
  const int d = codec.dim();
  const Format& f = codec.format();
  std::vector<float> qd(q, q + static_cast<size_t>(group) * d);  // queries in the key domain
  if (f.keys_rotated())
    for (int h = 0; h < group; ++h) codec.rotation().apply(&qd[static_cast<size_t>(h) * d]);

  std::vector<float> kbuf(d), vbuf(d);
  std::vector<double> scores(static_cast<size_t>(n_keys) * group);
  for (int t = 0; t < n_keys; ++t) {
    codec.decode_key_domain(slots[t], kbuf.data());
    for (int h = 0; h < group; ++h) {
      double s = 0;
      for (int i = 0; i < d; ++i) s += static_cast<double>(qd[static_cast<size_t>(h) * d + i]) * kbuf[i];
      scores[static_cast<size_t>(t) * group + h] = s * scale;
    }
  }
  std::vector<double> acc(static_cast<size_t>(group) * d, 0.0), mx(group, -INFINITY), sum(group, 0.0);
  for (int t = 0; t < n_keys; ++t)
    for (int h = 0; h < group; ++h) mx[h] = std::max(mx[h], scores[static_cast<size_t>(t) * group + h]);
  for (int t = 0; t < n_keys; ++t) {
    codec.decode_value_domain(slots[t] + codec.key_bytes(), vbuf.data());
    for (int h = 0; h < group; ++h) {
      const double w = std::exp(scores[static_cast<size_t>(t) * group + h] - mx[h]);
      sum[h] += w;
      for (int i = 0; i < d; ++i) acc[static_cast<size_t>(h) * d + i] += w * vbuf[i];
    }
  }
  for (int h = 0; h < group; ++h) {
    float* o = out + static_cast<size_t>(h) * d;
    for (int i = 0; i < d; ++i) o[i] = n_keys ? static_cast<float>(acc[static_cast<size_t>(h) * d + i] / sum[h]) : 0.0f;
    if (f.values_rotated() && n_keys) codec.rotation().inverse(o);
    if (lse) lse[h] = n_keys ? static_cast<float>(mx[h] + std::log(sum[h])) : -std::numeric_limits<float>::infinity();
  }
}

}  // namespace tqkv
