// The store kernel (store.cu launches it): one warp per (token, kv head) writes the slot exactly
// as vLLM's Triton store does (store.cu's comment says how).
#pragma once
#include "device.cuh"
#include "ops.h"

namespace tqkv_vllm {

constexpr int kStoreWarps = 4;

__device__ __forceinline__ void put_fp16(uint8_t* p, float x) {
  const uint16_t b = __half_as_ushort(__float2half_rn(x));
  p[0] = static_cast<uint8_t>(b & 0xFF);
  p[1] = static_cast<uint8_t>(b >> 8);
}

// Eight codes of `bits` bits as bits * 8 bits, written as `bits` little-endian bytes.
template <int BITS>
__device__ __forceinline__ void put_group(uint8_t* p, const uint32_t (&codes)[8]) {
  uint32_t w = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) w |= codes[i] << (BITS * i);
#pragma unroll
  for (int i = 0; i < BITS; ++i) p[i] = static_cast<uint8_t>((w >> (8 * i)) & 0xFF);
}

template <int KB, int VB, int D>
__global__ void __launch_bounds__(32 * kStoreWarps) store_kernel(StoreParams p) {
  using S = Slot<KB, VB, D>;
  constexpr int kGroups = D / 8;
  __shared__ float mids[16];
  if constexpr (!S::kFp8) {
    if (threadIdx.x < (1 << KB) - 1) mids[threadIdx.x] = p.midpoints[threadIdx.x];
    __syncthreads();
  }
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kStoreWarps + (threadIdx.x >> 5);  // token * H + head
  if (row >= static_cast<int64_t>(p.n_tokens) * p.cache.n_kv_heads) return;
  const int64_t token = row / p.cache.n_kv_heads;
  const int head = static_cast<int>(row % p.cache.n_kv_heads);
  const int64_t slot = p.slot_mapping_i64 ? static_cast<const int64_t*>(p.slot_mapping)[token]
                                          : static_cast<const int32_t*>(p.slot_mapping)[token];
  if (slot < 0) return;
  uint8_t* out = p.cache.base + slot_offset(p.cache, slot, head);
  const int64_t k_row = p.k.at(token, head), v_row = p.v.at(token, head);

  // Keys.
  if constexpr (S::kFp8) {
    for (int j = lane; j < D; j += 32) out[j] = fp8_e4m3_of(load_as_float(p.k.data, p.k.dtype, k_row + j));
  } else {
    constexpr int kCentroids = 1 << KB;
    if (lane < kGroups) {
      const float* y = p.y + row * D + lane * 8;
      uint32_t codes[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        // vLLM's search: lo counts the midpoints <= y, in KB halvings of [0, 2^KB - 1].
        const float yi = y[i];
        int lo = 0, hi = kCentroids - 1;
#pragma unroll
        for (int it = 0; it < KB; ++it) {
          const int mid = (lo + hi) >> 1;
          const float m = mids[min(mid, kCentroids - 2)];
          if (yi >= m) lo = mid + 1;
          else hi = mid;
        }
        codes[i] = static_cast<uint32_t>(min(lo, kCentroids - 1));
      }
      put_group<KB>(out + lane * KB, codes);
    }
    if (lane == 0) put_fp16(out + S::kKeyCodeBytes, p.norms[row]);
  }

  // Values: min/max over the head (exact in any order), then vLLM's uniform codes.
  float lo = INFINITY, hi = -INFINITY;
  for (int j = lane; j < D; j += 32) {
    const float x = load_as_float(p.v.data, p.v.dtype, v_row + j);
    lo = fminf(lo, x);
    hi = fmaxf(hi, x);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  constexpr int kMaxCode = (1 << VB) - 1;
  float scale = div_full(__fsub_rn(hi, lo), static_cast<float>(kMaxCode));
  scale = fmaxf(scale, 1e-8f);
  uint8_t* vout = out + S::kKeyBytes;
  if (lane < kGroups) {
    uint32_t codes[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float x = load_as_float(p.v.data, p.v.dtype, v_row + lane * 8 + i);
      const int q = __float2int_rz(__fadd_rn(div_full(__fsub_rn(x, lo), scale), 0.5f));
      codes[i] = static_cast<uint32_t>(min(max(q, 0), kMaxCode));
    }
    put_group<VB>(vout + lane * VB, codes);
  }
  if (lane == 0) {
    put_fp16(vout + S::kValueCodeBytes, scale);
    put_fp16(vout + S::kValueCodeBytes + 2, lo);
  }
}

}  // namespace tqkv_vllm
