// Decode kernels of head dim 256 for the pairs of decode_pairs.h (one file per head dim, so the
// instantiations compile in parallel).
#define TQKV_DECODE_D 256
#include "decode_kernel.cuh"
#include "decode_pairs.h"

namespace tqkv::cuda::detail {
TQKV_DEFINE_PICK_KERNEL()
}  // namespace tqkv::cuda::detail
