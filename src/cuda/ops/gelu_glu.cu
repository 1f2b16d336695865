// gelu_glu: gate = gelu(gate) * up, GELU in its tanh approximation (Gemma's GeGLU), computed
// in float as the CPU device does.
#include "glu.cuh"
#include "launch.cuh"

namespace tqkv::cuda {
namespace {

__global__ void gelu_glu_kernel(float* gate, const float* up, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    gate[i] = detail::gelu_times(gate[i], up[i]);
}

}  // namespace

void gelu_glu(float* gate, const float* up, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (!gate || !up) detail::throw_arg("gelu_glu: null argument");
  gelu_glu_kernel<<<detail::op_blocks(n), detail::kOpThreads, 0, stream>>>(gate, up, n);
  detail::check_launch();
}

}  // namespace tqkv::cuda
