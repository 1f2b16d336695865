// Issue 6: the uncompressed copies next to a compressed cache (RecentWindow): attention sinks
// [0, S), the recent window (p - W, p] and the compressed middle, merged by log-sum-exp, must
// equal attention over one key set built by hand from the same three sources.
#include <gtest/gtest.h>

#include "../common/test_data.h"

#include <cmath>
#include <random>
#include <vector>

#include "engine/cache/recent_window.h"
#include "tqkv/error.h"
#include "tqkv/half.h"

namespace tqkv::engine {
namespace {

std::vector<float> gaussian(size_t n, uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, sd);
  std::vector<float> x(n);
  for (float& e : x) e = g(rng);
  return x;
}

float f16(float x) { return half_to_float(float_to_half(x)); }

struct TwoLayerCache {
  static constexpr int H = 2, Hq = 6, d = 64, cap = 64;
  ContiguousCache cache;
  explicit TwoLayerCache(const char* fmt) : cache(config(fmt)) {}
  // What the copies sit beside, and the compressed part of layer l's attention.
  CopiedLayers layers() const { return {cache.config().layer_formats, H, d, cache.config().seed}; }
  CompressedPart part(int l, const float* q, int n, int64_t pos0) const {
    return [=, this](const AttentionParams& p, float* out) { tqkv::attention(cache, l, q, n, pos0, p, out); };
  }
  static ContiguousCacheConfig config(const char* fmt) {
    ContiguousCacheConfig c;
    c.n_layers = 2;
    c.n_kv_heads = H;
    c.head_dim = d;
    c.capacity = cap;
    c.layer_formats = {find_format(fmt), find_format(fmt)};
    return c;
  }
};

// The oracle: for a query at p, key j comes from an f16 copy when j < S or j > p - W, from
// the compressed slot (decoded) otherwise (own_exact: key p as given, unrounded); plain softmax
// attention in double.
std::vector<float> oracle(const ContiguousCache& cache, int layer, const std::vector<float>& k,
                          const std::vector<float>& v, const std::vector<float>& q, int n, int64_t pos0, int S,
                          int W, bool own_exact = false) {
  const int H = cache.n_kv_heads(), d = cache.head_dim(), Hq = TwoLayerCache::Hq, group = Hq / H;
  const SlotCodec& codec = cache.codec(layer);
  std::vector<float> out(static_cast<size_t>(n) * Hq * d), kd(d), vd(d);
  for (int t = 0; t < n; ++t) {
    const int64_t p = pos0 + t;
    for (int hq = 0; hq < Hq; ++hq) {
      const int h = hq / group;
      const float* qr = q.data() + (static_cast<size_t>(t) * Hq + hq) * d;
      std::vector<double> score, acc(d, 0.0);
      std::vector<std::vector<float>> vals;
      for (int64_t j = 0; j <= p; ++j) {
        const size_t src = (static_cast<size_t>(j) * H + h) * d;
        if (own_exact && j == p) {
          for (int i = 0; i < d; ++i) kd[i] = k[src + i], vd[i] = v[src + i];
        } else if (j < S || j > p - W) {
          for (int i = 0; i < d; ++i) kd[i] = f16(k[src + i]), vd[i] = f16(v[src + i]);
        } else {
          const uint8_t* slot = cache.slot(layer, h, j);
          codec.decode_key(slot, kd.data());
          codec.decode_value(slot + codec.key_bytes(), vd.data());
        }
        double s = 0;
        for (int i = 0; i < d; ++i) s += static_cast<double>(qr[i]) * kd[i];
        score.push_back(s / std::sqrt(static_cast<double>(d)));
        vals.push_back(vd);
      }
      double m = -1e300, sum = 0;
      for (double s : score) m = std::max(m, s);
      for (size_t j = 0; j < score.size(); ++j) {
        const double e = std::exp(score[j] - m);
        sum += e;
        for (int i = 0; i < d; ++i) acc[i] += e * vals[j][i];
      }
      for (int i = 0; i < d; ++i) out[(static_cast<size_t>(t) * Hq + hq) * d + i] = static_cast<float>(acc[i] / sum);
    }
  }
  return out;
}

double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * double(a[i] - b[i]), den += double(b[i]) * b[i];
  return std::sqrt(num / den);
}

// Writes n_total tokens of k, v into both layers of s and rw in batches of 3, 8, 8, 8, 8, then
// one at a time (prefills that straddle the sinks and the window, then decode), and returns the
// attention of layer 1's queries; fold: each query's own k, v passed in (its position folded in).
std::vector<float> run_batches(TwoLayerCache& s, RecentWindow& rw, const std::vector<float>& k,
                               const std::vector<float>& v, const std::vector<float>& q, bool fold) {
  const int H = TwoLayerCache::H, Hq = TwoLayerCache::Hq, d = TwoLayerCache::d;
  AttentionParams ap;
  ap.n_q_heads = Hq;
  std::vector<float> out(q.size(), NAN);
  int64_t p = 0;
  for (int m : {3, 8, 8, 8, 8, 1, 1, 1, 1, 1}) {
    const size_t kv_off = static_cast<size_t>(p) * H * d, q_off = static_cast<size_t>(p) * Hq * d;
    for (int l = 0; l < 2; ++l) {
      s.cache.write(l, p, m, k.data() + kv_off, v.data() + kv_off);
      rw.write(l, p, m, k.data() + kv_off, v.data() + kv_off);
    }
    rw.attention(s.part(1, q.data() + q_off, m, p), 1, q.data() + q_off, m, p, ap, out.data() + q_off, fold ? k.data() + kv_off : nullptr,
                 fold ? v.data() + kv_off : nullptr);
    p += m;
  }
  EXPECT_EQ(p * Hq * d, static_cast<int64_t>(q.size()));
  return out;
}

// Sinks, window, both: prefill batches that straddle the sinks and the window, then decode.
TEST(RecentWindow, SinksWindowAndCompressedPartsMergeExactly) {
  testing_util::ScoresGuard exact(KeyScores::Exact);  // the oracle scores in double
  const int n_total = 40, H = TwoLayerCache::H, Hq = TwoLayerCache::Hq, d = TwoLayerCache::d;
  const auto k = gaussian(static_cast<size_t>(n_total) * H * d, 1), v = gaussian(k.size(), 2);
  const auto q = gaussian(static_cast<size_t>(n_total) * Hq * d, 3);
  for (auto [S, W] : {std::pair{1, 0}, std::pair{3, 0}, std::pair{0, 5}, std::pair{2, 5}, std::pair{4, 1}}) {
    TwoLayerCache s("tq-k2v2");
    RecentWindow rw(s.layers(), W, 8, S);
    EXPECT_EQ(rw.sinks(), S);
    const auto out = run_batches(s, rw, k, v, q, false);
    const auto want = oracle(s.cache, 1, k, v, q, n_total, 0, S, W);
    EXPECT_LT(rel_error(out, want), 1e-5) << "S=" << S << " W=" << W;
    // Memory: S sink positions and W window positions of f16 copies.
    EXPECT_EQ(rw.copy_bytes(n_total), rw.bytes_per_window_position() * static_cast<size_t>(std::min(W, n_total)) +
                                          rw.bytes_per_sink_position() * static_cast<size_t>(S));
    EXPECT_EQ(rw.bytes_per_sink_position(), rw.bytes_per_window_position());  // both f16 here
  }
}

// With the layer's new keys and values passed in, each query reads its own position from them
// (exact, not an f16 copy or a code) and every part stops before it; the rest is unchanged.
TEST(RecentWindow, OwnPositionFoldedInExactly) {
  testing_util::ScoresGuard exact(KeyScores::Exact);
  const int n_total = 40, H = TwoLayerCache::H, Hq = TwoLayerCache::Hq, d = TwoLayerCache::d;
  const auto k = gaussian(static_cast<size_t>(n_total) * H * d, 11), v = gaussian(k.size(), 12);
  const auto q = gaussian(static_cast<size_t>(n_total) * Hq * d, 13);
  for (auto [S, W] : {std::pair{1, 0}, std::pair{3, 0}, std::pair{0, 5}, std::pair{2, 5}, std::pair{4, 1}}) {
    TwoLayerCache s("tq-k2v2");
    RecentWindow rw(s.layers(), W, 8, S);
    const auto out = run_batches(s, rw, k, v, q, true);
    const auto want = oracle(s.cache, 1, k, v, q, n_total, 0, S, W, true);
    EXPECT_LT(rel_error(out, want), 1e-5) << "S=" << S << " W=" << W;
    // The oracle with key p read from its copy differs: the fold is not a no-op.
    EXPECT_GT(rel_error(out, oracle(s.cache, 1, k, v, q, n_total, 0, S, W)), 1e-5) << "S=" << S << " W=" << W;
    // The first token attends to itself alone: its output is its value, bit for bit.
    for (int hq = 0; hq < Hq; ++hq)
      for (int i = 0; i < d; ++i) ASSERT_EQ(out[static_cast<size_t>(hq) * d + i], v[static_cast<size_t>(hq / (Hq / H)) * d + i]);
  }
}

// A fresh run (pos0 0) longer than the ring (window + max_batch) is taken whole: its queries
// read none of the copies, and the ring keeps its last positions — all that the queries of
// the steps after it read, merged exactly as after short steps.
TEST(RecentWindow, FreshRunLongerThanTheRingKeepsItsLastPositions) {
  testing_util::ScoresGuard exact(KeyScores::Exact);
  const int fresh = 30, n_total = 34, H = TwoLayerCache::H, Hq = TwoLayerCache::Hq, d = TwoLayerCache::d;
  const auto k = gaussian(static_cast<size_t>(n_total) * H * d, 21), v = gaussian(k.size(), 22);
  const auto q = gaussian(static_cast<size_t>(n_total) * Hq * d, 23);
  for (auto [S, W] : {std::pair{0, 5}, std::pair{2, 5}, std::pair{3, 0}}) {
    TwoLayerCache s("tq-k2v2");
    RecentWindow rw(s.layers(), W, 8, S);  // a ring of W + 8 < 30 positions
    for (int l = 0; l < 2; ++l) {
      s.cache.write(l, 0, fresh, k.data(), v.data());
      rw.write(l, 0, fresh, k.data(), v.data());
    }
    AttentionParams ap;
    ap.n_q_heads = Hq;
    for (int64_t p = fresh; p < n_total; ++p) {  // then decode steps
      const size_t kv_off = static_cast<size_t>(p) * H * d, q_off = static_cast<size_t>(p) * Hq * d;
      for (int l = 0; l < 2; ++l) {
        s.cache.write(l, p, 1, k.data() + kv_off, v.data() + kv_off);
        rw.write(l, p, 1, k.data() + kv_off, v.data() + kv_off);
      }
      const std::vector<float> qp(q.begin() + static_cast<int64_t>(q_off), q.begin() + static_cast<int64_t>(q_off) + Hq * d);
      std::vector<float> out(qp.size());
      rw.attention(s.part(1, qp.data(), 1, p), 1, qp.data(), 1, p, ap, out.data());
      // The oracle wants the query's keys from position 0: hand it the whole prefix.
      const std::vector<float> q_all(q.begin(), q.begin() + static_cast<int64_t>(q_off) + Hq * d);
      const auto want = oracle(s.cache, 1, k, v, q_all, static_cast<int>(p) + 1, 0, S, W);
      const std::vector<float> want_p(want.begin() + static_cast<int64_t>(q_off), want.end());
      EXPECT_LT(rel_error(out, want_p), 1e-5) << "S=" << S << " W=" << W << " p=" << p;
    }
  }
  // A run of more than max_batch after the first is still refused.
  TwoLayerCache s("tq-k2v2");
  RecentWindow rw(s.layers(), 5, 8, 0);
  rw.write(1, 0, fresh, k.data(), v.data());
  EXPECT_THROW(rw.write(1, fresh, 9, k.data(), v.data()), Error);
}

TEST(RecentWindow, BadArgumentsAndOverflowChangeNothing) {
  TwoLayerCache s("tq-k4v4");
  EXPECT_THROW(RecentWindow(s.layers(), 0, 8, 0), Error);
  EXPECT_THROW(RecentWindow(s.layers(), -1, 8, 2), Error);
  EXPECT_THROW(RecentWindow(s.layers(), 4, 8, -1), Error);
  EXPECT_THROW(RecentWindow(s.layers(), 4, 8, RecentWindow::kMaxSinks + 1), Error);
  EXPECT_THROW(RecentWindow(s.layers(), 4, 0, 1), Error);
  RecentWindow rw(s.layers(), 0, 8, 2);
  const int H = TwoLayerCache::H, d = TwoLayerCache::d, Hq = TwoLayerCache::Hq;
  auto k = gaussian(static_cast<size_t>(2) * H * d, 4), v = gaussian(k.size(), 5);
  const auto q = gaussian(static_cast<size_t>(2) * Hq * d, 6);
  s.cache.write(1, 0, 2, k.data(), v.data());
  auto bad = k;
  bad[d + 3] = 1e6f;  // a sink key beyond fp16: rejected before anything is copied
  EXPECT_THROW(rw.write(1, 0, 2, bad.data(), v.data()), Error);
  bad[d + 3] = NAN;
  EXPECT_THROW(rw.write(1, 0, 2, bad.data(), v.data()), Error);
  rw.write(1, 0, 2, k.data(), v.data());
  const auto k9 = gaussian(static_cast<size_t>(9) * H * d, 7);
  EXPECT_THROW(rw.write(1, 2, 9, k9.data(), k9.data()), Error);  // more than max_batch after the first step
  AttentionParams ap;
  ap.n_q_heads = Hq;
  std::vector<float> out(q.size());
  rw.attention(s.part(1, q.data(), 2, 0), 1, q.data(), 2, 0, ap, out.data());
  EXPECT_LT(rel_error(out, oracle(s.cache, 1, k, v, q, 2, 0, 2, 0)), 1e-5);
}

}  // namespace
}  // namespace tqkv::engine
