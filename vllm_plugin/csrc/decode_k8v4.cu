// The decode kernels of one vLLM preset (key bits 8, value bits 4) at head dims 64, 128, 256:
// one translation unit per preset, so that they compile in parallel.
#include "decode_launch.cuh"

namespace tqkv_vllm {
TQKV_VLLM_DECODE_INSTANCES(8, 4)
}  // namespace tqkv_vllm
