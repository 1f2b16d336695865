// Device helpers of the tqkv_vllm kernels over vLLM's TurboQuant slot (slot.h): slot addresses,
// Triton's float division, element loads and stores, code fields, fp16 and FP8 fields.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "slot.h"

namespace tqkv_vllm {

#if !defined(__CUDACC__)
// The host build of the kernels (tests/emu) provides these: a warp's mma.m16n8k16 from its
// lanes' fragments, and the block's dynamic shared memory.
void host_mma_m16n8k16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1);
uint8_t* host_dynamic_smem();
#define TQKV_VLLM_DYNAMIC_SMEM(name) uint8_t* name = ::tqkv_vllm::host_dynamic_smem()
#else
#define TQKV_VLLM_DYNAMIC_SMEM(name) extern __shared__ __align__(16) uint8_t name[]
#endif

// D += A B on tensor cores, mma.m16n8k16 with fp16 operands and float32 accumulators. Fragments
// of lane (g = lane / 4, c = lane % 4), each register two fp16, the lower first:
//   a0 = A[g][2c, 2c+1], a1 = A[g+8][2c, 2c+1], a2 = A[g][2c+8, 2c+9], a3 = A[g+8][2c+8, 2c+9];
//   b0 = B[2c, 2c+1][g], b1 = B[2c+8, 2c+9][g];  d = D[g][2c, 2c+1], D[g+8][2c, 2c+1].
__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#elif !defined(__CUDACC__)
  host_mma_m16n8k16(d, a0, a1, a2, a3, b0, b1);
#endif
}

// Two floats as an fp16 pair (a in the lower half), and two small codes (< 2048) likewise.
__device__ __forceinline__ uint32_t pack_h2(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  uint32_t r;
  memcpy(&r, &h, 4);
  return r;
}
__device__ __forceinline__ uint32_t pack_codes(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>(__half_as_ushort(__ushort2half_rn(static_cast<unsigned short>(a)))) |
         static_cast<uint32_t>(__half_as_ushort(__ushort2half_rn(static_cast<unsigned short>(b)))) << 16;
}
// Two FP8 E4M3 bytes (the lower first) as an fp16 pair.
__device__ __forceinline__ uint32_t fp8x2_to_h2(uint32_t two_bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes & 0xFFFF), __NV_E4M3);
  uint32_t r;
  memcpy(&r, &h, 4);
  return r;
}

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

// n-bit field at bit `off` of a little-endian word array.
template <int NW>
__device__ __forceinline__ uint32_t field(const uint32_t (&w)[NW], int off, int n) {
  const int i = off >> 5, sh = off & 31;
  uint32_t v = w[i] >> sh;
  if (sh + n > 32 && i + 1 < NW) v |= w[i + 1] << (32 - sh);
  return v & ((1u << n) - 1u);
}

// N bytes at p (2-byte aligned where N is even; any alignment otherwise) as little-endian words,
// zero beyond them.
template <int N, int NW>
__device__ __forceinline__ void load_words(uint32_t (&w)[NW], const uint8_t* p) {
  static_assert(NW >= (N + 3) / 4, "room for N bytes");
#pragma unroll
  for (int i = 0; i < NW; ++i) w[i] = 0;
  if constexpr (N % 2 == 0) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) w[i / 2] |= static_cast<uint32_t>(h[i]) << (16 * (i % 2));
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i / 4] |= static_cast<uint32_t>(p[i]) << (8 * (i % 4));
  }
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
