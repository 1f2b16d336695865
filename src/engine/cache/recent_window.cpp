#include "engine/cache/recent_window.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "tqkv/error.h"
#include "tqkv/half.h"

namespace tqkv::engine {
namespace {

constexpr float kNone = -std::numeric_limits<float>::infinity();

ContiguousCacheConfig copy_config(const CopiedLayers& main, int window, int max_batch, int sinks,
                                  const Format* window_format) {
  if (window < 0 || sinks < 0 || window + sinks < 1)
    throw Error(ErrorCode::InvalidArgument, "uncompressed copies: need a recent window or sinks of at least 1 token");
  if (sinks > RecentWindow::kMaxSinks)
    throw Error(ErrorCode::InvalidArgument, "attention sinks: at most " + std::to_string(RecentWindow::kMaxSinks));
  if (max_batch < 1) throw Error(ErrorCode::InvalidArgument, "recent window: max_batch must be at least 1");
  ContiguousCacheConfig c;
  c.n_layers = static_cast<int>(main.formats.size());
  c.n_kv_heads = main.n_kv_heads;
  c.head_dim = main.head_dim;
  c.capacity = window > 0 ? window + max_batch : 1;  // a sinks-only instance never writes it
  c.layer_formats.assign(main.formats.size(), window_format ? *window_format : find_format("f16"));
  c.seed = main.seed;
  return c;
}

// Folds a part (its rows' outputs w and log-sum-exps b) into the running result (o, a).
void merge_part(size_t rows, int d, float* out, float* lse, const float* part, const float* part_lse) {
  for (size_t r = 0; r < rows; ++r) {
    const float a = lse[r], b = part_lse[r];
    if (b == kNone) continue;
    float* o = out + r * d;
    const float* w = part + r * d;
    if (a == kNone) {
      for (int i = 0; i < d; ++i) o[i] = w[i];
      lse[r] = b;
      continue;
    }
    const float m = std::max(a, b), ea = std::exp(a - m), eb = std::exp(b - m), inv = 1.0f / (ea + eb);
    for (int i = 0; i < d; ++i) o[i] = (ea * o[i] + eb * w[i]) * inv;
    lse[r] = m + std::log(ea + eb);
  }
}

}  // namespace

RecentWindow::RecentWindow(const CopiedLayers& main, int window, int max_batch, int sinks,
                           const Format* window_format)
    : window_(window),
      max_batch_(max_batch),
      sinks_(sinks),
      n_kv_heads_(main.n_kv_heads),
      head_dim_(main.head_dim),
      copies_(copy_config(main, window, max_batch, sinks, window_format)) {
  for (const Format& f : main.formats) covered_.push_back(f.compressed());
  const size_t n = main.formats.size() * n_kv_heads_ * sinks_ * head_dim_;
  sink_k_.assign(n, 0.0f);
  sink_v_.assign(n, 0.0f);
}

bool RecentWindow::copy_prefix(const RecentWindow& src, int64_t n) {
  if (src.window_ != window_ || src.sinks_ != sinks_ || src.sink_k_.size() != sink_k_.size() ||
      src.copies_.capacity() != copies_.capacity())
    return false;
  if (window_ > 0) {
    const int64_t lo = std::max({int64_t{0}, src.copies_.first_pos(), n - copies_.capacity()});
    if (lo > std::max<int64_t>(0, n - window_) || src.copies_.seq_len() < n) return false;
    copies_.copy_positions(src.copies_, lo, n);
  }
  sink_k_ = src.sink_k_;  // positions >= n among them are rewritten when the sequence gets there
  sink_v_ = src.sink_v_;
  return true;
}

void RecentWindow::write(int layer, int64_t pos0, int n, const float* k, const float* v) {
  if (n > max_batch_ && pos0 != 0)
    throw Error(ErrorCode::Capacity, "recent window: a batch of " + std::to_string(n) + " tokens exceeds max_batch " +
                                         std::to_string(max_batch_));
  if (!covers(layer)) return;
  const int H = n_kv_heads_, d = head_dim_;
  const int n_sink = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(pos0 + n, sinks_) - pos0));
  const size_t row = static_cast<size_t>(H) * d;
  for (size_t i = 0; i < static_cast<size_t>(n_sink) * row; ++i)  // check before anything is written
    if (!(std::fabs(k[i]) <= 65504.0f) || !(std::fabs(v[i]) <= 65504.0f))
      throw Error(ErrorCode::Overflow, "attention sink: key or value element beyond the fp16 range (or NaN)");
  if (window_ > 0) {
    // A fresh run (pos0 0) may be longer than the ring: its queries read none of the copies, and
    // the ring keeps its last positions, all that later queries read.
    const int keep = std::min(n, copies_.capacity());
    const int64_t from = pos0 + n - keep;
    if (from > copies_.seq_len()) copies_.skip_to(from);
    copies_.write(layer, from, keep, k + static_cast<size_t>(n - keep) * row, v + static_cast<size_t>(n - keep) * row);
  }
  for (int t = 0; t < n_sink; ++t)
    for (int h = 0; h < H; ++h) {
      const size_t dst = ((static_cast<size_t>(layer) * H + h) * sinks_ + static_cast<size_t>(pos0 + t)) * d;
      for (int i = 0; i < d; ++i) {
        sink_k_[dst + i] = half_to_float(float_to_half(k[t * row + h * d + i]));
        sink_v_[dst + i] = half_to_float(float_to_half(v[t * row + h * d + i]));
      }
    }
}

void RecentWindow::sink_attention(int layer, const float* q, int n, int64_t pos0, const AttentionParams& params,
                                  float* out, float* lse, bool newest_out) const {
  const int Hq = params.n_q_heads, H = n_kv_heads_, d = head_dim_, group = Hq / H;
  const float scale = params.scale != 0 ? params.scale : 1.0f / std::sqrt(static_cast<float>(d));
  float score[kMaxSinks];
  for (int t = 0; t < n; ++t) {
    const int64_t p = pos0 + t;
    int64_t begin = params.min_key_pos;
    if (params.window > 0) begin = std::max<int64_t>(begin, p - params.window + 1);
    const int64_t end = std::min<int64_t>(sinks_ - 1, newest_out ? p - 1 : p);
    for (int hq = 0; hq < Hq; ++hq) {
      const size_t r = static_cast<size_t>(t) * Hq + hq;
      float* o = out + r * d;
      for (int i = 0; i < d; ++i) o[i] = 0;
      lse[r] = kNone;
      if (begin > end) continue;
      const float* qr = q + r * d;
      const size_t base = (static_cast<size_t>(layer) * H + hq / group) * sinks_;
      float m = kNone;
      for (int64_t j = begin; j <= end; ++j) {
        const float* kj = sink_k_.data() + (base + j) * d;
        float s = 0;
        for (int i = 0; i < d; ++i) s += qr[i] * kj[i];
        score[j] = s * scale;
        m = std::max(m, score[j]);
      }
      float sum = 0;
      for (int64_t j = begin; j <= end; ++j) {
        const float e = std::exp(score[j] - m);
        sum += e;
        const float* vj = sink_v_.data() + (base + j) * d;
        for (int i = 0; i < d; ++i) o[i] += e * vj[i];
      }
      for (int i = 0; i < d; ++i) o[i] /= sum;
      lse[r] = m + std::log(sum);
    }
  }
}

void RecentWindow::newest_attention(const float* q, int n, int64_t pos0, const AttentionParams& params,
                                    const float* k_new, const float* v_new, float* out, float* lse) const {
  const int Hq = params.n_q_heads, H = n_kv_heads_, d = head_dim_, group = Hq / H;
  const float scale = params.scale != 0 ? params.scale : 1.0f / std::sqrt(static_cast<float>(d));
  for (int t = 0; t < n; ++t) {
    const bool seen = pos0 + t >= params.min_key_pos;  // a query always sits inside its own window
    for (int hq = 0; hq < Hq; ++hq) {
      const size_t r = static_cast<size_t>(t) * Hq + hq, kv = (static_cast<size_t>(t) * H + hq / group) * d;
      const float* qr = q + r * d;
      float s = 0;
      for (int i = 0; i < d; ++i) s += qr[i] * k_new[kv + i];
      lse[r] = seen ? s * scale : kNone;  // one key: its log-sum-exp is its score, its output its value
      for (int i = 0; i < d; ++i) out[r * d + i] = v_new[kv + i];
    }
  }
}

void RecentWindow::attention(const CompressedPart& main, int layer, const float* q, int n, int64_t pos0,
                             const AttentionParams& params, float* out, const float* k_new, const float* v_new) {
  const int Hq = params.n_q_heads, d = head_dim_;
  const size_t rows = static_cast<size_t>(n) * Hq;
  const bool fold = k_new && v_new;
  lse_main_.resize(rows);
  AttentionParams older = params;
  older.min_key_pos = std::max<int64_t>(params.min_key_pos, sinks_);
  older.exclude_recent = fold ? std::max(window_, 1) : window_;
  older.lse = lse_main_.data();
  main(older, out);
  if (window_ > 0) {
    out_recent_.resize(rows * d);
    lse_recent_.resize(rows);
    AttentionParams recent = params;
    recent.min_key_pos = older.min_key_pos;
    recent.window = params.window > 0 ? std::min(params.window, window_) : window_;
    recent.exclude_recent = fold ? 1 : 0;
    recent.lse = lse_recent_.data();
    tqkv::attention(copies_, layer, q, n, pos0, recent, out_recent_.data());
    merge_part(rows, d, out, lse_main_.data(), out_recent_.data(), lse_recent_.data());
  }
  if (sinks_ > 0 && pos0 + n > params.min_key_pos) {
    out_sink_.resize(rows * d);
    lse_sink_.resize(rows);
    sink_attention(layer, q, n, pos0, params, out_sink_.data(), lse_sink_.data(), fold);
    merge_part(rows, d, out, lse_main_.data(), out_sink_.data(), lse_sink_.data());
  }
  if (fold) {
    out_new_.resize(rows * d);
    lse_new_.resize(rows);
    newest_attention(q, n, pos0, params, k_new, v_new, out_new_.data(), lse_new_.data());
    merge_part(rows, d, out, lse_main_.data(), out_new_.data(), lse_new_.data());
  }
}

size_t RecentWindow::bytes_per_window_position() const {
  size_t b = 0;
  for (int l = 0; l < copies_.n_layers(); ++l)
    if (covers(l)) b += copies_.slot_bytes(l) * static_cast<size_t>(copies_.n_kv_heads());
  return b;
}

size_t RecentWindow::bytes_per_sink_position() const {
  size_t b = 0;
  for (int l = 0; l < copies_.n_layers(); ++l)
    if (covers(l)) b += static_cast<size_t>(4) * head_dim_ * n_kv_heads_;  // f16 key and value
  return b;
}

size_t RecentWindow::copy_bytes(int64_t held) const {
  return bytes_per_window_position() * static_cast<size_t>(std::min<int64_t>(window_, held)) +
         bytes_per_sink_position() * static_cast<size_t>(std::min<int64_t>(sinks_, held));
}

}  // namespace tqkv::engine
