// The gated activations of swiglu.cu and gelu_glu.cu, shared with their fused forms (glu.cu) so
// that both compute the same expression.
#pragma once

namespace tqkv::cuda::detail {

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

__device__ __forceinline__ float gelu_times(float g, float u) {
  const float k = 0.7978845608028654f;  // sqrt(2/pi)
  return 0.5f * g * (1.0f + tanhf(k * (g + 0.044715f * g * g * g))) * u;
}

}  // namespace tqkv::cuda::detail
