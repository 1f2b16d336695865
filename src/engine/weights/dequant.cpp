#include "engine/weights/dequant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>

#include "engine/weights/qgemv_kernels.h"
#include "tqkv/error.h"
#include "tqkv/half.h"

namespace tqkv::engine {
namespace {

float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// 32-element blocks. In the 4- and 5-bit ones, byte j of qs holds element j in its low
// nibble and element j + 16 in its high nibble; the 5th bits of Q5_* live in a 32-bit mask
// (bit j for element j).
void q4_0(const uint8_t* b, float* y) {
  const float d = f16(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0f) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void q4_1(const uint8_t* b, float* y) {
  const float d = f16(b), m = f16(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0f) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

void q5(const uint8_t* qh_bytes, const uint8_t* qs, float d, float m, int offset, float* y) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0x0f) | (((qh >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = static_cast<float>(lo - offset) * d + m;
    y[j + 16] = static_cast<float>(hi - offset) * d + m;
  }
}

void q8_0(const uint8_t* b, float* y) {
  const float d = f16(b);
  const auto* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

// Q4_K: 256-element super-block = 8 sub-blocks of 32, each with a 6-bit scale and 6-bit min
// packed into 12 bytes; the two fp16 super-scales multiply them.
void q4_k(const uint8_t* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* q = b + 16;
  for (int g = 0; g < 4; ++g) {  // 64 elements per 32 bytes of codes: low nibbles, then high
    int s0, m0, s1, m1;
    detail::q4_k_scale_min(sc, 2 * g, s0, m0);
    detail::q4_k_scale_min(sc, 2 * g + 1, s1, m1);
    const float d0 = d * s0, n0 = dmin * m0, d1 = d * s1, n1 = dmin * m1;
    for (int l = 0; l < 32; ++l) {
      y[l] = d0 * static_cast<float>(q[l] & 0x0f) - n0;
      y[l + 32] = d1 * static_cast<float>(q[l] >> 4) - n1;
    }
    q += 32;
    y += 64;
  }
}

// Q6_K: 256 elements; low 4 bits in ql[128], high 2 bits in qh[64], 16 int8 scales, fp16 d.
void q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  for (int half = 0; half < 2; ++half) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * sc[is] * q1;
      y[l + 32] = d * sc[is + 2] * q2;
      y[l + 64] = d * sc[is + 4] * q3;
      y[l + 96] = d * sc[is + 6] * q4;
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

}  // namespace

void dequantize(uint32_t type, const uint8_t* src, float* dst, int64_t n) {
  const TensorTypeTraits* tr = tensor_type_traits(type);
  if (!tr) throw Error(ErrorCode::Format, "cannot dequantize tensor type " + tensor_type_name(type));
  if (n % tr->block_elems != 0)
    throw Error(ErrorCode::InvalidArgument, std::string("element count is not a multiple of the ") + tr->name + " block");
  const int64_t nb = n / tr->block_elems;
  const int be = tr->block_elems, bb = tr->block_bytes;
  switch (static_cast<TensorType>(type)) {
    case TensorType::F32: std::memcpy(dst, src, static_cast<size_t>(n) * 4); break;
    case TensorType::F16: for (int64_t i = 0; i < n; ++i) dst[i] = f16(src + 2 * i); break;
    case TensorType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = bf16_to_float(h);
      }
      break;
    case TensorType::Q4_0: for (int64_t i = 0; i < nb; ++i) q4_0(src + i * bb, dst + i * be); break;
    case TensorType::Q4_1: for (int64_t i = 0; i < nb; ++i) q4_1(src + i * bb, dst + i * be); break;
    case TensorType::Q5_0:
      for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* b = src + i * bb;
        q5(b + 2, b + 6, f16(b), 0.0f, 16, dst + i * be);
      }
      break;
    case TensorType::Q5_1:
      for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* b = src + i * bb;
        q5(b + 4, b + 8, f16(b), f16(b + 2), 0, dst + i * be);
      }
      break;
    case TensorType::Q8_0: for (int64_t i = 0; i < nb; ++i) q8_0(src + i * bb, dst + i * be); break;
    case TensorType::Q4_K: for (int64_t i = 0; i < nb; ++i) q4_k(src + i * bb, dst + i * be); break;
    case TensorType::Q6_K: for (int64_t i = 0; i < nb; ++i) q6_k(src + i * bb, dst + i * be); break;
    default: throw Error(ErrorCode::Format, "cannot dequantize tensor type " + tensor_type_name(type));
  }
}

void dequantize_tensor(const GgufTensor& t, float* dst) { dequantize(t.type, t.data, dst, t.n_elements()); }

namespace {

// The first of n 16-bit floats at p (stride bytes apart) whose exponent bits `exp` are all set
// (an infinity or a NaN), or -1. Branch-free inside so that the compiler can vectorise it.
int64_t first_all_ones(const uint8_t* p, int64_t n, size_t stride, uint16_t exp) {
  constexpr int64_t kChunk = 256;
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t end = std::min(n, i0 + kChunk);
    bool any = false;
    for (int64_t i = i0; i < end; ++i) {
      uint16_t h;
      std::memcpy(&h, p + static_cast<size_t>(i) * stride, 2);
      any |= (h & exp) == exp;
    }
    if (!any) continue;
    for (int64_t i = i0; i < end; ++i) {
      uint16_t h;
      std::memcpy(&h, p + static_cast<size_t>(i) * stride, 2);
      if ((h & exp) == exp) return i;
    }
  }
  return -1;
}

}  // namespace

int64_t first_non_finite(uint32_t type, const uint8_t* src, int64_t n) {
  const TensorTypeTraits* tr = tensor_type_traits(type);
  if (!tr) throw Error(ErrorCode::Format, "cannot read tensor type " + tensor_type_name(type));
  const int64_t nb = n / tr->block_elems;
  const size_t bb = static_cast<size_t>(tr->block_bytes);
  constexpr uint16_t kHalfExp = 0x7c00, kBf16Exp = 0x7f80;
  // A quantized block's codes are integers: only its fp16 scale and minimum can be non-finite,
  // and finite ones give finite weights (at most 65504 x 127 x 63).
  auto fields = [&](std::initializer_list<size_t> offsets) {
    int64_t first = -1;
    for (size_t off : offsets) {
      const int64_t b = first_all_ones(src + off, nb, bb, kHalfExp);
      if (b >= 0 && (first < 0 || b < first)) first = b;
    }
    return first < 0 ? -1 : first * tr->block_elems;
  };
  switch (static_cast<TensorType>(type)) {
    case TensorType::F32:
      for (int64_t i = 0; i < n; ++i) {
        float x;
        std::memcpy(&x, src + 4 * i, 4);
        if (!std::isfinite(x)) return i;
      }
      return -1;
    case TensorType::F16: return first_all_ones(src, n, 2, kHalfExp);
    case TensorType::BF16: return first_all_ones(src, n, 2, kBf16Exp);
    case TensorType::Q4_0:
    case TensorType::Q5_0:
    case TensorType::Q8_0: return fields({0});
    case TensorType::Q4_1:
    case TensorType::Q5_1:
    case TensorType::Q4_K: return fields({0, 2});
    case TensorType::Q6_K: return fields({208});
    default: throw Error(ErrorCode::Format, "cannot read tensor type " + tensor_type_name(type));
  }
}

}  // namespace tqkv::engine
