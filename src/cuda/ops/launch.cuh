// Launch helpers shared by the element-wise ops (tqkv/cuda_ops.h).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../common.cuh"
#include "tqkv/cuda_ops.h"

namespace tqkv::cuda::detail {

inline constexpr int kOpThreads = 256;

// Blocks for a grid-stride loop over n elements (capped; the loop covers the rest).
inline unsigned op_blocks(size_t n) {
  return static_cast<unsigned>(std::clamp<size_t>((n + kOpThreads - 1) / kOpThreads, 1, 65535u * 8));
}

inline void check_launch() { TQKV_CUDA_CHECK(cudaGetLastError()); }

__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }

}  // namespace tqkv::cuda::detail
