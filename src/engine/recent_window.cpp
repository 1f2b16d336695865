#include "recent_window.h"

#include <cmath>
#include <limits>
#include <string>

#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

ContiguousCacheConfig copy_config(const ContiguousCache& main, int window, int max_batch) {
  if (window < 1) throw Error(ErrorCode::InvalidArgument, "recent window must be at least 1 token");
  if (max_batch < 1) throw Error(ErrorCode::InvalidArgument, "recent window: max_batch must be at least 1");
  ContiguousCacheConfig c;
  c.n_layers = main.n_layers();
  c.n_kv_heads = main.n_kv_heads();
  c.head_dim = main.head_dim();
  c.capacity = window + max_batch;
  c.layer_formats.assign(main.n_layers(), &find_format("f16"));
  c.seed = main.config().seed;
  return c;
}

}  // namespace

RecentWindow::RecentWindow(const ContiguousCache& main, int window, int max_batch)
    : window_(window), max_batch_(max_batch), copies_(copy_config(main, window, max_batch)) {
  covered_.resize(main.n_layers());
  for (int l = 0; l < main.n_layers(); ++l) covered_[l] = main.format(l).compressed();
}

void RecentWindow::write(int layer, int64_t pos0, int n, const float* k, const float* v) {
  if (n > max_batch_)
    throw Error(ErrorCode::Capacity, "recent window: a batch of " + std::to_string(n) + " tokens exceeds max_batch " +
                                         std::to_string(max_batch_));
  if (!covers(layer)) return;
  copies_.write(layer, pos0, n, k, v);
}

void RecentWindow::attention(const ContiguousCache& main, int layer, const float* q, int n, int64_t pos0,
                             const AttentionParams& params, float* out) {
  const int Hq = params.n_q_heads, d = main.head_dim();
  const size_t rows = static_cast<size_t>(n) * Hq;
  out_recent_.resize(rows * d);
  lse_main_.resize(rows);
  lse_recent_.resize(rows);
  AttentionParams older = params, recent = params;
  older.exclude_recent = window_;
  older.lse = lse_main_.data();
  recent.window = params.window > 0 ? std::min(params.window, window_) : window_;
  recent.lse = lse_recent_.data();
  tqkv::attention(main, layer, q, n, pos0, older, out);
  tqkv::attention(copies_, layer, q, n, pos0, recent, out_recent_.data());
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  for (size_t r = 0; r < rows; ++r) {
    const float a = lse_main_[r], b = lse_recent_[r];
    if (b == kNone) continue;  // only older keys (cannot happen for a causal query: it sees itself)
    float* o = out + r * d;
    const float* w = out_recent_.data() + r * d;
    if (a == kNone) {
      for (int i = 0; i < d; ++i) o[i] = w[i];
      continue;
    }
    const float m = std::max(a, b), ea = std::exp(a - m), eb = std::exp(b - m), inv = 1.0f / (ea + eb);
    for (int i = 0; i < d; ++i) o[i] = (ea * o[i] + eb * w[i]) * inv;
  }
}

size_t RecentWindow::bytes_per_window_position() const {
  size_t b = 0;
  for (int l = 0; l < copies_.n_layers(); ++l)
    if (covers(l)) b += copies_.slot_bytes(l) * static_cast<size_t>(copies_.n_kv_heads());
  return b;
}

}  // namespace tqkv::engine
