// Host side of the decode (decode_kernel.cuh): picks the kernel for the preset, head dim and
// GQA group, and merges the splits' partial outputs by their log2-sum-exps.
#include "decode_kernel.cuh"

namespace tqkv_vllm {

// Defined by the per-preset translation units (decode_k*v*.cu).
template <int KB, int VB, int D>
void launch_decode_group(const DecodeParams& p, int group, cudaStream_t stream);

int max_splits() { return kMaxSplits; }

void decode(const DecodeParams& p, const Preset& preset, cudaStream_t stream) {
  if (p.batch <= 0) return;
  const int group = p.n_q_heads / p.cache.n_kv_heads;
  if (group < 1 || group > 16 || group * p.cache.n_kv_heads != p.n_q_heads)
    throw std::invalid_argument("tqkv_vllm: GQA group " + std::to_string(p.n_q_heads) + "/" +
                                std::to_string(p.cache.n_kv_heads) + " (whole groups of at most 16 heads)");
  if (p.kernel == DecodeKernel::Mma && group > 8)
    throw std::invalid_argument("tqkv_vllm: the tensor-core decode takes GQA groups of at most 8 heads, not " +
                                std::to_string(group));
  if (p.num_splits < 1 || p.num_splits > kMaxSplits)
    throw std::invalid_argument("tqkv_vllm: num_splits " + std::to_string(p.num_splits) + " (1.." +
                                std::to_string(kMaxSplits) + ")");
  dispatch_preset(preset, [&](auto kb, auto vb, auto d) {
    launch_decode_group<decltype(kb)::value, decltype(vb)::value, decltype(d)::value>(p, group, stream);
    if (p.num_splits > 1) merge_kernel<decltype(d)::value><<<dim3(p.n_q_heads, p.batch), kMergeThreads, 0, stream>>>(p);
  });
}

}  // namespace tqkv_vllm
