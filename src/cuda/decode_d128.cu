// Decode kernels of head dim 128 for the pairs of decode_pairs.h (one file per head dim, so the
// instantiations compile in parallel).
#include "decode_kernel.cuh"
#include "decode_pairs.h"

namespace tqkv::cuda::detail {

template <>
Kernel pick_kernel<128>(int kk, int vk) {
#define TQKV_DECODE_CASE(K, V) \
  if (kk == (K) && vk == (V)) return make_kernel<128, (K), (V)>();
  TQKV_DECODE_PAIRS(TQKV_DECODE_CASE)
#undef TQKV_DECODE_CASE
  return Kernel{};
}

}  // namespace tqkv::cuda::detail
