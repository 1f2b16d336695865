// Split-KV decode attention on vLLM's TurboQuant cache on tensor cores (mma.m16n8k16, fp16
// operands, float32 accumulators), for GQA groups of up to 8 query heads: one CTA of four warps
// per (split, kv head, sequence); each warp takes every fourth 16-token tile of the split with
// its own ring of cp.async stages, its own online softmax, and no block barrier in the loop; the
// four warps merge by log-sum-exp at the end. Per tile, in one warp:
//   S^T = K Q^T   M = 16 tokens, N = 8 query heads (the group, padded), K = 16 dims a step: lane
//                 (g, c) decodes tokens g and g + 8 over its quarter of the dims (contiguous code
//                 bytes; Q's fragments hold the same dims, so the dot products are unchanged);
//                 MSE keys are scaled afterwards by their fp16 norm and, with norm correction,
//                 1 / |centroid vector| (the quarters' squares reduced across c);
//   softmax       per head over the 8 lanes of one c (each holds 2 tokens), log2 domain;
//   O^T += V^T P^T  M = 16 dims, N = 8 heads, K = 16 tokens: the value codes go in as small fp16
//                 integers, P carries each token's scale (p * scale), and sum_t p_t zero_t is added
//                 per head; lane g owns the dims [g D / 8, (g + 1) D / 8) (contiguous bytes).
// P is transposed from the score accumulators to the B fragments through 512 bytes of shared
// memory per warp. Results as decode_kernel.cuh's: the split's normalised partial output and
// log2-sum-exp in the workspace (merge_kernel), or the output itself with one split.
#pragma once
#if defined(__CUDACC__)
#include <cuda_pipeline_primitives.h>
#endif

#include "decode_kernel.cuh"

namespace tqkv_vllm {

constexpr int kMmaWarps = 4;

template <int KB, int VB, int D>
struct MmaShape {
  using S = Slot<KB, VB, D>;
  static constexpr int kSlot = S::kAligned;
  static constexpr int kTileBytes = (kTile * kSlot + 15) / 16 * 16;
  // Three stages per warp where they fit 96 KiB, else two.
  static constexpr int kStages = kMmaWarps * 3 * kTileBytes <= 96 * 1024 ? 3 : 2;
  static constexpr int kSteps = D / 16;                          // k-steps of S, m-blocks of O
  static constexpr int kKeyQuarter = D / 4;                      // key dims of one lane
  static constexpr int kKeyBytes = S::kFp8 ? D / 4 : D / 4 * KB / 8;
  static constexpr int kValueEighth = D / 8;                     // value dims of one lane
  static constexpr int kValueBytes = D / 8 * VB / 8;
  static constexpr int kRing = kMmaWarps * kStages * kTileBytes;
  static constexpr int kQ = 8 * D * 4;                           // q_s, then the merged output: [8][D] float
  static constexpr int kP = kMmaWarps * 8 * kTile * 2;           // per warp P [8 heads][16 tokens] fp16
  static constexpr int kStats = kMmaWarps * 8 * 2 * 4 + 16 * 4;  // per warp (m, l) of 8 heads; centroids
  static constexpr int kSmem = kRing + kQ + kP + kStats;
  static_assert(kKeyQuarter * (S::kFp8 ? 8 : KB) % 8 == 0 && kValueEighth * VB % 8 == 0, "lanes start on a byte");
};

template <int KB, int VB, int D>
__global__ void __launch_bounds__(32 * kMmaWarps) decode_mma_kernel(const DecodeParams p) {
  using M = MmaShape<KB, VB, D>;
  using S = typename M::S;
  constexpr int SB = M::kSlot, ST = M::kStages;
  TQKV_VLLM_DYNAMIC_SMEM(smem);
  uint8_t* ring = smem;
  float* q_s = reinterpret_cast<float*>(smem + M::kRing);                  // [8][D]
  __half* p_all = reinterpret_cast<__half*>(smem + M::kRing + M::kQ);      // [warps][8][16]
  float* ml_s = reinterpret_cast<float*>(smem + M::kRing + M::kQ + M::kP);  // [warps][8][2]
  float* cent_s = ml_s + kMmaWarps * 16;                                   // [16]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int group = p.n_q_heads / p.cache.n_kv_heads;
  const SplitTiles st = split_tiles(p, b, split);
  const int len = st.len, tile_lo = st.lo, tile_hi = st.hi;

  // Queries, rotated into the codes' domain (x H / sqrt(D), as vLLM's q @ Pi^T), padded to 8 heads.
  for (int i = tid; i < 8 * D; i += 32 * kMmaWarps) {
    const int h = i / D, j = i % D;
    q_s[i] = h < group ? load_as_float(p.q.data, p.q.dtype, p.q.at(b, kvh * group + h) + j) : 0.0f;
  }
  if constexpr (!S::kFp8) {
    if (tid < (1 << KB)) cent_s[tid] = p.centroids[tid];
    for (int h = 1; h < D; h <<= 1) {
      __syncthreads();
      for (int i = tid; i < 8 * D / 2; i += 32 * kMmaWarps) {
        const int row = i / (D / 2), pp = i % (D / 2);
        const int x = row * D + (pp / h) * 2 * h + (pp % h), y = x + h;
        const float a = q_s[x], e = q_s[y];
        q_s[x] = a + e;
        q_s[y] = a - e;
      }
    }
  }
  __syncthreads();
  // Q's B fragments: head g, the dims of quarter c (4 per k-step).
  const float qn = S::kFp8 ? 1.0f : rsqrtf(static_cast<float>(D));
  uint32_t qf[M::kSteps][2];
#pragma unroll
  for (int kk = 0; kk < M::kSteps; ++kk) {
    const float* qp = q_s + g * D + c * M::kKeyQuarter + 4 * kk;
    qf[kk][0] = pack_h2(qp[0] * qn, qp[1] * qn);
    qf[kk][1] = pack_h2(qp[2] * qn, qp[3] * qn);
  }
  const float factor = p.scale * kLog2e;

  uint8_t* my_ring = ring + warp * ST * M::kTileBytes;
  __half* p_s = p_all + warp * 8 * kTile;
  const int32_t* bt = p.block_table + b * p.bt_stride;
  auto issue = [&](int tile, int stage) {
    const uint8_t* src = tile_source(p, bt, kvh, tile);
    uint8_t* dst = my_ring + stage * M::kTileBytes;
    if (p.contiguous_tiles) {
      for (int k = lane; k < kTile * SB / 16; k += 32) __pipeline_memcpy_async(dst + 16 * k, src + 16 * k, 16);
    } else {
      for (int k = lane; k < kTile * SB / 2; k += 32) {
        const int t = k / (SB / 2), w = k % (SB / 2);
        *reinterpret_cast<uint16_t*>(dst + t * SB + 2 * w) =
            *reinterpret_cast<const uint16_t*>(src + t * p.cache.stride_pos + 2 * w);
      }
    }
  };

  // This lane's heads: 2c (index 0) and 2c + 1 (index 1).
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, z[2] = {0.0f, 0.0f};
  float acc[M::kSteps][4];
#pragma unroll
  for (int mb = 0; mb < M::kSteps; ++mb) acc[mb][0] = acc[mb][1] = acc[mb][2] = acc[mb][3] = 0.0f;

  const int first = tile_lo + warp;
  for (int i = 0; i < ST - 1; ++i) {
    if (first + kMmaWarps * i < tile_hi) issue(first + kMmaWarps * i, i);
    __pipeline_commit();
  }
  for (int k = 0, tile = first; tile < tile_hi; ++k, tile += kMmaWarps) {
    const int next = tile + kMmaWarps * (ST - 1);
    if (next < tile_hi) issue(next, (k + ST - 1) % ST);
    __pipeline_commit();
    __pipeline_wait_prior(ST - 1);
    __syncwarp();
    const uint8_t* tb = my_ring + (k % ST) * M::kTileBytes;
    const int n_valid = min(kTile, len - tile * kTile);

    // S^T = K Q^T: s[0], s[1] token g, heads 2c, 2c + 1; s[2], s[3] token g + 8.
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    {
      uint32_t w0[M::kKeyBytes / 4 + 2], w1[M::kKeyBytes / 4 + 2];
      load_words<M::kKeyBytes>(w0, tb + g * SB + c * M::kKeyBytes);
      load_words<M::kKeyBytes>(w1, tb + (g + 8) * SB + c * M::kKeyBytes);
      float ssq0 = 0.0f, ssq1 = 0.0f;
#pragma unroll
      for (int kk = 0; kk < M::kSteps; ++kk) {
        uint32_t a0, a1, a2, a3;
        if constexpr (S::kFp8) {
          a0 = fp8x2_to_h2(field(w0, 32 * kk, 16));
          a2 = fp8x2_to_h2(field(w0, 32 * kk + 16, 16));
          a1 = fp8x2_to_h2(field(w1, 32 * kk, 16));
          a3 = fp8x2_to_h2(field(w1, 32 * kk + 16, 16));
        } else {
          float e0[4], e1[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            e0[e] = cent_s[field(w0, (4 * kk + e) * KB, KB)];
            e1[e] = cent_s[field(w1, (4 * kk + e) * KB, KB)];
            ssq0 = fmaf(e0[e], e0[e], ssq0);
            ssq1 = fmaf(e1[e], e1[e], ssq1);
          }
          a0 = pack_h2(e0[0], e0[1]);
          a2 = pack_h2(e0[2], e0[3]);
          a1 = pack_h2(e1[0], e1[1]);
          a3 = pack_h2(e1[2], e1[3]);
        }
        mma_f16(s, a0, a1, a2, a3, qf[kk][0], qf[kk][1]);
      }
      float f0 = factor, f1 = factor;
      if constexpr (!S::kFp8) {
        ssq0 += __shfl_xor_sync(0xffffffffu, ssq0, 1);
        ssq0 += __shfl_xor_sync(0xffffffffu, ssq0, 2);
        ssq1 += __shfl_xor_sync(0xffffffffu, ssq1, 1);
        ssq1 += __shfl_xor_sync(0xffffffffu, ssq1, 2);
        const uint8_t* n0 = tb + g * SB + S::kKeyCodeBytes;
        const uint8_t* n1 = tb + (g + 8) * SB + S::kKeyCodeBytes;
        f0 *= fp16_bits_to_float(n0[0], n0[1]);
        f1 *= fp16_bits_to_float(n1[0], n1[1]);
        if (p.norm_correction) f0 *= rsqrtf(ssq0 + 1e-16f), f1 *= rsqrtf(ssq1 + 1e-16f);
      }
      const bool v0 = g < n_valid, v1 = g + 8 < n_valid;
      s[0] = v0 ? s[0] * f0 : -INFINITY;
      s[1] = v0 ? s[1] * f0 : -INFINITY;
      s[2] = v1 ? s[2] * f1 : -INFINITY;
      s[3] = v1 ? s[3] * f1 : -INFINITY;
    }

    // Online softmax per head over the 8 lanes of this c; P' = p * scale to shared memory.
    {
      float sc0 = 0.0f, zr0 = 0.0f, sc1 = 0.0f, zr1 = 0.0f;  // tokens g, g + 8 (0 where invalid)
      if (g < n_valid) {
        const uint8_t* mp = tb + g * SB + S::kKeyBytes + S::kValueCodeBytes;
        sc0 = fp16_bits_to_float(mp[0], mp[1]), zr0 = fp16_bits_to_float(mp[2], mp[3]);
      }
      if (g + 8 < n_valid) {
        const uint8_t* mp = tb + (g + 8) * SB + S::kKeyBytes + S::kValueCodeBytes;
        sc1 = fp16_bits_to_float(mp[0], mp[1]), zr1 = fp16_bits_to_float(mp[2], mp[3]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = fmaxf(s[h], s[2 + h]);
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_new = fmaxf(m[h], mx);  // finite: token 0 of a tile is valid
        const float p0 = exp2f(s[h] - m_new), p1 = exp2f(s[2 + h] - m_new);
        float sum = p0 + p1, zsum = p0 * zr0 + p1 * zr1;
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
          sum += __shfl_xor_sync(0xffffffffu, sum, o);
          zsum += __shfl_xor_sync(0xffffffffu, zsum, o);
        }
        const float alpha = exp2f(m[h] - m_new);
        m[h] = m_new;
        l[h] = l[h] * alpha + sum;
        z[h] = z[h] * alpha + zsum;
#pragma unroll
        for (int mb = 0; mb < M::kSteps; ++mb) acc[mb][h] *= alpha, acc[mb][2 + h] *= alpha;
        p_s[(2 * c + h) * kTile + g] = __float2half_rn(p0 * sc0);
        p_s[(2 * c + h) * kTile + g + 8] = __float2half_rn(p1 * sc1);
      }
    }
    __syncwarp();

    // O^T += V^T P'^T: B = P'^T (tokens 2c, 2c + 1 | 2c + 8, 2c + 9 of head g); A = the codes
    // of this lane's dims (rows g, g + 8 of m-block mb: dims g D / 8 + 2 mb, + 1) at those tokens.
    {
      uint32_t b0, b1;
      memcpy(&b0, p_s + g * kTile + 2 * c, 4);
      memcpy(&b1, p_s + g * kTile + 2 * c + 8, 4);
      constexpr int NW = M::kValueBytes / 4 + 2;
      uint32_t wa[NW], wb[NW], wc[NW], wd[NW];  // tokens 2c, 2c + 1, 2c + 8, 2c + 9
      const uint8_t* vp = tb + S::kKeyBytes + g * M::kValueBytes;
      load_words<M::kValueBytes>(wa, vp + (2 * c) * SB);
      load_words<M::kValueBytes>(wb, vp + (2 * c + 1) * SB);
      load_words<M::kValueBytes>(wc, vp + (2 * c + 8) * SB);
      load_words<M::kValueBytes>(wd, vp + (2 * c + 9) * SB);
#pragma unroll
      for (int mb = 0; mb < M::kSteps; ++mb) {
        const int j0 = 2 * mb * VB, j1 = (2 * mb + 1) * VB;
        const uint32_t a0 = pack_codes(field(wa, j0, VB), field(wb, j0, VB));
        const uint32_t a1 = pack_codes(field(wa, j1, VB), field(wb, j1, VB));
        const uint32_t a2 = pack_codes(field(wc, j0, VB), field(wd, j0, VB));
        const uint32_t a3 = pack_codes(field(wc, j1, VB), field(wd, j1, VB));
        mma_f16(acc[mb], a0, a1, a2, a3, b0, b1);
      }
    }
    __syncwarp();  // P and this stage are read before the next tile overwrites them
  }
  __pipeline_wait_prior(0);

  // Merge the warps: weights 2^(m_w - M) / L per head, then the output in order of warps.
  if (g == 0) {
    ml_s[(warp * 8 + 2 * c) * 2] = m[0], ml_s[(warp * 8 + 2 * c) * 2 + 1] = l[0];
    ml_s[(warp * 8 + 2 * c + 1) * 2] = m[1], ml_s[(warp * 8 + 2 * c + 1) * 2 + 1] = l[1];
  }
  __syncthreads();  // every warp is past its fragments of q_s: it becomes the output
  for (int i = tid; i < 8 * D; i += 32 * kMmaWarps) q_s[i] = 0.0f;
  float wgt[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY, total = 0.0f;
    for (int w = 0; w < kMmaWarps; ++w) mx = fmaxf(mx, ml_s[(w * 8 + 2 * c + h) * 2]);
    for (int w = 0; w < kMmaWarps; ++w) {
      const float mw = ml_s[(w * 8 + 2 * c + h) * 2];
      total += mw == -INFINITY ? 0.0f : exp2f(mw - mx) * ml_s[(w * 8 + 2 * c + h) * 2 + 1];
    }
    wgt[h] = m[h] == -INFINITY || total <= 0.0f ? 0.0f : exp2f(m[h] - mx) / total;
  }
  __syncthreads();
  for (int w = 0; w < kMmaWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int mb = 0; mb < M::kSteps; ++mb) {
        const int d0 = g * M::kValueEighth + 2 * mb;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          q_s[(2 * c + h) * D + d0] += wgt[h] * (acc[mb][h] + z[h]);
          q_s[(2 * c + h) * D + d0 + 1] += wgt[h] * (acc[mb][2 + h] + z[h]);
        }
      }
    }
    __syncthreads();
  }
  for (int i = tid; i < group * D; i += 32 * kMmaWarps) {
    const int h = i / D, d = i % D, hq = kvh * group + h;
    if (p.num_splits == 1) {
      store_from_float(p.out.data, p.out.dtype, p.out.at(b, hq) + d, q_s[i]);
    } else {
      float* w = p.workspace + ((static_cast<int64_t>(b) * p.n_q_heads + hq) * p.num_splits + split) * (D + 1);
      w[d] = q_s[i];
      if (d == 0) {
        float mx = -INFINITY, total = 0.0f;
        for (int v = 0; v < kMmaWarps; ++v) mx = fmaxf(mx, ml_s[(v * 8 + h) * 2]);
        for (int v = 0; v < kMmaWarps; ++v) {
          const float mw = ml_s[(v * 8 + h) * 2];
          total += mw == -INFINITY ? 0.0f : exp2f(mw - mx) * ml_s[(v * 8 + h) * 2 + 1];
        }
        w[D] = total > 0.0f ? mx + log2f(total) : -INFINITY;
      }
    }
  }
}

}  // namespace tqkv_vllm
