#include "qgemv.h"

#include <cstring>
#include <vector>

#include "gguf.h"
#include "qgemv_kernels.h"
#include "tqkv/error.h"
#include "tqkv/half.h"
#include "tqkv/simd.h"

namespace tqkv::engine {
namespace detail {
namespace {

float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// Scalar references: the block layouts are those of dequant.cpp.
void q4_0(const uint8_t* w, int cols, int r0, int r1, const float* x, const float* xsum, float* y) {
  const int nb = cols / 32;
  for (int r = r0; r < r1; ++r) {
    const uint8_t* b = w + static_cast<size_t>(r) * nb * 18;
    float acc = 0;
    for (int i = 0; i < nb; ++i, b += 18) {
      const float* xb = x + 32 * i;
      float s = 0;
      for (int j = 0; j < 16; ++j) s += static_cast<float>(b[2 + j] & 0x0f) * xb[j] + static_cast<float>(b[2 + j] >> 4) * xb[j + 16];
      acc += f16(b) * (s - 8.0f * xsum[i]);
    }
    y[r - r0] = acc;
  }
}

void q4_1(const uint8_t* w, int cols, int r0, int r1, const float* x, const float* xsum, float* y) {
  const int nb = cols / 32;
  for (int r = r0; r < r1; ++r) {
    const uint8_t* b = w + static_cast<size_t>(r) * nb * 20;
    float acc = 0;
    for (int i = 0; i < nb; ++i, b += 20) {
      const float* xb = x + 32 * i;
      float s = 0;
      for (int j = 0; j < 16; ++j) s += static_cast<float>(b[4 + j] & 0x0f) * xb[j] + static_cast<float>(b[4 + j] >> 4) * xb[j + 16];
      acc += f16(b) * s + f16(b + 2) * xsum[i];
    }
    y[r - r0] = acc;
  }
}

// Q5_0: the 5th bit of element j is bit j of qh; (q - 16) d = d q - 16 d.
void q5_0(const uint8_t* w, int cols, int r0, int r1, const float* x, const float* xsum, float* y) {
  const int nb = cols / 32;
  for (int r = r0; r < r1; ++r) {
    const uint8_t* b = w + static_cast<size_t>(r) * nb * 22;
    float acc = 0;
    for (int i = 0; i < nb; ++i, b += 22) {
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      const float* xb = x + 32 * i;
      float s = 0;
      for (int j = 0; j < 16; ++j) {
        const int lo = (b[6 + j] & 0x0f) | (((qh >> j) & 1) << 4);
        const int hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        s += static_cast<float>(lo) * xb[j] + static_cast<float>(hi) * xb[j + 16];
      }
      acc += f16(b) * (s - 16.0f * xsum[i]);
    }
    y[r - r0] = acc;
  }
}

void q8_0(const uint8_t* w, int cols, int r0, int r1, const float* x, const float*, float* y) {
  const int nb = cols / 32;
  for (int r = r0; r < r1; ++r) {
    const uint8_t* b = w + static_cast<size_t>(r) * nb * 34;
    float acc = 0;
    for (int i = 0; i < nb; ++i, b += 34) {
      const auto* q = reinterpret_cast<const int8_t*>(b + 2);
      float s = 0;
      for (int j = 0; j < 32; ++j) s += static_cast<float>(q[j]) * x[32 * i + j];
      acc += f16(b) * s;
    }
    y[r - r0] = acc;
  }
}

// Q4_K: 256-element blocks of 8 sub-blocks of 32, each d*s*q - dmin*m; the mins factor out
// against the sub-block sums of x.
void q4_k(const uint8_t* w, int cols, int r0, int r1, const float* x, const float* xsum, float* y) {
  const int nb = cols / 256;
  for (int r = r0; r < r1; ++r) {
    const uint8_t* b = w + static_cast<size_t>(r) * nb * 144;
    float acc = 0;
    for (int i = 0; i < nb; ++i, b += 144) {
      const float d = f16(b), dmin = f16(b + 2);
      const uint8_t* q = b + 16;
      for (int g = 0; g < 4; ++g, q += 32) {
        int s0, m0, s1, m1;
        q4_k_scale_min(b + 4, 2 * g, s0, m0);
        q4_k_scale_min(b + 4, 2 * g + 1, s1, m1);
        const float* x0 = x + 256 * i + 64 * g;
        float a0 = 0, a1 = 0;
        for (int l = 0; l < 32; ++l) {
          a0 += static_cast<float>(q[l] & 0x0f) * x0[l];
          a1 += static_cast<float>(q[l] >> 4) * x0[32 + l];
        }
        const float* xs = xsum + 8 * i + 2 * g;
        acc += d * (static_cast<float>(s0) * a0 + static_cast<float>(s1) * a1) -
               dmin * (static_cast<float>(m0) * xs[0] + static_cast<float>(m1) * xs[1]);
      }
    }
    y[r - r0] = acc;
  }
}

// Q6_K: the codes' offset of 32 is subtracted in integers, so no sums of x are needed; each
// 16-element sub-block's dot product is scaled by d * scale.
void q6_k(const uint8_t* w, int cols, int r0, int r1, const float* x, const float*, float* y) {
  const int nb = cols / 256;
  for (int r = r0; r < r1; ++r) {
    const uint8_t* b = w + static_cast<size_t>(r) * nb * kQ6kBytes;
    float acc = 0;
    for (int i = 0; i < nb; ++i, b += kQ6kBytes) {
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b + 64 * h;
        const uint8_t* qh = b + 128 + 32 * h;
        const float* xh = x + 256 * i + 128 * h;
        for (int k = 0; k < 4; ++k)
          for (int half16 = 0; half16 < 2; ++half16) {
            float s = 0;
            for (int l = 16 * half16; l < 16 * half16 + 16; ++l) {
              const int lo = (ql[l + 32 * (k & 1)] >> (k < 2 ? 0 : 4)) & 0x0f;
              const int q = (lo | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
              s += static_cast<float>(q) * xh[32 * k + l];
            }
            acc += d * static_cast<float>(sc[8 * h + 2 * k + half16]) * s;
          }
      }
    }
    y[r - r0] = acc;
  }
}

}  // namespace

QgemvKernels qgemv_scalar() { return {q4_0, q4_1, q5_0, q8_0, q4_k, q6_k}; }

}  // namespace detail

namespace {

// One probe for the whole library (tqkv::active_simd_level): SimdLevel::Avx2 guarantees
// AVX2+FMA+F16C and SimdLevel::Avx512 F+BW+VL+DQ as well, so TQKV_SIMD / set_simd_level
// choose these kernels too.
const detail::QgemvKernels& kernels_for(SimdLevel level) {
  static const detail::QgemvKernels scalar = detail::qgemv_scalar();
  static const detail::QgemvKernels avx2 = detail::qgemv_avx2();
  static const detail::QgemvKernels avx512 = detail::qgemv_avx512();
  return level >= SimdLevel::Avx512 ? avx512 : level >= SimdLevel::Avx2 ? avx2 : scalar;
}

void run(const detail::QgemvKernels& k, uint32_t type, const uint8_t* w, int cols, int r0, int r1, const float* x,
         float* y) {
  if (cols % 32 != 0) throw Error(ErrorCode::InvalidArgument, "qgemv: cols must be a multiple of 32");
  const int nb = cols / 32;
  thread_local std::vector<float> xsum;
  xsum.resize(nb);
  for (int i = 0; i < nb; ++i) {
    float s = 0;
    for (int j = 0; j < 32; ++j) s += x[32 * i + j];
    xsum[i] = s;
  }
  switch (static_cast<TensorType>(type)) {
    case TensorType::Q4_0: k.q4_0(w, cols, r0, r1, x, xsum.data(), y); break;
    case TensorType::Q4_1: k.q4_1(w, cols, r0, r1, x, xsum.data(), y); break;
    case TensorType::Q5_0: k.q5_0(w, cols, r0, r1, x, xsum.data(), y); break;
    case TensorType::Q8_0: k.q8_0(w, cols, r0, r1, x, xsum.data(), y); break;
    case TensorType::Q4_K:
    case TensorType::Q6_K: {
      if (cols % 256 != 0) throw Error(ErrorCode::InvalidArgument, "qgemv: K-quants need cols a multiple of 256");
      (type == static_cast<uint32_t>(TensorType::Q4_K) ? k.q4_k : k.q6_k)(w, cols, r0, r1, x, xsum.data(), y);
      break;
    }
    default: throw Error(ErrorCode::InvalidArgument, "qgemv: unsupported type " + tensor_type_name(type));
  }
}

}  // namespace

bool qgemv_supported(uint32_t type) {
  const auto t = static_cast<TensorType>(type);
  return t == TensorType::Q4_0 || t == TensorType::Q4_1 || t == TensorType::Q5_0 || t == TensorType::Q8_0 ||
         t == TensorType::Q4_K || t == TensorType::Q6_K;
}

const char* qgemv_isa() {
  const SimdLevel l = active_simd_level();
  return l >= SimdLevel::Avx512 ? "avx512" : l >= SimdLevel::Avx2 ? "avx2" : "scalar";
}

void qgemv(uint32_t type, const uint8_t* w, int cols, int r0, int r1, const float* x, float* y) {
  run(kernels_for(active_simd_level()), type, w, cols, r0, r1, x, y);
}

}  // namespace tqkv::engine
