// Split-KV decode attention over the page layout (see decode.cu), and the merge step
// (merge.cu) that combines the partial outputs by log-sum-exp.
#pragma once
#include "common.cuh"

namespace tqkv::cuda::detail {

// One split per warp; a CTA holds Traits::WARPS (4 or 8) consecutive splits of one (sequence, kv head).
inline constexpr int kTileTokens = 16;    // tokens per MMA tile
inline constexpr int kMaxGroup = 8;       // query heads per kv head (MMA N = 8)
inline constexpr int kMaxSplits = 512;    // splits per (sequence, kv head)

struct MergeParams {
  const float* o_part;    // [batch, n_kv_heads, num_splits, group, D], normalised partial outputs
  const float* lse_part;  // [batch, n_kv_heads, num_splits, group], log2 units
  void* out;
  DType out_dtype;
  float* lse;  // optional, natural log
  int n_kv_heads, group, num_splits, head_dim;
  bool values_rotated;
  CodecTables tab;
};
void launch_merge(const MergeParams& p, int batch, int n_q_heads, cudaStream_t stream);

}  // namespace tqkv::cuda::detail
