// Decode attention over a page pool: the kernels read the pages in place through the block
// table, one run of slots per page; the page layout hands them the planes directly.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "attention_driver.h"
#include "tqkv/error.h"
#include "tqkv/page_pool.h"
#include "tqkv/paged_cache.h"
#include "tqkv/reference_attention.h"

namespace tqkv {
namespace {

class PageSource final : public cpu::KvSource {
 public:
  PageSource(const PagePool& pool, std::span<const int32_t> blocks) : pool_(pool), blocks_(blocks) {}

  // Both layouts give each field a constant stride within a page: one run per page.
  void runs(int head, int64_t k0, int64_t k1, std::vector<cpu::SlotRun>& out) const override {
    const PageGeometry& g = pool_.geometry;
    const int bs = g.block_size;
    const size_t pb = static_cast<size_t>(g.page_bytes());
    for (int64_t p = k0; p <= k1;) {
      const int t0 = static_cast<int>(p % bs);
      const int n = static_cast<int>(std::min<int64_t>(k1 - p + 1, bs - t0));
      const uint8_t* page = pool_.pages + blocks_[p / bs] * pb;
      cpu::SlotRun r{};
      r.pos0 = p;
      r.n = n;
      r.kc = page + g.key_codes(t0, head);
      r.kc_stride = static_cast<size_t>(g.key_code_stride());
      if (g.key_meta_bytes) r.km = page + g.key_meta(t0, head);
      r.km_stride = static_cast<size_t>(g.meta_stride());
      r.vc = page + g.value_codes(t0, head);
      r.vc_stride = static_cast<size_t>(g.value_code_stride());
      if (g.value_meta_bytes) r.vm0 = page + g.value_meta(t0, head, 0);
      if (g.value_meta_bytes >= 4) r.vm1 = page + g.value_meta(t0, head, 1);
      r.vm0_stride = r.vm1_stride = static_cast<size_t>(g.meta_stride());
      out.push_back(r);
      p += n;
    }
  }

 private:
  const PagePool& pool_;
  std::span<const int32_t> blocks_;
};

struct PagedPlan {
  int group;
  float scale;
};

// Visible keys of the query at pos (the sequence's last position): as key_begin / key_end of
// the contiguous cache, whose window starts at 0 here. begin > end when it sees none.
int64_t paged_key_begin(int64_t pos, const AttentionParams& params) {
  int64_t begin = std::max<int64_t>(0, params.min_key_pos);
  if (params.window > 0) begin = std::max(begin, pos - params.window + 1);
  return begin;
}
int64_t paged_key_end(int64_t pos, const AttentionParams& params) { return pos - params.exclude_recent; }

PagedPlan check_paged(const SlotCodec& codec, const PagePool& pool, std::span<const PagedSeq> seqs,
                      const AttentionParams& params) {
  const int H = pool.geometry.n_kv_heads, d = codec.dim(), bs = pool.geometry.block_size;
  if (params.head_dim != 0 && params.head_dim != d)
    throw Error(ErrorCode::InvalidArgument, "paged attention: query head dim " + std::to_string(params.head_dim) +
                                                " does not match the cache's " + std::to_string(d));
  if (params.n_q_heads < H || params.n_q_heads % H != 0)
    throw Error(ErrorCode::InvalidArgument, "paged attention: n_q_heads " + std::to_string(params.n_q_heads) +
                                                " is not a multiple of n_kv_heads " + std::to_string(H));
  if (params.window < 0) throw Error(ErrorCode::InvalidArgument, "paged attention: negative window");
  if (params.exclude_recent < 0) throw Error(ErrorCode::InvalidArgument, "paged attention: negative exclude_recent");
  for (size_t b = 0; b < seqs.size(); ++b) {
    const PagedSeq& s = seqs[b];
    if (s.len <= 0)
      throw Error(ErrorCode::OutOfRange, "paged attention: sequence " + std::to_string(b) + " is empty");
    const int64_t pages = (s.len + bs - 1) / bs;
    if (pages > static_cast<int64_t>(s.blocks.size()))
      throw Error(ErrorCode::OutOfRange, "paged attention: sequence " + std::to_string(b) + " of length " +
                                             std::to_string(s.len) + " needs " + std::to_string(pages) +
                                             " pages, its block table holds " + std::to_string(s.blocks.size()));
    for (int64_t i = 0; i < pages; ++i)
      if (s.blocks[i] < 0 || s.blocks[i] >= pool.num_blocks)
        throw Error(ErrorCode::OutOfRange, "paged attention: sequence " + std::to_string(b) + " names block " +
                                               std::to_string(s.blocks[i]) + ", outside the pool of " +
                                               std::to_string(pool.num_blocks));
  }
  return {params.n_q_heads / H, params.scale != 0 ? params.scale : 1.0f / std::sqrt(static_cast<float>(d))};
}

// The cache's sequences as the pool functions take them (unknown ids throw OutOfRange).
std::vector<PagedSeq> cache_seqs(const PagedCache& cache, int layer, std::span<const int64_t> seqs) {
  if (layer < 0 || layer >= cache.n_layers())
    throw Error(ErrorCode::OutOfRange, "paged attention: layer " + std::to_string(layer) + " out of range");
  std::vector<PagedSeq> out;
  for (int64_t s : seqs) {
    if (!cache.has_sequence(s)) throw Error(ErrorCode::OutOfRange, "paged attention: unknown sequence " + std::to_string(s));
    out.push_back(cache.paged_seq(s));
  }
  return out;
}

}  // namespace

void pool_attention(const SlotCodec& codec, const PagePool& pool, std::span<const PagedSeq> seqs, const float* q,
                    const AttentionParams& params, float* out) {
  const PagedPlan plan = check_paged(codec, pool, seqs, params);
  const int H = pool.geometry.n_kv_heads, Hq = params.n_q_heads, d = codec.dim();
  std::vector<PageSource> sources;
  sources.reserve(seqs.size());
  for (const PagedSeq& s : seqs) sources.emplace_back(pool, s.blocks);
  std::vector<cpu::AttnGroup> groups;
  groups.reserve(seqs.size() * H);
  AttentionParams row = params;
  for (size_t b = 0; b < seqs.size(); ++b) {  // sequence b: one query at its last position
    if (params.lse) row.lse = params.lse + b * Hq;
    cpu::push_chunk_groups(codec, sources[b], H, plan.group, plan.scale, q + b * Hq * d, 1, seqs[b].len - 1, 0, row,
                           out + b * Hq * d, groups);
  }
  cpu::run_attention_groups(codec, groups);
}

void pool_chunk_attention(const SlotCodec& codec, const PagePool& pool, const PagedSeq& seq, const float* q, int n_q,
                          int64_t q_pos0, const AttentionParams& params, float* out) {
  if (n_q < 0) throw Error(ErrorCode::InvalidArgument, "paged attention: negative query count");
  if (n_q == 0) return;
  if (q_pos0 < 0 || q_pos0 + n_q > seq.len)
    throw Error(ErrorCode::OutOfRange, "paged attention: query positions [" + std::to_string(q_pos0) + ", " +
                                           std::to_string(q_pos0 + n_q) + ") are not in the sequence's [0, " +
                                           std::to_string(seq.len) + ")");
  const PagedPlan plan = check_paged(codec, pool, std::span<const PagedSeq>(&seq, 1), params);
  const PageSource src(pool, seq.blocks);
  std::vector<cpu::AttnGroup> groups;
  cpu::push_chunk_groups(codec, src, pool.geometry.n_kv_heads, plan.group, plan.scale, q, n_q, q_pos0, 0, params, out,
                         groups);
  cpu::run_attention_groups(codec, groups);
}

void pool_attention_reference(const SlotCodec& codec, const PagePool& pool, std::span<const PagedSeq> seqs,
                              const float* q, const AttentionParams& params, float* out) {
  const PagedPlan plan = check_paged(codec, pool, seqs, params);
  const PageGeometry& geo = pool.geometry;
  const int H = geo.n_kv_heads, Hq = params.n_q_heads, d = codec.dim(), bs = geo.block_size;
  const size_t sb = codec.slot_bytes();
  const auto pb = static_cast<size_t>(geo.page_bytes());
  for (size_t b = 0; b < seqs.size(); ++b) {
    const int64_t pos = seqs[b].len - 1;
    const int64_t begin = paged_key_begin(pos, params);
    const int n = static_cast<int>(std::max<int64_t>(0, paged_key_end(pos, params) - begin + 1));
    std::vector<uint8_t> bytes(static_cast<size_t>(n) * sb);
    std::vector<const uint8_t*> slots(n);
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < n; ++i) {
        const int64_t p = begin + i;
        gather_slot(geo, pool.pages + seqs[b].blocks[p / bs] * pb, static_cast<int>(p % bs), h, bytes.data() + i * sb);
        slots[i] = bytes.data() + i * sb;
      }
      const size_t off = (b * Hq + static_cast<size_t>(h) * plan.group) * d;
      reference_attention(codec, slots.data(), n, q + off, plan.group, plan.scale, out + off,
                          params.lse ? params.lse + b * Hq + static_cast<size_t>(h) * plan.group : nullptr);
    }
  }
}

void paged_attention(const PagedCache& cache, int layer, std::span<const int64_t> seqs, const float* q,
                     const AttentionParams& params, float* out) {
  const std::vector<PagedSeq> s = cache_seqs(cache, layer, seqs);
  pool_attention(cache.codec(layer), cache.page_pool(layer), s, q, params, out);
}

void paged_chunk_attention(const PagedCache& cache, int layer, int64_t seq, const float* q, int n_q, int64_t q_pos0,
                           const AttentionParams& params, float* out) {
  const int64_t one[1] = {seq};
  const std::vector<PagedSeq> s = cache_seqs(cache, layer, one);
  pool_chunk_attention(cache.codec(layer), cache.page_pool(layer), s[0], q, n_q, q_pos0, params, out);
}

void paged_attention_reference(const PagedCache& cache, int layer, std::span<const int64_t> seqs, const float* q,
                               const AttentionParams& params, float* out) {
  const std::vector<PagedSeq> s = cache_seqs(cache, layer, seqs);
  pool_attention_reference(cache.codec(layer), cache.page_pool(layer), s, q, params, out);
}

}  // namespace tqkv
