// A paged KV cache, vLLM's model: a pool of fixed-size pages (blocks) shared by many
// sequences through per-sequence block tables, plus decode attention for a batch of sequences
// computed directly on the pages. docs/FORMAT.md ("Paged cache") documents every byte.
//
// - Block ids index the pool of every layer at once (one block table per sequence serves all
//   layers); page `b` of layer `l` is `page_bytes(l)` bytes at `b * page_bytes(l)`.
// - The pool keeps a free list and a reference count per block. fork() shares every page of the
//   parent; the first append to a sequence whose partly filled last page is shared copies that
//   one page (all layers) first (copy on write). Full pages are never written again, so they
//   stay shared.
// - Writing is two steps, as in vLLM: append_slots() reserves positions and returns their slot
//   ids (page * block_size + offset), then store() writes the K/V of a batch of tokens of any
//   sequences through that slot mapping, one layer at a time.
// Every method that throws tqkv::Error has changed nothing.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "tqkv/attention_params.h"
#include "tqkv/codec.h"
#include "tqkv/format.h"
#include "tqkv/page_geometry.h"
#include "tqkv/page_pool.h"

namespace tqkv {
namespace cpu {
class PageBuffer;
}

struct PagedCacheConfig {
  int n_layers = 1;
  int n_kv_heads = 1;
  int head_dim = 128;
  int block_size = 16;  // tokens per page: 16, 32, 64 or 128
  int num_blocks = 256;
  PageLayout layout = PageLayout::Slot;
  std::vector<Format> layer_formats;  // [n_layers]; empty = kDefaultFormat everywhere
  uint64_t seed = kDefaultSeed;
};

class PagedCache {
 public:
  explicit PagedCache(const PagedCacheConfig& config);
  ~PagedCache();
  PagedCache(PagedCache&&) noexcept;
  PagedCache& operator=(PagedCache&&) noexcept;

  const PagedCacheConfig& config() const { return config_; }
  int n_layers() const { return config_.n_layers; }
  int n_kv_heads() const { return config_.n_kv_heads; }
  int head_dim() const { return config_.head_dim; }
  int block_size() const { return config_.block_size; }
  int num_blocks() const { return config_.num_blocks; }
  PageLayout layout() const { return config_.layout; }
  const Format& format(int layer) const;
  const SlotCodec& codec(int layer) const;
  size_t slot_bytes(int layer) const { return format(layer).slot_bytes(config_.head_dim); }
  size_t page_bytes(int layer) const { return static_cast<size_t>(geometry(layer).page_bytes()); }
  // Where each field of a (token, head) lives in a page of this layer (page_geometry.h).
  PageGeometry geometry(int layer) const {
    return page_geometry(format(layer), config_.head_dim, config_.block_size, config_.n_kv_heads, config_.layout);
  }

  // Pool state.
  int free_blocks() const { return static_cast<int>(free_.size()); }
  int ref_count(int32_t block) const;

  // Sequences. Ids are never reused. Unknown ids throw Error(OutOfRange).
  int64_t add_sequence();
  int64_t fork(int64_t parent);  // shares every page of the parent
  // Makes the empty sequence dst hold the first n positions of src by sharing their pages (a
  // partly filled last page too: the first append to either copies it first). Throws
  // Error(OutOfRange) for unknown sequences, a dst that is not empty or n outside [0, seq_len(src)].
  void share_prefix(int64_t src, int64_t dst, int64_t n);
  void free_sequence(int64_t seq);
  bool has_sequence(int64_t seq) const { return seqs_.count(seq) != 0; }
  int64_t seq_len(int64_t seq) const;
  std::span<const int32_t> block_table(int64_t seq) const;

  // Reserves the next n positions of a sequence and returns their slot ids. Allocates pages as
  // needed and copies a shared, partly filled last page first. Throws Error(Capacity) if the
  // pool cannot hold them (nothing allocated).
  std::vector<int64_t> append_slots(int64_t seq, int n);

  // Batched store: token i of k, v ([n_tokens, n_kv_heads, head_dim] floats, n_tokens =
  // slot_mapping.size()) goes to slot slot_mapping[i] (negative: skipped). The shape arguments
  // must match the cache (else InvalidArgument); a slot outside the pool is OutOfRange; bad
  // values (NaN/Inf, fp16 overflow) throw as the codecs do. Nothing is written on error.
  void store(int layer, std::span<const int64_t> slot_mapping, const float* k, const float* v, int n_kv_heads,
             int head_dim);

  // Decodes positions [start, start + count) of a sequence into out [count, n_kv_heads,
  // head_dim] (original domain). A position past the end throws OutOfRange.
  void decode(int layer, int64_t seq, int64_t start, int count, bool keys, float* out) const;

  // The slot of (layer, seq, pos, head) reassembled in the slot layout [slot_bytes] (a copy:
  // in the page layout the fields of one slot are spread over planes).
  void read_slot(int layer, int64_t seq, int64_t pos, int head, uint8_t* out) const;

  // Raw page bytes of one layer: [num_blocks, page_bytes]. The mutable view is for tools that
  // fill pages wholesale (benchmarks copy encoded pages); it bypasses every check.
  const uint8_t* pool(int layer) const;
  uint8_t* pool_mut(int layer);

  size_t bytes() const;  // all pools

  // One layer's pool and a sequence as the pool functions take them (page_pool.h); const
  // callers only read through the pool.
  PagePool page_pool(int layer) const;
  PagedSeq paged_seq(int64_t seq) const {
    const Sequence& s = seq_at(seq);
    return {s.blocks, s.len};
  }

 private:
  struct Sequence {
    std::vector<int32_t> blocks;
    int64_t len = 0;
  };
  void check_layer(int layer) const;
  const Sequence& seq_at(int64_t seq) const;

  PagedCacheConfig config_;
  std::vector<std::unique_ptr<SlotCodec>> codecs_;
  std::vector<std::unique_ptr<cpu::PageBuffer>> pools_;  // [n_layers] num_blocks * page_bytes
  std::vector<int32_t> free_;                // free list (stack)
  std::vector<int32_t> refs_;                // [num_blocks]
  std::unordered_map<int64_t, Sequence> seqs_;
  int64_t next_id_ = 0;
};

// Decode attention for a batch: sequence seqs[b] attends with one query token at its last
// position p = seq_len - 1 over its tokens, honouring every field of params as tqkv::attention
// does (window, min_key_pos, exclude_recent, lse [n_seqs, n_q_heads]).
//   q:   [n_seqs, n_q_heads, head_dim]
//   out: [n_seqs, n_q_heads, head_dim]
// Throws tqkv::Error (changing nothing) for a bad layer, unknown or empty sequence, head count
// or head dim.
void paged_attention(const PagedCache& cache, int layer, std::span<const int64_t> seqs, const float* q,
                     const AttentionParams& params, float* out);

// Causal attention of a chunk of one sequence (pool_chunk_attention, page_pool.h): its n_q
// query tokens at positions q_pos0 .. over its stored tokens. Throws tqkv::Error (changing
// nothing) for a bad layer, an unknown sequence, positions it does not hold, head count or dim.
void paged_chunk_attention(const PagedCache& cache, int layer, int64_t seq, const float* q, int n_q, int64_t q_pos0,
                           const AttentionParams& params, float* out);

// The same through the scalar reference (tqkv::reference_attention), for tests.
void paged_attention_reference(const PagedCache& cache, int layer, std::span<const int64_t> seqs, const float* q,
                               const AttentionParams& params, float* out);

}  // namespace tqkv
