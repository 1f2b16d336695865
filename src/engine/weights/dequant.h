// Expands GGUF tensor blocks (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K) to
// float. Layouts are ggml's, documented in docs/ENGINE.md.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/gguf/gguf.h"

namespace tqkv::engine {

// Dequantizes n elements (a multiple of the type's block size) from src into dst.
// Throws tqkv::Error(Format) for a type this reader does not know.
void dequantize(uint32_t type, const uint8_t* src, float* dst, int64_t n);

// Whole tensor -> float vector of n_elements() (row-major, ne[0] contiguous).
void dequantize_tensor(const GgufTensor& t, float* dst);

// The index of the first of n elements (a multiple of the type's block size) at src that is NaN
// or infinite, or -1: for a quantized type, the first element of the first block whose fp16
// scale or minimum is (its codes are integers). Throws tqkv::Error(Format) for an unknown type.
int64_t first_non_finite(uint32_t type, const uint8_t* src, int64_t n);

// Throws tqkv::Error(Format) naming the tensor and an element when a weight is NaN or infinite
// (split over the thread pool): such a model gives NaN logits, which no sampler can read.
void check_tensor_finite(const GgufTensor& t);

// Throws tqkv::Error(Format) naming the tensor unless its shape is [cols (contiguous), rows].
void check_tensor_shape(const GgufTensor& t, int64_t cols, int64_t rows = 1);

// Expands a tensor of shape [cols (contiguous), rows] to float32 (rows split over the thread
// pool). Throws tqkv::Error(Format) naming the tensor when the shape differs.
std::vector<float> expand_tensor(const GgufTensor& t, int64_t cols, int64_t rows = 1);

}  // namespace tqkv::engine
