// Split-KV decode attention over the page layout (see decode.cu): one launch computes the
// partial outputs, merges them by log-sum-exp and writes the output.
#pragma once
#include "common.cuh"

namespace tqkv::cuda::detail {

// One split per warp; a CTA holds Traits::WARPS (4 or 8) consecutive splits of one (sequence, kv head).
inline constexpr int kTileTokens = 16;    // tokens per MMA tile
inline constexpr int kMaxGroup = 8;       // query heads per kv head (MMA N = 8)
inline constexpr int kMaxSplits = 512;    // splits per (sequence, kv head)
inline constexpr int kMaxClusterCtas = 8;              // portable thread-block cluster size
inline constexpr int kMaxClusterCtasNonPortable = 16;  // Hopper's largest, where it fits

// Workspace counters (one per (sequence, kv head)): the CTAs that finished, in the low 16 bits,
// under a tag that init_decode_workspace writes; a counter without the tag is a workspace that
// was never prepared, and the decode then writes NaN rather than merge wrongly.
inline constexpr uint32_t kCounterTag = 0x7c0d0000u;
inline constexpr uint32_t kCounterTagMask = 0xffff0000u;

}  // namespace tqkv::cuda::detail
