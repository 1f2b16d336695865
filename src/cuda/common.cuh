// Device helpers shared by the tqkv CUDA kernels: error checks, element loads/stores,
// the paged-cache address arithmetic of docs/FORMAT.md, and warp-level FWHT/reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "tqkv/codec_kind.h"
#include "tqkv/cuda.h"
#include "tqkv/error.h"
#include "tqkv/page_geometry.h"

namespace tqkv::cuda::detail {

[[noreturn]] void throw_cuda(cudaError_t err, const char* expr, const char* file, int line);
[[noreturn]] void throw_arg(const std::string& what);

#define TQKV_CUDA_CHECK(expr)                                                             \
  do {                                                                                    \
    const cudaError_t tqkv_err_ = (expr);                                                 \
    if (tqkv_err_ != cudaSuccess) ::tqkv::cuda::detail::throw_cuda(tqkv_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// One layer's pool as the kernels see it: the page geometry (page_geometry.h, shared with the
// CPU pool) and the codecs of its format (codec_kind.h).
struct Layout {
  uint8_t* pages;
  PageGeometry geo;
  KeyCodec kcodec;
  uint8_t kbits;
  ValueCodec vcodec;
  uint8_t vbits;
  bool nc;
};

// The plain element codecs (F32, F16, BF16, Fp8) have the same ids in KeyCodec and ValueCodec
// (codec_kind.h), so one element encoder/decoder names them by KeyCodec.
__host__ __device__ constexpr KeyCodec plain_codec(ValueCodec v) { return static_cast<KeyCodec>(v); }

struct SlotAddr {
  uint8_t* kc;  // key codes
  uint8_t* km;  // key meta (fp16 norm)
  uint8_t* vc;  // value codes
  uint8_t* vm;  // value meta 0 (fp16 scale or norm)
  int vm1;      // offset from vm to value meta 1 (fp16 zero)
  uint8_t* pad; // the pad byte (valid when the slot size is odd)
};

__host__ __device__ inline SlotAddr slot_addr(const Layout& L, int64_t page, int off, int h) {
  const PageGeometry& g = L.geo;
  uint8_t* base = L.pages + page * g.page_bytes();
  SlotAddr a;
  a.kc = base + g.key_codes(off, h);
  a.km = base + g.key_meta(off, h);
  a.vc = base + g.value_codes(off, h);
  a.vm = base + g.value_meta(off, h);
  a.vm1 = static_cast<int>(g.value_meta(off, h, 1) - g.value_meta(off, h));
  a.pad = base + g.pad(off, h);
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

template <class Tables>  // CodecTables or the decode kernel's subset
__device__ __forceinline__ bool sign_negative(const Tables& t, int i) {
  return (t.sign_bits[i >> 5] >> (i & 31)) & 1u;
}

}  // namespace tqkv::cuda::detail
