// The cache-independent half of CPU attention (internal): query preparation, the split of each
// kv head's key range into tasks, the threaded run of the kernel over the slot runs a cache
// hands out, and the log-sum-exp merge of the partial results.
#pragma once
#include <cstdint>
#include <vector>

#include "kernel.h"
#include "tqkv/attention_params.h"
#include "tqkv/codec.h"

namespace tqkv::cpu {

// Sources cut their runs at multiples of kRunAlign positions (a page of the engine's paged
// cache; the ring's runs alike), so that the kernels see the same runs, and sum in the same
// order, whichever cache holds the slots: the CPU engine's paged and ring layers give the same
// bits for the same tokens.
inline constexpr int64_t kRunAlign = 64;

// Where the slots of one kv head live: the runs covering key positions [k0, k1] (inclusive),
// in position order.
class KvSource {
 public:
  virtual ~KvSource() = default;
  virtual void runs(int head, int64_t k0, int64_t k1, std::vector<SlotRun>& out) const = 0;
};

// The query rows of one kv head that share its slots (GQA heads, possibly several tokens).
struct AttnGroup {
  const KvSource* src = nullptr;
  int head = 0;
  int rows = 0;
  std::vector<float> q;               // [rows, dim] in the key domain, times the softmax scale
  std::vector<int64_t> begin, end;    // [rows] visible key positions [begin, end]
  std::vector<float*> out;            // [rows] where each output row goes ([dim] floats)
  std::vector<float*> lse;            // [rows] where each row's log-sum-exp goes, or empty
};

KernelFormat kernel_format(const SlotCodec& codec);

// A run of `n` consecutive slot-layout slots starting at `first`, `stride` bytes apart.
SlotRun slot_layout_run(const Format& f, int dim, const uint8_t* first, size_t stride, int64_t pos0, int n);

// Appends one query row (original domain) prepared for the kernel to g.q.
void push_query(const SlotCodec& codec, const float* q, float scale, AttnGroup& g);

// The groups of a chunk of one sequence: its n_q query tokens at positions q_pos0 .. (q:
// [n_q, n_q_heads, head_dim], original domain; out alike), per kv head in blocks of rows that
// share each decoded tile, every row cut causally and by params (window, min_key_pos,
// exclude_recent; lse rows when params.lse is set). first_key: the first position the source
// holds. src must outlive the groups.
void push_chunk_groups(const SlotCodec& codec, const KvSource& src, int n_kv_heads, int group, float scale,
                       const float* q, int n_q, int64_t q_pos0, int64_t first_key, const AttentionParams& params,
                       float* out, std::vector<AttnGroup>& groups);

// Runs every group (threads, split-KV, merge) at the active SIMD level and writes the outputs.
void run_attention_groups(const SlotCodec& codec, const std::vector<AttnGroup>& groups);

}  // namespace tqkv::cpu
