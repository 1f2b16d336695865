// rmsnorm: one CTA per row; the sum of squares in double, as the CPU device computes it.
#include "launch.cuh"

namespace tqkv::cuda {
namespace {

__global__ void rmsnorm_kernel(const float* x, const float* w, int d, float eps, float* y) {
  __shared__ double partial[detail::kOpThreads / 32];
  const float* xr = x + static_cast<size_t>(blockIdx.x) * d;
  float* yr = y + static_cast<size_t>(blockIdx.x) * d;
  double ss = 0;
  for (int i = threadIdx.x; i < d; i += blockDim.x) ss += static_cast<double>(xr[i]) * xr[i];
  ss = detail::warp_sum(ss);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    double s = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0;
    s = detail::warp_sum(s);
    if (threadIdx.x == 0) partial[0] = s;
  }
  __syncthreads();
  const float r = static_cast<float>(1.0 / sqrt(partial[0] / d + eps));
  for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * r * w[i];
}

}  // namespace

void rmsnorm(const float* x, const float* w, int n, int d, float eps, float* y, cudaStream_t stream) {
  if (n <= 0) return;
  if (!x || !w || !y || d <= 0) detail::throw_arg("rmsnorm: null or empty argument");
  rmsnorm_kernel<<<n, detail::kOpThreads, 0, stream>>>(x, w, d, eps, y);
  detail::check_launch();
}

}  // namespace tqkv::cuda
