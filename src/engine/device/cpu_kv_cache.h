// The CPU cache layer: the full-attention layers of every sequence in one tqkv::PagedCache (a
// pool of pages of kBlockSize positions, the spec's per-layer formats; a sequence takes pages
// as it grows, so memory follows the tokens held, and copy_prefix shares pages instead of
// copying them). When the plan keeps copies, each sequence has a RecentWindow (sinks and recent
// window, merged with the compressed part by log-sum-exp). Sliding-window layers (Gemma 3's
// local layers) live in a per-sequence ContiguousCache whose ring holds only
// CacheSpec::ring_positions (the window plus one step), with copies of their own. Attention runs
// on the compressed slots through tqkv's CPU kernels (SIMD, threads).
#pragma once
#include <memory>
#include <unordered_map>
#include <vector>

#include "engine/cache/key_centring.h"
#include "engine/cache/kv_cache.h"
#include "engine/cache/recent_window.h"
#include "tqkv/contiguous_cache.h"
#include "tqkv/paged_cache.h"

namespace tqkv::engine {

class CpuKvCache final : public KvCache {
 public:
  // Positions per page. The page layout keeps each head's codes contiguous within a page, so the
  // kernels read runs of kBlockSize slots; the pool holds max_seqs * capacity positions of
  // address space, of which only the pages handed out are ever touched.
  static constexpr int kBlockSize = 64;

  // Throws tqkv::Error(InvalidArgument) for a capacity or sequence count below 1.
  CpuKvCache(const CacheSpec& spec, const CacheShape& shape);

  int64_t add_sequence() override;
  void free_sequence(int64_t seq) override;
  int64_t seq_len(int64_t seq) const override;
  void check(const Batch& batch) const override;
  void attend(int layer, const Batch& batch, float* q, float* k, const float* v, float* out) override;
  void read(int layer, int64_t seq, int64_t start, int count, bool keys, float* out) const override;
  bool copy_prefix(int64_t src, int64_t dst, int64_t n) override;

  // attend() in two steps, for callers that get the keys and values of a layer before its
  // queries (tqkv.transformers): store() centres k in place and writes k, v at the batch's
  // positions; attend_stored() scales q in place and computes the attention of the batch's
  // queries over what is stored, those positions included. attend() = store + attend_stored
  // (no key hook here). A sequence may take at most plan().step_limit() positions between the
  // two. The layer's last store() is kept (its keys and values as given), so that
  // attend_stored() folds each query's own position in from it as attend() does
  // (RecentWindow::attention), and a fresh run attends to them; attend_stored() of a fresh run
  // that its layer's last store() did not write throws tqkv::Error(InvalidArgument).
  void store(int layer, const Batch& batch, float* k, const float* v);
  void attend_stored(int layer, const Batch& batch, float* q, float* out);

  // read() without undoing the centring: keys as stored (tests).
  void read_stored(int layer, int64_t seq, int64_t start, int count, bool keys, float* out) const;
  // The slots of (full-attention layer, sequence, kv head) in the slot layout, keys as stored:
  // [seq_len, slot bytes]. Throws tqkv::Error(InvalidArgument) for a sliding-window layer.
  std::vector<uint8_t> stored_slots(int layer, int64_t seq, int head) const;
  const KeyCentring& centring() const { return centring_; }
  // The pool of the full-attention layers (tests; pages handed out, page sharing).
  const PagedCache& pages() const { return pages_; }

 private:
  struct Sequence {
    std::unique_ptr<ContiguousCache> ring;      // sliding-window layers, when they keep a ring
    std::unique_ptr<RecentWindow> copies;       // the copies of the paged layers
    std::unique_ptr<RecentWindow> ring_copies;  // the copies of ring's layers
    // The step being stored: its first layer appends the positions to the pool, the others
    // store at the same slots.
    int64_t step_pos0 = -1;
    std::vector<int64_t> step_slots;
  };
  // The copies of a layer of seq (null when it has none), by its index in pages_ or ring.
  RecentWindow* copies_of(Sequence& s, int layer) const;
  const Sequence& at(int64_t seq) const;
  // The slots of a run at a paged layer: appended when the run starts the step, else the step's.
  const std::vector<int64_t>& run_slots(Sequence& s, const Batch::Run& r);
  void write(int layer, const Batch& batch, const float* k, const float* v);
  // k_new, v_new: the batch's keys and values as written: a fresh run's queries attend to them
  // alone; with TQKV_FOLD_NEWEST they are folded in exactly at each query's own position
  // (layers with copies). Null (attend_stored of another batch, never a fresh run): every
  // position read back from the cache.
  void attention(int layer, const Batch& batch, const float* q, float* out, const float* k_new, const float* v_new);

  // A layer's last store(): the batch it wrote and its keys (centred) and values.
  struct Stored {
    std::vector<Batch::Run> runs;
    std::vector<float> k, v;
  };
  std::vector<Stored> stored_;  // [n_layers]
  bool fold_newest_ = true;     // TQKV_FOLD_NEWEST=0: every position read back from the cache

  KeyCentring centring_;
  PagedCacheConfig config_;
  ContiguousCacheConfig ring_config_;
  PagedCache pages_;
  std::vector<int> index_;    // [n_layers]: the layer's index in pages_ or ring
  std::vector<bool> in_ring_;  // [n_layers]
  std::unordered_map<int64_t, Sequence> seqs_;  // by their id in pages_
};

}  // namespace tqkv::engine
