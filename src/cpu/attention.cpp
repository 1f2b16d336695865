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
      const int64_t n = std::min({k1 - p + 1, cap - idx, cpu::kRunAlign - p % cpu::kRunAlign});
      out.push_back(cpu::slot_layout_run(f, d, base + idx * sb, sb, p, static_cast<int>(n)));
      p += n;
    }
  }

 private:
  const ContiguousCache& cache_;
  int layer_;
};

}  // namespace

void attention(const ContiguousCache& cache, int layer, const float* q, int n_q, int64_t q_pos0,
               const AttentionParams& params, float* out) {
  const AttentionPlan plan = check_attention(cache, layer, n_q, q_pos0, params);
  if (n_q == 0) return;
  const SlotCodec& codec = cache.codec(layer);
  const RingSource src(cache, layer);
  std::vector<cpu::AttnGroup> groups;
  cpu::push_chunk_groups(codec, src, cache.n_kv_heads(), plan.group, plan.scale, q, n_q, q_pos0, cache.first_pos(),
                         params, out, groups);
  cpu::run_attention_groups(codec, groups);
}

}  // namespace tqkv
