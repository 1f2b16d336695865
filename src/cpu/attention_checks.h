// Argument checks and derived constants shared by the CPU attention paths (internal header).
#pragma once
#include <cstdint>

#include "tqkv/attention.h"

namespace tqkv {

struct AttentionPlan {
  int group;    // query heads per kv head
  float scale;  // resolved softmax scale
};

// Throws tqkv::Error for a bad layer, head count, window or query positions.
AttentionPlan check_attention(const ContiguousCache& cache, int layer, int n_q, int64_t q_pos0,
                              const AttentionParams& params);

// First / last key position visible from a query at `pos` (window, eviction and the
// min_key_pos / exclude_recent cuts applied; begin > end when it sees none).
int64_t key_begin(const ContiguousCache& cache, int64_t pos, const AttentionParams& params);
int64_t key_end(int64_t pos, const AttentionParams& params);

}  // namespace tqkv
