// One layer's page pool as plain memory that someone else owns: [num_blocks, page_bytes] bytes
// laid out as docs/FORMAT.md ("Paged cache") says, addressed by block tables. PagedCache keeps
// one per layer and adds the sequence bookkeeping (free list, reference counts, fork); the torch
// ops (python/tqkv/torch.py) hand in a uint8 tensor and their own block tables, as a vLLM-style
// attention backend does. The bytes are those of the CUDA kernels (tqkv/cuda.h) for the same
// format, head dim, block size and layout.
#pragma once
#include <cstdint>
#include <span>

#include "tqkv/attention_params.h"
#include "tqkv/codec.h"
#include "tqkv/page_geometry.h"

namespace tqkv {

struct PagePool {
  uint8_t* pages = nullptr;  // [num_blocks, geometry.page_bytes()]
  int num_blocks = 0;
  PageGeometry geometry;
};

// A sequence of the pool: its pages in order and its length (positions [0, len) are held).
struct PagedSeq {
  std::span<const int32_t> blocks;
  int64_t len = 0;
};

// The slot-layout bytes of token offset t, kv head h of one page <-> their places in the page
// (a copy in both layouts; the page layout spreads a slot over planes).
void place_slot(const PageGeometry& g, uint8_t* page, int t, int head, const uint8_t* slot);
void gather_slot(const PageGeometry& g, const uint8_t* page, int t, int head, uint8_t* slot);

// Batched store: token i of k, v ([n_tokens, n_kv_heads, head_dim] floats, n_tokens =
// slot_mapping.size()) goes to slot slot_mapping[i] = block * block_size + offset (negative:
// skipped). A slot past the pool is OutOfRange; bad values (NaN/Inf, fp16 overflow) throw as the
// codecs do. Everything is encoded before anything is written: on error the pool is unchanged.
void pool_store(const SlotCodec& codec, const PagePool& pool, std::span<const int64_t> slot_mapping, const float* k,
                const float* v);

// Decodes positions [start, start + count) of a sequence into out [count, n_kv_heads, head_dim]
// (original domain). A position past seq.len or a block outside the pool is OutOfRange.
void pool_decode(const SlotCodec& codec, const PagePool& pool, const PagedSeq& seq, int64_t start, int count,
                 bool keys, float* out);

// Decode attention for a batch: sequence b attends with one query token at its last position
// p = seqs[b].len - 1 over its tokens, honouring every field of params as tqkv::attention does.
//   q:   [n_seqs, n_q_heads, head_dim]
//   out: [n_seqs, n_q_heads, head_dim]
// Throws tqkv::Error (changing nothing) for an empty sequence, a block table shorter than the
// sequence, a block outside the pool, or a head count or head dim that does not fit.
void pool_attention(const SlotCodec& codec, const PagePool& pool, std::span<const PagedSeq> seqs, const float* q,
                    const AttentionParams& params, float* out);

// Causal attention of one sequence's n_q query tokens at positions q_pos0 .. q_pos0 + n_q - 1
// (a prefill chunk; its own keys already stored) over its tokens up to each query's position,
// honouring every field of params as tqkv::attention does (lse: [n_q, n_q_heads]).
//   q, out: [n_q, n_q_heads, head_dim]
// Throws tqkv::Error (changing nothing) for query positions outside [0, seq.len) and as
// pool_attention does.
void pool_chunk_attention(const SlotCodec& codec, const PagePool& pool, const PagedSeq& seq, const float* q, int n_q,
                          int64_t q_pos0, const AttentionParams& params, float* out);

// The same through the scalar reference (tqkv::reference_attention), for tests.
void pool_attention_reference(const SlotCodec& codec, const PagePool& pool, std::span<const PagedSeq> seqs,
                              const float* q, const AttentionParams& params, float* out);

}  // namespace tqkv
