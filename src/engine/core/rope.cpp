#include "engine/core/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

[[noreturn]] void bad(const std::string& what) { throw Error(ErrorCode::Format, "model: RoPE " + what); }

// YaRN's pair index at which a pair turns `rotations` times over `context` positions
// (transformers' find_correction_dim).
double yarn_pair_at(double rotations, int n_rot, double base, int context) {
  return n_rot * std::log(context / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
}

}  // namespace

void RopeParams::validate() const {
  const RopeScaling& s = scaling;
  if (!(base > 1.0f) || !std::isfinite(base)) bad("freq_base = " + std::to_string(base) + " must be finite and > 1");
  if (s.kind != RopeScaling::Kind::None && !(s.factor >= 1.0 && std::isfinite(s.factor)))
    bad("scaling factor " + std::to_string(s.factor) + " must be finite and >= 1");
  if (!s.freq_factors.empty()) {
    if (static_cast<int>(s.freq_factors.size()) != n_rot / 2)
      bad("rope_freqs has " + std::to_string(s.freq_factors.size()) + " factors for " + std::to_string(n_rot / 2) +
          " pairs");
    for (float f : s.freq_factors)
      if (!(f > 0.0f) || !std::isfinite(f)) bad("rope_freqs holds a factor that is not finite and > 0");
  }
  if (s.kind == RopeScaling::Kind::Yarn) {
    if (s.original_context <= 0) bad("YaRN needs the original context length (rope.scaling.original_context_length)");
    if (!(s.beta_fast > s.beta_slow && s.beta_slow > 0)) bad("YaRN needs beta_fast > beta_slow > 0");
    if (!(s.ext_factor >= 0 && s.ext_factor <= 1)) bad("YaRN's ext_factor must be in [0, 1]");
    if (!(s.attn_factor >= 0 && std::isfinite(s.attn_factor))) bad("YaRN's attn_factor must be finite and >= 0");
  }
}

std::vector<float> RopeParams::inv_freq() const {
  const int half = n_rot / 2;
  std::vector<float> out(half);
  const RopeScaling& s = scaling;
  // YaRN: pairs below `low` keep their frequency, pairs above `high` are interpolated (divided by
  // the factor), a linear ramp between (transformers' _compute_yarn_parameters, truncate on).
  double low = 0, high = 0;
  if (s.kind == RopeScaling::Kind::Yarn) {
    low = std::max(0.0, std::floor(yarn_pair_at(s.beta_fast, n_rot, base, s.original_context)));
    high = std::min(static_cast<double>(n_rot - 1), std::ceil(yarn_pair_at(s.beta_slow, n_rot, base, s.original_context)));
    if (low == high) high += 0.001;
  }
  for (int i = 0; i < half; ++i) {
    double f = std::pow(static_cast<double>(base), -2.0 * i / n_rot);
    if (!s.freq_factors.empty()) f /= s.freq_factors[i];
    switch (s.kind) {
      case RopeScaling::Kind::None:
        break;
      case RopeScaling::Kind::Linear:
        f /= s.factor;
        break;
      case RopeScaling::Kind::Yarn: {
        const double interpolate = std::clamp((i - low) / (high - low), 0.0, 1.0) * s.ext_factor;
        f = f / s.factor * interpolate + f * (1.0 - interpolate);
        break;
      }
    }
    out[i] = static_cast<float>(f);
  }
  return out;
}

float RopeParams::mscale() const {
  if (scaling.kind != RopeScaling::Kind::Yarn) return 1.0f;
  if (scaling.attn_factor > 0) return static_cast<float>(scaling.attn_factor);
  return scaling.factor <= 1.0 ? 1.0f : static_cast<float>(0.1 * std::log(scaling.factor) + 1.0);
}

}  // namespace tqkv::engine
