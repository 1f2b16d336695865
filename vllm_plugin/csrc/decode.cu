// Host side of the decode (decode_kernel.cuh): picks the kernel for the preset, head dim and
// GQA group, and merges the splits' partial outputs by their log2-sum-exps.
#include "ops.h"
#include "device.cuh"

namespace tqkv_vllm {

// Defined by the per-preset translation units (decode_k*v*.cu).
template <int KB, int VB, int D>
void launch_decode_group(const DecodeParams& p, int group, cudaStream_t stream);

namespace {

constexpr int kMergeThreads = 128;
constexpr int kMaxSplits = 64;

// One CTA per (query head, sequence): out = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max).
template <int D>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const DecodeParams p) {
  const int hq = blockIdx.x, b = blockIdx.y;
  const float* w = p.workspace + (static_cast<int64_t>(b) * p.n_q_heads + hq) * p.num_splits * (D + 1);
  __shared__ float weight[kMaxSplits];
  __shared__ float total;
  if (threadIdx.x < 32) {
    float mx = -INFINITY;
    for (int s = threadIdx.x; s < p.num_splits; s += 32) mx = fmaxf(mx, w[s * (D + 1) + D]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
    for (int s = threadIdx.x; s < p.num_splits; s += 32) {
      const float lse = w[s * (D + 1) + D];
      const float e = lse == -INFINITY ? 0.0f : exp2f(lse - mx);
      weight[s] = e;
      sum += e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (threadIdx.x == 0) total = sum;
  }
  __syncthreads();
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;  // a sequence of length 0 gives zeros
  for (int d = threadIdx.x; d < D; d += kMergeThreads) {
    float o = 0.0f;
    for (int s = 0; s < p.num_splits; ++s) o = fmaf(weight[s], w[s * (D + 1) + d], o);
    store_from_float(p.out.data, p.out.dtype, p.out.at(b, hq) + d, o * inv);
  }
}

}  // namespace

int max_splits() { return kMaxSplits; }

void decode(const DecodeParams& p, const Preset& preset, cudaStream_t stream) {
  if (p.batch <= 0) return;
  const int group = p.n_q_heads / p.cache.n_kv_heads;
  if (group < 1 || group > 16 || group * p.cache.n_kv_heads != p.n_q_heads)
    throw std::invalid_argument("tqkv_vllm: GQA group " + std::to_string(p.n_q_heads) + "/" +
                                std::to_string(p.cache.n_kv_heads) + " (whole groups of at most 16 heads)");
  if (p.num_splits < 1 || p.num_splits > kMaxSplits)
    throw std::invalid_argument("tqkv_vllm: num_splits " + std::to_string(p.num_splits) + " (1.." +
                                std::to_string(kMaxSplits) + ")");
  dispatch_preset(preset, [&](auto kb, auto vb, auto d) {
    launch_decode_group<decltype(kb)::value, decltype(vb)::value, decltype(d)::value>(p, group, stream);
    if (p.num_splits > 1) merge_kernel<decltype(d)::value><<<dim3(p.n_q_heads, p.batch), kMergeThreads, 0, stream>>>(p);
  });
}

}  // namespace tqkv_vllm
