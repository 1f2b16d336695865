#include "engine/device/cpu_kv_cache.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "tqkv/attention.h"
#include "tqkv/options.h"
#include "tqkv/error.h"

namespace tqkv::engine {
CpuKvCache::CpuKvCache(const CacheSpec& spec, const CacheShape& shape)
    : KvCache(spec, shape), centring_(spec, shape.capacity) {
  const CachePlan& p = plan();
  config_.n_kv_heads = ring_config_.n_kv_heads = spec.model.n_kv_heads;
  config_.head_dim = ring_config_.head_dim = spec.model.head_dim;
  config_.capacity = p.capacity;
  ring_config_.capacity = 0;
  config_.layer_formats.clear();
  ring_config_.layer_formats.clear();
  // Full-attention layers in one ContiguousCache, the sliding-window layers with rings in another.
  for (const LayerPlan& L : p.layers) {
    in_ring_.push_back(L.ring > 0);
    ContiguousCacheConfig& c = L.ring > 0 ? ring_config_ : config_;
    index_.push_back(static_cast<int>(c.layer_formats.size()));
    c.layer_formats.push_back(L.format);
    c.capacity = std::max<int>(c.capacity, static_cast<int>(L.ring));
  }
  config_.n_layers = static_cast<int>(config_.layer_formats.size());
  ring_config_.n_layers = static_cast<int>(ring_config_.layer_formats.size());
  stored_.resize(spec.model.n_layers);
  fold_newest_ = env_bool("TQKV_FOLD_NEWEST");
}

int64_t CpuKvCache::add_sequence() {
  if (static_cast<int>(seqs_.size()) >= max_seqs())
    throw Error(ErrorCode::Capacity, "cache: all " + std::to_string(max_seqs()) + " sequences are in use");
  Sequence s{ContiguousCache(config_), nullptr, nullptr, nullptr};
  if (ring_config_.n_layers > 0) s.ring = std::make_unique<ContiguousCache>(ring_config_);
  const CachePlan& p = plan();
  if (p.copies()) {
    const Format* wf = p.window_format ? &*p.window_format : nullptr;
    if (config_.n_layers > 0) s.copies = std::make_unique<RecentWindow>(s.main, p.window, CachePlan::kCopyStepTokens, p.sinks, wf);
    if (s.ring) s.ring_copies = std::make_unique<RecentWindow>(*s.ring, p.window, CachePlan::kCopyStepTokens, p.sinks, wf);
  }
  const int64_t id = next_id_++;
  seqs_.emplace(id, std::move(s));
  return id;
}

void CpuKvCache::free_sequence(int64_t seq) {
  at(seq);
  seqs_.erase(seq);
}

const CpuKvCache::Sequence& CpuKvCache::at(int64_t seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw Error(ErrorCode::OutOfRange, "cache: unknown sequence " + std::to_string(seq));
  return it->second;
}

int64_t CpuKvCache::seq_len(int64_t seq) const { return at(seq).main.seq_len(); }

RecentWindow* CpuKvCache::copies_of(Sequence& s, int layer) const {
  RecentWindow* c = in_ring_[layer] ? s.ring_copies.get() : s.copies.get();
  return c && c->covers(index_[layer]) ? c : nullptr;
}

void CpuKvCache::check(const Batch& batch) const {
  for (const Batch::Run& r : batch.runs()) {
    const ContiguousCache& c = at(r.seq).main;
    if (r.pos0 != c.seq_len())
      throw Error(ErrorCode::OutOfRange, "forward: position " + std::to_string(r.pos0) + " of sequence " +
                                             std::to_string(r.seq) + " does not follow the cache (" +
                                             std::to_string(c.seq_len()) + " tokens held)");
    if (r.count > c.capacity())
      throw Error(ErrorCode::Capacity, "forward: " + std::to_string(r.count) +
                                           " tokens exceed the cache capacity of " + std::to_string(c.capacity()));
  }
}

namespace {

// Throws before anything is written when a run exceeds what one step may append.
void check_step(const std::vector<Batch::Run>& runs, int max_step) {
  for (const Batch::Run& r : runs)  // (Model::forward splits longer runs)
    if (r.count > max_step)
      throw Error(ErrorCode::Capacity, "cache: " + std::to_string(r.count) + " tokens of one sequence in one step; " +
                                           "this cache takes at most " + std::to_string(max_step));
}

}  // namespace

void CpuKvCache::attend(int layer, const Batch& batch, float* q, float* k, const float* v, float* out) {
  check_step(batch.runs(), max_step_tokens());
  centring_.apply(layer, batch.size(), k, q);
  if (key_hook()) key_hook()(layer, batch.size(), k, q);
  // The new keys and values go into the (possibly compressed) cache first; attention then
  // reads every earlier position from the cache, exactly as decode will, and (layers with
  // copies) each query's own key and value as computed.
  write(layer, batch, k, v);
  attention(layer, batch, q, out, k, v);
}

void CpuKvCache::store(int layer, const Batch& batch, float* k, const float* v) {
  check_step(batch.runs(), max_step_tokens());
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
    if (r.pos0 + r.count > at(r.seq).main.seq_len())
      throw Error(ErrorCode::OutOfRange, "cache: attention at positions not stored yet");
  centring_.apply(layer, batch.size(), nullptr, q);
  // The layer's last store() gives each query's own key and value where it wrote this batch.
  const Stored& st = stored_.at(layer);
  const std::vector<Batch::Run> runs = batch.runs();
  const bool same = std::equal(st.runs.begin(), st.runs.end(), runs.begin(), runs.end(),
                               [](const Batch::Run& a, const Batch::Run& b) {
                                 return a.seq == b.seq && a.pos0 == b.pos0 && a.count == b.count && a.begin == b.begin;
                               });
  attention(layer, batch, q, out, same ? st.k.data() : nullptr, same ? st.v.data() : nullptr);
}

void CpuKvCache::write(int layer, const Batch& batch, const float* k, const float* v) {
  const size_t kv_row = static_cast<size_t>(spec().model.n_kv_heads) * spec().model.head_dim;
  for (const Batch::Run& r : batch.runs()) {
    Sequence& s = seqs_.at(r.seq);
    const size_t t0 = static_cast<size_t>(r.begin);
    // A ring layer keeps the window's positions only; the step appends at most max_step_tokens.
    ContiguousCache& c = in_ring_[layer] ? *s.ring : s.main;
    c.write(index_[layer], r.pos0, r.count, k + t0 * kv_row, v + t0 * kv_row);
    if (RecentWindow* w = copies_of(s, layer)) w->write(index_[layer], r.pos0, r.count, k + t0 * kv_row, v + t0 * kv_row);
  }
}

void CpuKvCache::attention(int layer, const Batch& batch, const float* q, float* out, const float* k_new,
                           const float* v_new) {
  if (!fold_newest_) k_new = v_new = nullptr;
  const size_t kv_row = static_cast<size_t>(spec().model.n_kv_heads) * spec().model.head_dim;
  const ModelConfig& m = spec().model;
  AttentionParams ap;
  ap.n_q_heads = m.n_heads;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(m.head_dim));
  ap.window = m.window(layer);
  const size_t q_row = static_cast<size_t>(m.n_heads) * m.head_dim;
  for (const Batch::Run& r : batch.runs()) {
    Sequence& s = seqs_.at(r.seq);
    const size_t t0 = static_cast<size_t>(r.begin);
    const ContiguousCache& c = in_ring_[layer] ? *s.ring : s.main;
    if (RecentWindow* w = copies_of(s, layer))
      w->attention(c, index_[layer], q + t0 * q_row, r.count, r.pos0, ap, out + t0 * q_row,
                   k_new ? k_new + t0 * kv_row : nullptr, v_new ? v_new + t0 * kv_row : nullptr);
    else
      tqkv::attention(c, index_[layer], q + t0 * q_row, r.count, r.pos0, ap, out + t0 * q_row);
  }
}

bool CpuKvCache::copy_prefix(int64_t src, int64_t dst, int64_t n) {
  const Sequence& a = at(src);
  at(dst);
  Sequence& b = seqs_.at(dst);
  if (b.main.seq_len() != 0) throw Error(ErrorCode::OutOfRange, "copy_prefix: the target sequence is not empty");
  if (n < 0 || n > a.main.seq_len())
    throw Error(ErrorCode::OutOfRange, "copy_prefix: " + std::to_string(n) + " positions asked, the source holds " +
                                           std::to_string(a.main.seq_len()));
  // Everything is checked before anything is copied.
  if (a.main.first_pos() != 0) return false;
  if (a.ring && a.ring->first_pos() != 0) return false;  // sliding-window layers: only before their ring wraps
  if (a.copies && !b.copies->copy_prefix(*a.copies, n)) return false;  // checks before it copies
  if (a.ring_copies && !b.ring_copies->copy_prefix(*a.ring_copies, n)) return false;
  b.main.copy_positions(a.main, 0, n);
  if (a.ring) b.ring->copy_positions(*a.ring, 0, n);
  return true;
}

void CpuKvCache::read(int layer, int64_t seq, int64_t start, int count, bool keys, float* out) const {
  if (layer < 0 || layer >= spec().model.n_layers)
    throw Error(ErrorCode::OutOfRange, "cache: layer " + std::to_string(layer) + " out of range");
  const Sequence& s = at(seq);
  (in_ring_[layer] ? *s.ring : s.main).decode(index_[layer], start, count, keys, out);
  if (keys) centring_.restore(layer, count, out);
}

}  // namespace tqkv::engine
