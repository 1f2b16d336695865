// The decode kernels' launchers (decode_kernel.cuh, decode_mma_kernel.cuh), instantiated per preset by decode_k*v*.cu
// so that the presets compile in parallel; decode.cu calls launch_decode_group.
#pragma once
#include "decode_kernel.cuh"
#include "decode_mma_kernel.cuh"

namespace tqkv_vllm {

// Launches the decode of one preset and head dim for a GQA group of at most G heads.
template <int KB, int VB, int D, int G>
void launch_decode(const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(p.num_splits, p.cache.n_kv_heads, p.batch);
  decode_kernel<KB, VB, D, G><<<grid, kThreads, 0, stream>>>(p);
}

template <int KB, int VB, int D>
void launch_decode_mma(const DecodeParams& p, cudaStream_t stream) {
  constexpr int smem = MmaShape<KB, VB, D>::kSmem;
  if constexpr (smem > 48 * 1024) {
    // Per device, so set at every launch outside a stream capture (no device is assumed); a
    // captured launch follows an eager one on its device (vLLM warms up before it captures).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cudaError_t err = cudaStreamIsCapturing(stream, &capture);
    if (err == cudaSuccess && capture == cudaStreamCaptureStatusNone)
      err = cudaFuncSetAttribute(decode_mma_kernel<KB, VB, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) throw std::runtime_error(std::string("tqkv_vllm: ") + cudaGetErrorString(err));
  }
  const dim3 grid(p.num_splits, p.cache.n_kv_heads, p.batch);
  decode_mma_kernel<KB, VB, D><<<grid, 32 * kMmaWarps, smem, stream>>>(p);
}

template <int KB, int VB, int D>
void launch_decode_group(const DecodeParams& p, int group, cudaStream_t stream) {
  if (p.kernel == DecodeKernel::Mma || (p.kernel == DecodeKernel::Auto && group <= 8))
    return launch_decode_mma<KB, VB, D>(p, stream);
  if (group <= 1) return launch_decode<KB, VB, D, 1>(p, stream);
  if (group <= 2) return launch_decode<KB, VB, D, 2>(p, stream);
  if (group <= 4) return launch_decode<KB, VB, D, 4>(p, stream);
  if (group <= 8) return launch_decode<KB, VB, D, 8>(p, stream);
  return launch_decode<KB, VB, D, 16>(p, stream);
}

// One translation unit per preset (decode_k*v*.cu) instantiates these.
#define TQKV_VLLM_DECODE_INSTANCES(KB, VB)                                                     \
  template void launch_decode_group<KB, VB, 64>(const DecodeParams&, int, cudaStream_t);  \
  template void launch_decode_group<KB, VB, 128>(const DecodeParams&, int, cudaStream_t); \
  template void launch_decode_group<KB, VB, 256>(const DecodeParams&, int, cudaStream_t);

}  // namespace tqkv_vllm
