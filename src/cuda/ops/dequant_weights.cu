// GGUF weight blocks kept in GPU memory, expanded to bf16 for a product (gguf_blocks.h decodes
// them, as the CPU's dequantize does; rounded to bf16 as the CPU's float_to_bf16 rounds).
#include "launch.cuh"
#include "tqkv/gguf_blocks.h"

namespace tqkv::cuda {
namespace {

template <gguf::TensorType T>
__global__ void dequant_weights_kernel(const uint8_t* blocks, uint16_t* out, size_t n) {
  constexpr int kElems = gguf::block_elems(T), kBytes = gguf::block_bytes(T);
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float x = gguf::element<T>(blocks + (i / kElems) * kBytes, static_cast<int>(i % kElems));
    out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
}

template <gguf::TensorType T>
void launch(const void* blocks, uint16_t* out, size_t n, cudaStream_t stream) {
  if (n % gguf::block_elems(T) != 0) detail::throw_arg("dequant_weights_bf16: not a whole number of blocks");
  dequant_weights_kernel<T><<<detail::op_blocks(n), detail::kOpThreads, 0, stream>>>(static_cast<const uint8_t*>(blocks),
                                                                                    out, n);
}

}  // namespace

bool dequant_weights_supports(uint32_t type) {
  using gguf::TensorType;
  switch (static_cast<TensorType>(type)) {
    case TensorType::Q4_0: case TensorType::Q4_1: case TensorType::Q5_0: case TensorType::Q5_1:
    case TensorType::Q8_0: case TensorType::Q4_K: case TensorType::Q6_K: return true;
    default: return false;
  }
}

void dequant_weights_bf16(uint32_t type, const void* blocks, size_t n, uint16_t* out, cudaStream_t stream) {
  using gguf::TensorType;
  if (n == 0) return;
  if (!blocks || !out) detail::throw_arg("dequant_weights_bf16: null argument");
  switch (static_cast<TensorType>(type)) {
    case TensorType::Q4_0: launch<TensorType::Q4_0>(blocks, out, n, stream); break;
    case TensorType::Q4_1: launch<TensorType::Q4_1>(blocks, out, n, stream); break;
    case TensorType::Q5_0: launch<TensorType::Q5_0>(blocks, out, n, stream); break;
    case TensorType::Q5_1: launch<TensorType::Q5_1>(blocks, out, n, stream); break;
    case TensorType::Q8_0: launch<TensorType::Q8_0>(blocks, out, n, stream); break;
    case TensorType::Q4_K: launch<TensorType::Q4_K>(blocks, out, n, stream); break;
    case TensorType::Q6_K: launch<TensorType::Q6_K>(blocks, out, n, stream); break;
    default: detail::throw_arg("dequant_weights_bf16: a GGUF type without a GPU decoder");
  }
  detail::check_launch();
}

}  // namespace tqkv::cuda
