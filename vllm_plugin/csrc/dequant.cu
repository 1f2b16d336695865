// Dequantize a sequence's cached tokens out of vLLM's TurboQuant cache into contiguous K and V
// (the continuation-prefill path that attends a long cached history with FlashAttention): one
// warp per (token, kv head); MSE keys are decoded as vLLM decodes them (centroid * fp16 norm,
// norm-corrected) and rotated back here by a warp-level Walsh-Hadamard transform.
#include "dequant_kernel.cuh"

namespace tqkv_vllm {

void dequant(const DequantParams& p, const Preset& preset, cudaStream_t stream) {
  if (p.n_tokens <= 0) return;
  const int64_t rows = static_cast<int64_t>(p.n_tokens) * p.cache.n_kv_heads;
  const unsigned blocks = static_cast<unsigned>((rows + kDequantWarps - 1) / kDequantWarps);
  dispatch_preset(preset, [&](auto kb, auto vb, auto d) {
    dequant_kernel<decltype(kb)::value, decltype(vb)::value, decltype(d)::value><<<blocks, 32 * kDequantWarps, 0, stream>>>(p);
  });
}

}  // namespace tqkv_vllm
