// swiglu: gate = silu(gate) * up.
#include "glu.cuh"
#include "launch.cuh"

namespace tqkv::cuda {
namespace {

__global__ void swiglu_kernel(float* gate, const float* up, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    gate[i] = detail::silu_times(gate[i], up[i]);
}

}  // namespace

void swiglu(float* gate, const float* up, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (!gate || !up) detail::throw_arg("swiglu: null argument");
  swiglu_kernel<<<detail::op_blocks(n), detail::kOpThreads, 0, stream>>>(gate, up, n);
  detail::check_launch();
}

}  // namespace tqkv::cuda
