// prefill_attention: causal attention of a run of queries over a contiguous K/V (a prefill
// chunk against its sequence's dequantized cache), flash-attention style.
//
// A CTA of 128 threads takes kRows = 16 queries of one query head. Thread t owns row t / 8 and
// lane c = t % 8 of it: in each tile of kCols = 32 keys it scores keys c, c + 8, c + 16, c + 24
// and accumulates output dims c, c + 8, ... of its row, so the 8 lanes of a row (inside one
// warp) reduce the row's max and sum by shuffles. K and V tiles go through shared memory (K rows
// padded by one float against bank conflicts); the running max/sum rescale the accumulator.
#include <cmath>

#include "launch.cuh"

namespace tqkv::cuda {
namespace {

constexpr int kRows = 16;
constexpr int kCols = 32;
constexpr int kThreads = 128;
constexpr int kLanes = kThreads / kRows;  // 8 per row

struct Params {
  const float* q;
  const void* k;
  const void* v;
  float* out;
  int64_t q_stride, out_stride, pos0, kv_start;
  int n_q, n_kv, n_q_heads, n_kv_heads, window;
  float scale;
};

__device__ __forceinline__ float load_kv(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_kv(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }

template <int D>
constexpr size_t smem_bytes() {
  return (static_cast<size_t>(kRows) * (D + 1) + static_cast<size_t>(kCols) * (D + 1) + static_cast<size_t>(kCols) * D +
          kRows * kCols) *
         sizeof(float);
}

template <int D, typename KV>
__global__ void __launch_bounds__(kThreads) prefill_kernel(const __grid_constant__ Params p) {
  constexpr int E = D / kLanes;  // output dims per thread
  extern __shared__ float smem[];
  float* qs = smem;                      // [kRows][D + 1]
  float* ks = qs + kRows * (D + 1);      // [kCols][D + 1]
  float* vs = ks + kCols * (D + 1);      // [kCols][D]
  float* ps = vs + kCols * D;            // [kRows][kCols]
  const int tid = threadIdx.x, r = tid / kLanes, c = tid % kLanes;
  const int h = blockIdx.y, kvh = h / (p.n_q_heads / p.n_kv_heads);
  const int q0 = blockIdx.x * kRows;
  const int rows = min(kRows, p.n_q - q0);
  const KV* kp = static_cast<const KV*>(p.k);
  const KV* vp = static_cast<const KV*>(p.v);

  for (int i = tid; i < kRows * D; i += kThreads) {
    const int rr = i / D, j = i % D;
    qs[rr * (D + 1) + j] = rr < rows ? p.q[(q0 + rr) * p.q_stride + static_cast<int64_t>(h) * D + j] * p.scale : 0.0f;
  }
  const bool valid = r < rows;
  const int64_t my_pos = p.pos0 + q0 + r;
  const int64_t first_pos = p.pos0 + q0, last_pos = p.pos0 + q0 + rows - 1;
  const int64_t k_end = last_pos + 1;
  const int64_t k_begin = p.window > 0 ? (first_pos - p.window + 1 > 0 ? first_pos - p.window + 1 : int64_t{0}) : 0;

  float m = -INFINITY, l = 0.0f;
  float o[E];
#pragma unroll
  for (int j = 0; j < E; ++j) o[j] = 0.0f;

  for (int64_t kt = k_begin; kt < k_end; kt += kCols) {
    __syncthreads();  // the previous tile is consumed (and, the first time, qs is written)
    for (int i = tid; i < kCols * D; i += kThreads) {
      const int j = i / D, d = i % D;
      const int64_t key = kt + j;
      float kv = 0.0f, vv = 0.0f;
      if (key < k_end) {
        const int64_t at = ((key - p.kv_start) * p.n_kv_heads + kvh) * D + d;
        kv = load_kv(kp, at);
        vv = load_kv(vp, at);
      }
      ks[j * (D + 1) + d] = kv;
      vs[j * D + d] = vv;
    }
    __syncthreads();
    float s[kCols / kLanes];
    float tmax = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < kCols / kLanes; ++jj) {
      const int j = c + kLanes * jj;
      const int64_t key = kt + j;
      const bool visible = valid && key < k_end && key <= my_pos && (p.window <= 0 || key > my_pos - p.window);
      float acc = 0.0f;
      if (visible) {
        const float* qr = qs + r * (D + 1);
        const float* kr = ks + j * (D + 1);
#pragma unroll 8
        for (int d = 0; d < D; ++d) acc = fmaf(qr[d], kr[d], acc);
      }
      s[jj] = visible ? acc : -INFINITY;
      tmax = fmaxf(tmax, s[jj]);
    }
#pragma unroll
    for (int off = kLanes / 2; off > 0; off >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
    const float m_new = fmaxf(m, tmax);
    float alpha = 1.0f, psum = 0.0f;
    if (m_new != -INFINITY) {
      alpha = m == -INFINITY ? 0.0f : expf(m - m_new);
#pragma unroll
      for (int jj = 0; jj < kCols / kLanes; ++jj) {
        const float e = s[jj] == -INFINITY ? 0.0f : expf(s[jj] - m_new);
        ps[r * kCols + c + kLanes * jj] = e;
        psum += e;
      }
    } else {
#pragma unroll
      for (int jj = 0; jj < kCols / kLanes; ++jj) ps[r * kCols + c + kLanes * jj] = 0.0f;
    }
#pragma unroll
    for (int off = kLanes / 2; off > 0; off >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, off);
    l = l * alpha + psum;
    m = m_new;
    __syncwarp();  // a row's probabilities are written and read by its own 8 lanes
#pragma unroll
    for (int j = 0; j < E; ++j) o[j] *= alpha;
    for (int key = 0; key < kCols; ++key) {
      const float pk = ps[r * kCols + key];
#pragma unroll
      for (int j = 0; j < E; ++j) o[j] = fmaf(pk, vs[key * D + c + kLanes * j], o[j]);
    }
  }
  if (!valid) return;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  float* orow = p.out + (q0 + r) * p.out_stride + static_cast<int64_t>(h) * D;
#pragma unroll
  for (int j = 0; j < E; ++j) orow[c + kLanes * j] = o[j] * inv;
}

template <int D, typename KV>
void launch(const Params& p, cudaStream_t stream) {
  constexpr size_t smem = smem_bytes<D>();
  static const bool attr = [] {
    TQKV_CUDA_CHECK(cudaFuncSetAttribute(prefill_kernel<D, KV>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
    return true;
  }();
  (void)attr;
  const dim3 grid((p.n_q + kRows - 1) / kRows, p.n_q_heads);
  prefill_kernel<D, KV><<<grid, kThreads, smem, stream>>>(p);
  detail::check_launch();
}

template <typename KV>
void dispatch(int head_dim, const Params& p, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return launch<64, KV>(p, stream);
    case 128: return launch<128, KV>(p, stream);
    case 256: return launch<256, KV>(p, stream);
    default: detail::throw_arg("prefill_attention: head_dim must be 64, 128 or 256");
  }
}

}  // namespace

void prefill_attention(const PrefillArgs& a, cudaStream_t stream) {
  if (a.n_q <= 0) return;
  if (!a.q || !a.k || !a.v || !a.out) detail::throw_arg("prefill_attention: null argument");
  if (a.n_kv_heads <= 0 || a.n_q_heads <= 0 || a.n_q_heads % a.n_kv_heads)
    detail::throw_arg("prefill_attention: n_q_heads must be a positive multiple of n_kv_heads");
  if (a.pos0 < 0 || a.pos0 + a.n_q > a.n_kv) detail::throw_arg("prefill_attention: the keys end before the last query");
  if (a.kv_start < 0 || (a.kv_start > 0 && (a.window <= 0 || a.pos0 - a.window + 1 < a.kv_start)))
    detail::throw_arg("prefill_attention: kv_start leaves out keys inside a query's window");
  Params p{};
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.out = a.out;
  const int64_t row = static_cast<int64_t>(a.n_q_heads) * a.head_dim;
  p.q_stride = a.q_stride ? a.q_stride : row;
  p.out_stride = a.out_stride ? a.out_stride : row;
  p.pos0 = a.pos0;
  p.kv_start = a.kv_start;
  p.n_q = a.n_q;
  p.n_kv = a.n_kv;
  p.n_q_heads = a.n_q_heads;
  p.n_kv_heads = a.n_kv_heads;
  p.window = a.window;
  p.scale = a.scale != 0 ? a.scale : 1.0f / std::sqrt(static_cast<float>(a.head_dim));
  if (a.kv_bf16) dispatch<__nv_bfloat16>(a.head_dim, p, stream);
  else dispatch<float>(a.head_dim, p, stream);
}

}  // namespace tqkv::cuda
