// rmsnorm: one CTA per row; the sum of squares in double, as the CPU device computes it.
// add_rmsnorm is the same kernel with the residual add before it (x += delta, each element by
// the thread that then squares it) and, optionally, the output's bf16 copy after it: the plain
// and the fused forms compute the same expressions in the same order.
#include "launch.cuh"

namespace tqkv::cuda {
namespace {

template <bool kAdd>
__global__ void rmsnorm_kernel(float* x, const float* delta, const float* w, int d, float eps, float* y,
                               uint16_t* y_bf16) {
  __shared__ double partial[detail::kOpThreads / 32];
  float* xr = x + static_cast<size_t>(blockIdx.x) * d;
  const float* dr = kAdd ? delta + static_cast<size_t>(blockIdx.x) * d : nullptr;
  float* yr = y + static_cast<size_t>(blockIdx.x) * d;
  double ss = 0;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float v = xr[i];
    if constexpr (kAdd) {
      v += dr[i];
      xr[i] = v;
    }
    ss += static_cast<double>(v) * v;
  }
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
  uint16_t* br = y_bf16 ? y_bf16 + static_cast<size_t>(blockIdx.x) * d : nullptr;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float o = xr[i] * r * w[i];
    yr[i] = o;
    if (br) br[i] = __bfloat16_as_ushort(__float2bfloat16_rn(o));
  }
}

}  // namespace

void rmsnorm(const float* x, const float* w, int n, int d, float eps, float* y, cudaStream_t stream) {
  if (n <= 0) return;
  if (!x || !w || !y || d <= 0) detail::throw_arg("rmsnorm: null or empty argument");
  // x is only read (kAdd = false).
  rmsnorm_kernel<false><<<n, detail::kOpThreads, 0, stream>>>(const_cast<float*>(x), nullptr, w, d, eps, y, nullptr);
  detail::check_launch();
}

void add_rmsnorm(float* x, const float* delta, const float* w, int n, int d, float eps, float* y, uint16_t* y_bf16,
                 cudaStream_t stream) {
  if (n <= 0) return;
  if (!x || !w || !y || d <= 0) detail::throw_arg("add_rmsnorm: null or empty argument");
  if (y == x) detail::throw_arg("add_rmsnorm: y may not be x");
  if (delta)
    rmsnorm_kernel<true><<<n, detail::kOpThreads, 0, stream>>>(x, delta, w, d, eps, y, y_bf16);
  else
    rmsnorm_kernel<false><<<n, detail::kOpThreads, 0, stream>>>(x, nullptr, w, d, eps, y, y_bf16);
  detail::check_launch();
}

}  // namespace tqkv::cuda
