// Decode's products over weights kept quantized (TQKV_CUDA_WEIGHTS=quantized): y[t, r] =
// x[t] . W[r] (+ bias[r]) for a few input rows, straight from the GGUF blocks, each weight decoded
// once (tqkv/gguf_blocks.h, exactly as the CPU decodes it) for all the input rows, float32
// accumulation. One warp per output row; lane l takes the row's elements l, l + 32, ...: a warp
// reads one 32-element stretch of the row at a time (its block's scales by broadcast, its codes
// side by side), so the weights stream through once at their packed size.
#include "launch.cuh"
#include "tqkv/gguf_blocks.h"

namespace tqkv::cuda {
namespace {

constexpr int kWarps = 4;

template <gguf::TensorType T, int N>
__global__ void __launch_bounds__(kWarps * 32)
    qgemv_kernel(const uint8_t* w, int rows, int cols, const float* x, const uint16_t* xb, int n, float* y,
                 const float* bias) {
  constexpr int kElems = gguf::block_elems(T), kBytes = gguf::block_bytes(T);
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (r >= rows) return;
  const uint8_t* wr = w + static_cast<size_t>(r) * static_cast<size_t>(cols / kElems) * kBytes;
  float acc[N];
#pragma unroll
  for (int t = 0; t < N; ++t) acc[t] = 0.0f;
  for (int i = lane; i < cols; i += 32) {
    const float wi = gguf::element<T>(wr + (i / kElems) * kBytes, i % kElems);
#pragma unroll
    for (int t = 0; t < N; ++t) {
      if (t >= n) break;
      const size_t at = static_cast<size_t>(t) * cols + i;
      const float xi = xb ? detail::bf16_bits_to_float(xb[at]) : x[at];
      acc[t] = fmaf(wi, xi, acc[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < N; ++t) {
    if (t >= n) break;
    float s = acc[t];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) y[static_cast<size_t>(t) * rows + r] = bias ? s + bias[r] : s;
  }
}

template <gguf::TensorType T>
void launch(const void* w, int rows, int cols, const float* x, const uint16_t* xb, int n, float* y, const float* bias,
            cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>((rows + kWarps - 1) / kWarps);
  const auto* wb = static_cast<const uint8_t*>(w);
  if (n == 1) qgemv_kernel<T, 1><<<grid, kWarps * 32, 0, stream>>>(wb, rows, cols, x, xb, n, y, bias);
  else if (n == 2) qgemv_kernel<T, 2><<<grid, kWarps * 32, 0, stream>>>(wb, rows, cols, x, xb, n, y, bias);
  else if (n <= 4) qgemv_kernel<T, 4><<<grid, kWarps * 32, 0, stream>>>(wb, rows, cols, x, xb, n, y, bias);
  else qgemv_kernel<T, kQgemvMaxRows><<<grid, kWarps * 32, 0, stream>>>(wb, rows, cols, x, xb, n, y, bias);
}

}  // namespace

bool qgemv_supports(uint32_t type, int n, int cols) {
  const int be = gguf::block_elems(static_cast<gguf::TensorType>(type));
  return dequant_weights_supports(type) && n >= 1 && n <= kQgemvMaxRows && cols > 0 && be > 0 && cols % be == 0;
}

void qgemv(uint32_t type, const void* w, int rows, int cols, const float* x_f32, const uint16_t* x_bf16, int n, float* y,
           const float* bias, cudaStream_t stream) {
  using gguf::TensorType;
  if (rows == 0) return;
  if (!w || !y || (!x_f32) == (!x_bf16)) detail::throw_arg("qgemv: null argument, or not exactly one input");
  if (rows < 0 || !qgemv_supports(type, n, cols)) detail::throw_arg("qgemv: a type, row count or width it does not take");
  switch (static_cast<TensorType>(type)) {
    case TensorType::Q4_0: launch<TensorType::Q4_0>(w, rows, cols, x_f32, x_bf16, n, y, bias, stream); break;
    case TensorType::Q4_1: launch<TensorType::Q4_1>(w, rows, cols, x_f32, x_bf16, n, y, bias, stream); break;
    case TensorType::Q5_0: launch<TensorType::Q5_0>(w, rows, cols, x_f32, x_bf16, n, y, bias, stream); break;
    case TensorType::Q5_1: launch<TensorType::Q5_1>(w, rows, cols, x_f32, x_bf16, n, y, bias, stream); break;
    case TensorType::Q8_0: launch<TensorType::Q8_0>(w, rows, cols, x_f32, x_bf16, n, y, bias, stream); break;
    case TensorType::Q4_K: launch<TensorType::Q4_K>(w, rows, cols, x_f32, x_bf16, n, y, bias, stream); break;
    case TensorType::Q6_K: launch<TensorType::Q6_K>(w, rows, cols, x_f32, x_bf16, n, y, bias, stream); break;
    default: detail::throw_arg("qgemv: a GGUF type without a GPU decoder");
  }
  detail::check_launch();
}

}  // namespace tqkv::cuda
