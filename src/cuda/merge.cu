// Merge step of the split-KV decode: combines each query head's partial outputs by their
// log-sum-exp, and rotates the output back (o = R^T o~) where values are stored rotated.
#include "decode.cuh"

namespace tqkv::cuda::detail {
namespace {

constexpr int kMergeThreads = 256;

// One block per (sequence, query head); kMergeThreads / D groups of threads walk interleaved
// splits so that many partial outputs are in flight at once.
template <int D>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const __grid_constant__ MergeParams p) {
  constexpr int R = kMergeThreads / D;
  __shared__ float buf[D];
  __shared__ float part[R][D];
  __shared__ float w[kMaxSplits];
  __shared__ float red[2];
  const int hq = blockIdx.x, b = blockIdx.y, t = threadIdx.x, i = t % D, r = t / D;
  const int hkv = hq / p.group, j = hq % p.group;
  const int S = p.num_splits;
  const int64_t row0 = (static_cast<int64_t>(b) * p.n_kv_heads + hkv) * S;
  // All splits' log2-sum-exp at once (independent loads), then max and weights.
  for (int s = t; s < S; s += kMergeThreads) w[s] = p.lse_part[(row0 + s) * p.group + j];
  __syncthreads();
  if (t < 32) {
    float m = -INFINITY;
    for (int s = t; s < S; s += 32) m = fmaxf(m, w[s]);
    m = warp_max(m);
    if (t == 0) red[0] = m;
  }
  __syncthreads();
  const float mx = red[0];
  for (int s = t; s < S; s += kMergeThreads) w[s] = (mx == -INFINITY || w[s] == -INFINITY) ? 0.0f : exp2f(w[s] - mx);
  __syncthreads();
  if (t < 32) {
    float d = 0;
    for (int s = t; s < S; s += 32) d += w[s];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    if (t == 0) red[1] = d;
  }
  __syncthreads();
  const float den = red[1];
  float acc = 0.0f;
  const float* op = p.o_part + (row0 * p.group + j) * D + i;
  const int64_t stride = static_cast<int64_t>(p.group) * D;
#pragma unroll 4
  for (int s = r; s < S; s += R) acc += w[s] * op[s * stride];
  part[r][i] = acc;
  __syncthreads();
  if (t >= D) return;
  acc = 0.0f;
#pragma unroll
  for (int q = 0; q < R; ++q) acc += part[q][i];
  if (den > 0) acc /= den;
  if (p.values_rotated) {  // o = D H y / sqrt(d), butterflies in the reference's order
    // Only the first D threads are left: synchronise them with a named barrier.
    buf[i] = acc;
    asm volatile("bar.sync 1, %0;" ::"n"(D));
    for (int len = 1; len < D; len <<= 1) {
      const float u = buf[i & ~len], v = buf[i | len];
      const float nv = (i & len) ? u - v : u + v;
      asm volatile("bar.sync 1, %0;" ::"n"(D));
      buf[i] = nv;
      asm volatile("bar.sync 1, %0;" ::"n"(D));
    }
    acc = buf[i] * p.tab.rot_scale;
    if (sign_negative(p.tab, i)) acc = -acc;
  }
  const int64_t o = (static_cast<int64_t>(b) * gridDim.x + hq) * D + i;
  store_elem(p.out, p.out_dtype, o, acc);
  if (p.lse && i == 0)
    p.lse[static_cast<int64_t>(b) * gridDim.x + hq] = den > 0 ? (mx + log2f(den)) * 0.69314718055994531f : -INFINITY;
}

}  // namespace

void launch_merge(const MergeParams& p, int batch, int n_q_heads, cudaStream_t stream) {
  const dim3 grid(n_q_heads, batch);
  switch (p.head_dim) {
    case 64: merge_kernel<64><<<grid, kMergeThreads, 0, stream>>>(p); break;
    case 128: merge_kernel<128><<<grid, kMergeThreads, 0, stream>>>(p); break;
    default: merge_kernel<256><<<grid, kMergeThreads, 0, stream>>>(p); break;
  }
  TQKV_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tqkv::cuda::detail
