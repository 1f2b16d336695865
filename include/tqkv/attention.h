// Attention computed directly on a compressed cache (CPU).
#pragma once
#include <cstdint>

#include "tqkv/attention_params.h"
#include "tqkv/contiguous_cache.h"

namespace tqkv {

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
