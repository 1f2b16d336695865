// Matrix-vector products straight from GGUF quantized blocks, for decode: one token streams
// the weights once, so reading 0.56-1.06 bytes per weight (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K)
// instead of 4 (expanded float32) is what sets decode speed.
//
// The result equals the float32 product with the dequantized matrix up to summation order:
// each block's scale and offset are factored out of the dot product,
//   Q4_1: sum_j (d q_j + m) x_j = d * sum_j q_j x_j + m * sum_j x_j,
// with the per-block sums of x computed once per vector.
//
// x stays float32 (no int8 activation quantization as in llama.cpp), so a product equals the
// batched path's SGEMM on dequantized weights to float rounding, which keeps token-by-token
// decode and batched prefill in agreement (tests/engine/test_model.cpp).
//
// Kernels, one set for qgemv and qgemm (1-8 activation rows per call): a scalar reference
// (always compiled, the oracle), AVX2+FMA+F16C (qgemv_avx2.cpp) and AVX-512 F+BW+VL+DQ
// (qgemv_avx512.cpp), picked by tqkv::active_simd_level(), so TQKV_SIMD=scalar|avx2|avx512 or
// set_simd_level() forces a level.
#pragma once
#include <cstddef>
#include <cstdint>

namespace tqkv::engine {

bool qgemv_supported(uint32_t type);

// y[r - r0] = sum_c W[r, c] x[c] for rows r in [r0, r1); W: rows of `cols` elements in `type`
// blocks, row stride = cols / block_elems * block_bytes; cols a multiple of 32 (256 for
// Q4_K and Q6_K); y: [r1 - r0].
void qgemv(uint32_t type, const uint8_t* w, int cols, int r0, int r1, const float* x, float* y);

// qgemv of n activation rows at once: y[t * ldy + r - r0] for t < n, x: [n, cols]. Each weight
// block is decoded once per group of up to 8 rows; every row's result is bit-identical to
// qgemv of that row alone (same operations in the same order), so batching decode steps
// changes no product. n = 0 writes nothing.
void qgemm(uint32_t type, const uint8_t* w, int cols, int r0, int r1, const float* x, int n, float* y, size_t ldy);

// The implementation qgemv uses now: "avx512", "avx2" or "scalar".
const char* qgemv_isa();

}  // namespace tqkv::engine
