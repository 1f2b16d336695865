// Device helpers of the tqkv_vllm kernels over vLLM's TurboQuant slot (slot.h): slot addresses,
// Triton's float division, element loads and stores, code fields, fp16 and FP8 fields.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "slot.h"

namespace tqkv_vllm {

__device__ __forceinline__ int64_t slot_offset(const CacheView& c, int64_t slot, int head) {
  const int64_t blk = slot / c.block_size, off = slot % c.block_size;
  return blk * c.stride_block + off * c.stride_pos + head * c.stride_head;
}

// Triton lowers a float32 `/` to div.full.f32 (checked on the PTX of vLLM's store kernels,
// Triton 3.6); the store must divide the same way to write the same codes. (The host build of
// the kernels, tests/emu, divides in IEEE.)
__device__ __forceinline__ float div_full(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a / b;
#endif
}

// Triton's float32 -> float8e4nv on sm_90: round to nearest even, saturate to +-448.
__device__ __forceinline__ uint8_t fp8_e4m3_of(float x) {
#if defined(__CUDA_ARCH__)
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
  return static_cast<uint8_t>(r & 0xFF);
#else
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
#endif
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float load_as_float(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::F16: return __half2float(static_cast<const __half*>(p)[i]);
    case DType::BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
__device__ __forceinline__ void store_from_float(void* p, DType t, int64_t i, float x) {
  switch (t) {
    case DType::F16: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
    case DType::BF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    default: static_cast<float*>(p)[i] = x;
  }
}

__device__ __forceinline__ float fp16_bits_to_float(uint32_t lo, uint32_t hi) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(lo | (hi << 8))));
}
__device__ __forceinline__ float fp8_e4m3_to_float(uint8_t b) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
  return __half2float(__half(h));
}

// The `bits`-wide code of element j of a little-endian code field at p (any byte alignment;
// reads at most two bytes past the field's byte of j, which stay inside the slot).
template <int BITS>
__device__ __forceinline__ uint32_t code_at(const uint8_t* p, int j) {
  const int bit = j * BITS, byte = bit >> 3, sh = bit & 7;
  uint32_t w = p[byte];
  if (sh + BITS > 8) w |= static_cast<uint32_t>(p[byte + 1]) << 8;
  return (w >> sh) & ((1u << BITS) - 1u);
}

}  // namespace tqkv_vllm
