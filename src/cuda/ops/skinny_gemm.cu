// Skinny products for decode steps: y[n, rows] = x[n, cols] * W[rows, cols]^T with n <= 64 on
// the tensor cores (mma.sync m16n8k16, bf16 in, float32 accumulate), each weight read once.
//
// Why not cuBLAS alone: at a decode step's few rows each product of a layer (Q, K, V, their
// biases, gate, up, the GLU) was a launch or two of its own, and the small ones ran far below the
// memory rate (Qwen2.5-1.5B's Q/K/V group read its weights at 0.32 TB/s on the H200, this kernel at
// 0.91; docs/journal/RESULTS-journal.md, "Skinny products"). cuBLAS stays faster on long columns
// and very many rows, and at more than ~16 rows (the engine's choice is CudaDevice::skinny_single).
// Here one launch computes a group of products over the same input with their biases, or gate and
// up with the GLU applied, and reads a float32 input directly (rounded to bf16 as f32_to_bf16
// rounds), so no conversion kernel runs before it.
//
// Layout: a cluster of S blocks of 4 warps owns 16 rows of one product (for the GLU: 16 rows of
// gate and the same 16 of up); S = 1 unless the product has few row tiles and many columns (the
// down projection: 1,536 rows of 8,960 columns), where S blocks on S SMs split its columns. The
// 4 S warps take the columns in chunks of 128 (warp w of the cluster takes chunks w, w + 4 S, ...,
// two at a time: 16 loads of 16 bytes in flight per lane). In a chunk a lane loads 16 contiguous
// bytes of each of its two weight rows (rows g and g + 8 of the tile, g = lane / 4) at columns
// 32 i + 8 j (j = lane % 4, i = 0..3), so a quarter warp reads 64 contiguous bytes of a row, and
// the same columns of the input row of token g of each 8-token tile. Those eight bf16 values feed
// two mma steps: the mma's fragment positions {2j, 2j+1, 2j+8, 2j+9} are filled from columns
// 8j + {0..3} and then 8j + {4..7}. A dot product does not depend on the order of its terms'
// columns, and the weights and the input use the same assignment, so the fragments need no
// shuffles and the weights no repacking. Partial sums are added in a fixed order (a block's warps
// in shared memory, then the cluster's blocks by rank through distributed shared memory), so a
// result does not depend on timing, and a row's result not on the other rows.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include "glu.cuh"
#include "launch.cuh"

namespace tqkv::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileRows = 16;
constexpr int kChunk = 128;  // columns per warp step
constexpr int kMaxSplit = 8;  // blocks per cluster (the portable limit)

enum class Epilogue { Plain, Silu, Gelu };

struct Params {
  const uint16_t* x_bf16;  // one of the two inputs, [n, cols]
  const float* x_f32;
  int n, cols;
  int count;  // products (Plain)
  const uint16_t* w[kMaxSkinnyProducts];
  const float* bias[kMaxSkinnyProducts];
  float* y[kMaxSkinnyProducts];
  int rows[kMaxSkinnyProducts];
  int tile_begin[kMaxSkinnyProducts + 1];  // first block of each product
  const uint16_t* w_up;                    // the GLU's second matrix (w[0] is gate)
  uint16_t* y_bf16;                        // the GLU's bf16 copy of y[0] (may be null)
  int split;                               // blocks per row tile (the cluster's size)
};

__device__ __forceinline__ uint4 load_weights(const uint16_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);  // a in the low half
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Eight input values at columns [k, k + 8) of one row, as bf16 pairs.
template <bool kF32>
__device__ __forceinline__ uint4 load_input(const Params& p, int token, int k) {
  if constexpr (kF32) {
    const float4* s = reinterpret_cast<const float4*>(p.x_f32 + static_cast<size_t>(token) * p.cols + k);
    const float4 a = __ldg(s), b = __ldg(s + 1);
    return make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y), pack_bf16(b.z, b.w));
  } else {
    return __ldg(reinterpret_cast<const uint4*>(p.x_bf16 + static_cast<size_t>(token) * p.cols + k));
  }
}

// c += a (16 x 16 bf16) * b (16 x 8 bf16).
__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Both mma steps of one 16-byte load per row: columns 8j + {0..3}, then 8j + {4..7}.
__device__ __forceinline__ void mma2(float (&c)[4], const uint4& lo, const uint4& hi, const uint4& b) {
  mma(c, lo.x, hi.x, lo.y, hi.y, b.x, b.y);
  mma(c, lo.z, hi.z, lo.w, hi.w, b.z, b.w);
}

template <int kTiles, bool kF32, Epilogue kEpi>
__global__ void __launch_bounds__(kThreads) skinny_kernel(const Params p) {
  constexpr bool kGlu = kEpi != Epilogue::Plain;
  constexpr int kSets = kGlu ? 2 : 1;    // weight matrices per tile: gate and up, or one
  constexpr int kUnroll = kGlu ? 1 : 2;  // chunks loaded at once (16 loads per lane either way)
  __shared__ float partial[kWarps][kSets][4][32];
  __shared__ float block_sum[kTiles][kSets][128];  // the block's sums, read by the cluster's rank 0

  const int tile = static_cast<int>(blockIdx.x) / p.split, rank = static_cast<int>(blockIdx.x) % p.split;
  int prod = 0;
  if constexpr (!kGlu)
    while (prod + 1 < p.count && tile >= p.tile_begin[prod + 1]) ++prod;
  const int rows = p.rows[prod];
  const int row0 = (tile - p.tile_begin[prod]) * kTileRows;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, j = lane % 4;

  // The lane's two rows of each matrix (null past the product's rows: they read as zero).
  const uint16_t* wr[kSets][2];
  for (int s = 0; s < kSets; ++s) {
    const uint16_t* base = s == 0 ? p.w[prod] : p.w_up;
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + g + 8 * h;
      wr[s][h] = r < rows ? base + static_cast<size_t>(r) * p.cols : nullptr;
    }
  }

  float acc[kSets][kTiles][4] = {};
  const int chunks = (p.cols + kChunk - 1) / kChunk;
  const int stride = kWarps * p.split;
  for (int c = rank * kWarps + warp; c < chunks; c += kUnroll * stride) {
    uint4 a[kUnroll][4][kSets][2];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int k = (c + u * stride) * kChunk + 8 * j + 32 * i;
#pragma unroll
        for (int s = 0; s < kSets; ++s)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            a[u][i][s][h] = (wr[s][h] && k < p.cols) ? load_weights(wr[s][h] + k) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        // Past the columns for the whole warp (the unrolled pair's second chunk, or a tail): the
        // condition is the same on every lane, as mma.sync needs. A lane past them inside the
        // 32 columns reads zeros.
        if ((c + u * stride) * kChunk + 32 * i >= p.cols) continue;
        const int k = (c + u * stride) * kChunk + 8 * j + 32 * i;
#pragma unroll
        for (int t = 0; t < kTiles; ++t) {
          const int token = t * 8 + g;
          const uint4 b = (token < p.n && k < p.cols) ? load_input<kF32>(p, token, k) : make_uint4(0, 0, 0, 0);
#pragma unroll
          for (int s = 0; s < kSets; ++s) mma2(acc[s][t], a[u][i][s][0], a[u][i][s][1], b);
        }
      }
  }

  // The block's sums in warp order, one 8-token tile at a time. Value v = (register r, lane L) of
  // an accumulator is row g + 8 (r / 2) and token 2 (L % 4) + r % 2 of the tile (mma's layout).
  const int tid = static_cast<int>(threadIdx.x);  // kThreads == 128: one value each
  const int tiles_used = (p.n + 7) / 8;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    if (t >= tiles_used) break;  // uniform over the block
#pragma unroll
    for (int s = 0; s < kSets; ++s)
#pragma unroll
      for (int r = 0; r < 4; ++r) partial[warp][s][r][lane] = acc[s][t][r];
    __syncthreads();
#pragma unroll
    for (int s = 0; s < kSets; ++s) {
      float v = 0.0f;
      for (int w = 0; w < kWarps; ++w) v += partial[w][s][tid / 32][tid % 32];
      block_sum[t][s][tid] = v;
    }
    __syncthreads();
  }

  // Rank 0 adds the cluster's blocks in rank order (the others wait until it has read them).
  namespace cg = cooperative_groups;
  if (p.split > 1) cg::this_cluster().sync();
  if (rank == 0) {
    const int r = tid / 32, L = tid % 32;
    const int row = row0 + L / 4 + 8 * (r / 2);
    for (int t = 0; t < tiles_used; ++t) {
      const int token = t * 8 + 2 * (L % 4) + r % 2;
      float sum[kSets];
#pragma unroll
      for (int s = 0; s < kSets; ++s) sum[s] = block_sum[t][s][tid];
      for (int b = 1; b < p.split; ++b) {
        const float* remote = cg::this_cluster().map_shared_rank(&block_sum[0][0][0], b);
#pragma unroll
        for (int s = 0; s < kSets; ++s) sum[s] += remote[(t * kSets + s) * 128 + tid];
      }
      if (row < rows && token < p.n) {
        const size_t at = static_cast<size_t>(token) * rows + row;
        if constexpr (kGlu) {
          const float v = kEpi == Epilogue::Gelu ? detail::gelu_times(sum[0], sum[1]) : detail::silu_times(sum[0], sum[1]);
          p.y[0][at] = v;
          if (p.y_bf16) p.y_bf16[at] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
        } else {
          p.y[prod][at] = sum[0] + (p.bias[prod] ? p.bias[prod][row] : 0.0f);
        }
      }
    }
  }
  if (p.split > 1) cg::this_cluster().sync();
}

template <int kTiles, bool kF32, Epilogue kEpi>
void launch_kernel(const Params& p, int tiles, cudaStream_t stream) {
  const auto fn = skinny_kernel<kTiles, kF32, kEpi>;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(tiles * p.split));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (p.split > 1) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(p.split);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  TQKV_CUDA_CHECK(cudaLaunchKernelEx(&cfg, fn, p));
}

template <bool kF32, Epilogue kEpi>
void launch_tiles(const Params& p, int tiles, cudaStream_t stream) {
  const int token_tiles = (p.n + 7) / 8;
  if (token_tiles <= 1)
    launch_kernel<1, kF32, kEpi>(p, tiles, stream);
  else if (token_tiles <= 2)
    launch_kernel<2, kF32, kEpi>(p, tiles, stream);
  else if (token_tiles <= 4)
    launch_kernel<4, kF32, kEpi>(p, tiles, stream);
  else
    launch_kernel<8, kF32, kEpi>(p, tiles, stream);
}

// Blocks per row tile: more than one only where the row tiles alone leave SMs idle and each warp
// of the cluster still gets two or more chunks of columns.
int split_for(int tiles, int cols) {
  static const int sms = [] {
    int dev = 0, n = 0;
    TQKV_CUDA_CHECK(cudaGetDevice(&dev));
    TQKV_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  const int chunks = (cols + kChunk - 1) / kChunk;
  int split = 1;
  // Up to ~4 blocks per SM (a block holds 16 loads of 16 bytes per lane in flight).
  while (split < kMaxSplit && tiles * split * 2 <= 4 * sms && chunks >= 2 * kWarps * split * 2) split *= 2;
  return split;
}

template <Epilogue kEpi>
void launch(Params& p, int tiles, cudaStream_t stream) {
  p.split = split_for(tiles, p.cols);
  if (p.x_f32)
    launch_tiles<true, kEpi>(p, tiles, stream);
  else
    launch_tiles<false, kEpi>(p, tiles, stream);
}

Params input_params(const char* what, const uint16_t* x_bf16, const float* x_f32, int n, int cols) {
  if ((x_bf16 == nullptr) == (x_f32 == nullptr))
    detail::throw_arg(std::string(what) + ": give exactly one input (bf16 or float32)");
  if (!skinny_gemm_supports(n, cols))
    detail::throw_arg(std::string(what) + ": " + std::to_string(n) + " rows of " + std::to_string(cols) +
                      " columns (needs 1.." + std::to_string(kSkinnyMaxRows) + " rows, columns a multiple of 8)");
  Params p{};
  p.x_bf16 = x_bf16;
  p.x_f32 = x_f32;
  p.n = n;
  p.cols = cols;
  return p;
}

}  // namespace

bool skinny_gemm_supports(int n, int cols) { return n >= 1 && n <= kSkinnyMaxRows && cols > 0 && cols % 8 == 0; }

void skinny_gemm(const uint16_t* x_bf16, const float* x_f32, int n, int cols, const SkinnyProduct* products, int count,
                 cudaStream_t stream) {
  Params p = input_params("skinny_gemm", x_bf16, x_f32, n, cols);
  if (count < 1 || count > kMaxSkinnyProducts || !products)
    detail::throw_arg("skinny_gemm: 1.." + std::to_string(kMaxSkinnyProducts) + " products");
  p.count = count;
  int tiles = 0;
  for (int i = 0; i < count; ++i) {
    const SkinnyProduct& q = products[i];
    if (!q.w || !q.y || q.rows < 1) detail::throw_arg("skinny_gemm: a product without weights, output or rows");
    p.w[i] = q.w;
    p.y[i] = q.y;
    p.bias[i] = q.bias;
    p.rows[i] = q.rows;
    p.tile_begin[i] = tiles;
    tiles += (q.rows + kTileRows - 1) / kTileRows;
  }
  p.tile_begin[count] = tiles;
  launch<Epilogue::Plain>(p, tiles, stream);
}

void skinny_gemm_glu(bool gelu, const uint16_t* x_bf16, const float* x_f32, int n, int cols, const uint16_t* w_gate,
                     const uint16_t* w_up, int rows, float* y, uint16_t* y_bf16, cudaStream_t stream) {
  Params p = input_params("skinny_gemm_glu", x_bf16, x_f32, n, cols);
  if (!w_gate || !w_up || !y || rows < 1) detail::throw_arg("skinny_gemm_glu: null argument or no rows");
  p.count = 1;
  p.w[0] = w_gate;
  p.w_up = w_up;
  p.y[0] = y;
  p.rows[0] = rows;
  p.y_bf16 = y_bf16;
  const int tiles = (rows + kTileRows - 1) / kTileRows;
  p.tile_begin[1] = tiles;
  if (gelu)
    launch<Epilogue::Gelu>(p, tiles, stream);
  else
    launch<Epilogue::Silu>(p, tiles, stream);
}

}  // namespace tqkv::cuda
