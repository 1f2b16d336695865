// Per-ISA entry points of qgemv (internal to the engine).
#pragma once
#include <cstdint>

namespace tqkv::engine::detail {

// xsum: [cols / 32] sums of x per 32-element block; y: [r1 - r0].
using QgemvFn = void (*)(const uint8_t* w, int cols, int r0, int r1, const float* x, const float* xsum, float* y);

struct QgemvKernels {
  QgemvFn q4_0, q4_1, q5_0, q8_0;
};

QgemvKernels qgemv_scalar();
QgemvKernels qgemv_avx2();

}  // namespace tqkv::engine::detail
