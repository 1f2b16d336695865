// CPU attention on a contiguous cache: the query heads of each kv head form one block of rows
// (GQA: every slot is decoded once for all of them; in a prefill chunk, for several tokens at
// once with a per-row causal/window mask), and the kernels read the ring's slots in place.
#include "tqkv/attention.h"

#include <algorithm>

#include "attention_checks.h"
#include "attention_driver.h"

namespace tqkv {
namespace {

// The slots of a ring between [k0, k1]: one run, or two where the range wraps.
class RingSource final : public cpu::KvSource {
 public:
  RingSource(const ContiguousCache& cache, int layer) : cache_(cache), layer_(layer) {}
  void runs(int head, int64_t k0, int64_t k1, std::vector<cpu::SlotRun>& out) const override {
    const Format& f = cache_.format(layer_);
    const int d = cache_.head_dim();
    const int64_t cap = cache_.capacity();
    const size_t sb = cache_.slot_stride(layer_);
    const uint8_t* base = cache_.ring(layer_, head);
    for (int64_t p = k0; p <= k1;) {
      const int64_t idx = p % cap;
      const int64_t n = std::min(k1 - p + 1, cap - idx);
      out.push_back(cpu::slot_layout_run(f, d, base + idx * sb, sb, p, static_cast<int>(n)));
      p += n;
    }
  }

 private:
  const ContiguousCache& cache_;
  int layer_;
};

// Rows per block: enough query tokens of a prefill chunk to amortise each decoded tile.
constexpr int kMaxRows = 64;

}  // namespace

void attention(const ContiguousCache& cache, int layer, const float* q, int n_q, int64_t q_pos0,
               const AttentionParams& params, float* out) {
  const AttentionPlan plan = check_attention(cache, layer, n_q, q_pos0, params);
  if (n_q == 0) return;
  const SlotCodec& codec = cache.codec(layer);
  const int H = cache.n_kv_heads(), Hq = params.n_q_heads, G = plan.group, d = cache.head_dim();
  const RingSource src(cache, layer);
  const int tokens_per_block = std::max(1, kMaxRows / G);
  std::vector<cpu::AttnGroup> groups;
  for (int h = 0; h < H; ++h) {
    for (int t0 = 0; t0 < n_q; t0 += tokens_per_block) {
      const int t1 = std::min(n_q, t0 + tokens_per_block);
      cpu::AttnGroup& g = groups.emplace_back();
      g.src = &src;
      g.head = h;
      for (int t = t0; t < t1; ++t) {
        const int64_t pos = q_pos0 + t;
        for (int j = 0; j < G; ++j) {
          const size_t off = (static_cast<size_t>(t) * Hq + static_cast<size_t>(h) * G + j) * d;
          cpu::push_query(codec, q + off, plan.scale, g);
          g.begin.push_back(key_begin(cache, pos, params));
          g.end.push_back(key_end(pos, params));
          g.out.push_back(out + off);
          if (params.lse) g.lse.push_back(params.lse + static_cast<size_t>(t) * Hq + static_cast<size_t>(h) * G + j);
          ++g.rows;
        }
      }
    }
  }
  cpu::run_attention_groups(codec, groups);
}

}  // namespace tqkv
