// Fused decode kernels of head dim 128 (sinks + compressed middle + recent window in one launch)
// for the quadruples of decode_pairs.h; a file of its own, so that they compile in parallel with
// the plain kernels.
#define TQKV_DECODE_D 128
#include "decode_kernel.cuh"
#include "decode_pairs.h"

namespace tqkv::cuda::detail {
TQKV_DEFINE_PICK_FUSED_KERNEL(TQKV_FUSED_QUADS_128)
}  // namespace tqkv::cuda::detail
