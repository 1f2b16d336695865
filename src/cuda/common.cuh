// Device helpers shared by the tqkv CUDA kernels: error checks, element loads/stores,
// the paged-cache address arithmetic of docs/FORMAT.md, and warp-level FWHT/reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "tqkv/cuda.h"
#include "tqkv/error.h"

namespace tqkv::cuda::detail {

[[noreturn]] void throw_cuda(cudaError_t err, const char* expr, const char* file, int line);
[[noreturn]] void throw_arg(const std::string& what);

#define TQKV_CUDA_CHECK(expr)                                                             \
  do {                                                                                    \
    const cudaError_t tqkv_err_ = (expr);                                                 \
    if (tqkv_err_ != cudaSuccess) ::tqkv::cuda::detail::throw_cuda(tqkv_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// Codec ids as in format.h: keys F32=0 F16=1 BF16=2 Fp8=3 Mse=4; values ... Uniform=4 Mse=5.
enum : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kFp8 = 3 };
enum : uint8_t { kKeyMse = 4 };
enum : uint8_t { kValUniform = 4, kValMse = 5 };

// Where the bytes of one (page, offset, head) live, for either arrangement of a page.
struct Layout {
  uint8_t* pages;
  int64_t page_bytes;
  int block_size;
  int n_kv_heads;
  int slot_bytes;
  int kcb, kmb, vcb, vmb;  // key/value code and meta bytes
  bool page_layout;
  uint8_t kcodec, kbits, vcodec, vbits;
  bool nc;
};

struct SlotAddr {
  uint8_t* kc;  // key codes
  uint8_t* km;  // key meta (fp16 norm)
  uint8_t* vc;  // value codes
  uint8_t* vm;  // value meta 0 (fp16 scale or norm)
  int vm1;      // offset from vm to value meta 1 (fp16 zero)
  uint8_t* pad; // the pad byte (valid when the slot size is odd)
};

__host__ __device__ inline SlotAddr slot_addr(const Layout& L, int64_t page, int off, int h) {
  uint8_t* base = L.pages + page * L.page_bytes;
  SlotAddr a;
  if (!L.page_layout) {
    uint8_t* s = base + (static_cast<int64_t>(off) * L.n_kv_heads + h) * L.slot_bytes;
    const int kb = L.kcb + L.kmb;
    a.kc = s;
    a.km = s + L.kcb;
    a.vc = s + kb;
    a.vm = s + kb + L.vcb;
    a.vm1 = 2;
    a.pad = s + kb + L.vcb + L.vmb;
  } else {
    const int bs = L.block_size;
    uint8_t* sec = base + static_cast<int64_t>(h) * bs * L.slot_bytes;
    a.kc = sec + off * L.kcb;
    a.vc = sec + bs * L.kcb + off * L.vcb;
    a.km = sec + bs * (L.kcb + L.vcb) + off * 2;
    a.vm = sec + bs * (L.kcb + L.vcb + L.kmb) + off * 2;
    a.vm1 = 2 * bs;
    a.pad = sec + bs * (L.kcb + L.vcb + L.kmb + L.vmb) + off;
  }
  return a;
}

Layout make_layout(const CacheCodec& codec, const PagedKv& kv);

__device__ __forceinline__ float load_elem(const void* p, DType t, int64_t i) {
  if (t == DType::F32) return static_cast<const float*>(p)[i];
  if (t == DType::F16) return __half2float(static_cast<const __half*>(p)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}

__device__ __forceinline__ void store_elem(void* p, DType t, int64_t i, float x) {
  if (t == DType::F32) static_cast<float*>(p)[i] = x;
  else if (t == DType::F16) static_cast<__half*>(p)[i] = __float2half_rn(x);
  else static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
}

__device__ __forceinline__ uint16_t f2h_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }
__device__ __forceinline__ float h2f_bits(uint16_t b) { return __half2float(__ushort_as_half(b)); }

__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_min(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Unnormalised Walsh-Hadamard transform of a d = 32*E vector spread over a warp, lane l holding
// elements [E*l, E*l+E). Stages run in the CPU reference's order (len = 1, 2, 4, ...), each
// butterfly computing u + v and u - v exactly as src/core/rotation.cpp does, so the result is
// bit-identical to tqkv::fwht.
template <int E>
__device__ __forceinline__ void warp_fwht(float (&x)[E], int lane) {
#pragma unroll
  for (int len = 1; len < E; len <<= 1) {
#pragma unroll
    for (int j = 0; j < E; ++j) {
      if ((j & len) == 0) {
        const float u = x[j], v = x[j + len];
        x[j] = __fadd_rn(u, v);
        x[j + len] = __fsub_rn(u, v);
      }
    }
  }
#pragma unroll
  for (int lm = 1; lm < 32; lm <<= 1) {
    const bool upper = (lane & lm) != 0;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const float other = __shfl_xor_sync(0xffffffffu, x[j], lm);
      x[j] = upper ? __fsub_rn(other, x[j]) : __fadd_rn(x[j], other);
    }
  }
}

__device__ __forceinline__ bool sign_negative(const CodecTables& t, int i) {
  return (t.sign_bits[i >> 5] >> (i & 31)) & 1u;
}

}  // namespace tqkv::cuda::detail
