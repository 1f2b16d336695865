// add (residuals), add_bias (a bias row broadcast over tokens) and add_biases (several in one launch).
#include <string>

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

// Up to kMaxBiases (y, bias) pairs, each y [n, cols[j]], as one flat index space.
struct BiasList {
  float* y[kMaxBiases];
  const float* bias[kMaxBiases];
  int cols[kMaxBiases];
  size_t end[kMaxBiases];  // cumulative n * cols
  int count;
};

__global__ void add_biases_kernel(const __grid_constant__ BiasList l) {
  const size_t total = l.end[l.count - 1];
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    int j = 0;
    while (i >= l.end[j]) ++j;
    const size_t e = i - (j ? l.end[j - 1] : 0);
    l.y[j][e] += l.bias[j][e % l.cols[j]];
  }
}

}  // namespace

void add_biases(float* const* y, const float* const* bias, const int* cols, int count, int n, cudaStream_t stream) {
  if (n <= 0 || count == 0) return;
  if (count < 0 || count > kMaxBiases) detail::throw_arg("add_biases: count must be 1.." + std::to_string(kMaxBiases));
  BiasList l{};
  size_t total = 0;
  for (int j = 0; j < count; ++j) {
    if (!y[j] || !bias[j] || cols[j] <= 0) detail::throw_arg("add_biases: null or empty argument");
    l.y[j] = y[j];
    l.bias[j] = bias[j];
    l.cols[j] = cols[j];
    total += static_cast<size_t>(n) * cols[j];
    l.end[j] = total;
  }
  l.count = count;
  add_biases_kernel<<<detail::op_blocks(total), detail::kOpThreads, 0, stream>>>(l);
  detail::check_launch();
}

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
