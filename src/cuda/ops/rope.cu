// rope: each thread turns one (token, pair) in every head; the angle pos * inv_freq and its
// cos/sin in double, then rounded to float, as the CPU device does.
#include "launch.cuh"

namespace tqkv::cuda {
namespace {

constexpr int kMaxPairs = 128;  // head_dim <= 256

struct RopeParams {
  float inv_freq[kMaxPairs];
  int n, heads, head_dim, half;
  bool halves;
};

__global__ void rope_kernel(float* x, const int64_t* positions, const __grid_constant__ RopeParams p) {
  const int64_t total = static_cast<int64_t>(p.n) * p.half;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(idx / p.half), i = static_cast<int>(idx % p.half);
    const double a = static_cast<double>(positions[t]) * static_cast<double>(p.inv_freq[i]);
    double sd, cd;
    sincos(a, &sd, &cd);
    const float c = static_cast<float>(cd), s = static_cast<float>(sd);
    const int i0 = p.halves ? i : 2 * i, i1 = p.halves ? i + p.half : 2 * i + 1;
    for (int h = 0; h < p.heads; ++h) {
      float* v = x + (static_cast<size_t>(t) * p.heads + h) * p.head_dim;
      const float a0 = v[i0], a1 = v[i1];
      v[i0] = a0 * c - a1 * s;
      v[i1] = a0 * s + a1 * c;
    }
  }
}

}  // namespace

void rope(float* x, int n, int heads, int head_dim, const int64_t* positions, int n_rot, const float* inv_freq,
          bool halves, cudaStream_t stream) {
  if (n <= 0 || n_rot == 0) return;
  if (!x || !positions || !inv_freq) detail::throw_arg("rope: null argument");
  if (n_rot < 0 || n_rot % 2 || n_rot > head_dim || n_rot / 2 > kMaxPairs)
    detail::throw_arg("rope: n_rot must be even, at most head_dim and 256");
  RopeParams p{};
  for (int i = 0; i < n_rot / 2; ++i) p.inv_freq[i] = inv_freq[i];
  p.n = n;
  p.heads = heads;
  p.head_dim = head_dim;
  p.half = n_rot / 2;
  p.halves = halves;
  rope_kernel<<<detail::op_blocks(static_cast<size_t>(n) * p.half), detail::kOpThreads, 0, stream>>>(x, positions, p);
  detail::check_launch();
}

}  // namespace tqkv::cuda
