#include "engine/device/cpu_kv_cache.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "tqkv/attention.h"
#include "tqkv/options.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

// The pool of the full-attention layers (every layer without a ring): address space for
// max_seqs sequences of `capacity` positions (pages are touched only when handed out).
PagedCacheConfig paged_config(const CachePlan& p, const ModelConfig& m) {
  PagedCacheConfig c;
  c.n_kv_heads = m.n_kv_heads;
  c.head_dim = m.head_dim;
  c.block_size = CpuKvCache::kBlockSize;
  c.layout = PageLayout::Page;
  c.layer_formats.clear();
  for (const LayerPlan& L : p.layers)
    if (L.ring == 0) c.layer_formats.push_back(L.format);
  c.n_layers = static_cast<int>(c.layer_formats.size());
  const int64_t pages_per_seq = (p.capacity + c.block_size - 1) / c.block_size;
  if (pages_per_seq * p.max_seqs > INT32_MAX)
    throw Error(ErrorCode::InvalidArgument, "cache: " + std::to_string(p.max_seqs) + " sequences of " +
                                                std::to_string(p.capacity) + " positions exceed the page pool's block ids");
  c.num_blocks = static_cast<int>(pages_per_seq * p.max_seqs);
  return c;
}

}  // namespace

CpuKvCache::CpuKvCache(const CacheSpec& spec, const CacheShape& shape)
    : KvCache(spec, shape),
      centring_(spec, shape.capacity),
      config_(paged_config(plan(), spec.model)),
      pages_(config_) {
  const CachePlan& p = plan();
  ring_config_.n_kv_heads = spec.model.n_kv_heads;
  ring_config_.head_dim = spec.model.head_dim;
  ring_config_.capacity = 0;
  ring_config_.layer_formats.clear();
  int paged = 0;
  for (const LayerPlan& L : p.layers) {
    in_ring_.push_back(L.ring > 0);
    if (L.ring > 0) {
      index_.push_back(static_cast<int>(ring_config_.layer_formats.size()));
      ring_config_.layer_formats.push_back(L.format);
      ring_config_.capacity = std::max<int>(ring_config_.capacity, static_cast<int>(L.ring));
    } else {
      index_.push_back(paged++);
    }
  }
  ring_config_.n_layers = static_cast<int>(ring_config_.layer_formats.size());
  stored_.resize(spec.model.n_layers);
  fold_newest_ = env_bool("TQKV_FOLD_NEWEST");
}

int64_t CpuKvCache::add_sequence() {
  if (static_cast<int>(seqs_.size()) >= max_seqs())
    throw Error(ErrorCode::Capacity, "cache: all " + std::to_string(max_seqs()) + " sequences are in use");
  Sequence s;
  if (ring_config_.n_layers > 0) s.ring = std::make_unique<ContiguousCache>(ring_config_);
  const CachePlan& p = plan();
  if (p.copies()) {
    const Format* wf = p.window_format ? &*p.window_format : nullptr;
    const CopiedLayers paged{config_.layer_formats, config_.n_kv_heads, config_.head_dim, config_.seed};
    // (a ring of window + kCopyStepTokens positions: the plan's copy_ring_positions())
    s.copies = std::make_unique<RecentWindow>(paged, p.window, CachePlan::kCopyStepTokens, p.sinks, wf);
    if (s.ring) {
      const CopiedLayers ring{ring_config_.layer_formats, ring_config_.n_kv_heads, ring_config_.head_dim,
                              ring_config_.seed};
      s.ring_copies = std::make_unique<RecentWindow>(ring, p.window, CachePlan::kCopyStepTokens, p.sinks, wf);
    }
  }
  const int64_t id = pages_.add_sequence();
  seqs_.emplace(id, std::move(s));
  return id;
}

void CpuKvCache::free_sequence(int64_t seq) {
  at(seq);
  pages_.free_sequence(seq);
  seqs_.erase(seq);
}

const CpuKvCache::Sequence& CpuKvCache::at(int64_t seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw Error(ErrorCode::OutOfRange, "cache: unknown sequence " + std::to_string(seq));
  return it->second;
}

int64_t CpuKvCache::seq_len(int64_t seq) const {
  at(seq);
  return pages_.seq_len(seq);
}

RecentWindow* CpuKvCache::copies_of(Sequence& s, int layer) const {
  RecentWindow* c = in_ring_[layer] ? s.ring_copies.get() : s.copies.get();
  return c && c->covers(index_[layer]) ? c : nullptr;
}

void CpuKvCache::check(const Batch& batch) const {
  for (const Batch::Run& r : batch.runs()) {
    const int64_t held = seq_len(r.seq);
    if (r.pos0 != held)
      throw Error(ErrorCode::OutOfRange, "forward: position " + std::to_string(r.pos0) + " of sequence " +
                                             std::to_string(r.seq) + " does not follow the cache (" +
                                             std::to_string(held) + " tokens held)");
    if (r.pos0 + r.count > capacity())
      throw Error(ErrorCode::Capacity, "forward: " + std::to_string(r.pos0 + r.count) + " positions of sequence " +
                                           std::to_string(r.seq) + " exceed the cache capacity of " +
                                           std::to_string(capacity()));
  }
}

namespace {

// A fresh run's attention: its n queries over the run's own keys and values as computed (f32,
// causal, within the params' window), read by the same kernels as an f32 cache.
void fresh_attention(const ModelConfig& m, const float* q, const float* k, const float* v, int n,
                     const AttentionParams& ap, float* out) {
  ContiguousCacheConfig c;
  c.n_layers = 1;
  c.n_kv_heads = m.n_kv_heads;
  c.head_dim = m.head_dim;
  c.capacity = n;
  c.layer_formats = {find_format("f32")};
  ContiguousCache own(c);
  own.write(0, 0, n, k, v);
  tqkv::attention(own, 0, q, n, 0, ap, out);
}

}  // namespace

void CpuKvCache::attend(int layer, const Batch& batch, float* q, float* k, const float* v, float* out) {
  plan().check_steps(batch.runs());  // before anything is written
  centring_.apply(layer, batch.size(), k, q);
  if (key_hook()) key_hook()(layer, batch.size(), k, q);
  // The new keys and values go into the (possibly compressed) cache first; attention then
  // reads every earlier position from the cache, exactly as decode will, and (layers with
  // copies) each query's own key and value as computed — a fresh run reads only its own.
  write(layer, batch, k, v);
  attention(layer, batch, q, out, k, v);
}

void CpuKvCache::store(int layer, const Batch& batch, float* k, const float* v) {
  plan().check_steps(batch.runs());  // before anything is written
  centring_.apply(layer, batch.size(), k, nullptr);
  write(layer, batch, k, v);
  Stored& st = stored_.at(layer);
  st.runs = batch.runs();
  const size_t floats = static_cast<size_t>(batch.size()) * spec().model.n_kv_heads * spec().model.head_dim;
  st.k.assign(k, k + floats);
  st.v.assign(v, v + floats);
}

void CpuKvCache::attend_stored(int layer, const Batch& batch, float* q, float* out) {
  for (const Batch::Run& r : batch.runs())
    if (r.pos0 + r.count > seq_len(r.seq))
      throw Error(ErrorCode::OutOfRange, "cache: attention at positions not stored yet");
  centring_.apply(layer, batch.size(), nullptr, q);
  // The layer's last store() gives each query's own key and value where it wrote this batch.
  const Stored& st = stored_.at(layer);
  const std::vector<Batch::Run> runs = batch.runs();
  const bool same = std::equal(st.runs.begin(), st.runs.end(), runs.begin(), runs.end(),
                               [](const Batch::Run& a, const Batch::Run& b) {
                                 return a.seq == b.seq && a.pos0 == b.pos0 && a.count == b.count && a.begin == b.begin;
                               });
  if (!same)
    for (const Batch::Run& r : runs)
      if (r.pos0 == 0)
        throw Error(ErrorCode::InvalidArgument, "cache: a fresh sequence's queries attend to their own keys and values: "
                                                "store() them in the same batch before attend_stored()");
  attention(layer, batch, q, out, same ? st.k.data() : nullptr, same ? st.v.data() : nullptr);
}

const std::vector<int64_t>& CpuKvCache::run_slots(Sequence& s, const Batch::Run& r) {
  if (r.pos0 == pages_.seq_len(r.seq)) {
    s.step_slots = pages_.append_slots(r.seq, r.count);
    s.step_pos0 = r.pos0;
  } else if (r.pos0 != s.step_pos0 || r.count != static_cast<int>(s.step_slots.size())) {
    throw Error(ErrorCode::OutOfRange, "cache: positions [" + std::to_string(r.pos0) + ", " +
                                           std::to_string(r.pos0 + r.count) + ") of sequence " +
                                           std::to_string(r.seq) + " are neither the next nor this step's");
  }
  return s.step_slots;
}

void CpuKvCache::write(int layer, const Batch& batch, const float* k, const float* v) {
  const ModelConfig& m = spec().model;
  const size_t kv_row = static_cast<size_t>(m.n_kv_heads) * m.head_dim;
  for (const Batch::Run& r : batch.runs()) {
    if (r.count == 0) continue;
    Sequence& s = seqs_.at(r.seq);
    const float* kr = k + static_cast<size_t>(r.begin) * kv_row;
    const float* vr = v + static_cast<size_t>(r.begin) * kv_row;
    // A ring layer keeps the window's positions only; the step appends at most max_step_tokens.
    if (in_ring_[layer]) s.ring->write(index_[layer], r.pos0, r.count, kr, vr);
    else pages_.store(index_[layer], run_slots(s, r), kr, vr, m.n_kv_heads, m.head_dim);
    if (RecentWindow* w = copies_of(s, layer)) w->write(index_[layer], r.pos0, r.count, kr, vr);
  }
}

void CpuKvCache::attention(int layer, const Batch& batch, const float* q, float* out, const float* k_new,
                           const float* v_new) {
  const float* k_fold = fold_newest_ ? k_new : nullptr;
  const float* v_fold = fold_newest_ ? v_new : nullptr;
  const ModelConfig& m = spec().model;
  const size_t kv_row = static_cast<size_t>(m.n_kv_heads) * m.head_dim;
  AttentionParams ap;
  ap.n_q_heads = m.n_heads;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(m.head_dim));
  ap.window = m.window(layer);
  const size_t q_row = static_cast<size_t>(m.n_heads) * m.head_dim;
  const int li = index_[layer];
  for (const Batch::Run& r : batch.runs()) {
    Sequence& s = seqs_.at(r.seq);
    const size_t t0 = static_cast<size_t>(r.begin);
    const float* qr = q + t0 * q_row;
    float* o = out + t0 * q_row;
    if (r.pos0 == 0) {  // fresh: the run's own keys and values, whatever the cache stores
      fresh_attention(m, qr, k_new + t0 * kv_row, v_new + t0 * kv_row, r.count, ap, o);
      continue;
    }
    // The compressed part: the ring of a sliding-window layer, else the sequence's pages.
    const CompressedPart compressed = [&](const AttentionParams& p, float* part_out) {
      if (in_ring_[layer]) tqkv::attention(*s.ring, li, qr, r.count, r.pos0, p, part_out);
      else paged_chunk_attention(pages_, li, r.seq, qr, r.count, r.pos0, p, part_out);
    };
    if (RecentWindow* w = copies_of(s, layer))
      w->attention(compressed, li, qr, r.count, r.pos0, ap, o, k_fold ? k_fold + t0 * kv_row : nullptr,
                   v_fold ? v_fold + t0 * kv_row : nullptr);
    else
      compressed(ap, o);
  }
}

bool CpuKvCache::copy_prefix(int64_t src, int64_t dst, int64_t n) {
  const Sequence& a = at(src);
  at(dst);
  Sequence& b = seqs_.at(dst);
  if (seq_len(dst) != 0) throw Error(ErrorCode::OutOfRange, "copy_prefix: the target sequence is not empty");
  if (n < 0 || n > seq_len(src))
    throw Error(ErrorCode::OutOfRange, "copy_prefix: " + std::to_string(n) + " positions asked, the source holds " +
                                           std::to_string(seq_len(src)));
  // Everything is checked before anything is copied.
  if (a.ring && a.ring->first_pos() != 0) return false;  // sliding-window layers: only before their ring wraps
  if (a.copies && !b.copies->copy_prefix(*a.copies, n)) return false;  // checks before it copies
  if (a.ring_copies && !b.ring_copies->copy_prefix(*a.ring_copies, n)) return false;
  pages_.share_prefix(src, dst, n);  // the pages themselves: shared, copied on their next write
  if (a.ring) b.ring->copy_positions(*a.ring, 0, n);
  return true;
}

void CpuKvCache::read_stored(int layer, int64_t seq, int64_t start, int count, bool keys, float* out) const {
  if (layer < 0 || layer >= spec().model.n_layers)
    throw Error(ErrorCode::OutOfRange, "cache: layer " + std::to_string(layer) + " out of range");
  const Sequence& s = at(seq);
  if (in_ring_[layer]) s.ring->decode(index_[layer], start, count, keys, out);
  else pages_.decode(index_[layer], seq, start, count, keys, out);
}

void CpuKvCache::read(int layer, int64_t seq, int64_t start, int count, bool keys, float* out) const {
  read_stored(layer, seq, start, count, keys, out);
  if (keys) centring_.restore(layer, count, out);
}

std::vector<uint8_t> CpuKvCache::stored_slots(int layer, int64_t seq, int head) const {
  if (layer < 0 || layer >= spec().model.n_layers)
    throw Error(ErrorCode::OutOfRange, "cache: layer " + std::to_string(layer) + " out of range");
  if (in_ring_[layer])
    throw Error(ErrorCode::InvalidArgument, "cache: layer " + std::to_string(layer) + " is a sliding-window ring");
  at(seq);
  const int64_t n = pages_.seq_len(seq);
  const size_t sb = pages_.slot_bytes(index_[layer]);
  std::vector<uint8_t> out(static_cast<size_t>(n) * sb);
  for (int64_t p = 0; p < n; ++p) pages_.read_slot(index_[layer], seq, p, head, out.data() + p * sb);
  return out;
}

}  // namespace tqkv::engine
