// The store into vLLM's TurboQuant cache, byte for byte what vLLM's Triton store writes
// (vllm/v1/attention/ops/triton_turboquant_store.py, vLLM 0.26-0.27): one warp per (token, kv
// head). MSE keys arrive rotated and normalised (y = (k / (|k| + 1e-8)) H / sqrt(D), computed by
// the caller with the same torch operations as vLLM, with |k| beside them) and are bucketed by
// the same binary search over vLLM's midpoints; FP8 keys are cast here. Values are coded with
// vLLM's uniform min/max quantizer in the same float operations (sub, div.full, add, truncate).
#include "store_kernel.cuh"

namespace tqkv_vllm {
namespace {

template <int KB, int VB, int D>
void launch(const StoreParams& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.n_tokens) * p.cache.n_kv_heads;
  const int64_t blocks = (rows + kStoreWarps - 1) / kStoreWarps;
  store_kernel<KB, VB, D><<<static_cast<unsigned>(blocks), 32 * kStoreWarps, 0, stream>>>(p);
}

}  // namespace

void store(const StoreParams& p, const Preset& preset, cudaStream_t stream) {
  if (p.n_tokens <= 0) return;
  dispatch_preset(preset, [&](auto kb, auto vb, auto d) { launch<decltype(kb)::value, decltype(vb)::value, decltype(d)::value>(p, stream); });
}

}  // namespace tqkv_vllm
