// rope: each thread turns one (token, pair) in every head; the angle pos * inv_freq and its
// cos/sin in double, then rounded to float, as the CPU device does. rope_qk turns the queries'
// and the keys' heads in one launch, a thread per (token, head, pair).
#include "launch.cuh"

namespace tqkv::cuda {
namespace {

constexpr int kMaxPairs = 128;  // head_dim <= 256

struct RopeParams {
  float inv_freq[kMaxPairs];
  int n, heads, head_dim, half;
  float mscale;
  bool halves;
};

__device__ __forceinline__ void rope_cos_sin(int64_t pos, float inv_freq, float mscale, float& c, float& s) {
  const double a = static_cast<double>(pos) * static_cast<double>(inv_freq);
  double sd, cd;
  sincos(a, &sd, &cd);
  c = static_cast<float>(cd * mscale);
  s = static_cast<float>(sd * mscale);
}

// Turns pair (i0, i1) of each of the `heads` heads of one token's rows at x.
__device__ __forceinline__ void rope_heads(float* x, int heads, int head_dim, int i0, int i1, float c, float s) {
  for (int h = 0; h < heads; ++h) {
    float* v = x + static_cast<size_t>(h) * head_dim;
    const float a0 = v[i0], a1 = v[i1];
    v[i0] = a0 * c - a1 * s;
    v[i1] = a0 * s + a1 * c;
  }
}

__global__ void rope_kernel(float* x, const int64_t* positions, const __grid_constant__ RopeParams p) {
  const int64_t total = static_cast<int64_t>(p.n) * p.half;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(idx / p.half), i = static_cast<int>(idx % p.half);
    float c, s;
    rope_cos_sin(positions[t], p.inv_freq[i], p.mscale, c, s);
    const int i0 = p.halves ? i : 2 * i, i1 = p.halves ? i + p.half : 2 * i + 1;
    rope_heads(x + static_cast<size_t>(t) * p.heads * p.head_dim, p.heads, p.head_dim, i0, i1, c, s);
  }
}

// One thread per (token, head, pair) over the queries' heads and then the keys': every head in
// parallel (the plain kernel's thread walks a token's heads in turn), each from the same angle.
__global__ void rope_qk_kernel(float* q, int q_heads, float* k, int k_heads, int n, int head_dim, int half,
                               bool halves, const int64_t* positions, const float* inv_freq, float mscale) {
  const int heads = q_heads + k_heads;
  const int64_t total = static_cast<int64_t>(n) * heads * half;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(idx % half);
    const int64_t th = idx / half;
    const int h = static_cast<int>(th % heads), t = static_cast<int>(th / heads);
    float c, s;
    rope_cos_sin(positions[t], inv_freq[i], mscale, c, s);
    const int i0 = halves ? i : 2 * i, i1 = halves ? i + half : 2 * i + 1;
    float* x = h < q_heads ? q + (static_cast<size_t>(t) * q_heads + h) * head_dim
                           : k + (static_cast<size_t>(t) * k_heads + (h - q_heads)) * head_dim;
    rope_heads(x, 1, head_dim, i0, i1, c, s);
  }
}

void check_rot(int n_rot, int head_dim) {
  if (n_rot < 0 || n_rot % 2 || n_rot > head_dim || n_rot / 2 > kMaxPairs)
    detail::throw_arg("rope: n_rot must be even, at most head_dim and 256");
}

}  // namespace

void rope(float* x, int n, int heads, int head_dim, const int64_t* positions, int n_rot, const float* inv_freq,
          float mscale, bool halves, cudaStream_t stream) {
  if (n <= 0 || n_rot == 0) return;
  if (!x || !positions || !inv_freq) detail::throw_arg("rope: null argument");
  check_rot(n_rot, head_dim);
  RopeParams p{};
  for (int i = 0; i < n_rot / 2; ++i) p.inv_freq[i] = inv_freq[i];
  p.n = n;
  p.heads = heads;
  p.head_dim = head_dim;
  p.half = n_rot / 2;
  p.mscale = mscale;
  p.halves = halves;
  rope_kernel<<<detail::op_blocks(static_cast<size_t>(n) * p.half), detail::kOpThreads, 0, stream>>>(x, positions, p);
  detail::check_launch();
}

void rope_qk(float* q, int q_heads, float* k, int k_heads, int n, int head_dim, const int64_t* positions, int n_rot,
             const float* inv_freq, float mscale, bool halves, cudaStream_t stream) {
  if (n <= 0 || n_rot == 0) return;
  if (!q || !k || !positions || !inv_freq) detail::throw_arg("rope_qk: null argument");
  if (q_heads < 0 || k_heads < 0) detail::throw_arg("rope_qk: negative head count");
  check_rot(n_rot, head_dim);
  const int half = n_rot / 2;
  const size_t total = static_cast<size_t>(n) * (q_heads + k_heads) * half;
  rope_qk_kernel<<<detail::op_blocks(total), detail::kOpThreads, 0, stream>>>(
      q, q_heads, k, k_heads, n, head_dim, half, halves, positions, inv_freq, mscale);
  detail::check_launch();
}

}  // namespace tqkv::cuda
