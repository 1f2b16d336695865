// merge_attention: folds one part of an attention (its rows' outputs and log-sum-exps) into a
// running result, exactly as the CPU's RecentWindow merges the sinks, the compressed middle and
// the recent window (engine::CudaKvCache); merge_newest folds in each row's own position.
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

// One warp per (row, query head): the score of its own key, then the one-key merge.
__global__ void merge_newest_kernel(float* out, float* lse, const float* q, NewestKv nk, int64_t n_rows, int hq,
                                    int hkv, int d, float scale) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (r >= n_rows) return;
  const int64_t b = r / hq;
  const int h = static_cast<int>(r % hq), g = h / (hq / hkv);
  const int64_t tok = nk.rows ? nk.rows[b] : b;
  const float* k = nk.k + (tok * hkv + g) * d;
  const float* v = nk.v + (tok * hkv + g) * d;
  const float* mu = nk.key_mean ? nk.key_mean + static_cast<int64_t>(g) * d : nullptr;
  const float* qr = q + r * d;
  float dot = 0.0f;
  for (int i = lane; i < d; i += 32) dot += qr[i] * (mu ? k[i] - mu[i] : k[i]);
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  const float a = lse[r], s = dot * scale;
  if (a != a) return;  // a NaN stays loud
  const float m = fmaxf(a, s), ea = a == -INFINITY ? 0.0f : expf(a - m), es = expf(s - m), inv = 1.0f / (ea + es);
  float* o = out + r * d;
  for (int i = lane; i < d; i += 32) o[i] = (ea * o[i] + es * v[i]) * inv;
  __syncwarp();
  if (lane == 0) lse[r] = m + logf(ea + es);
}

}  // namespace

void merge_newest(float* out, float* lse, const float* q, const NewestKv& newest, int batch, int n_q_heads,
                  int n_kv_heads, int d, float scale, cudaStream_t stream) {
  if (batch <= 0) return;
  if (!out || !lse || !q || !newest.k || !newest.v || d <= 0 || n_kv_heads <= 0 || n_q_heads % n_kv_heads)
    detail::throw_arg("merge_newest: null or inconsistent argument");
  const size_t threads = static_cast<size_t>(batch) * n_q_heads * 32;
  merge_newest_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
      out, lse, q, newest, static_cast<int64_t>(batch) * n_q_heads, n_q_heads, n_kv_heads, d, scale);
  detail::check_launch();
}

void merge_attention(float* out, float* lse, const float* part, const float* part_lse, int rows, int d,
                     cudaStream_t stream) {
  if (rows <= 0) return;
  if (!out || !lse || !part || !part_lse || d <= 0) detail::throw_arg("merge_attention: null or empty argument");
  const size_t threads = static_cast<size_t>(rows) * 32;
  merge_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(out, lse, part, part_lse, rows, d);
  detail::check_launch();
}

}  // namespace tqkv::cuda
