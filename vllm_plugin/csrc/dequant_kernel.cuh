// The dequantize kernel (dequant.cu launches it).
#pragma once
#include "device.cuh"
#include "ops.h"

namespace tqkv_vllm {

constexpr int kDequantWarps = 4;

template <int KB, int VB, int D>
__global__ void __launch_bounds__(32 * kDequantWarps) dequant_kernel(const DequantParams p) {
  using S = Slot<KB, VB, D>;
  constexpr int E = D / 32;  // elements per lane, contiguous
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kDequantWarps + (threadIdx.x >> 5);
  if (row >= static_cast<int64_t>(p.n_tokens) * p.cache.n_kv_heads) return;
  const int token = static_cast<int>(row / p.cache.n_kv_heads);
  const int head = static_cast<int>(row % p.cache.n_kv_heads);
  const int64_t page = p.block_table[token / p.cache.block_size];
  const uint8_t* slot = p.cache.base + page * p.cache.stride_block +
                        static_cast<int64_t>(token % p.cache.block_size) * p.cache.stride_pos +
                        static_cast<int64_t>(head) * p.cache.stride_head;
  float x[E];
  if constexpr (S::kFp8) {
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = fp8_e4m3_to_float(slot[lane * E + e]);
  } else {
    float csq = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      x[e] = p.centroids[code_at<KB>(slot, lane * E + e)];
      csq = fmaf(x[e], x[e], csq);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) csq += __shfl_xor_sync(0xffffffffu, csq, o);
    float f = fp16_bits_to_float(slot[S::kKeyCodeBytes], slot[S::kKeyCodeBytes + 1]) * rsqrtf(static_cast<float>(D));
    if (p.norm_correction) f *= rsqrtf(csq + 1e-16f);
    // x = H y / sqrt(D): butterflies within the lane's E elements, then across lanes.
#pragma unroll
    for (int h = 1; h < E; h <<= 1)
#pragma unroll
      for (int e = 0; e < E; ++e)
        if ((e & h) == 0) {
          const float a = x[e], b = x[e + h];
          x[e] = a + b;
          x[e + h] = a - b;
        }
#pragma unroll
    for (int m = 1; m < 32; m <<= 1)
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float other = __shfl_xor_sync(0xffffffffu, x[e], m);
        x[e] = (lane & m) ? other - x[e] : x[e] + other;
      }
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] *= f;
  }
  const int64_t ko = p.k_out.at(token, head) + lane * E;
#pragma unroll
  for (int e = 0; e < E; ++e) store_from_float(p.k_out.data, p.k_out.dtype, ko + e, x[e]);

  const uint8_t* vc = slot + S::kKeyBytes;
  const uint8_t* vm = vc + S::kValueCodeBytes;
  const float scale = fp16_bits_to_float(vm[0], vm[1]), zero = fp16_bits_to_float(vm[2], vm[3]);
  const int64_t vo = p.v_out.at(token, head) + lane * E;
#pragma unroll
  for (int e = 0; e < E; ++e)
    store_from_float(p.v_out.data, p.v_out.dtype, vo + e, fmaf(static_cast<float>(code_at<VB>(vc, lane * E + e)), scale, zero));
}

}  // namespace tqkv_vllm
