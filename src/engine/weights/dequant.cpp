#include "engine/weights/dequant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>

#include "tqkv/error.h"
#include "tqkv/gguf_blocks.h"
#include "tqkv/half.h"

namespace tqkv::engine {
namespace {

// n blocks of type T (gguf_blocks.h decodes them, the GPU's dequantize too).
template <gguf::TensorType T>
void blocks(const uint8_t* src, float* dst, int64_t nb) {
  constexpr int be = gguf::block_elems(T), bb = gguf::block_bytes(T);
  for (int64_t i = 0; i < nb; ++i)
    for (int j = 0; j < be; ++j) dst[i * be + j] = gguf::element<T>(src + i * bb, j);
}

}  // namespace

void dequantize(uint32_t type, const uint8_t* src, float* dst, int64_t n) {
  const TensorTypeTraits* tr = tensor_type_traits(type);
  if (!tr) throw Error(ErrorCode::Format, "cannot dequantize tensor type " + tensor_type_name(type));
  if (n % tr->block_elems != 0)
    throw Error(ErrorCode::InvalidArgument, std::string("element count is not a multiple of the ") + tr->name + " block");
  const int64_t nb = n / tr->block_elems;
  switch (static_cast<TensorType>(type)) {
    case TensorType::F32: std::memcpy(dst, src, static_cast<size_t>(n) * 4); break;
    case TensorType::F16: blocks<TensorType::F16>(src, dst, nb); break;
    case TensorType::BF16: blocks<TensorType::BF16>(src, dst, nb); break;
    case TensorType::Q4_0: blocks<TensorType::Q4_0>(src, dst, nb); break;
    case TensorType::Q4_1: blocks<TensorType::Q4_1>(src, dst, nb); break;
    case TensorType::Q5_0: blocks<TensorType::Q5_0>(src, dst, nb); break;
    case TensorType::Q5_1: blocks<TensorType::Q5_1>(src, dst, nb); break;
    case TensorType::Q8_0: blocks<TensorType::Q8_0>(src, dst, nb); break;
    case TensorType::Q4_K: blocks<TensorType::Q4_K>(src, dst, nb); break;
    case TensorType::Q6_K: blocks<TensorType::Q6_K>(src, dst, nb); break;
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
