// f32 <-> bf16, f32 -> f16 (round to nearest even; NaN stays NaN).
#include <cuda_fp16.h>

#include "launch.cuh"

namespace tqkv::cuda {
namespace {

__global__ void to_bf16_kernel(const float* x, uint16_t* y, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    y[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
}

__global__ void to_f16_kernel(const float* x, uint16_t* y, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    y[i] = __half_as_ushort(__float2half_rn(x[i]));
}

__global__ void from_bf16_kernel(const uint16_t* x, float* y, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    y[i] = detail::bf16_bits_to_float(x[i]);
}

}  // namespace

void f32_to_bf16(const float* x, uint16_t* y, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (!x || !y) detail::throw_arg("f32_to_bf16: null argument");
  to_bf16_kernel<<<detail::op_blocks(n), detail::kOpThreads, 0, stream>>>(x, y, n);
  detail::check_launch();
}

void f32_to_f16(const float* x, uint16_t* y, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (!x || !y) detail::throw_arg("f32_to_f16: null argument");
  to_f16_kernel<<<detail::op_blocks(n), detail::kOpThreads, 0, stream>>>(x, y, n);
  detail::check_launch();
}

void bf16_to_f32(const uint16_t* x, float* y, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (!x || !y) detail::throw_arg("bf16_to_f32: null argument");
  from_bf16_kernel<<<detail::op_blocks(n), detail::kOpThreads, 0, stream>>>(x, y, n);
  detail::check_launch();
}

}  // namespace tqkv::cuda
