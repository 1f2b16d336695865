// The cache layer: a model's KV cache with everything its spec adds (cache_spec.h) —
// per-layer formats and skipped layers, key centring and channel scales, attention sinks, the
// recent window, layer types — behind one interface that every device implements
// (cpu_kv_cache.h; the CUDA device adds its own). The model definition calls attend() once
// per layer and knows nothing of formats, copies or centring; the scheduler reads bytes().
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>

#include "engine/core/batch.h"
#include "engine/cache/cache_plan.h"
#include "engine/cache/cache_spec.h"

namespace tqkv::engine {

// Called by attend() with a layer's new keys (after RoPE and centring, before they are
// stored) and its queries, both in device memory: calibration reads them (calibrate.h), a
// study may rewrite the keys. k: [n, n_kv_heads, head_dim], q: [n, n_heads, head_dim].
using KeyHook = std::function<void(int layer, int n, float* k, const float* q)>;

struct StepGraph;  // a recorded step: device/cuda_graphs.h (named here, never used)

// What a device needs to record a cache's decode steps once and replay them (CUDA graphs,
// device/cuda_graphs.h): a replay reads the step's slot mappings, block tables and lengths from
// fixed buffers of the cache, so the cache prepares them and keeps the recordings.
class StepRecorder {
 public:
  // Prepares the decode step `batch` (every run one token, at most `bucket` runs) padded to
  // `bucket` rows in the bucket's fixed buffers; the step's attend() calls then take a batch of
  // `bucket` rows whose first batch.size() are `batch`'s.
  virtual void prepare_bucket(const Batch& batch, int bucket) = 0;
  // Forgets a prepare_bucket whose step did not run.
  virtual void cancel_bucket() = 0;
  // The recorded step of `model` at `bucket` whose longest sequence then holds `longest`
  // positions (made empty at first use).
  virtual StepGraph& step_graph(const void* model, int bucket, int64_t longest) = 0;

 protected:
  ~StepRecorder() = default;
};

class KvCache {
 public:
  // Plans the cache (plan_cache; throws its errors).
  KvCache(const CacheSpec& spec, const CacheShape& shape) : spec_(spec), shape_(shape), plan_(plan_cache(spec, shape)) {}
  virtual ~KvCache() = default;
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const CacheSpec& spec() const { return spec_; }
  const CachePlan& plan() const { return plan_; }
  int capacity() const { return shape_.capacity; }  // positions per sequence
  int max_seqs() const { return shape_.max_seqs; }

  // Sequences. Ids are never reused; an unknown id throws tqkv::Error(OutOfRange).
  // add_sequence throws Error(Capacity) when max_seqs are live.
  virtual int64_t add_sequence() = 0;
  virtual void free_sequence(int64_t seq) = 0;
  virtual int64_t seq_len(int64_t seq) const = 0;

  // The most tokens of one sequence a single step may append to a sequence holding some
  // (CachePlan::step_tokens; a fresh one: CachePlan::step_limit); the model splits longer
  // batches, and attend() refuses them (CachePlan::check_steps).
  int max_step_tokens() const { return plan_.step_tokens; }

  // Checks a whole batch before a forward changes anything (however many steps it then takes):
  // known sequences, each run starting at the sequence's length, room for it. Throws
  // tqkv::Error (OutOfRange, Capacity).
  virtual void check(const Batch& batch) const = 0;

  // One layer of a step (the batch passed check()): centres k and scales q as the spec asks,
  // stores k and v at the batch's positions, then computes the causal attention of every query
  // over its sequence's cached positions, the new ones included (GQA; the layer's sliding
  // window) — except a fresh run's (pos0 0: the sequence held nothing), whose queries attend to
  // the run's own k and v as computed, whatever the spec stores (docs/ENGINE.md, "Fresh
  // prompts"). Device memory:
  //   q: [n, n_heads, head_dim] (scaled in place by channel scales), k: [n, n_kv_heads,
  //   head_dim] (centred in place), v: [n, n_kv_heads, head_dim], out: [n, n_heads, head_dim].
  virtual void attend(int layer, const Batch& batch, float* q, float* k, const float* v, float* out) = 0;

  // Decodes positions [start, start + count) of one sequence and layer, keys or values, into
  // host memory out [count, n_kv_heads, head_dim], in the model's domain: centring and channel
  // scales undone (k = s * decoded + mu), so a caller never sees the cache's internal shift.
  // Throws tqkv::Error(OutOfRange) for positions the sequence does not hold.
  virtual void read(int layer, int64_t seq, int64_t start, int count, bool keys, float* out) const = 0;

  // Prefix sharing: makes the empty sequence dst hold the first n positions of src, copied as
  // stored (compressed slots, sink and window copies; nothing recomputed), so that dst goes on
  // at position n. Returns false, changing nothing, where the cache cannot (a device without
  // it, copies src no longer holds); the caller then computes the positions. Throws
  // tqkv::Error(OutOfRange) for unknown sequences, a dst that is not empty or n > seq_len(src).
  virtual bool copy_prefix(int64_t src, int64_t dst, int64_t n) {
    (void)src, (void)dst, (void)n;
    return false;
  }

  // Memory holding one sequence's positions, by the one accounting every command reports
  // (CacheSpec::bytes, cache_spec.h).
  CacheBytes bytes(int64_t seq) const {
    return spec_.bytes(std::min<int64_t>(seq_len(seq), shape_.capacity), shape_.capacity);
  }

  void set_key_hook(KeyHook hook) { hook_ = std::move(hook); }

  // The recorder of this cache's decode steps, where its device can replay them (null: every
  // step runs op by op, e.g. on the CPU, or with a key hook set).
  virtual StepRecorder* step_recorder() { return nullptr; }

 protected:
  const KeyHook& key_hook() const { return hook_; }

 private:
  CacheSpec spec_;
  CacheShape shape_;
  CachePlan plan_;
  KeyHook hook_;
};

}  // namespace tqkv::engine
