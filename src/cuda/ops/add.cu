// add (residuals) and add_bias (a bias row broadcast over tokens).
#include "launch.cuh"

namespace tqkv::cuda {
namespace {

__global__ void add_kernel(float* x, const float* y, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    x[i] += y[i];
}

__global__ void add_bias_kernel(float* y, const float* bias, size_t n, int cols) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    y[i] += bias[i % cols];
}

}  // namespace

void add(float* x, const float* y, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (!x || !y) detail::throw_arg("add: null argument");
  add_kernel<<<detail::op_blocks(n), detail::kOpThreads, 0, stream>>>(x, y, n);
  detail::check_launch();
}

void add_bias(float* y, const float* bias, int n, int cols, cudaStream_t stream) {
  if (n <= 0) return;
  if (!y || !bias || cols <= 0) detail::throw_arg("add_bias: null or empty argument");
  const size_t total = static_cast<size_t>(n) * cols;
  add_bias_kernel<<<detail::op_blocks(total), detail::kOpThreads, 0, stream>>>(y, bias, total, cols);
  detail::check_launch();
}

}  // namespace tqkv::cuda
