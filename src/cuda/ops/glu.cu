// glu: swiglu or gelu_glu (the same expressions, glu.cuh) that also writes the result's bf16
// copy, rounded as f32_to_bf16 rounds, for the product that follows.
#include "glu.cuh"
#include "launch.cuh"

namespace tqkv::cuda {
namespace {

template <bool kGelu>
__global__ void glu_kernel(float* gate, const float* up, size_t n, uint16_t* gate_bf16) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float r = kGelu ? detail::gelu_times(gate[i], up[i]) : detail::silu_times(gate[i], up[i]);
    gate[i] = r;
    if (gate_bf16) gate_bf16[i] = __bfloat16_as_ushort(__float2bfloat16_rn(r));
  }
}

}  // namespace

void glu(bool gelu, float* gate, const float* up, size_t n, uint16_t* gate_bf16, cudaStream_t stream) {
  if (n == 0) return;
  if (!gate || !up) detail::throw_arg("glu: null argument");
  if (gelu)
    glu_kernel<true><<<detail::op_blocks(n), detail::kOpThreads, 0, stream>>>(gate, up, n, gate_bf16);
  else
    glu_kernel<false><<<detail::op_blocks(n), detail::kOpThreads, 0, stream>>>(gate, up, n, gate_bf16);
  detail::check_launch();
}

}  // namespace tqkv::cuda
