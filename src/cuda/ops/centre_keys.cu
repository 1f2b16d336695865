// centre_keys: the cache spec's key centring and channel scales (key_centring.h's numbers).
#include "launch.cuh"

namespace tqkv::cuda {
namespace {

__global__ void centre_kernel(float* k, const float* mean, const float* scale, size_t n_k, int per_token) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n_k;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(i % per_token);
    k[i] = (k[i] - mean[c]) / scale[c];
  }
}

// q [n, n_kv_heads, group, head_dim] *= scale [n_kv_heads, head_dim].
__global__ void scale_queries_kernel(float* q, const float* scale, size_t n_q, int group, int head_dim, int n_kv_heads) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n_q;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int j = static_cast<int>(i % head_dim);
    const int h = static_cast<int>((i / head_dim / group) % n_kv_heads);
    q[i] *= scale[h * head_dim + j];
  }
}

}  // namespace

void centre_keys(float* k, float* q, const float* mean, const float* scale, int n, int n_kv_heads, int group,
                 int head_dim, bool scale_queries, cudaStream_t stream) {
  if (n <= 0) return;
  if (!k || !mean || !scale || (scale_queries && !q)) detail::throw_arg("centre_keys: null argument");
  const int per_token = n_kv_heads * head_dim;
  const size_t n_k = static_cast<size_t>(n) * per_token;
  centre_kernel<<<detail::op_blocks(n_k), detail::kOpThreads, 0, stream>>>(k, mean, scale, n_k, per_token);
  detail::check_launch();
  if (!scale_queries) return;
  const size_t n_q = n_k * group;
  scale_queries_kernel<<<detail::op_blocks(n_q), detail::kOpThreads, 0, stream>>>(q, scale, n_q, group, head_dim,
                                                                                 n_kv_heads);
  detail::check_launch();
}

}  // namespace tqkv::cuda
