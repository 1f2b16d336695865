#include "engine/weights/qgemv.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <cstring>
#include <vector>

#include "engine/gguf/gguf.h"
#include "engine/weights/block_groups.h"
#include "engine/weights/qgemv_kernels.h"
#include "tqkv/error.h"
#include "tqkv/options.h"
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

// Scalar references: the block layouts are those of dequant.cpp. Each converts a block's codes
// to floats once and runs the one-row arithmetic of every activation row t on them.
inline const float* row_x(const QgemmArgs& a, int t) { return a.x + static_cast<size_t>(t) * a.cols; }
inline const float* row_xsum(const QgemmArgs& a, int t) { return a.xsum + static_cast<size_t>(t) * (a.cols / 32); }

// For each weight row of [r0, r1): acc[t] starts at 0, block(b, i, acc) runs over its blocks
// of kBytes bytes (kElems elements), and y = acc[t].
template <int N, int kElems, int kBytes, class Block>
inline void over_rows(const QgemmArgs& a, Block block) {
  const int nb = a.cols / kElems;
  for (int r = a.r0; r < a.r1; ++r) {
    const uint8_t* b = a.w + static_cast<size_t>(r) * nb * kBytes;
    float acc[N] = {};
    for (int i = 0; i < nb; ++i, b += kBytes) block(b, i, acc);
    for (int t = 0; t < N; ++t) a.y[t * a.ldy + (r - a.r0)] = acc[t];
  }
}

// q[j] for the 32 4-bit codes of a Q4_0/Q4_1 block (low nibbles: elements 0-15).
inline void nibbles(const uint8_t* qs, float* q) {
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<float>(qs[j] & 0x0f);
    q[j + 16] = static_cast<float>(qs[j] >> 4);
  }
}

// sum_j q_j x_j, pairing elements j and j + 16 as the one-row kernels do.
inline float dot_pairs(const float* q, const float* xb) {
  float s = 0;
  for (int j = 0; j < 16; ++j) s += q[j] * xb[j] + q[j + 16] * xb[j + 16];
  return s;
}

template <int N>
void q4_0(const QgemmArgs& a) {
  over_rows<N, 32, 18>(a, [&](const uint8_t* b, int i, float* acc) {
    float q[32];
    nibbles(b + 2, q);
    for (int t = 0; t < N; ++t) acc[t] += f16(b) * (dot_pairs(q, row_x(a, t) + 32 * i) - 8.0f * row_xsum(a, t)[i]);
  });
}

template <int N>
void q4_1(const QgemmArgs& a) {
  over_rows<N, 32, 20>(a, [&](const uint8_t* b, int i, float* acc) {
    float q[32];
    nibbles(b + 4, q);
    for (int t = 0; t < N; ++t) acc[t] += f16(b) * dot_pairs(q, row_x(a, t) + 32 * i) + f16(b + 2) * row_xsum(a, t)[i];
  });
}

// Q5_0: the 5th bit of element j is bit j of qh; (q - 16) d = d q - 16 d.
template <int N>
void q5_0(const QgemmArgs& a) {
  over_rows<N, 32, 22>(a, [&](const uint8_t* b, int i, float* acc) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    float q[32];
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<float>((b[6 + j] & 0x0f) | (((qh >> j) & 1) << 4));
      q[j + 16] = static_cast<float>((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
    for (int t = 0; t < N; ++t) acc[t] += f16(b) * (dot_pairs(q, row_x(a, t) + 32 * i) - 16.0f * row_xsum(a, t)[i]);
  });
}

template <int N>
void q8_0(const QgemmArgs& a) {
  over_rows<N, 32, 34>(a, [&](const uint8_t* b, int i, float* acc) {
    float q[32];
    for (int j = 0; j < 32; ++j) q[j] = static_cast<float>(static_cast<int8_t>(b[2 + j]));
    for (int t = 0; t < N; ++t) {
      const float* xb = row_x(a, t) + 32 * i;
      float s = 0;
      for (int j = 0; j < 32; ++j) s += q[j] * xb[j];
      acc[t] += f16(b) * s;
    }
  });
}

// Q4_K: 256-element blocks of 8 sub-blocks of 32, each d*s*q - dmin*m; the mins factor out
// against the sub-block sums of x.
template <int N>
void q4_k(const QgemmArgs& a) {
  over_rows<N, 256, 144>(a, [&](const uint8_t* b, int i, float* acc) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* qs = b + 16;
    for (int g = 0; g < 4; ++g, qs += 32) {
      int s0, m0, s1, m1;
      q4_k_scale_min(b + 4, 2 * g, s0, m0);
      q4_k_scale_min(b + 4, 2 * g + 1, s1, m1);
      float q0[32], q1[32];
      for (int l = 0; l < 32; ++l) {
        q0[l] = static_cast<float>(qs[l] & 0x0f);
        q1[l] = static_cast<float>(qs[l] >> 4);
      }
      for (int t = 0; t < N; ++t) {
        const float* x0 = row_x(a, t) + 256 * i + 64 * g;
        float a0 = 0, a1 = 0;
        for (int l = 0; l < 32; ++l) {
          a0 += q0[l] * x0[l];
          a1 += q1[l] * x0[32 + l];
        }
        const float* xs = row_xsum(a, t) + 8 * i + 2 * g;
        acc[t] += d * (static_cast<float>(s0) * a0 + static_cast<float>(s1) * a1) -
                  dmin * (static_cast<float>(m0) * xs[0] + static_cast<float>(m1) * xs[1]);
      }
    }
  });
}

// Q6_K: the codes' offset of 32 is subtracted in integers, so no sums of x are needed; each
// 16-element sub-block's dot product is scaled by d * scale.
template <int N>
void q6_k(const QgemmArgs& a) {
  over_rows<N, 256, kQ6kBytes>(a, [&](const uint8_t* b, int i, float* acc) {
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
      float q[128];  // element 32k + l
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < 32; ++l) {
          const int lo = (ql[l + 32 * (k & 1)] >> (k < 2 ? 0 : 4)) & 0x0f;
          q[32 * k + l] = static_cast<float>((lo | (((qh[l] >> (2 * k)) & 3) << 4)) - 32);
        }
      for (int t = 0; t < N; ++t) {
        const float* xh = row_x(a, t) + 256 * i + 128 * h;
        for (int k = 0; k < 4; ++k)
          for (int half16 = 0; half16 < 2; ++half16) {
            float s = 0;
            for (int l = 16 * half16; l < 16 * half16 + 16; ++l) s += q[32 * k + l] * xh[32 * k + l];
            acc[t] += d * static_cast<float>(sc[8 * h + 2 * k + half16]) * s;
          }
      }
    }
  });
}

}  // namespace

QgemvKernels qgemv_scalar() {
  return {TQKV_QGEMM_ENTRY(q4_0), TQKV_QGEMM_ENTRY(q4_1), TQKV_QGEMM_ENTRY(q5_0),
          TQKV_QGEMM_ENTRY(q8_0), TQKV_QGEMM_ENTRY(q4_k), TQKV_QGEMM_ENTRY(q6_k)};
}

#if defined(TQKV_NO_AVX512)
// A build without the AVX-512 kernels (TQKV_AVX512): the dispatch below never asks for them.
bool qdot_avx512_supported() { return false; }
QgemvKernels qgemv_avx512() { return qgemv_avx2(); }
QdotKernels qdot_avx512() { return qdot_avx2(); }
void quantize_rows_256_avx512(const float*, size_t, int8_t*, float*, int16_t*, int16_t*) {
  throw Error(ErrorCode::InvalidArgument, "qdot: this build has no AVX-512 kernels");
}
#else
bool qdot_avx512_supported() {
  static const bool ok = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
}
#endif

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

// Row tiles of W that qgemm runs every group of kQgemmRows activation rows over before moving
// on, so that past kQgemmRows rows the tile is read from the cache, not from memory, again.
constexpr int kQgemmTileRows = 16;

// The kernel of `type` in a kernel table (QgemvKernels or QdotKernels); checks cols.
template <class Table>
auto kernel_of(const Table& k, uint32_t type, int cols) {
  if (cols % 32 != 0) throw Error(ErrorCode::InvalidArgument, "qgemv: cols must be a multiple of 32");
  switch (static_cast<TensorType>(type)) {
    case TensorType::Q4_0: return k.q4_0;
    case TensorType::Q4_1: return k.q4_1;
    case TensorType::Q5_0: return k.q5_0;
    case TensorType::Q8_0: return k.q8_0;
    case TensorType::Q4_K:
    case TensorType::Q6_K:
      if (cols % 256 != 0) throw Error(ErrorCode::InvalidArgument, "qgemv: K-quants need cols a multiple of 256");
      return type == static_cast<uint32_t>(TensorType::Q4_K) ? k.q4_k : k.q6_k;
    default: throw Error(ErrorCode::InvalidArgument, "qgemv: unsupported type " + tensor_type_name(type));
  }
}

// Runs call(t0, t1, g, rows) over row tiles of W and groups of up to kQgemmRows activation
// rows: one tile and one group at a time (a row's arithmetic depends on neither).
template <class Call>
void over_tiles(int r0, int r1, int n, Call call) {
  const int tile = n <= detail::kQgemmRows ? std::max(1, r1 - r0) : kQgemmTileRows;
  for (int t0 = r0; t0 < r1; t0 += tile) {
    const int t1 = std::min(r1, t0 + tile);
    for (int g = 0; g < n; g += detail::kQgemmRows) call(t0, t1, g, std::min(detail::kQgemmRows, n - g));
  }
}

// The VNNI table is built only where the CPU runs it (its file is compiled for AVX-512).
const detail::QdotKernels& qdot_kernels_for(SimdLevel level) {
  static const detail::QdotKernels scalar = detail::qdot_scalar();
  static const detail::QdotKernels avx2 = detail::qdot_avx2();
  static const detail::QdotKernels avx512 = detail::qdot_avx512_supported() ? detail::qdot_avx512() : avx2;
  if (level >= SimdLevel::Avx512 && detail::qdot_avx512_supported()) return avx512;
  return level >= SimdLevel::Avx2 ? avx2 : scalar;
}

QdotMode mode_from_env() {
  return parse_qdot_mode(env_choice("TQKV_QDOT"));
}

std::atomic<int>& mode_slot() {
  static std::atomic<int> m{static_cast<int>(mode_from_env())};
  return m;
}

}  // namespace

bool is_k_quant(uint32_t type) {
  return type == static_cast<uint32_t>(TensorType::Q4_K) || type == static_cast<uint32_t>(TensorType::Q6_K);
}

bool qgemv_supported(uint32_t type) {
  const auto t = static_cast<TensorType>(type);
  return t == TensorType::Q4_0 || t == TensorType::Q4_1 || t == TensorType::Q5_0 || t == TensorType::Q8_0 ||
         t == TensorType::Q4_K || t == TensorType::Q6_K;
}

const char* qgemv_isa() {
  const SimdLevel l = active_simd_level();
  return l >= SimdLevel::Avx512 ? "avx512" : l >= SimdLevel::Avx2 ? "avx2" : "scalar";
}

void QgemmInput::prepare(const float* x, int n, int cols, bool k_quants_only) {
  if (n < 0) throw Error(ErrorCode::InvalidArgument, "qgemm: negative row count");
  if (cols % 32 != 0) throw Error(ErrorCode::InvalidArgument, "qgemv: cols must be a multiple of 32");
  mode_ = qdot_mode();
  x_ = x;
  n_ = n;
  cols_ = cols;
  if (mode_ == QdotMode::Int8) {
    detail::quantize_rows(x, n, cols, q_, !k_quants_only);
    return;
  }
  xsum_.resize(static_cast<size_t>(n) * (cols / 32));
  for (size_t i = 0; i < xsum_.size(); ++i) {
    float s = 0;
    for (int j = 0; j < 32; ++j) s += x[32 * i + j];
    xsum_[i] = s;
  }
}

void qgemm(uint32_t type, const uint8_t* w, int r0, int r1, const QgemmInput& x, float* y, size_t ldy) {
  if (r0 < 0 || r1 < r0) throw Error(ErrorCode::InvalidArgument, "qgemm: negative row count or range");
  const SimdLevel level = active_simd_level();
  const int cols = x.cols_, nb = cols / 32;
  if (is_grouped(type)) {
    const uint32_t gguf_type = ungrouped_type(type);
    const detail::QdotKernels& ks = qdot_kernels_for(level);
    const detail::QdotFn grouped =
        x.mode_ != QdotMode::Int8 ? nullptr
        : type == kQ5_0Groups     ? ks.q5_0_groups
        : type == kQ4_1Groups     ? ks.q4_1_groups
                                  : ks.q8_0_groups;
    if (!grouped) {
      // The other kernels read the GGUF layout: restore it a slice of rows at a time (the
      // results are those of the GGUF matrix, bit for bit, whatever the slices).
      constexpr int kSlice = 64;
      thread_local std::vector<uint8_t> gguf;
      const size_t row_bytes = static_cast<size_t>(nb) * tensor_type_traits(gguf_type)->block_bytes;
      for (int s0 = r0; s0 < r1; s0 += kSlice) {
        const int s1 = std::min(r1, s0 + kSlice);
        gguf.resize(row_bytes * (s1 - s0));
        unpack_group_rows(type, w + row_bytes * s0, s1 - s0, cols, gguf.data());
        qgemm(gguf_type, gguf.data(), 0, s1 - s0, x, y + (s0 - r0), ldy);
      }
      return;
    }
    if (x.n_ > 0 && x.q_.xq.empty())
      throw Error(ErrorCode::InvalidArgument,
                  "qgemm: " + tensor_type_name(gguf_type) + " over an input prepared for K-quants only");
    over_tiles(r0, r1, x.n_, [&](int t0, int t1, int g, int m) {
      grouped({w, cols, t0, t1, x.q_.rows(g, cols), m, y + g * ldy + (t0 - r0), ldy});
    });
    return;
  }
  if (x.mode_ == QdotMode::Int8) {
    const detail::QdotFn fn = kernel_of(qdot_kernels_for(level), type, cols);
    if (x.n_ > 0 && x.q_.xq.empty() && !is_k_quant(type))
      throw Error(ErrorCode::InvalidArgument,
                  "qgemm: " + tensor_type_name(type) + " over an input prepared for K-quants only");
    over_tiles(r0, r1, x.n_, [&](int t0, int t1, int g, int m) {
      fn({w, cols, t0, t1, x.q_.rows(g, cols), m, y + g * ldy + (t0 - r0), ldy});
    });
  } else {
    const detail::QgemmFn fn = kernel_of(kernels_for(level), type, cols);
    over_tiles(r0, r1, x.n_, [&](int t0, int t1, int g, int m) {
      fn({w, cols, t0, t1, x.x_ + static_cast<size_t>(g) * cols, x.xsum_.data() + static_cast<size_t>(g) * nb, m,
          y + g * ldy + (t0 - r0), ldy});
    });
  }
}

void qgemm(uint32_t type, const uint8_t* w, int cols, int r0, int r1, const float* x, int n, float* y, size_t ldy) {
  if (n < 0 || r0 < 0 || r1 < r0) throw Error(ErrorCode::InvalidArgument, "qgemm: negative row count or range");
  // Checks type and cols before the rows are read.
  kernel_of(qdot_kernels_for(SimdLevel::Scalar), ungrouped_type(type), cols);
  thread_local QgemmInput input;
  input.prepare(x, n, cols, is_k_quant(type));
  qgemm(type, w, r0, r1, input, y, ldy);
}

void qgemv(uint32_t type, const uint8_t* w, int cols, int r0, int r1, const float* x, float* y) {
  qgemm(type, w, cols, r0, r1, x, 1, y, 0);
}

QdotMode parse_qdot_mode(std::string_view name) {
  if (name == "f32") return QdotMode::F32;
  if (name == "int8") return QdotMode::Int8;
  throw Error(ErrorCode::InvalidArgument, "TQKV_QDOT: expected f32 or int8, got '" + std::string(name) + "'");
}

const char* qdot_mode_name(QdotMode mode) { return mode == QdotMode::F32 ? "f32" : "int8"; }

QdotMode qdot_mode() { return static_cast<QdotMode>(mode_slot().load(std::memory_order_relaxed)); }

void set_qdot_mode(QdotMode mode) { mode_slot().store(static_cast<int>(mode), std::memory_order_relaxed); }

const char* qdot_isa() {
  if (qdot_mode() == QdotMode::F32) return qgemv_isa();
  const SimdLevel l = active_simd_level();
  if (l >= SimdLevel::Avx512 && detail::qdot_avx512_supported()) return "avx512vnni";
  return l >= SimdLevel::Avx2 ? "avx2" : "scalar";
}

}  // namespace tqkv::engine
