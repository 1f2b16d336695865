// CPU attention entry point. For now it runs the scalar reference; the SIMD and threaded
// kernels plug in here behind the same signature.
#include "tqkv/attention.h"

namespace tqkv {

void attention(const ContiguousCache& cache, int layer, const float* q, int n_q, int64_t q_pos0,
               const AttentionParams& params, float* out) {
  attention_reference(cache, layer, q, n_q, q_pos0, params, out);
}

}  // namespace tqkv
