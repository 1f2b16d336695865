// gelu_glu: gate = gelu(gate) * up, GELU in its tanh approximation (Gemma's GeGLU), computed
// in float as the CPU device does.
#include "launch.cuh"

namespace tqkv::cuda {
namespace {

__global__ void gelu_glu_kernel(float* gate, const float* up, size_t n) {
  const float k = 0.7978845608028654f;  // sqrt(2/pi)
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    gate[i] = 0.5f * g * (1.0f + tanhf(k * (g + 0.044715f * g * g * g))) * up[i];
  }
}

}  // namespace

void gelu_glu(float* gate, const float* up, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (!gate || !up) detail::throw_arg("gelu_glu: null argument");
  gelu_glu_kernel<<<detail::op_blocks(n), detail::kOpThreads, 0, stream>>>(gate, up, n);
  detail::check_launch();
}

}  // namespace tqkv::cuda
