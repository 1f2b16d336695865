// embed_rows: rows of a bf16 embedding table, scaled, into float32 activations.
#include "launch.cuh"

namespace tqkv::cuda {
namespace {

__global__ void embed_kernel(const uint16_t* table, int cols, const int32_t* tokens, int n, float scale, float* x) {
  const size_t total = static_cast<size_t>(n) * cols;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t t = i / cols, c = i % cols;
    const float w = detail::bf16_bits_to_float(table[static_cast<size_t>(tokens[t]) * cols + c]);
    x[i] = scale == 1.0f ? w : w * scale;
  }
}

}  // namespace

void embed_rows(const uint16_t* table, int cols, const int32_t* tokens, int n, float scale, float* x,
                cudaStream_t stream) {
  if (n <= 0) return;
  if (!table || !tokens || !x || cols <= 0) detail::throw_arg("embed_rows: null or empty argument");
  const size_t total = static_cast<size_t>(n) * cols;
  embed_kernel<<<detail::op_blocks(total), detail::kOpThreads, 0, stream>>>(table, cols, tokens, n, scale, x);
  detail::check_launch();
}

}  // namespace tqkv::cuda
