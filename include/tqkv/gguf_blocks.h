// GGUF's (ggml's) weight block layouts, decoded one element at a time by the same code on the
// CPU (the engine's dequantize) and on the GPU (cuda::dequant_weights_bf16, for weights kept
// quantized in GPU memory): one implementation of every layout. Plain arithmetic on bytes; on the
// device every product and sum is rounded on its own (no fused multiply-add), so both sides give
// the same float for the same block, bit for bit.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TQKV_HD __host__ __device__ __forceinline__
#else
#define TQKV_HD inline
#endif

namespace tqkv::gguf {

// Tensor type ids of the GGUF file format (ggml's ggml_type).
enum class TensorType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15, BF16 = 30,
};

// Elements and bytes of one block of a type decoded here (0 for any other).
TQKV_HD constexpr int block_elems(TensorType t) {
  switch (t) {
    case TensorType::F32: case TensorType::F16: case TensorType::BF16: return 1;
    case TensorType::Q4_0: case TensorType::Q4_1: case TensorType::Q5_0: case TensorType::Q5_1:
    case TensorType::Q8_0: return 32;
    case TensorType::Q4_K: case TensorType::Q6_K: return 256;
    default: return 0;
  }
}
TQKV_HD constexpr int block_bytes(TensorType t) {
  switch (t) {
    case TensorType::F32: return 4;
    case TensorType::F16: case TensorType::BF16: return 2;
    case TensorType::Q4_0: return 18;
    case TensorType::Q4_1: return 20;
    case TensorType::Q5_0: return 22;
    case TensorType::Q5_1: return 24;
    case TensorType::Q8_0: return 34;
    case TensorType::Q4_K: return 144;
    case TensorType::Q6_K: return 210;
    default: return 0;
  }
}

namespace detail {

TQKV_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
TQKV_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TQKV_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TQKV_HD uint32_t load_u16(const uint8_t* p) { return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8); }
TQKV_HD uint32_t load_u32(const uint8_t* p) { return load_u16(p) | (load_u16(p + 2) << 16); }

// IEEE fp16 bits to float, exactly (subnormals included).
TQKV_HD float f16(const uint8_t* p) {
  const uint32_t h = load_u16(p);
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_to_float(sign);
  const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant * 2^-24, exact
  return sign ? -v : v;
}

}  // namespace detail

// Q4_K's 6-bit scale and min of sub-block j (0-7) from the block's 12 packed bytes.
TQKV_HD void q4_k_scale_min(const uint8_t* sc, int j, int& s, int& m) {
  if (j < 4) {
    s = sc[j] & 63;
    m = sc[j + 4] & 63;
  } else {
    s = (sc[j + 4] & 0x0f) | ((sc[j - 4] >> 6) << 4);
    m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
  }
}

// Element j (0 <= j < block_elems(T)) of the block at b. The 32-element types: byte l of the
// codes holds element l in its low nibble and element l + 16 in its high one; the 5th bits of
// Q5_* sit in a 32-bit mask (bit j for element j). Q4_K: 8 sub-blocks of 32, each with a 6-bit
// scale and min, times two fp16 super-scales; codes of elements 64g + l and 64g + 32 + l share
// byte 32g + l. Q6_K: two halves of 128; element l + 32k of a half (l < 32, k < 4) has its low
// nibble in ql[l + 32 (k & 1)] (shifted by 4 for k >= 2) and its high two bits in qh[l] >> 2k,
// value d * scale[l / 16 + 2k] * (q - 32).
template <TensorType T>
TQKV_HD float element(const uint8_t* b, int j) {
  using namespace detail;
  if constexpr (T == TensorType::F32) {
    return bits_to_float(load_u32(b + 4 * j));
  } else if constexpr (T == TensorType::F16) {
    return f16(b + 2 * j);
  } else if constexpr (T == TensorType::BF16) {
    return bits_to_float(load_u16(b + 2 * j) << 16);
  } else if constexpr (T == TensorType::Q4_0 || T == TensorType::Q4_1) {
    constexpr int kCodes = T == TensorType::Q4_0 ? 2 : 4;
    const uint8_t q = b[kCodes + (j & 15)];
    const int code = j < 16 ? (q & 0x0f) : (q >> 4);
    if constexpr (T == TensorType::Q4_0) return mul(static_cast<float>(code - 8), f16(b));
    else return add(mul(static_cast<float>(code), f16(b)), f16(b + 2));
  } else if constexpr (T == TensorType::Q5_0 || T == TensorType::Q5_1) {
    constexpr int kMask = T == TensorType::Q5_0 ? 2 : 4;
    const uint32_t qh = load_u32(b + kMask);
    const uint8_t q = b[kMask + 4 + (j & 15)];
    const int code = (j < 16 ? (q & 0x0f) : (q >> 4)) | static_cast<int>(((qh >> j) & 1u) << 4);
    if constexpr (T == TensorType::Q5_0) return mul(static_cast<float>(code - 16), f16(b));
    else return add(mul(static_cast<float>(code), f16(b)), f16(b + 2));
  } else if constexpr (T == TensorType::Q8_0) {
    return mul(static_cast<float>(static_cast<int8_t>(b[2 + j])), f16(b));
  } else if constexpr (T == TensorType::Q4_K) {
    const int g = j >> 6, hi = (j >> 5) & 1, l = j & 31;
    int s, m;
    q4_k_scale_min(b + 4, 2 * g + hi, s, m);
    const uint8_t q = b[16 + 32 * g + l];
    const float scale = mul(f16(b), static_cast<float>(s)), min = mul(f16(b + 2), static_cast<float>(m));
    return add(mul(scale, static_cast<float>(hi ? (q >> 4) : (q & 0x0f))), -min);
  } else if constexpr (T == TensorType::Q6_K) {
    const int half = j >> 7, r = j & 127, k = r >> 5, l = r & 31;
    const uint8_t* ql = b + 64 * half;
    const uint8_t* qh = b + 128 + 32 * half;
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * half);
    const int low = (k & 1 ? ql[l + 32] : ql[l]) >> (k < 2 ? 0 : 4) & 0x0f;
    const int q = (low | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
    return mul(mul(f16(b + 208), static_cast<float>(sc[l / 16 + 2 * k])), static_cast<float>(q));
  } else {
    static_assert(block_elems(T) > 0, "a GGUF type without a decoder here");
    return 0.0f;
  }
}

}  // namespace tqkv::gguf
