// Matrix-vector products straight from GGUF quantized blocks, for decode: one token streams
// the weights once, so reading 0.56-1.06 bytes per weight (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K)
// instead of 4 (expanded float32) is what sets decode speed.
//
// The result equals the float32 product with the dequantized matrix up to summation order:
// each block's scale and offset are factored out of the dot product,
//   Q4_1: sum_j (d q_j + m) x_j = d * sum_j q_j x_j + m * sum_j x_j,
// with the per-block sums of x computed once per vector.
//
// Two paths for x (QdotMode, TQKV_QDOT=f32|int8 or set_qdot_mode; int8 by default):
// - f32: x stays float32, so a product equals the batched path's SGEMM on dequantized weights
//   to float rounding (token-by-token decode and batched prefill agree to 1e-4,
//   tests/engine/test_model.cpp).
// - int8: each row of x is quantized once per product (once per group of products over the same
//   rows, QgemmInput) to int8 per 32-element block with a
//   float scale (as llama.cpp's Q8_0; for Q4_K and Q6_K per 256 elements with integer
//   sub-scales per 32, whose products stay integers across a super-block), and the weight
//   codes meet it in integer dot products (AVX-512 VNNI vpdpbusd / vpdpwssd, AVX2 vpmaddubsw +
//   vpmaddwd); the contract every ISA meets bit for bit is in qgemv_kernels.h. A product
//   differs from the float one by the activation rounding: |error| <= sum_b (step_b / 2)
//   sum_{c in b} |w_c| per row over the 32-element blocks b, step_b = max_b |x| / 127 (K-quants:
//   at most max_b |x| / 127 + max |x| / 2032 over b's 256-element block), plus float rounding.
//
// Kernels, one set for qgemv and qgemm (1-8 activation rows per call): a scalar reference
// (always compiled, the oracle), AVX2+FMA+F16C (qgemv_avx2.cpp) and AVX-512 F+BW+VL+DQ
// (qgemv_avx512.cpp), picked by tqkv::active_simd_level(), so TQKV_SIMD=scalar|avx2|avx512 or
// set_simd_level() forces a level.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "engine/weights/qgemv_kernels.h"

namespace tqkv::engine {

enum class QdotMode { F32, Int8 };

bool qgemv_supported(uint32_t type);
bool is_k_quant(uint32_t type);  // Q4_K or Q6_K: the int8 path's per-256 activations

// y[r - r0] = sum_c W[r, c] x[c] for rows r in [r0, r1); W: rows of `cols` elements in `type`
// blocks, row stride = cols / block_elems * block_bytes; cols a multiple of 32 (256 for
// Q4_K and Q6_K); y: [r1 - r0].
void qgemv(uint32_t type, const uint8_t* w, int cols, int r0, int r1, const float* x, float* y);

// qgemv of n activation rows at once: y[t * ldy + r - r0] for t < n, x: [n, cols]. Each weight
// block is decoded once per group of up to 8 rows; every row's result is bit-identical to
// qgemv of that row alone (same operations in the same order), so batching decode steps
// changes no product. n = 0 writes nothing.
void qgemm(uint32_t type, const uint8_t* w, int cols, int r0, int r1, const float* x, int n, float* y, size_t ldy);

// Activation rows x [n, cols] made ready once for several products over them (a group of
// products that share an input, CpuDevice::matmul_group, or one product's row slices on several
// threads): under the int8 path quantized, under f32 their block sums taken. qgemm over it
// equals qgemm over x bit for bit, in the mode current at prepare(). x is not copied: it must
// stay unchanged while products read the input. Throws tqkv::Error for n < 0 or cols not a
// multiple of 32. k_quants_only: every product over the input is Q4_K or Q6_K, so the int8
// path makes only their per-256 rows (not the per-32 ones the other types read, which cost as
// much again); qgemm of another type over such an input throws tqkv::Error.
class QgemmInput {
 public:
  void prepare(const float* x, int n, int cols, bool k_quants_only = false);
  int n() const { return n_; }
  int cols() const { return cols_; }

 private:
  friend void qgemm(uint32_t type, const uint8_t* w, int r0, int r1, const QgemmInput& x, float* y, size_t ldy);
  QdotMode mode_ = QdotMode::Int8;
  const float* x_ = nullptr;
  int n_ = 0, cols_ = 0;
  std::vector<float> xsum_;  // f32: sums of x per 32-element block [n, cols / 32]
  detail::QdotBuffers q_;    // int8: the quantized rows
};

// qgemm of prepared rows (cols = x.cols()); safe to call from several threads at once.
void qgemm(uint32_t type, const uint8_t* w, int r0, int r1, const QgemmInput& x, float* y, size_t ldy);

// The f32 path's implementation for the active SIMD level: "avx512", "avx2" or "scalar".
const char* qgemv_isa();

QdotMode parse_qdot_mode(std::string_view name);  // "f32" | "int8"; else tqkv::Error
const char* qdot_mode_name(QdotMode mode);
// The mode qgemv / qgemm use now: TQKV_QDOT if set (read once), else Int8, unless overridden.
QdotMode qdot_mode();
void set_qdot_mode(QdotMode mode);  // for the whole process
// The kernels qgemv uses now: qgemv_isa() under f32; "avx512vnni", "avx2" or "scalar" under int8.
const char* qdot_isa();

}  // namespace tqkv::engine
