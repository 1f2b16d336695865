// Attention computed directly on a compressed cache (CPU).
#pragma once
#include <cstdint>

#include "tqkv/contiguous_cache.h"

namespace tqkv {

struct AttentionParams {
  int n_q_heads = 1;  // a multiple of the cache's n_kv_heads (grouped-query attention)
  float scale = 0;    // softmax scale; 0 means 1/sqrt(head_dim)
  int window = 0;     // sliding window: a query at position p sees keys in (p - window, p]; 0 = all
  // Cuts for attention split over several caches (the engine keeps some positions in a
  // separate uncompressed cache, src/engine/side_cache.h): a query at p sees no key below
  // min_key_pos and none above p - exclude_recent.
  int64_t min_key_pos = 0;
  int exclude_recent = 0;
  // Optional [n_q, n_q_heads]: ln of the sum of exp(scaled score) over the keys each row saw
  // (-inf when it saw none; its output row is then 0), so that the outputs of disjoint key
  // sets can be merged exactly.
  float* lse = nullptr;
};

// Causal attention of n_q query tokens at positions q_pos0 .. q_pos0 + n_q - 1 over one layer
// of the cache: the query at position p attends to the cached keys at positions
// [first_pos, p] (within the window). The new tokens' keys and values must already be written.
//   q:   [n_q, n_q_heads, head_dim]
//   out: [n_q, n_q_heads, head_dim]
// Throws tqkv::Error (changing nothing) for a bad layer, head count or position.
void attention(const ContiguousCache& cache, int layer, const float* q, int n_q, int64_t q_pos0,
               const AttentionParams& params, float* out);

// The same computed by the scalar reference (tqkv::reference_attention), for tests.
void attention_reference(const ContiguousCache& cache, int layer, const float* q, int n_q, int64_t q_pos0,
                         const AttentionParams& params, float* out);

}  // namespace tqkv
