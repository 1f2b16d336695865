// prefill_attention: causal attention of a run of queries over a contiguous K/V (a prefill
// chunk against its sequence's dequantized cache), flash-attention style. Two kernels:
//
// bf16 or f16 K/V (every cache but the f32 one; compressed formats dequantize to bf16, f16 and
// bf16 caches to themselves): tensor cores, mma of that type. A CTA of 4 warps takes 64 queries of
// one query head, warp w rows [16 w, 16 w + 16). Tiles of 64 keys (32 at d = 256) of K and V stream
// through two shared-memory buffers filled by cp.async while the previous tile is used. Per tile:
//   S = Q K^T  with mma.m16n8k16 (16-bit in, f32 accumulate): the query (times scale * log2 e,
//              rounded to K's type: the precision of the decode kernel, which takes the same
//              rows otherwise) is the A fragment, K's rows the B fragments (ldmatrix);
//   online softmax in f32 (log2 domain) on the accumulator: a thread holds rows g and g + 8 and
//              keys 2c, 2c + 1 of every 8-key block, so a row's max and sum take two shuffles;
//   O += P V   P (K's type) comes straight from S's accumulator layout as the A fragment, V's B
//              fragments by ldmatrix.trans from the same [key][dim] rows.
// CTAs with later queries have more keys, so the grid runs them first (less tail).
// A run too short to fill the GPU by itself (a chunk of 512 over a long history: 8 CTAs a head)
// splits each CTA's key tiles over several CTAs (grid z), as many as keep the grid within one
// wave of resident CTAs and each split at least kMinSplitTiles tiles long; each writes its rows'
// normalised outputs and log-sum-exps to the caller's workspace, and merge_splits_kernel combines
// them by their log-sum-exps.
//
// f32 K/V (the f32 reference cache): the scalar kernel below, exact in f32. A CTA of 128 threads
// takes kRows = 16 queries of one query head. Thread t owns row t / 8 and lane c = t % 8 of it:
// in each tile of kCols = 32 keys it scores keys c, c + 8, c + 16, c + 24 and accumulates output
// dims c, c + 8, ... of its row, so the 8 lanes of a row (inside one warp) reduce the row's max
// and sum by shuffles. K and V tiles go through shared memory (K rows padded by one float against
// bank conflicts); the running max/sum rescale the accumulator.
//
// TQKV_PREFILL_KERNEL=scalar sends 16-bit K/V to the scalar kernel too (read at every call, so a
// benchmark or a test runs both in one process).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>
#include <cuda_bf16.h>

#include "../mma.cuh"
#include "launch.cuh"
#include "tqkv/options.h"

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
  int n_q, n_kv, n_q_heads, n_kv_heads, window, shift;
  float scale;
  float* lse;  // optional [n_q, n_q_heads], natural log
  // Split keys (the tensor-core kernel): CTA z of `splits` takes its z-th share of the key tiles
  // and writes its rows' normalised outputs to split_o [splits][n_q * n_q_heads][D] and their
  // log-sum-exps to split_lse [splits][n_q * n_q_heads]; merge_splits_kernel then combines them.
  int splits;
  float* split_o;
  float* split_lse;
};

// The keys a CTA whose queries sit at [first_pos, last_pos] may see: from kv_start (or the first
// query's window) to n_kv (held) or last_pos - shift (causal), whichever ends first.
__device__ __forceinline__ int64_t first_key(const Params& p, int64_t first_pos) {
  const int64_t w = p.window > 0 ? first_pos - p.window + 1 : 0;
  return w > p.kv_start ? w : p.kv_start;
}
__device__ __forceinline__ int64_t key_end(const Params& p, int64_t last_pos) {
  const int64_t c = last_pos + 1 - p.shift;
  return c < p.n_kv ? c : static_cast<int64_t>(p.n_kv);
}
// Whether the query at pos sees key (which lies in [first_key, key_end) of its CTA).
__device__ __forceinline__ bool sees(const Params& p, int64_t pos, int64_t key, int64_t k_end) {
  return key < k_end && key <= pos - p.shift && (p.window <= 0 || key > pos - p.window);
}

__device__ __forceinline__ float load_kv(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_kv(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float load_kv(const __half* p, int64_t i) { return __half2float(p[i]); }

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
  const int64_t k_end = key_end(p, last_pos), k_begin = first_key(p, first_pos);

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
      const bool visible = valid && sees(p, my_pos, key, k_end);
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
  if (p.lse && c == 0) p.lse[static_cast<int64_t>(q0 + r) * p.n_q_heads + h] = l > 0.0f ? m + logf(l) : -INFINITY;
  float* orow = p.out + (q0 + r) * p.out_stride + static_cast<int64_t>(h) * D;
#pragma unroll
  for (int j = 0; j < E; ++j) orow[c + kLanes * j] = o[j] * inv;
}

// ---- The tensor-core kernel (bf16 or f16 K/V) ----

// Warps a CTA (16 queries each): 4, or 8 with TQKV_PREFILL_WARPS=8 (each K/V tile a CTA loads
// then serves twice the queries; the splits keep the grid full; at d = 64 held to 128 registers
// for two CTAs an SM). 8 is built and tested against the reference but not yet timed on a GPU
// (docs/journal/RESULTS-journal.md). 2 warps, for twice the CTAs where a chunk's grid left SMs
// idle, measured slower on the H200 at every chunk (SmolLM2 prefill).
constexpr int kMmaWarps = 4;

template <int D>
__host__ __device__ constexpr int mma_tile_keys() {
  return D == 256 ? 32 : 64;
}
// bf16 elements per shared-memory row: 16 bytes of padding put the 8 rows one ldmatrix phase
// reads on 8 different 4-bank groups.
template <int D>
__host__ __device__ constexpr int mma_stride() {
  return D + 8;
}
// The queries (16 rows a warp), then two buffers of a K tile and a V tile.
template <int D, int W>
constexpr size_t mma_smem_bytes() {
  return static_cast<size_t>(16 * W + 4 * mma_tile_keys<D>()) * mma_stride<D>() * sizeof(uint16_t);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared, or 16 zero bytes where !ok (src is then not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
template <int D, bool BF, int W>
__global__ void __launch_bounds__(32 * W, (W == 8 && D == 64) ? 2 : 1) prefill_mma_kernel(const __grid_constant__ Params p) {
  constexpr int kMmaThreads = 32 * W, kMmaRows = 16 * W;
  constexpr int KT = mma_tile_keys<D>(), S = mma_stride<D>();
  constexpr int NB = KT / 8;   // 8-key blocks of a tile (the n-tiles of S)
  constexpr int DB = D / 8;    // 8-dim blocks (the n-tiles of O)
  constexpr int KS = D / 16;   // k-steps of Q K^T
  constexpr int PR = D / 8;    // 16-byte pieces of a row
  // The whole query's A fragments stay in registers up to d = 128; at 256 they are read per tile
  // (with O's 128 accumulators they would not fit).
  constexpr bool kQRegs = D <= 128;
  extern __shared__ __align__(16) uint16_t sm[];
  uint16_t* qs = sm;                  // [kMmaRows][S]
  uint16_t* kvs = sm + kMmaRows * S;  // buffer b: K at kvs + 2 b KT S, V KT S after it
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
  const int h = blockIdx.y, kvh = h / (p.n_q_heads / p.n_kv_heads);
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kMmaRows;  // the longest CTAs first
  const int rows = min(kMmaRows, p.n_q - q0);
  const int64_t first_pos = p.pos0 + q0, k_end = key_end(p, first_pos + rows - 1), k_begin = first_key(p, first_pos);
  const int n_tiles = k_end > k_begin ? static_cast<int>((k_end - k_begin + KT - 1) / KT) : 0;
  // This CTA's share of the tiles: [t_lo, t_hi) of its split (all of them unsplit).
  int t_lo = 0, t_hi = n_tiles;
  if (p.splits > 1) {
    const int per = (n_tiles + p.splits - 1) / p.splits;
    t_lo = min(n_tiles, static_cast<int>(blockIdx.z) * per);
    t_hi = min(n_tiles, t_lo + per);
  }
  const uint16_t* kg = static_cast<const uint16_t*>(p.k);
  const uint16_t* vg = static_cast<const uint16_t*>(p.v);
  const int64_t key_elems = static_cast<int64_t>(p.n_kv_heads) * D;

  // Keys [t0, t0 + KT) into buffer b; keys at or past k_end read as zeros (never past n_kv).
  auto load_tile = [&](int64_t t0, int b) {
    uint16_t* kd = kvs + 2 * b * KT * S;
    uint16_t* vd = kd + KT * S;
    for (int i = tid; i < KT * PR; i += kMmaThreads) {
      const int j = i / PR, piece = i % PR;
      const int64_t key = t0 + j;
      const bool ok = key < k_end;
      const int64_t at = ok ? (key - p.kv_start) * key_elems + static_cast<int64_t>(kvh) * D + piece * 8 : 0;
      cp_async16(kd + j * S + piece * 8, kg + at, ok);
      cp_async16(vd + j * S + piece * 8, vg + at, ok);
    }
    cp_async_commit();
  };
  if (t_lo < t_hi) load_tile(k_begin + static_cast<int64_t>(t_lo) * KT, t_lo & 1);

  // The queries, times scale * log2 e (scores in the log2 domain), rounded to K's 16-bit type;
  // rows past n_q are zeros (their outputs are not written).
  const float qscale = p.scale * 1.4426950408889634f;
  for (int i = tid; i < kMmaRows * (D / 2); i += kMmaThreads) {
    const int r = i / (D / 2), d = 2 * (i % (D / 2));
    float a = 0.0f, b = 0.0f;
    if (r < rows) {
      const float* qr = p.q + static_cast<int64_t>(q0 + r) * p.q_stride + static_cast<int64_t>(h) * D + d;
      a = qr[0] * qscale;
      b = qr[1] * qscale;
    }
    *reinterpret_cast<uint32_t*>(qs + r * S + d) = detail::pack2<BF>(a, b);
  }
  __syncthreads();
  // A fragment of k-step ks: matrices (rows 0-7 | 8-15) x (dims 16 ks + 0-7 | + 8-15).
  const uint16_t* q_lane = qs + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * S + (lane >> 4) * 8;
  uint32_t qa[kQRegs ? KS : 1][4];
  if constexpr (kQRegs) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) ldmatrix_x4(qa[ks], q_lane + 16 * ks);
  }

  // This thread's rows: g and g + 8 of the warp's 16.
  const int64_t wpos = first_pos + 16 * warp;  // the warp's first row's position
  const int64_t rpos0 = wpos + g, rpos1 = rpos0 + 8;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[DB][4];
#pragma unroll
  for (int i = 0; i < DB; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

  for (int t = t_lo; t < t_hi; ++t) {
    const int64_t t0 = k_begin + static_cast<int64_t>(t) * KT;
    if (t + 1 < t_hi) {
      load_tile(t0 + KT, (t + 1) & 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile t is in its buffer for every warp
    // Keys entirely after the warp's last row, or entirely before its first row's window: nothing to do.
    const bool after = t0 > wpos + 15 - p.shift;
    const bool before = p.window > 0 && t0 + KT - 1 <= wpos - p.window;
    if (!after && !before && 16 * warp < rows) {
      const uint16_t* kb = kvs + 2 * (t & 1) * KT * S;
      const uint16_t* vb = kb + KT * S;
      float s[NB][4];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
      // B fragments of key block nb for k-steps ks, ks + 1: matrices (keys 8 nb + 0-7) x (dims
      // 16 ks + 0-7, + 8-15, + 16-23, + 24-31).
      const uint16_t* k_lane = kb + (lane & 7) * S + (lane >> 3) * 8;
#pragma unroll
      for (int ks = 0; ks < KS; ks += 2) {
        uint32_t a0[4], a1[4];
        if constexpr (kQRegs) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a0[i] = qa[ks][i], a1[i] = qa[ks + 1][i];
        } else {
          ldmatrix_x4(a0, q_lane + 16 * ks);
          ldmatrix_x4(a1, q_lane + 16 * (ks + 1));
        }
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          uint32_t b[4];
          ldmatrix_x4(b, k_lane + 8 * nb * S + 16 * ks);
          detail::mma<BF>(s[nb], a0[0], a0[1], a0[2], a0[3], b[0], b[1]);
          detail::mma<BF>(s[nb], a1[0], a1[1], a1[2], a1[3], b[2], b[3]);
        }
      }
      // Masks, where some key of the tile is past a row, before its window or not held.
      const bool partial =
          t0 + KT > k_end || t0 + KT - 1 > wpos - p.shift || (p.window > 0 && t0 <= wpos + 15 - p.window);
      if (partial) {
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int64_t key = t0 + 8 * nb + 2 * c + (e & 1), rp = e < 2 ? rpos0 : rpos1;
            if (!sees(p, rp, key, k_end)) s[nb][e] = -INFINITY;
          }
      }
      // Online softmax, rows g (elements 0, 1) and g + 8 (2, 3).
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        mx[0] = fmaxf(mx[0], fmaxf(s[nb][0], s[nb][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[nb][2], s[nb][3]));
      }
      float alpha[2], mu[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float mn = fmaxf(m[r], mx[r]);
        mu[r] = mn == -INFINITY ? 0.0f : mn;  // no key seen yet: every weight below is 0, not NaN
        alpha[r] = exp2f(m[r] - mu[r]);
        m[r] = mn;
      }
      float sum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[nb][e] = exp2f(s[nb][e] - mu[e >> 1]);
          sum[e >> 1] += s[nb][e];
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + sum[r];
#pragma unroll
      for (int i = 0; i < DB; ++i) {
        o[i][0] *= alpha[0];
        o[i][1] *= alpha[0];
        o[i][2] *= alpha[1];
        o[i][3] *= alpha[1];
      }
      // O += P V over k-steps of 16 keys (key blocks 2 kk, 2 kk + 1). V's B fragments for dim
      // blocks db, db + 1: matrices (keys 16 kk + 0-7 | + 8-15) x (dims 8 db + 0-7 | 8 (db + 1) + 0-7),
      // transposed.
      const uint16_t* v_lane = vb + ((lane & 7) + ((lane >> 3) & 1) * 8) * S + (lane >> 4) * 8;
#pragma unroll
      for (int kk = 0; kk < NB / 2; ++kk) {
        const uint32_t a[4] = {detail::pack2<BF>(s[2 * kk][0], s[2 * kk][1]), detail::pack2<BF>(s[2 * kk][2], s[2 * kk][3]),
                               detail::pack2<BF>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               detail::pack2<BF>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int db = 0; db < DB; db += 2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_lane + 16 * kk * S + 8 * db);
          detail::mma<BF>(o[db], a[0], a[1], a[2], a[3], b[0], b[1]);
          detail::mma<BF>(o[db + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with buffer t & 1 before tile t + 2 is loaded into it
  }

  // The rows' sums over the 4 lanes that share them, then the normalised outputs.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  const bool split = p.splits > 1;
  const int64_t split_rows = static_cast<int64_t>(p.n_q) * p.n_q_heads;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = 16 * warp + g + 8 * r;
    if (row >= rows) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    const int64_t at = static_cast<int64_t>(q0 + row) * p.n_q_heads + h;  // (query, head)
    float* lse_out = split ? p.split_lse + blockIdx.z * split_rows : p.lse;
    if (lse_out && c == 0)  // m is in the log2 domain
      lse_out[at] = l[r] > 0.0f ? (m[r] + log2f(l[r])) * 0.6931471805599453f : -INFINITY;
    float* orow = (split ? p.split_o + (blockIdx.z * split_rows + at) * D
                         : p.out + static_cast<int64_t>(q0 + row) * p.out_stride + static_cast<int64_t>(h) * D) +
                  2 * c;
#pragma unroll
    for (int i = 0; i < DB; ++i) {
      orow[8 * i] = o[i][2 * r] * inv;
      orow[8 * i + 1] = o[i][2 * r + 1] * inv;
    }
  }
}

// The splits of a row combined as merge_attention combines parts: one warp per (query, head),
// the largest log-sum-exp first so that no weight overflows; a row no split saw gives 0 and -inf.
template <int D>
__global__ void merge_splits_kernel(const __grid_constant__ Params p) {
  const int64_t rows = static_cast<int64_t>(p.n_q) * p.n_q_heads;
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  float mx = -INFINITY;
  for (int z = 0; z < p.splits; ++z) mx = fmaxf(mx, p.split_lse[z * rows + r]);
  float acc[D / 32];
#pragma unroll
  for (int i = 0; i < D / 32; ++i) acc[i] = 0.0f;
  float sum = 0.0f;
  if (mx != -INFINITY) {
    for (int z = 0; z < p.splits; ++z) {
      const float lz = p.split_lse[z * rows + r];
      if (lz == -INFINITY) continue;
      const float w = expf(lz - mx);
      sum += w;
      const float* oz = p.split_o + (z * rows + r) * D;
#pragma unroll
      for (int i = 0; i < D / 32; ++i) acc[i] = fmaf(w, oz[lane + 32 * i], acc[i]);
    }
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  const int64_t qi = r / p.n_q_heads;
  const int h = static_cast<int>(r % p.n_q_heads);
  float* orow = p.out + qi * p.out_stride + static_cast<int64_t>(h) * D;
#pragma unroll
  for (int i = 0; i < D / 32; ++i) orow[lane + 32 * i] = acc[i] * inv;
  if (p.lse && lane == 0) p.lse[r] = sum > 0.0f ? mx + logf(sum) : -INFINITY;
}

// Raises kernel K's dynamic shared memory limit to Smem bytes (once per kernel) and returns how
// many of its CTAs of `Threads` threads an SM holds at once.
template <auto K, size_t Smem, int Threads>
int resident_ctas() {
  static const int n = [] {
    TQKV_CUDA_CHECK(cudaFuncSetAttribute(K, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Smem)));
    int ctas = 0;
    TQKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, K, Threads, Smem));
    return ctas > 0 ? ctas : 1;
  }();
  return n;
}

// Launches kernel K on a CTA of `Threads` threads per `Rows` queries and query head (times
// p.splits), with `Smem` bytes of dynamic shared memory.
template <auto K, size_t Smem, int Rows, int Threads>
void launch_kernel(const Params& p, cudaStream_t stream) {
  (void)resident_ctas<K, Smem, Threads>();  // the shared-memory limit
  const dim3 grid((p.n_q + Rows - 1) / Rows, p.n_q_heads, p.splits > 1 ? p.splits : 1);
  K<<<grid, Threads, Smem, stream>>>(p);
  detail::check_launch();
}

template <int D, bool BF, int W>
void launch_mma(const Params& p, cudaStream_t stream) {
  launch_kernel<prefill_mma_kernel<D, BF, W>, mma_smem_bytes<D, W>(), 16 * W, 32 * W>(p, stream);
  if (p.splits > 1) {
    const size_t threads = static_cast<size_t>(p.n_q) * p.n_q_heads * 32;
    merge_splits_kernel<D><<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(p);
    detail::check_launch();
  }
}

template <int D, typename KV>
void launch(const Params& p, cudaStream_t stream) {
  launch_kernel<prefill_kernel<D, KV>, smem_bytes<D>(), kRows, kThreads>(p, stream);
}

// The tensor-core kernel reads K and V in 16-byte pieces: rows of d bf16 start 16-byte aligned
// when the base pointers are.
bool mma_kernel_fits(const PrefillArgs& a) {
  if (a.kv_dtype == DType::F32) return false;
  if ((reinterpret_cast<uintptr_t>(a.k) | reinterpret_cast<uintptr_t>(a.v)) % 16 != 0) return false;
  return env_choice("TQKV_PREFILL_KERNEL") != "scalar";
}

// The tensor-core kernel's warps a CTA: kMmaWarps, or TQKV_PREFILL_WARPS (4 or 8).
int mma_warps() {
  const std::optional<std::string> w = env_choice_if_set("TQKV_PREFILL_WARPS");
  return w ? std::stoi(*w) : kMmaWarps;
}

// A split of keys keeps at least this many tiles of the longest CTA (fewer: the merge and the
// prologue outweigh the gain), and there are at most kMaxSplits of them.
constexpr int kMinSplitTiles = 4;
constexpr int kMaxSplits = 16;

// How many splits the tensor-core kernel at head dim D would take for `a` (1: unsplit) before
// the workspace is considered: an explicit PrefillArgs::splits, else as many as keep the grid
// within one wave of resident CTAs, each split keeping kMinSplitTiles tiles of the longest CTA
// (the last one: its queries see the most keys), capped by TQKV_PREFILL_SPLITS.
template <int D, bool BF, int W>
int wanted_splits(const PrefillArgs& a) {
  constexpr int kMmaRows = 16 * W;
  if (a.splits > 0) return a.splits;
  const int cap = static_cast<int>(env_count("TQKV_PREFILL_SPLITS", kMaxSplits));
  if (cap <= 1) return 1;
  int dev = 0, sms = 0;
  TQKV_CUDA_CHECK(cudaGetDevice(&dev));
  TQKV_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int slots = sms * resident_ctas<prefill_mma_kernel<D, BF, W>, mma_smem_bytes<D, W>(), 32 * W>();
  const int64_t blocks = (a.n_q + kMmaRows - 1) / kMmaRows, ctas = blocks * a.n_q_heads;
  if (2 * ctas > slots) return 1;
  const int64_t first_pos = a.pos0 + (blocks - 1) * kMmaRows, last_pos = a.pos0 + a.n_q - 1;
  const int64_t k_end = std::min<int64_t>(last_pos + 1 - a.shift, a.n_kv);
  const int64_t k_begin = std::max<int64_t>(a.kv_start, a.window > 0 ? first_pos - a.window + 1 : 0);
  const int64_t tiles = k_end > k_begin ? (k_end - k_begin + mma_tile_keys<D>() - 1) / mma_tile_keys<D>() : 0;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({cap, slots / ctas, tiles / kMinSplitTiles})));
}

size_t split_bytes(const PrefillArgs& a, int splits) {
  return static_cast<size_t>(splits) * a.n_q * a.n_q_heads * (a.head_dim + 1) * sizeof(float);
}

// f(std::integral_constant<int, D>) for the head dim D.
template <typename F>
void by_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
    default: detail::throw_arg("prefill_attention: head_dim must be 64, 128 or 256");
  }
}

// f(D, BF, W) as integral constants: the head dim, bf16 (else f16) K/V, the warps a CTA.
template <typename F>
void by_mma_kernel(const PrefillArgs& a, int warps, F&& f) {
  by_head_dim(a.head_dim, [&](auto d) {
    using BT = std::true_type;
    using BFa = std::false_type;
    using W4 = std::integral_constant<int, 4>;
    using W8 = std::integral_constant<int, 8>;
    const bool bf = a.kv_dtype == DType::BF16;
    if (bf && warps == 8) f(d, BT{}, W8{});
    else if (bf) f(d, BT{}, W4{});
    else if (warps == 8) f(d, BFa{}, W8{});
    else f(d, BFa{}, W4{});
  });
}

// The splits the call will take: those wanted, as many as its workspace holds.
int split_count(const PrefillArgs& a) {
  if (!mma_kernel_fits(a) || a.n_q <= 0) return 1;
  int n = 1;
  by_mma_kernel(a, mma_warps(), [&](auto d, auto bf, auto w) {
    n = wanted_splits<decltype(d)::value, decltype(bf)::value, decltype(w)::value>(a);
  });
  return n;
}

void check_splits(const PrefillArgs& a) {
  if (a.splits < 0 || a.splits > 64) detail::throw_arg("prefill_attention: splits must be 0 (automatic) to 64");
}

}  // namespace

size_t prefill_workspace_bytes(const PrefillArgs& a) {
  check_splits(a);
  const int n = split_count(a);
  return n > 1 ? split_bytes(a, n) : 0;
}

void prefill_attention(const PrefillArgs& a, cudaStream_t stream) {
  if (a.n_q <= 0) return;
  check_splits(a);
  if (!a.q || !a.k || !a.v || !a.out) detail::throw_arg("prefill_attention: null argument");
  if (a.n_kv_heads <= 0 || a.n_q_heads <= 0 || a.n_q_heads % a.n_kv_heads)
    detail::throw_arg("prefill_attention: n_q_heads must be a positive multiple of n_kv_heads");
  if (a.pos0 < 0 || a.kv_start < 0 || a.shift < 0) detail::throw_arg("prefill_attention: negative position or shift");
  if (a.part) {
    if (a.n_kv < a.kv_start) detail::throw_arg("prefill_attention: n_kv before kv_start");
  } else {
    if (a.pos0 + a.n_q > a.n_kv) detail::throw_arg("prefill_attention: the keys end before the last query");
    if (a.kv_start > 0 && (a.window <= 0 || a.pos0 - a.window + 1 < a.kv_start))
      detail::throw_arg("prefill_attention: kv_start leaves out keys inside a query's window");
  }
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
  p.shift = a.shift;
  p.lse = a.lse;
  p.scale = a.scale != 0 ? a.scale : 1.0f / std::sqrt(static_cast<float>(a.head_dim));
  const bool mma = mma_kernel_fits(a);
  // Splits: as many as wanted and the workspace holds (its first bytes the outputs, then the lses).
  const size_t held = a.workspace ? a.workspace_bytes / split_bytes(a, 1) : 1;
  p.splits = mma ? static_cast<int>(std::max<size_t>(1, std::min<size_t>(split_count(a), held))) : 1;
  if (p.splits > 1) {
    p.split_o = static_cast<float*>(a.workspace);
    p.split_lse = p.split_o + static_cast<size_t>(p.splits) * a.n_q * a.n_q_heads * a.head_dim;
  }
  if (mma) {
    by_mma_kernel(a, mma_warps(), [&](auto d, auto bf, auto w) {
      launch_mma<decltype(d)::value, decltype(bf)::value, decltype(w)::value>(p, stream);
    });
    return;
  }
  by_head_dim(a.head_dim, [&](auto d) {
    constexpr int D = decltype(d)::value;
    if (a.kv_dtype == DType::BF16) launch<D, __nv_bfloat16>(p, stream);
    else if (a.kv_dtype == DType::F16) launch<D, __half>(p, stream);
    else launch<D, float>(p, stream);
  });
}

}  // namespace tqkv::cuda
