#include "outlier_keys.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "tqkv/error.h"

namespace tqkv::research {

OutlierKeySplit::OutlierKeySplit(const ModelConfig& cfg, int n, std::vector<int> key_bits)
    : cfg_(cfg), n_(n), key_bits_(std::move(key_bits)) {
  if (n < 2 || n >= cfg.head_dim || n % 2 != 0)
    throw Error(ErrorCode::InvalidArgument, "outlier channels: need an even count in [2, head_dim), got " +
                                                std::to_string(n));
  if (static_cast<int>(key_bits_.size()) != cfg.n_layers)
    throw Error(ErrorCode::InvalidArgument, "outlier channels: one key width per layer");
  for (int b : key_bits_)
    if (b < 0 || b > 7) throw Error(ErrorCode::InvalidArgument, "outlier channels: key bits out of 1..7");
  is_outlier_.resize(static_cast<size_t>(cfg.n_layers) * cfg.n_kv_heads);
}

const SlotCodec& OutlierKeySplit::codec(int bits, int dim) {
  for (const SlotCodec& c : codecs_)
    if (c.format().key_bits == bits && c.dim() == dim) return c;
  codecs_.emplace_back(
      Format{KeyCodec::Mse, static_cast<uint8_t>(bits), ValueCodec::F16, 16, true, Law::Sphere, RotationKind::Srht}, dim);
  return codecs_.back();
}

std::vector<int> OutlierKeySplit::outliers(int layer, int head) const {
  const auto& m = is_outlier_.at(static_cast<size_t>(layer) * cfg_.n_kv_heads + head);
  std::vector<int> out;
  for (int i = 0; i < static_cast<int>(m.size()); ++i)
    if (m[i]) out.push_back(i);
  return out;
}

void OutlierKeySplit::apply(int layer, int n, float* k) {
  const int b = key_bits_.at(layer), H = cfg_.n_kv_heads, d = cfg_.head_dim;
  if (b == 0 || n <= 0) return;
  const size_t row = static_cast<size_t>(H) * d;
  for (int h = 0; h < H; ++h) {
    auto& mask = is_outlier_[static_cast<size_t>(layer) * H + h];
    if (mask.empty()) {
      // Energy per channel, summed over each RoPE pair (a pair is chosen whole); channels
      // RoPE leaves alone stand alone and are taken in pairs of two by energy order.
      std::vector<double> e(d, 0.0);
      for (int t = 0; t < n; ++t)
        for (int i = 0; i < d; ++i) e[i] += static_cast<double>(k[t * row + h * d + i]) * k[t * row + h * d + i];
      std::vector<std::vector<int>> groups;
      std::vector<uint8_t> seen(d, 0);
      const int half = cfg_.rope.n_rot / 2;
      for (int i = 0; i < d; ++i) {
        if (seen[i]) continue;
        int p = i;
        if (i < cfg_.rope.n_rot) p = cfg_.rope.layout == engine::RopeLayout::Adjacent ? (i ^ 1) : (i < half ? i + half : i - half);
        seen[i] = seen[p] = 1;
        groups.push_back(p == i ? std::vector<int>{i} : std::vector<int>{i, p});
      }
      std::vector<double> ge(groups.size(), 0.0);
      for (size_t g = 0; g < groups.size(); ++g)
        for (int i : groups[g]) ge[g] += e[i] / groups[g].size();  // energy per channel
      std::vector<size_t> order(groups.size());
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t c) { return ge[a] > ge[c]; });
      mask.assign(d, 0);
      int taken = 0;
      for (size_t g : order) {
        if (taken + static_cast<int>(groups[g].size()) > n_) continue;
        for (int i : groups[g]) mask[i] = 1;
        taken += static_cast<int>(groups[g].size());
        if (taken == n_) break;
      }
      for (int i = 0; i < d && taken < n_; ++i)  // odd leftovers: fill with unpaired channels
        if (!mask[i]) mask[i] = 1, ++taken;
    }
    const SlotCodec& hi = codec(b + 1, n_);
    const SlotCodec& lo = codec(b, d - n_);
    std::vector<float> xo(n_), xr(d - n_), yo(n_), yr(d - n_);
    std::vector<uint8_t> bo(hi.key_bytes()), br(lo.key_bytes());
    for (int t = 0; t < n; ++t) {
      float* x = k + t * row + static_cast<size_t>(h) * d;
      for (int i = 0, a = 0, c = 0; i < d; ++i) (mask[i] ? xo[a++] : xr[c++]) = x[i];
      hi.encode_key(xo.data(), bo.data());
      lo.encode_key(xr.data(), br.data());
      hi.decode_key(bo.data(), yo.data());
      lo.decode_key(br.data(), yr.data());
      for (int i = 0, a = 0, c = 0; i < d; ++i) x[i] = mask[i] ? yo[a++] : yr[c++];
    }
  }
}

}  // namespace tqkv::research
