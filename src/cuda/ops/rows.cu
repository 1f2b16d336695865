// gather_rows / scatter_rows: rows of d floats by a device index list.
#include "launch.cuh"

namespace tqkv::cuda {
namespace {

template <bool Gather>
__global__ void rows_kernel(const float* x, int d, const int32_t* rows, int n, float* y) {
  const size_t total = static_cast<size_t>(n) * d;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t r = i / d, c = i % d;
    if (Gather) y[i] = x[static_cast<size_t>(rows[r]) * d + c];
    else y[static_cast<size_t>(rows[r]) * d + c] = x[i];
  }
}

}  // namespace

void gather_rows(const float* x, int d, const int32_t* rows, int n, float* y, cudaStream_t stream) {
  if (n <= 0) return;
  if (!x || !rows || !y || d <= 0) detail::throw_arg("gather_rows: null or empty argument");
  rows_kernel<true><<<detail::op_blocks(static_cast<size_t>(n) * d), detail::kOpThreads, 0, stream>>>(x, d, rows, n, y);
  detail::check_launch();
}

void scatter_rows(const float* x, int d, const int32_t* rows, int n, float* y, cudaStream_t stream) {
  if (n <= 0) return;
  if (!x || !rows || !y || d <= 0) detail::throw_arg("scatter_rows: null or empty argument");
  rows_kernel<false><<<detail::op_blocks(static_cast<size_t>(n) * d), detail::kOpThreads, 0, stream>>>(x, d, rows, n, y);
  detail::check_launch();
}

}  // namespace tqkv::cuda
