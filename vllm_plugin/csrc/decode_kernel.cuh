// Split-KV decode attention on vLLM's TurboQuant cache (slot.cuh), one CTA of 128 threads per
// (split, kv head, sequence) serving every query head of the kv head's GQA group, so each slot
// is read once per kv head (vLLM's Triton kernel reads it once per query head).
//
// Per 16-token tile (one page holds whole tiles: vLLM's block sizes are 16..128):
//   the tile's slots are copied to shared memory (cp.async, three stages in flight where 16
//   slots of a head lie back to back, as vLLM 0.26+ allocates them; plain loads otherwise);
//   scores: thread (token t, chunk c) decodes its D/8 key elements once and dots them with
//     every query head (queries rotated once per CTA by an in-shared-memory Walsh-Hadamard
//     transform), the 8 chunks of a token reduce by shuffles; MSE keys are scaled by their
//     fp16 norm and, with norm correction, by 1 / |centroid vector| computed at read time as
//     vLLM does;
//   online softmax per query head in the log2 domain;
//   values: thread (dim) decodes its uniform code per token and accumulates every head.
// A split writes its normalised partial output and log2-sum-exp to the workspace
// ([batch, n_q_heads, splits, D + 1], the shape of vLLM's TurboQuant decode workspace); a merge
// kernel below combines them. With one split the CTA writes the output itself.
#pragma once
#if defined(__CUDACC__)
#include <cuda_pipeline_primitives.h>
#endif

#include "ops.h"
#include "device.cuh"

namespace tqkv_vllm {

constexpr int kThreads = 128;
constexpr int kTile = 16;
constexpr int kStages = 3;
constexpr float kLog2e = 1.4426950408889634f;

// The tiles [lo, hi) that split `split` of sequence b reads: its 16-token tiles shared evenly.
struct SplitTiles {
  int len, lo, hi;
};
__device__ __forceinline__ SplitTiles split_tiles(const DecodeParams& p, int b, int split) {
  const int len = p.seq_lens[b];
  const int n_tiles = (len + kTile - 1) / kTile;
  const int per = (n_tiles + p.num_splits - 1) / p.num_splits;
  return SplitTiles{len, split * per, min(n_tiles, split * per + per)};
}

// The first byte of tile `tile` (16 tokens, one page) of kv head kvh in a sequence's pages bt.
__device__ __forceinline__ const uint8_t* tile_source(const DecodeParams& p, const int32_t* bt, int kvh, int tile) {
  const int tok0 = tile * kTile;
  const int64_t page = bt[tok0 / p.cache.block_size];
  return p.cache.base + page * p.cache.stride_block + static_cast<int64_t>(tok0 % p.cache.block_size) * p.cache.stride_pos +
         static_cast<int64_t>(kvh) * p.cache.stride_head;
}

template <int KB, int VB, int D, int G>
struct DecodeShape {
  using S = Slot<KB, VB, D>;
  static constexpr int kSlot = S::kAligned;
  static constexpr int kTileBytes = (kTile * kSlot + 15) / 16 * 16;
  static constexpr int kChunk = D / 8;           // key elements per thread
  static constexpr int kQRow = D + 4 * 8;        // a query head in shared memory: chunks 4 floats apart
  static constexpr int kChunkBytes = S::kFp8 ? kChunk : kChunk * KB / 8;
  // Value phase: 128 threads over D dims; at D = 64 two threads share a dim and split the heads.
  static constexpr int kVd = D >= kThreads ? D / kThreads : 1;            // dims per thread
  static constexpr int kHg = D >= kThreads ? 1 : kThreads / D;            // head groups
  static constexpr int kGpt = (G + kHg - 1) / kHg;                        // heads per thread
  static constexpr int kSmem = kStages * kTileBytes + G * kQRow * 4 + G * kTile * 4;
  static_assert(kSmem + 1024 <= 48 * 1024, "static shared memory");
  static_assert(kChunk * KB % 8 == 0, "key chunks start on a byte");
};

__device__ __forceinline__ int qpos(int j, int chunk) { return j + 4 * (j / chunk); }

template <int KB, int VB, int D, int G>
__global__ void __launch_bounds__(kThreads) decode_kernel(const DecodeParams p) {
  using Sh = DecodeShape<KB, VB, D, G>;
  using S = typename Sh::S;
  constexpr int SB = Sh::kSlot, CD = Sh::kChunk;
  __shared__ __align__(16) uint8_t tiles[kStages][Sh::kTileBytes];
  __shared__ __align__(16) float q_s[G][Sh::kQRow];
  __shared__ __align__(16) float sc_s[G][kTile];  // scores, then probabilities
  __shared__ float cent_s[16];
  __shared__ float m_s[G], l_s[G], alpha_s[G];

  const int tid = threadIdx.x;
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int group = p.n_q_heads / p.cache.n_kv_heads;
  const SplitTiles st = split_tiles(p, b, split);
  const int len = st.len, tile_lo = st.lo, tile_hi = st.hi;

  // Query heads of this kv head, rotated (MSE keys) into the codes' domain.
  for (int i = tid; i < G * D; i += kThreads) {
    const int g = i / D, j = i % D;
    q_s[g][qpos(j, CD)] =
        g < group ? load_as_float(p.q.data, p.q.dtype, p.q.at(b, kvh * group + g) + j) : 0.0f;
  }
  if constexpr (!S::kFp8) {
    if (tid < (1 << KB)) cent_s[tid] = p.centroids[tid];
    for (int h = 1; h < D; h <<= 1) {
      __syncthreads();
      for (int i = tid; i < G * D / 2; i += kThreads) {
        const int g = i / (D / 2), pp = i % (D / 2);
        const int x = (pp / h) * 2 * h + (pp % h), y = x + h;
        const float a = q_s[g][qpos(x, CD)], c = q_s[g][qpos(y, CD)];
        q_s[g][qpos(x, CD)] = a + c;
        q_s[g][qpos(y, CD)] = a - c;
      }
    }
  }
  if (tid < G) m_s[tid] = -INFINITY, l_s[tid] = 0.0f;
  // vLLM's rotation is H / sqrt(D); the transform above is H.
  const float factor = p.scale * kLog2e * (S::kFp8 ? 1.0f : rsqrtf(static_cast<float>(D)));

  const int32_t* bt = p.block_table + b * p.bt_stride;
  auto issue = [&](int tile, int stage) {
    const uint8_t* src = tile_source(p, bt, kvh, tile);
    if (p.contiguous_tiles) {
      for (int k = tid; k < kTile * SB / 16; k += kThreads) __pipeline_memcpy_async(&tiles[stage][16 * k], src + 16 * k, 16);
    } else {
      for (int k = tid; k < kTile * SB / 2; k += kThreads) {
        const int t = k / (SB / 2), w = k % (SB / 2);
        *reinterpret_cast<uint16_t*>(&tiles[stage][t * SB + 2 * w]) =
            *reinterpret_cast<const uint16_t*>(src + t * p.cache.stride_pos + 2 * w);
      }
    }
  };

  for (int i = 0; i < kStages - 1; ++i) {
    if (tile_lo + i < tile_hi) issue(tile_lo + i, i);
    __pipeline_commit();
  }

  float acc[Sh::kGpt][Sh::kVd];
#pragma unroll
  for (int i = 0; i < Sh::kGpt; ++i)
#pragma unroll
    for (int v = 0; v < Sh::kVd; ++v) acc[i][v] = 0.0f;
  const int vd0 = D >= kThreads ? tid : tid % D;
  const int hg = D >= kThreads ? 0 : tid / D;

  for (int tile = tile_lo; tile < tile_hi; ++tile) {
    const int k = tile - tile_lo;
    if (tile + kStages - 1 < tile_hi) issue(tile + kStages - 1, (k + kStages - 1) % kStages);
    __pipeline_commit();
    __pipeline_wait_prior(kStages - 1);
    __syncthreads();
    const uint8_t* tb = tiles[k % kStages];
    const int n_valid = min(kTile, len - tile * kTile);

    // Scores.
    {
      const int t = tid >> 3, c = tid & 7;
      const uint8_t* kp = tb + t * SB + c * Sh::kChunkBytes;
      float dot[G];
#pragma unroll
      for (int g = 0; g < G; ++g) dot[g] = 0.0f;
      float csq = 0.0f;
      float kv[CD];
      if constexpr (S::kFp8) {
#pragma unroll
        for (int j = 0; j < CD; ++j) kv[j] = fp8_e4m3_to_float(kp[j]);
      } else {
        uint32_t w[(Sh::kChunkBytes + 3) / 4 + 1];
        load_words<Sh::kChunkBytes>(w, kp);
#pragma unroll
        for (int j = 0; j < CD; ++j) {
          kv[j] = cent_s[field(w, j * KB, KB)];
          csq = fmaf(kv[j], kv[j], csq);
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float4* qg = reinterpret_cast<const float4*>(&q_s[g][c * (CD + 4)]);
#pragma unroll
        for (int j4 = 0; j4 < CD / 4; ++j4) {
          const float4 q4 = qg[j4];
          dot[g] = fmaf(q4.x, kv[4 * j4], dot[g]);
          dot[g] = fmaf(q4.y, kv[4 * j4 + 1], dot[g]);
          dot[g] = fmaf(q4.z, kv[4 * j4 + 2], dot[g]);
          dot[g] = fmaf(q4.w, kv[4 * j4 + 3], dot[g]);
        }
      }
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o);
        if constexpr (!S::kFp8) csq += __shfl_xor_sync(0xffffffffu, csq, o);
      }
      if (c == 0) {
        float f = factor;
        if constexpr (!S::kFp8) {
          const uint8_t* np = tb + t * SB + S::kKeyCodeBytes;
          f *= fp16_bits_to_float(np[0], np[1]);
          if (p.norm_correction) f *= rsqrtf(csq + 1e-16f);
        }
#pragma unroll
        for (int g = 0; g < G; ++g) sc_s[g][t] = t < n_valid ? dot[g] * f : -INFINITY;
      }
    }
    __syncthreads();

    // Online softmax, one warp per query head (heads w, w + 4, ...).
    {
      const int warp = tid >> 5, lane = tid & 31;
      for (int g = warp; g < G; g += kThreads / 32) {
        const float s = lane < kTile ? sc_s[g][lane] : -INFINITY;
        float mx = s;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_old = m_s[g];
        const float m_new = fmaxf(m_old, mx);  // finite: a tile holds at least one valid token
        const float e = lane < kTile ? exp2f(s - m_new) : 0.0f;
        float sum = e;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        __syncwarp();
        if (lane < kTile) sc_s[g][lane] = e;
        if (lane == 0) {
          const float alpha = exp2f(m_old - m_new);
          alpha_s[g] = alpha;
          l_s[g] = l_s[g] * alpha + sum;
          m_s[g] = m_new;
        }
      }
    }
    __syncthreads();

    // Values.
    {
#pragma unroll
      for (int i = 0; i < Sh::kGpt; ++i) {
        const int g = hg * Sh::kGpt + i;
        const float a = g < G ? alpha_s[g] : 0.0f;
#pragma unroll
        for (int v = 0; v < Sh::kVd; ++v) acc[i][v] *= a;
      }
      for (int t4 = 0; t4 < kTile / 4; ++t4) {
        float vals[4][Sh::kVd];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int t = 4 * t4 + u;
          const uint8_t* vp = tb + t * SB + S::kKeyBytes;
          const uint8_t* mp = vp + S::kValueCodeBytes;
          const float scale = fp16_bits_to_float(mp[0], mp[1]), zero = fp16_bits_to_float(mp[2], mp[3]);
#pragma unroll
          for (int v = 0; v < Sh::kVd; ++v) {
            const float x = fmaf(static_cast<float>(code_at<VB>(vp, vd0 + v * kThreads)), scale, zero);
            vals[u][v] = t < n_valid ? x : 0.0f;  // an unwritten slot may hold NaN; its weight is 0
          }
        }
#pragma unroll
        for (int i = 0; i < Sh::kGpt; ++i) {
          const int g = hg * Sh::kGpt + i;
          if (g >= G) break;
          const float4 p4 = reinterpret_cast<const float4*>(sc_s[g])[t4];
#pragma unroll
          for (int v = 0; v < Sh::kVd; ++v) {
            acc[i][v] = fmaf(p4.x, vals[0][v], acc[i][v]);
            acc[i][v] = fmaf(p4.y, vals[1][v], acc[i][v]);
            acc[i][v] = fmaf(p4.z, vals[2][v], acc[i][v]);
            acc[i][v] = fmaf(p4.w, vals[3][v], acc[i][v]);
          }
        }
      }
    }
    __syncthreads();
  }
  __pipeline_wait_prior(0);
  __syncthreads();  // m_s, l_s of a split that read no tile

  // The split's result: normalised partial output and log2-sum-exp (-inf where it read nothing).
#pragma unroll
  for (int i = 0; i < Sh::kGpt; ++i) {
    const int g = hg * Sh::kGpt + i;
    if (g >= G || g >= group) break;
    const int hq = kvh * group + g;
    const float l = l_s[g];
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    if (p.num_splits == 1) {
#pragma unroll
      for (int v = 0; v < Sh::kVd; ++v)
        store_from_float(p.out.data, p.out.dtype, p.out.at(b, hq) + vd0 + v * kThreads, acc[i][v] * inv);
    } else {
      float* w = p.workspace + ((static_cast<int64_t>(b) * p.n_q_heads + hq) * p.num_splits + split) * (D + 1);
#pragma unroll
      for (int v = 0; v < Sh::kVd; ++v) w[vd0 + v * kThreads] = acc[i][v] * inv;
      if (vd0 == 0) w[D] = l > 0.0f ? m_s[g] + log2f(l) : -INFINITY;
    }
  }
}

constexpr int kMergeThreads = 128;
constexpr int kMaxSplits = 64;

// One CTA per (query head, sequence): out = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max).
template <int D>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const DecodeParams p) {
  const int hq = blockIdx.x, b = blockIdx.y;
  const float* w = p.workspace + (static_cast<int64_t>(b) * p.n_q_heads + hq) * p.num_splits * (D + 1);
  __shared__ float weight[kMaxSplits];
  __shared__ float total;
  if (threadIdx.x < 32) {
    float mx = -INFINITY;
    for (int s = threadIdx.x; s < p.num_splits; s += 32) mx = fmaxf(mx, w[s * (D + 1) + D]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
    for (int s = threadIdx.x; s < p.num_splits; s += 32) {
      const float lse = w[s * (D + 1) + D];
      const float e = lse == -INFINITY ? 0.0f : exp2f(lse - mx);
      weight[s] = e;
      sum += e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (threadIdx.x == 0) total = sum;
  }
  __syncthreads();
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;  // a sequence of length 0 gives zeros
  for (int d = threadIdx.x; d < D; d += kMergeThreads) {
    float o = 0.0f;
    for (int s = 0; s < p.num_splits; ++s) o = fmaf(weight[s], w[s * (D + 1) + d], o);
    store_from_float(p.out.data, p.out.dtype, p.out.at(b, hq) + d, o * inv);
  }
}

}  // namespace tqkv_vllm
