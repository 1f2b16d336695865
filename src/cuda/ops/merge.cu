// merge_attention: folds one part of an attention (its rows' outputs and log-sum-exps) into a
// running result, exactly as the CPU's RecentWindow merges the sinks, the compressed middle and
// the recent window (engine::CudaKvCache).
#include <cmath>

#include "launch.cuh"

namespace tqkv::cuda {
namespace {

// One warp per row: every lane reads the row's two log-sum-exps before lane 0 replaces lse.
__global__ void merge_kernel(float* out, float* lse, const float* part, const float* part_lse, int64_t rows, int d) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const float a = lse[r], b = part_lse[r];
  if (b == -INFINITY) return;
  float* o = out + r * d;
  const float* w = part + r * d;
  if (a == -INFINITY) {
    for (int i = lane; i < d; i += 32) o[i] = w[i];
  } else {
    const float m = fmaxf(a, b), ea = expf(a - m), eb = expf(b - m), inv = 1.0f / (ea + eb);
    for (int i = lane; i < d; i += 32) o[i] = (ea * o[i] + eb * w[i]) * inv;
    __syncwarp();
    if (lane == 0) lse[r] = m + logf(ea + eb);
    return;
  }
  __syncwarp();
  if (lane == 0) lse[r] = b;
}

}  // namespace

void merge_attention(float* out, float* lse, const float* part, const float* part_lse, int rows, int d,
                     cudaStream_t stream) {
  if (rows <= 0) return;
  if (!out || !lse || !part || !part_lse || d <= 0) detail::throw_arg("merge_attention: null or empty argument");
  const size_t threads = static_cast<size_t>(rows) * 32;
  merge_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(out, lse, part, part_lse, rows, d);
  detail::check_launch();
}

}  // namespace tqkv::cuda
