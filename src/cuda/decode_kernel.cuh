// Split-KV decode attention on the compressed paged cache (page layout), tensor-core based.
//
// One warp owns one split (a contiguous range of 16-token tiles) of one (sequence, kv head)
// and serves all `group` query heads of that kv head, so each page is read once per kv head.
// Compressed tiles stream through a per-warp ring of shared-memory stages filled by cp.async
// (the 16-bit formats load straight into registers). Per tile:
//   S^T = K Q^T  with mma.m16n8k16 (M = 16 tokens, N = 8 query heads, K = 16 dims); keys are
//              decoded from their codes straight into the A fragment (thread (g, c) owns tokens
//              g and 8+g and a contiguous d/4-dim chunk c of each, so a tile is read with wide
//              loads); the query is the B fragment, held in registers for the whole split;
//   online softmax in fp32 (log2 domain), per query head over the lanes that share c;
//   O^T += V^T P^T  (M = 16 dims, N = query heads, K = 16 tokens); P^T comes from the S^T
//              accumulator through two movmatrix transposes, and the value codes are decoded
//              into the A fragment (thread (g, c) owns tokens 2c, 2c+1, 2c+8, 2c+9 and a
//              d/8-dim chunk g).
// Dims are permuted consistently between Q and K (and between V rows and the output), which
// is what lets every thread read contiguous code bytes. Per-token scales (MSE norms, uniform
// scale) are folded into the scores / into P; the uniform zero point adds sum_t p_t z_t.
// Code -> value lookups use a shared-memory table replicated per lane (entry e of lane l at
// word e*32 + l), so a warp's 32 random lookups never conflict on a bank; uniform 2-4-bit value
// codes need none (they are ORed into fp16 mantissas, value_frag).
// The merge is part of the same launch: the warps of a CTA combine their partial outputs by
// log-sum-exp in shared memory; where a (sequence, kv head) has several CTAs, they either form a
// thread-block cluster and merge through distributed shared memory (small grids: batch 1), or
// each writes its partial to the workspace and the last to finish (a counter per (sequence, kv
// head), reset by that CTA) merges them. Either way the grid is fixed by the plan.
//
// This header holds the kernel template, instantiated for the pairs and head dims that
// src/cuda/decode_pairs.cmake generates (from the recipes and the named formats); decode.cu plans
// and launches.
#pragma once
#include <cooperative_groups.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include "decode.cuh"
#include "mma.cuh"
#include "tqkv/options.h"

namespace tqkv::cuda::detail {

// Codec traits. A key kind KK and a value kind VK are (codec class) * 32 + (bits per element),
// so one template parameter names both and the code width is a compile-time constant.
enum KClass : int { KC_MSE, KC_FP8, KC_F16, KC_BF16 };
enum VClass : int { VC_MSE, VC_UNI, VC_FP8, VC_F16, VC_BF16 };
__host__ __device__ constexpr int kind(int cls, int bits) { return cls * 32 + bits; }
__host__ __device__ constexpr int kclass(int kk) { return kk >> 5; }
__host__ __device__ constexpr int vclass(int vk) { return vk >> 5; }
__host__ __device__ constexpr int kbits_of(int kk) { return kk & 31; }
__host__ __device__ constexpr int vbits_of(int vk) { return vk & 31; }
constexpr int K_FP8 = kind(KC_FP8, 8), K_F16 = kind(KC_F16, 16), K_BF16 = kind(KC_BF16, 16);
constexpr int V_FP8 = kind(VC_FP8, 8), V_F16 = kind(VC_F16, 16), V_BF16 = kind(VC_BF16, 16);
constexpr int kmse(int bits) { return kind(KC_MSE, bits); }
constexpr int vmse(int bits) { return kind(VC_MSE, bits); }
constexpr int vuni(int bits) { return kind(VC_UNI, bits); }
constexpr int V_U4 = vuni(4);  // the nibble fast path (value_frag)
__host__ __device__ constexpr bool is_kmse(int kk) { return kclass(kk) == KC_MSE; }
__host__ __device__ constexpr bool is_uniform(int vk) { return vclass(vk) == VC_UNI; }
// Uniform codes of 2-4 bits go straight into fp16 mantissas (value_frag), no table.
__host__ __device__ constexpr bool is_direct(int vk) { return is_uniform(vk) && vbits_of(vk) >= 2 && vbits_of(vk) <= 4; }
__host__ __device__ constexpr bool is_vmse(int vk) { return vclass(vk) == VC_MSE; }
// Code -> fp16 lookups: codes of at most 4 bits are looked up in pairs (one table entry holds
// the half2 of two neighbouring codes: 2^(2b) entries), wider codes one at a time (2^b entries).
__host__ __device__ constexpr bool pair_lut(int bits) { return bits <= 4; }
__host__ __device__ constexpr int lut_entries(int bits) { return pair_lut(bits) ? 1 << (2 * bits) : 1 << bits; }
__host__ __device__ constexpr int klut_entries(int kk) { return is_kmse(kk) ? lut_entries(kbits_of(kk)) : 0; }
__host__ __device__ constexpr int vlut_entries(int vk) {
  return is_direct(vk) ? 0 : (is_vmse(vk) || is_uniform(vk)) ? lut_entries(vbits_of(vk)) : 0;
}

// Variants of the kernel (decode_kernel's VA, a set of these bits); va_default is what make_kernel
// picks unless TQKV_DECODE_VALUE_LUT / TQKV_DECODE_KEY_LUT say otherwise on the host (read at every
// pick, so a benchmark runs before and after in one process).
//  kVaValueSmem: MSE values of 2 or 3 bits looked up in the shared-memory pair table, else in
//    registers (value_frag_reg: the levels' low and high bytes are byte tables PRMT indexes by
//    code). The table is the default: on the H200 (2026-12-02, docs/journal/RESULTS-journal.md)
//    registers were 0-2% slower for 2-bit values despite fewer instructions, and 12-20% slower for
//    3-bit values. TQKV_DECODE_VALUE_LUT=smem|reg.
//    (The 256-byte key entries below were 4-8% faster at d = 64 there, so they are the default.)
//  kVaKey256: 4-bit MSE keys at d = 64 with table entries 256 bytes apart (32 KiB more shared
//    memory, a cost d = 64's small stages can afford), so a lookup's address is one PRMT (the
//    code byte over the lane's offset) instead of a shift and a LOP3. TQKV_DECODE_KEY_LUT=128|256.
constexpr int kVaValueSmem = 1, kVaKey256 = 2;
__host__ __device__ constexpr bool vreg_lut(int vk) { return is_vmse(vk) && vbits_of(vk) >= 2 && vbits_of(vk) <= 3; }
__host__ __device__ constexpr bool key256_ok(int d, int kk) { return d == 64 && is_kmse(kk) && kbits_of(kk) == 4; }
__host__ __device__ constexpr int va_default(int d, int kk, int /*vk: every value width uses the table*/) {
  return kVaValueSmem | (key256_ok(d, kk) ? kVaKey256 : 0);
}

// MSE keys and values of the same width share one codebook (CacheCodec fills both from
// get_codebook(law, head_dim, bits); run_decode checks the levels agree), so their lookup tables
// are one: a second copy costs shared memory the ring needs (tq-k4v4: 32 KiB, two stages of four
// at d = 128).
__host__ __device__ constexpr bool shared_lut(int kk, int vk) {
  return is_kmse(kk) && is_vmse(vk) && kbits_of(kk) == vbits_of(vk);
}

// What the decode kernel needs of CodecTables (1 KiB of kernel parameters, not 4).
struct DecodeTables {
  uint16_t k_lv[CodecTables::kMaxLevels];  // fp16 bits of the key / value levels
  uint16_t v_lv[CodecTables::kMaxLevels];
  uint32_t sign_bits[8];
  float rot_scale;
};

struct DecodeParams {
  const uint8_t* pages;
  PageGeometry geo;  // page_geometry.h: where each field of a (token, kv head) lives
  int64_t page_bytes;
  int block_size;
  int tpp_log2;  // log2(tiles per page) = log2(block_size / 16)
  int n_kv_heads;
  int slot_bytes;
  const void* q;
  DType q_dtype;
  const int32_t* block_tables;
  int bt_stride;
  const int32_t* seq_lens;
  int n_q_heads;
  int group;
  int num_splits;
  int max_seq_len;  // the plan's: fixes the tiles per split
  float scale_log2;  // softmax scale * log2(e)
  bool keys_rotated;
  bool values_rotated;
  float* o_part;        // [batch, n_kv_heads, ctas, group, D]: each CTA's normalised partial output
  float* lse_part;      // [batch, n_kv_heads, ctas, group]: its log2-sum-exp
  uint32_t* counters;   // [batch, n_kv_heads]: CTAs done (low 16 bits) under kCounterTag
  void* out;            // [batch, n_q_heads, D]
  DType out_dtype;
  float* lse;           // optional [batch, n_q_heads], natural log
  bool cluster;  // the CTAs of a (sequence, kv head) form a thread-block cluster (merge in DSMEM)
  // Key-range cuts (AttentionParams): keys [max(min_key_pos, len - window if window > 0),
  // len - exclude_recent); ranged = false: [0, len), and the page ids are requested before len.
  bool ranged;
  // With cuts: the splits share the tiles of [lo, hi) evenly (it is known before any page id is
  // read), not the plan's max_seq_len (a short sequence in a large cache then keeps every split
  // busy instead of loading the first few with the whole range).
  bool spread;
  int min_key_pos, window, exclude_recent;
  DecodeTables tab;
};


// n-bit field at bit `off` of a little-endian word array (offsets are compile-time after unrolling).
template <int NW>
__device__ __forceinline__ uint32_t field(const uint32_t (&w)[NW], int off, int n) {
  const int i = off >> 5, sh = off & 31;
  uint32_t v = w[i] >> sh;
  if (sh + n > 32) v |= w[i + 1] << (32 - sh);
  return v & ((1u << n) - 1u);
}

// The same field times 128 (the byte stride of one entry of a lane-replicated table): ORed with
// lane * 4 it is the entry's shared-memory byte offset, so a lookup costs a shift, a LOP3, an LDS.
template <int NW>
__device__ __forceinline__ uint32_t field_x128(const uint32_t (&w)[NW], int off, int n) {
  const int i = off >> 5, sh = off & 31;
  uint32_t v;
  if (sh + n <= 32) v = sh >= 7 ? w[i] >> (sh - 7) : w[i] << (7 - sh);
  else v = __funnelshift_r(w[i], w[i + 1], sh - 7);  // a straddling field has sh > 32 - n >= 24
  return v & (((1u << n) - 1u) << 7);
}

__device__ __forceinline__ uint32_t lut_ld(const char* base, uint32_t x128, uint32_t lane4) {
  return *reinterpret_cast<const uint32_t*>(base + (x128 | lane4));
}

// The lookup of byte K of `word` in a lane-replicated table whose entries are 256 bytes apart
// (kVaKey256): one PRMT puts the byte over the lane's offset (lane4 < 256, so its byte 1 is 0).
template <int K>
__device__ __forceinline__ uint32_t lut_ld256(const char* base, uint32_t word, uint32_t lane4) {
  return *reinterpret_cast<const uint32_t*>(base + __byte_perm(word, lane4, 4 | K << 4 | 5 << 8 | 5 << 12));
}

template <bool G, typename V>
__device__ __forceinline__ V ld(const V* p) {
  if constexpr (G) return __ldg(p);
  else return *p;
}

// Reads BYTES bytes at p (aligned to BYTES' lowest set bit, at most 16) into words; G: global
// memory through the read-only path, else shared memory.
template <int BYTES, bool G = true>
__device__ __forceinline__ void load_chunk(uint32_t (&w)[(BYTES + 3) / 4], const uint8_t* p) {
  constexpr int A = (BYTES & -BYTES) >= 16 ? 16 : (BYTES & -BYTES);
  if constexpr (A == 16) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) {
      const uint4 v = ld<G>(reinterpret_cast<const uint4*>(p) + i);
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (A == 8) {
#pragma unroll
    for (int i = 0; i < BYTES / 8; ++i) {
      const uint2 v = ld<G>(reinterpret_cast<const uint2*>(p) + i);
      w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
  } else if constexpr (A == 4) {
#pragma unroll
    for (int i = 0; i < BYTES / 4; ++i) w[i] = ld<G>(reinterpret_cast<const uint32_t*>(p) + i);
  } else if constexpr (A == 2) {
#pragma unroll
    for (int i = 0; i < (BYTES + 3) / 4; ++i) w[i] = 0;
#pragma unroll
    for (int i = 0; i < BYTES / 2; ++i)
      w[i / 2] |= static_cast<uint32_t>(ld<G>(reinterpret_cast<const unsigned short*>(p) + i)) << (16 * (i & 1));
  } else {
#pragma unroll
    for (int i = 0; i < (BYTES + 3) / 4; ++i) w[i] = 0;
#pragma unroll
    for (int i = 0; i < BYTES; ++i) w[i / 4] |= static_cast<uint32_t>(ld<G>(p + i)) << (8 * (i & 3));
  }
}

__device__ __forceinline__ uint32_t fp8x2_to_h2(uint32_t two) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(r.x) | (static_cast<uint32_t>(r.y) << 16);
}

// Shared-memory wavefronts a warp needs to read its value chunks of one tile from a stage whose
// value rows are `row` bytes apart (read_stage_at: thread (g, c) reads VCH bytes at column g * VCH
// of rows 2c, 2c+1, 2c+8, 2c+9), counting only chunks that are not word multiples (the words
// covering each chunk, one load per word index); 0 for the others.
__host__ __device__ constexpr int value_read_wavefronts(int row, int vch) {
  if (vch % 4 == 0) return 0;
  const int a = (vch & -vch) < 4 ? (vch & -vch) : 4, nx = (vch + (4 - a) + 3) / 4;  // as load_chunk
  int total = 0;
  for (int i = 0; i < 4; ++i) {
    const int r0 = (i & 1) + (i >> 1) * 8;
    for (int k = 0; k < nx; ++k) {
      int words[32] = {};
      for (int l = 0; l < 32; ++l) words[l] = ((2 * (l & 3) + r0) * row + (l >> 2) * vch) / 4 + k;
      int worst = 0;
      for (int j = 0; j < 32; ++j) {  // distinct words on word j's bank (the same word is one broadcast)
        int n = 0;
        for (int l = 0; l < 32; ++l) {
          bool first = words[l] % 32 == words[j] % 32;
          for (int e = 0; e < l && first; ++e) first = words[e] != words[l];
          n += first ? 1 : 0;
        }
        worst = n > worst ? n : worst;
      }
      total += worst;
    }
  }
  return total;
}

// The padded value-row stride of a stage: VCB + 16 (16-byte pieces) or + 8, as before, unless a
// wider padding (in steps of the copy piece PV, up to 8 more) reads the chunks in fewer
// wavefronts (3-bit values: rows of 48 + 16 bytes put rows 2c of the four c on one bank, a
// 4-way conflict; 80 bytes halve it; at d = 64, 24 + 24 bytes remove it).
__host__ __device__ constexpr int value_row_bytes(int vcb, int pv, int vch) {
  const int base = vcb + (vcb % 16 == 0 ? 16 : 8);
  int best = base, best_wf = value_read_wavefronts(base, vch);
  for (int row = base + pv; row <= base + 8 * pv; row += pv) {
    const int wf = value_read_wavefronts(row, vch);
    if (wf < best_wf) best = row, best_wf = wf;
  }
  return best;
}

// W: warps per CTA (0: the format's own choice; the fused decode gives every part the middle's).
// VA: the variant (kVaValueSmem, kVaKey256).
template <int D, int KK, int VK, int W = 0, int VA = va_default(D, KK, VK)>
struct Traits {
  static constexpr bool KBF = KK == K_BF16;  // S = K Q^T in bf16 (else fp16)
  static constexpr bool VBF = VK == V_BF16;  // O = P V in bf16
  static constexpr int KCB = D * kbits_of(KK) / 8;  // key code bytes per token
  static constexpr int VCB = D * vbits_of(VK) / 8;
  static constexpr int KMB = is_kmse(KK) ? 2 : 0;
  static constexpr int KCH = KCB / 4;  // bytes of one thread's key chunk (d/4 dims)
  static constexpr int VCH = VCB / 8;  // bytes of one thread's value chunk (d/8 dims)
  static constexpr int KW = (KCH + 3) / 4;
  static constexpr int VW = (VCH + 3) / 4;
  static constexpr bool K256 = (VA & kVaKey256) && key256_ok(D, KK);  // key table entries 256 bytes apart
  static constexpr int KLUT = klut_entries(KK) * (K256 ? 64 : 32);
  static constexpr int VLUT = shared_lut(KK, VK) ? 0 : vlut_entries(VK) * 32;  // 0: values use the key table
  static constexpr int LUT_BYTES = (KLUT + VLUT) * 4 + kMaxGroup * D * 4;  // tables + rotated queries
  // Compressed formats stream tiles through a per-warp ring of shared-memory stages filled with
  // cp.async, so many tiles are in flight without holding registers; the 16-bit formats (large
  // tiles) load straight into registers instead.
  static constexpr bool ASYNC = !(KK == K_F16 || KK == K_BF16);
  static constexpr int WARPS = W ? W : (ASYNC && D <= 128) ? 8 : 4;
  // Two CTAs an SM for every compressed format. At d = 256 a 220 KB budget (more ring stages)
  // left formats with 4- or 8-bit keys (32 KB pair tables, larger stages) one CTA of 4 warps an
  // SM: on the H200 two CTAs read the cache 9-22% faster at batch 64 x 32K, and +4-9% slower only
  // where the grid leaves each SM's second slot empty (batch 16 x 4K).
  static constexpr int MIN_BLOCKS = ASYNC ? 2 : 1;
  static constexpr int KPL = 16 * KCB;                              // key plane of a tile
  static constexpr int PV = (VCB & -VCB) >= 16 ? 16 : (VCB & -VCB);  // cp.async piece of a value row
  static constexpr int VROW = value_row_bytes(VCB, PV, VCH);      // padded: few bank conflicts
  static constexpr int VPL = 16 * VROW;
  // issue_page16 applies: 16-byte value pieces. Where every 32 pieces hold whole rows, a lane's
  // pieces lie at compile-time distances from its first one; otherwise (3-bit values: rows of 3
  // pieces) the lane keeps the stage offset of each of its NVK pieces.
  // Also 8-byte value pieces (3- and 5-bit values at d = 64: rows of 3 or 5 pieces), which
  // otherwise take issue_tile's per-lane divisions and 64-bit adds (~40 instructions a tile).
  static constexpr bool PAGE16 = PV >= 8;
  static constexpr int VPR = PAGE16 && VCB >= PV ? VCB / PV : 1;  // value pieces per row
  static constexpr int NVK = 32 % VPR == 0 ? 1 : (16 * VPR + 31) / 32;
  static constexpr int KM_OFF = 0, VS_OFF = KMB ? 32 : 0, VZ_OFF = VS_OFF + 32;
  static constexpr int M_PLANES = (KMB ? 1 : 0) + ((is_uniform(VK) || is_vmse(VK)) ? 1 : 0) + (is_uniform(VK) ? 1 : 0);
  static constexpr int STAGE = KPL + VPL + 96;
  static constexpr int BUDGET = 113 * 1024 - LUT_BYTES;
  static constexpr int NST_RAW = BUDGET / (WARPS * STAGE);
  static constexpr int NST = !ASYNC ? 0 : NST_RAW < 2 ? 2 : NST_RAW > 6 ? 6 : NST_RAW;
  // Epilogue (after the tile loop, over the queries and the ring): every warp's unnormalised
  // output, the merged output, per-(warp, head) max and sum, per-CTA weights of the cross-CTA merge.
  static constexpr int EPI_BYTES =
      (WARPS * kMaxGroup * D + kMaxGroup * D + WARPS * kMaxGroup * 2 + 2 * kMaxGroup + (kMaxSplits / WARPS) * kMaxGroup + 4) * 4;
  static constexpr int SMEM_LOOP = LUT_BYTES + WARPS * NST * STAGE;
  static constexpr int SMEM_EPI = (KLUT + VLUT) * 4 + EPI_BYTES;
  static constexpr int SMEM = SMEM_LOOP > SMEM_EPI ? SMEM_LOOP : SMEM_EPI;
  static_assert(KM_OFF == 0 && VZ_OFF > VS_OFF && PV > 0 && VROW % PV == 0 && M_PLANES <= 3, "stage layout");
};

template <int D, int KK, int VK>
struct Raw {
  uint32_t k[2][Traits<D, KK, VK>::KW];  // tokens g, 8+g
  uint32_t v[4][Traits<D, KK, VK>::VW];  // tokens 2c, 2c+1, 2c+8, 2c+9
  uint32_t kn[2];                        // fp16 key norms of tokens g, 8+g (low 16 bits)
  uint32_t vs[2];                        // fp16 value scale or norm, same tokens
  uint32_t vz[2];                        // fp16 value zero, same tokens
};

// Per-thread byte offsets inside one page section, fixed for the whole kernel.
struct ThreadOffsets {
  int k[2];   // key chunks of tokens g, 8+g
  int v[4];   // value chunks of tokens 2c, 2c+1, 2c+8, 2c+9
  int km[2];  // key norms of tokens g, 8+g
  int vm[2];  // value scale/norm, same tokens
  int vz[2];  // value zero, same tokens
};

// Loads one 16-token tile starting at token `off` of the page section `sec`.
template <int D, int KK, int VK>
__device__ __forceinline__ void load_tile(Raw<D, KK, VK>& r, const uint8_t* sec, int off, const ThreadOffsets& o) {
  using T = Traits<D, KK, VK>;
  const uint8_t* kp = sec + off * T::KCB;
  load_chunk<T::KCH>(r.k[0], kp + o.k[0]);
  load_chunk<T::KCH>(r.k[1], kp + o.k[1]);
  const uint8_t* vp = sec + off * T::VCB;
#pragma unroll
  for (int i = 0; i < 4; ++i) load_chunk<T::VCH>(r.v[i], vp + o.v[i]);
  const uint8_t* mp = sec + off * 2;
  if constexpr (T::KMB) {
    r.kn[0] = __ldg(reinterpret_cast<const unsigned short*>(mp + o.km[0]));
    r.kn[1] = __ldg(reinterpret_cast<const unsigned short*>(mp + o.km[1]));
  }
  if constexpr (is_uniform(VK) || is_vmse(VK)) {
    r.vs[0] = __ldg(reinterpret_cast<const unsigned short*>(mp + o.vm[0]));
    r.vs[1] = __ldg(reinterpret_cast<const unsigned short*>(mp + o.vm[1]));
  }
  if constexpr (is_uniform(VK)) {
    r.vz[0] = __ldg(reinterpret_cast<const unsigned short*>(mp + o.vz[0]));
    r.vz[1] = __ldg(reinterpret_cast<const unsigned short*>(mp + o.vz[1]));
  }
}

template <int N>
__device__ __forceinline__ void cp_async(uint32_t dst, const void* src) {
  if constexpr (N == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src), "n"(N));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Copies one tile (its key plane, padded value rows and metadata) into a ring stage; the warp
// shares the 16-byte pieces. Lane l copies pieces l, l+32, ...: its first piece's offsets are
// computed once (IssueOffsets), the later ones are compile-time deltas, so a tile costs a few
// 64-bit adds and the copies themselves.
struct IssueOffsets {
  int v_src, v_dst;  // this lane's first value piece: offset in the page's value plane / in the stage
  int m_src, m_dst;  // this lane's metadata piece (lanes < 2 * M_PLANES)
};

template <int D, int KK, int VK>
__device__ __forceinline__ IssueOffsets issue_offsets(int lane, int bs) {
  using T = Traits<D, KK, VK>;
  constexpr int PR = T::VCB / T::PV;
  IssueOffsets io;
  io.v_src = (lane / PR) * T::VCB + (lane % PR) * T::PV;
  io.v_dst = T::KPL + (lane / PR) * T::VROW + (lane % PR) * T::PV;
  const int plane = lane >> 1, half = lane & 1;
  io.m_src = bs * (T::KCB + T::VCB) + plane * 2 * bs + 16 * half;
  io.m_dst = T::KPL + T::VPL + 32 * plane + 16 * half;
  return io;
}

template <int D, int KK, int VK>
__device__ __forceinline__ void issue_tile(uint32_t st, const uint8_t* sec, int off, int bs, int lane,
                                           const IssueOffsets& io) {
  using T = Traits<D, KK, VK>;
  constexpr int NK = T::KPL / 16;
  const uint8_t* kp = sec + off * T::KCB + 16 * lane;
  const uint32_t kd = st + 16 * lane;
#pragma unroll
  for (int i0 = 0; i0 < NK; i0 += 32)
    if (i0 + 32 <= NK || i0 + lane < NK) cp_async<16>(kd + 16 * i0, kp + 16 * i0);
  constexpr int PR = T::VCB / T::PV;
  constexpr int NV = 16 * PR;
  if constexpr (32 % PR == 0) {  // piece l + 32k is row r0 + 32k/PR, same column
    const uint8_t* vp = sec + bs * T::KCB + off * T::VCB + io.v_src;
    const uint32_t vd = st + io.v_dst;
#pragma unroll
    for (int i0 = 0; i0 < NV; i0 += 32)
      if (i0 + 32 <= NV || i0 + lane < NV)
        cp_async<T::PV>(vd + (i0 / PR) * T::VROW, vp + (i0 / PR) * T::VCB);
  } else {
    const uint8_t* vp = sec + bs * T::KCB + off * T::VCB;
#pragma unroll
    for (int i0 = 0; i0 < NV; i0 += 32) {
      const int i = i0 + lane;
      if (i < NV) {
        const int r = i / PR, j = i % PR;
        cp_async<T::PV>(st + T::KPL + r * T::VROW + j * T::PV, vp + r * T::VCB + j * T::PV);
      }
    }
  }
  if (lane < 2 * T::M_PLANES) cp_async<16>(st + io.m_dst, sec + off * 2 + io.m_src);
}

// The same copy where a page holds exactly one tile (block size 16) and value rows split into
// 16-byte (or 8-byte) pieces: then every piece of lane l lies at a compile-time offset from `src`
// (the page section + 16 l) and from `dst_k` (the stage + 16 l) or, for values, from the stage + dst_v[0]
// (its first piece's padded offset; rows of 3 pieces: + dst_v[k] for its k-th piece), so a tile
// costs one address computation and the copies.
// 8-byte value pieces: the lane's first one is at `vsrc` from src (KPL - 8 l, a per-lane constant).
template <int D, int KK, int VK>
__device__ __forceinline__ void issue_page16(const uint8_t* src, uint32_t st, const uint32_t (&dst_v)[Traits<D, KK, VK>::NVK],
                                             int lane, int vsrc) {
  using T = Traits<D, KK, VK>;
  static_assert(T::PAGE16, "value pieces of 8 or 16 bytes");
  const uint32_t dst_k = st + 16u * lane;
  constexpr int NK = T::KPL / 16;
#pragma unroll
  for (int i0 = 0; i0 < NK; i0 += 32)
    if (i0 + 32 <= NK || i0 + lane < NK) cp_async<16>(dst_k + 16 * i0, src + 16 * i0);
  constexpr int PR = T::VPR;
  constexpr int NV = 16 * PR;
#pragma unroll
  for (int i0 = 0; i0 < NV; i0 += 32) {
    const uint32_t d = T::NVK == 1 ? st + dst_v[0] + (i0 / PR) * T::VROW : st + dst_v[T::NVK == 1 ? 0 : i0 / 32];
    if (i0 + 32 <= NV || i0 + lane < NV) cp_async<T::PV>(d, src + (T::PV == 16 ? T::KPL : vsrc) + T::PV * i0);
  }
  if (lane < 2 * T::M_PLANES) cp_async<16>(dst_k + T::KPL + T::VPL, src + 16 * (T::KCB + T::VCB));
}

// The per-thread offsets of a tile's fragments in a ring stage (read_stage_at), computed once: a
// thread's chunks lie at the same offsets in every stage, and derived from g, c and the stage
// index the compiler would recompute them (and, for chunks that are not word-aligned, their word
// addresses and funnel shifts) from the lane id every tile (about 30 instructions a tile at
// d = 64). StageReads holds them relative to the shared-memory base, hidden from the compiler
// (an empty asm) so that they stay in registers; a tile then costs one add per chunk group.
struct StageReads {
  uint32_t k, ksh;  // key chunk of token g (token 8+g at + 8 KCB): word-aligned offset, funnel shift
  uint32_t v, vsh;  // value chunk of token 2c (2c+1, 2c+8, 2c+9 at + VROW, 8 VROW, 9 VROW)
  uint32_t m;       // the metadata of token g (8+g at + 16)
};

template <int BYTES>
__host__ __device__ constexpr bool funnel_chunk() {
  constexpr int A = (BYTES & -BYTES) >= 4 ? 4 : (BYTES & -BYTES);
  return A < 4 && BYTES > A;
}

__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm("" : "+r"(x));
  return x;
}

// ring: the warp's ring, as an offset from smem_base.
template <int D, int KK, int VK>
__device__ __forceinline__ StageReads stage_reads(uint32_t ring, int g, int c) {
  using T = Traits<D, KK, VK>;
  const uint32_t k = ring + g * T::KCB + c * T::KCH, v = ring + T::KPL + 2 * c * T::VROW + g * T::VCH;
  StageReads s;
  s.k = opaque(funnel_chunk<T::KCH>() ? k & ~3u : k);
  s.ksh = funnel_chunk<T::KCH>() ? opaque((k & 3u) * 8u) : 0u;
  s.v = opaque(funnel_chunk<T::VCH>() ? v & ~3u : v);
  s.vsh = funnel_chunk<T::VCH>() ? opaque((v & 3u) * 8u) : 0u;
  s.m = opaque(ring + T::KPL + T::VPL + 2 * g);
  return s;
}

// Reads BYTES bytes of shared memory. A chunk that is not word-aligned and takes more than one
// narrow load (3-bit codes: 6 bytes at d = 128, 3 at d = 64) is read as the aligned words that
// cover it (p, 4-byte aligned), funnel-shifted by sh into place: two LDS.32 and two SHF for 6
// bytes instead of three LDS.U16 and their shifts and ORs. The bits above BYTES then hold the
// neighbouring codes; every reader masks its fields. Other chunks: at p, sh unused.
template <int BYTES>
__device__ __forceinline__ void load_chunk_at(uint32_t (&w)[(BYTES + 3) / 4], const uint8_t* p, uint32_t sh) {
  if constexpr (funnel_chunk<BYTES>()) {
    constexpr int A = BYTES & -BYTES, NW = (BYTES + 3) / 4, NX = (BYTES + (4 - A) + 3) / 4;
    const uint32_t* q = reinterpret_cast<const uint32_t*>(p);
    uint32_t x[NX + 1];
#pragma unroll
    for (int i = 0; i < NX; ++i) x[i] = q[i];
    x[NX] = 0u;
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = __funnelshift_r(x[i], x[i + 1], sh);
  } else {
    load_chunk<BYTES, false>(w, p);
  }
}

// Reads this thread's fragments of a tile (the same roles as load_tile) from the stage at byte
// offset `so` from the warp's ring (sb: the shared-memory base).
template <int D, int KK, int VK>
__device__ __forceinline__ void read_stage_at(Raw<D, KK, VK>& r, const uint8_t* sb, uint32_t so, const StageReads& sr) {
  using T = Traits<D, KK, VK>;
  const uint8_t* kp = sb + (sr.k + so);
  load_chunk_at<T::KCH>(r.k[0], kp, sr.ksh);
  load_chunk_at<T::KCH>(r.k[1], kp + 8 * T::KCB, sr.ksh);
  const uint8_t* vp = sb + (sr.v + so);
  constexpr int dv[4] = {0, T::VROW, 8 * T::VROW, 9 * T::VROW};
#pragma unroll
  for (int i = 0; i < 4; ++i) load_chunk_at<T::VCH>(r.v[i], vp + dv[i], sr.vsh);
  const unsigned short* m = reinterpret_cast<const unsigned short*>(sb + (sr.m + so));
  if constexpr (T::KMB) {
    r.kn[0] = m[T::KM_OFF / 2];
    r.kn[1] = m[T::KM_OFF / 2 + 8];
  }
  if constexpr (is_uniform(VK) || is_vmse(VK)) {
    r.vs[0] = m[T::VS_OFF / 2];
    r.vs[1] = m[T::VS_OFF / 2 + 8];
  }
  if constexpr (is_uniform(VK)) {
    r.vz[0] = m[T::VZ_OFF / 2];
    r.vz[1] = m[T::VZ_OFF / 2 + 8];
  }
}

// Key B fragment for k-step s: dims 4s..4s+3 of the thread's chunk.
template <int D, int KK, int VK, bool K256 = false>
__device__ __forceinline__ void key_frag(const uint32_t (&w)[Traits<D, KK, VK>::KW], int s, const char* klut,
                                         uint32_t lane4, uint32_t& b0, uint32_t& b1) {
  if constexpr (K256) {  // 4 bits: the pair fields are bytes 2s and 2s + 1 of the chunk
    if (s & 1) {
      b0 = lut_ld256<2>(klut, w[s >> 1], lane4);
      b1 = lut_ld256<3>(klut, w[s >> 1], lane4);
    } else {
      b0 = lut_ld256<0>(klut, w[s >> 1], lane4);
      b1 = lut_ld256<1>(klut, w[s >> 1], lane4);
    }
  } else if constexpr (is_kmse(KK) && pair_lut(kbits_of(KK))) {  // 4 bits: fields of 8 bits at 16 s, 16 s + 8
    constexpr int B = kbits_of(KK);
    b0 = lut_ld(klut, field_x128(w, 4 * B * s, 2 * B), lane4);
    b1 = lut_ld(klut, field_x128(w, 4 * B * s + 2 * B, 2 * B), lane4);
  } else if constexpr (is_kmse(KK)) {
    constexpr int B = kbits_of(KK);
    b0 = __byte_perm(lut_ld(klut, field_x128(w, 4 * B * s, B), lane4),
                     lut_ld(klut, field_x128(w, 4 * B * s + B, B), lane4), 0x5410);
    b1 = __byte_perm(lut_ld(klut, field_x128(w, 4 * B * s + 2 * B, B), lane4),
                     lut_ld(klut, field_x128(w, 4 * B * s + 3 * B, B), lane4), 0x5410);
  } else if constexpr (KK == K_FP8) {
    b0 = fp8x2_to_h2(w[s]);
    b1 = fp8x2_to_h2(w[s] >> 16);
  } else {
    b0 = w[2 * s];
    b1 = w[2 * s + 1];
  }
}

// Value pair (dims 2m, 2m+1 of the thread's chunk) of one token, as two 16-bit values.
template <int D, int KK, int VK, bool K256 = false>
__device__ __forceinline__ uint32_t value_pair(const uint32_t (&w)[Traits<D, KK, VK>::VW], int m,
                                               const char* vlut, uint32_t lane4) {
  if constexpr (K256 && shared_lut(KK, VK)) {  // 4-bit values in the key table: byte m of the chunk
    switch (m & 3) {
      case 0: return lut_ld256<0>(vlut, w[m >> 2], lane4);
      case 1: return lut_ld256<1>(vlut, w[m >> 2], lane4);
      case 2: return lut_ld256<2>(vlut, w[m >> 2], lane4);
      default: return lut_ld256<3>(vlut, w[m >> 2], lane4);
    }
  } else if constexpr ((is_vmse(VK) || is_uniform(VK)) && pair_lut(vbits_of(VK))) {
    constexpr int B = vbits_of(VK);
    return lut_ld(vlut, field_x128(w, 2 * B * m, 2 * B), lane4);
  } else if constexpr (is_vmse(VK) || is_uniform(VK)) {
    constexpr int B = vbits_of(VK);
    return __byte_perm(lut_ld(vlut, field_x128(w, 2 * B * m, B), lane4),
                       lut_ld(vlut, field_x128(w, 2 * B * m + B, B), lane4), 0x5410);
  } else if constexpr (VK == V_FP8) return fp8x2_to_h2(field(w, 16 * m, 16));
  else return w[m];
}

// The 2B-bit fields of dims 2m, 2m+1 (B <= 4) of two tokens' value chunks w0 and w1: token 0's
// at bit 0, token 1's at bit 16 (the bits above each field hold whatever followed it). The two
// bytes holding each field go to bytes 0-1 and 2-3 (one PRMT) and one shift aligns both (offsets
// are compile-time after unrolling); a field that straddles two words (3 bits: one m in eight)
// takes two funnel shifts and the PRMT instead.
template <int B, int NW>
__device__ __forceinline__ uint32_t pair_fields(const uint32_t (&w0)[NW], const uint32_t (&w1)[NW], int m) {
  const int off = 2 * B * m, i = off >> 5, sh = off & 31, by = sh >> 3;
  if (sh + 2 * B <= 32) {
    const int b1 = by < 3 ? by + 1 : by;
    return __byte_perm(w0[i], w1[i], by | b1 << 4 | (4 + by) << 8 | (4 + b1) << 12) >> (sh & 7);
  }
  const uint32_t lo = __funnelshift_r(w0[i], w0[i + 1], sh);
  const uint32_t hi = __funnelshift_r(w1[i], w1[i + 1], sh - 16);
  return __byte_perm(lo, hi, 0x7610);
}

// Value A fragment of m-tile m for the token pair (t0, t1): rows dim 2m (a_lo) and 2m+1 (a_hi).
template <int D, int KK, int VK, bool K256 = false>
__device__ __forceinline__ void value_frag(const uint32_t (&w0)[Traits<D, KK, VK>::VW],
                                           const uint32_t (&w1)[Traits<D, KK, VK>::VW], int m, const char* vlut,
                                           uint32_t lane4, uint32_t h1024, uint32_t& a_lo, uint32_t& a_hi) {
  if constexpr (VK == V_U4) {
    // Byte m of each token's chunk holds the codes of dims 2m (low nibble) and 2m+1. Put the two
    // tokens' bytes at bytes 0 and 2, then OR in fp16 1024 so each nibble becomes an exact half:
    // 1024 + c (row dim 2m) and 1024 + 16 c (row dim 2m+1). The kernel removes the offsets and
    // the factor 16 once at the end (with the running sum of P), not per element.
    const int b = m & 3;
    const uint32_t x = __byte_perm(w0[m >> 2], w1[m >> 2], b | ((4 + b) << 8));
    a_lo = (x & 0x000f000fu) | h1024;
    a_hi = (x & 0x00f000f0u) | h1024;
  } else if constexpr (is_direct(VK)) {
    // The same for 2- and 3-bit codes: the two bytes holding the 2B-bit field of dims 2m, 2m+1
    // of token 0 go to bytes 0-1 and token 1's to bytes 2-3 (one PRMT), one shift puts both
    // fields at bits 0 and 16 (offsets are compile-time after unrolling), then 1024 + c (dim 2m)
    // and 1024 + 2^B c (dim 2m+1): four ALU instructions per fragment pair instead of four table
    // lookups (shift, LOP3, LDS each) and two PRMT. A field that straddles two words (3 bits:
    // one m in eight) takes two funnel shifts and the PRMT instead.
    constexpr int B = vbits_of(VK), M = (1 << B) - 1;
    const uint32_t x = pair_fields<B>(w0, w1, m);
    a_lo = (x & static_cast<uint32_t>(M | M << 16)) | h1024;
    a_hi = (x & static_cast<uint32_t>(M << B | M << (16 + B))) | h1024;
  } else if constexpr ((is_vmse(VK) || is_uniform(VK)) && !pair_lut(vbits_of(VK))) {
    // Codes wider than 4 bits (one level per table entry, in its low half): each register is
    // the two tokens' levels of one dim, so one PRMT per register, not a PRMT per token's pair
    // and two more to transpose the pairs.
    constexpr int B = vbits_of(VK);
    a_lo = __byte_perm(lut_ld(vlut, field_x128(w0, 2 * B * m, B), lane4), lut_ld(vlut, field_x128(w1, 2 * B * m, B), lane4),
                       0x5410);
    a_hi = __byte_perm(lut_ld(vlut, field_x128(w0, 2 * B * m + B, B), lane4),
                       lut_ld(vlut, field_x128(w1, 2 * B * m + B, B), lane4), 0x5410);
  } else {
    const uint32_t p0 = value_pair<D, KK, VK, K256>(w0, m, vlut, lane4), p1 = value_pair<D, KK, VK, K256>(w1, m, vlut, lane4);
    a_lo = __byte_perm(p0, p1, 0x5410);
    a_hi = __byte_perm(p0, p1, 0x7632);
  }
}

// The value levels as byte tables for value_frag_reg: lo[k] holds the low bytes of levels 4k..4k+3
// (byte j: level 4k + j), hi[k] their high bytes; 2-bit codes use lo[0], hi[0].
struct ValueRegs {
  uint32_t lo[2], hi[2];
};

template <int VK>
__device__ __forceinline__ ValueRegs value_regs(const DecodeTables& tab) {
  ValueRegs r{{0u, 0u}, {0u, 0u}};
  if constexpr (vreg_lut(VK)) {
#pragma unroll
    for (int e = 0; e < (1 << vbits_of(VK)); ++e) {
      const uint32_t v = tab.v_lv[e];
      r.lo[e >> 2] |= (v & 0xffu) << (8 * (e & 3));
      r.hi[e >> 2] |= (v >> 8) << (8 * (e & 3));
    }
    // Per-thread registers: the compiler keeps these warp-uniform values in uniform registers,
    // which PRMT cannot read as a source (one move per lookup otherwise).
#pragma unroll
    for (int k = 0; k < 2; ++k) r.lo[k] = opaque(r.lo[k]), r.hi[k] = opaque(r.hi[k]);
  }
  return r;
}

// value_frag for MSE values of 2 or 3 bits, the levels looked up in registers: y holds four codes
// in its low four nibbles (as PRMT selectors: < 8, so bit 3, the sign mode, stays clear); one PRMT
// over the low-byte table and one over the high-byte table give the four levels' bytes, and two
// PRMT interleave them into the A registers. No shared-memory lookups.
//   2 bits: byte m/2 of each token's chunk holds dims 2m..2m+3 (m even). With token 0's byte at
//   byte 0 and token 1's at byte 1 (one PRMT), x & 0x3333 holds dims 2m and 2m+2 of both tokens
//   (nibbles: t0 2m, t0 2m+2, t1 2m, t1 2m+2) and (x >> 2) & 0x3333 dims 2m+1 and 2m+3, so four A
//   registers (m and m+1) cost PRMT, two LOP3, SHF, four PRMT lookups and four PRMT: 3 per
//   register against 4 with the table (shift, LOP3, LDS per token pair of dims, PRMT per register).
//   3 bits: x from pair_fields (token 0's 6-bit field of dims 2m, 2m+1 at bit 0, token
//   1's at bit 16), its codes spread to nibbles 0, 1 and 4, 5 (two LOP3 and an add), and the upper
//   pair folded down onto nibbles 2, 3 (y + (y >> 8)): nibbles t0 2m, t0 2m+1, t1 2m, t1 2m+1.
template <int D, int KK, int VK>
__device__ __forceinline__ void value_frag_reg(const uint32_t (&w0)[Traits<D, KK, VK>::VW],
                                               const uint32_t (&w1)[Traits<D, KK, VK>::VW], int m, const ValueRegs& vr,
                                               uint32_t& a_lo, uint32_t& a_hi) {
  constexpr int B = vbits_of(VK);
  static_assert(vreg_lut(VK), "2- or 3-bit MSE values");
  if constexpr (B == 2) {
    const int i = m >> 3, by = (m >> 1) & 3;
    const uint32_t x = __byte_perm(w0[i], w1[i], by | (4 + by) << 4);
    const uint32_t ye = x & 0x3333u, yo = (x >> 2) & 0x3333u;
    const uint32_t le = __byte_perm(vr.lo[0], 0u, ye), he = __byte_perm(vr.hi[0], 0u, ye);
    const uint32_t lo = __byte_perm(vr.lo[0], 0u, yo), ho = __byte_perm(vr.hi[0], 0u, yo);
    const uint32_t sel = (m & 1) ? 0x7351u : 0x6240u;  // bytes (t0, t1) of dim 2m or of dim 2m+2
    a_lo = __byte_perm(le, he, sel);
    a_hi = __byte_perm(lo, ho, sel);
  } else {
    const uint32_t x = pair_fields<B>(w0, w1, m);
    const uint32_t u = (x & 0x00070007u) + ((x & 0x00380038u) << 1);
    const uint32_t y = u + (u >> 8);
    const uint32_t l = __byte_perm(vr.lo[0], vr.lo[1], y), h = __byte_perm(vr.hi[0], vr.hi[1], y);
    a_lo = __byte_perm(l, h, 0x6240);
    a_hi = __byte_perm(l, h, 0x7351);
  }
}

__device__ __forceinline__ uint32_t atom_add_acq_rel_gpu(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// 2^x on the special-function unit (inputs are <= 0 here, flushing tiny results to zero is fine).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ float h_lo(uint32_t x) { return __half2float(__ushort_as_half(x & 0xffffu)); }

// Rotates one query head's merged rotated-domain values back (o = R^T o~); lane l holds dims
// [E l, E l + E).
template <int D>
__device__ __forceinline__ void rotate_back(const DecodeTables& tab, float (&x)[D / 32], int lane) {
  constexpr int E = D / 32;
  warp_fwht<E>(x, lane);
#pragma unroll
  for (int i = 0; i < E; ++i) {
    x[i] *= tab.rot_scale;
    if (sign_negative(tab, E * lane + i)) x[i] = -x[i];
  }
}

// Writes one query head's output (lane l: dims [E l, E l + E)) and, where lse is set, its
// natural-log log-sum-exp from the log2 one.
template <int D>
__device__ __forceinline__ void write_out(void* out, DType out_dtype, float* lse, const float (&x)[D / 32], int lane,
                                          int64_t qhead, float lse2) {
  constexpr int E = D / 32;
#pragma unroll
  for (int i = 0; i < E; ++i) store_elem(out, out_dtype, qhead * D + E * lane + i, x[i]);
  if (lse && lane == 0) lse[qhead] = lse2 == -INFINITY || lse2 != lse2 ? lse2 : lse2 * 0.69314718055994531f;
}

// Writes one query head's output from its merged values x, rotated back where values are stored rotated.
template <int D>
__device__ __forceinline__ void write_head(const DecodeParams& p, float (&x)[D / 32], int lane, int64_t qhead, float lse2) {
  if (p.values_rotated) rotate_back<D>(p.tab, x, lane);
  write_out<D>(p.out, p.out_dtype, p.lse, x, lane, qhead, lse2);
}

// Word of element e of query head g in the rotated queries' shared-memory copy ([kMaxGroup][D]
// floats). Lane (g, c) of the query fragment reads head g's quarter c (d/4 contiguous dims), 16
// bytes per k-step. In a plain row-major copy every quarter starts on the same bank, so the 32
// lanes' reads of one k-step were 24- to 32-way conflicts (their scalar loads were the largest
// stall of a batch-1 decode after the cluster barrier, Nsight Compute,
// docs/journal/RESULTS-journal.md). Each quarter is therefore rotated by r 16-byte units, r chosen
// so that the 8 lanes of each phase of a 16-byte load (g in {2p, 2p+1}, c in 0..3) read 8 different
// 16-byte bank groups.
template <int D>
__host__ __device__ constexpr int qs_word(int g, int e) {
  constexpr int Q = D / 4;  // words of a quarter (16, 32 or 64)
  const int c = e / Q, w = e % Q;
  const int r = D == 64 ? (c >> 1) + 2 * g : c + 4 * g;
  return g * D + c * Q + ((w + 4 * r) & (Q - 1));
}

// Checked when this header compiles: every row is a permutation of its D words, and every phase
// of every k-step's 16-byte loads is free of bank conflicts.
template <int D>
constexpr bool qs_layout_ok() {
  for (int g = 0; g < kMaxGroup; ++g) {
    bool seen[D] = {};
    for (int e = 0; e < D; ++e) {
      const int w = qs_word<D>(g, e) - g * D;
      if (w < 0 || w >= D || seen[w]) return false;
      seen[w] = true;
    }
  }
  for (int s = 0; s < D / 16; ++s)
    for (int phase = 0; phase < 4; ++phase) {
      bool used[8] = {};
      for (int lane = 8 * phase; lane < 8 * phase + 8; ++lane) {
        const int word = qs_word<D>(lane >> 2, (D / 4) * (lane & 3) + 4 * s);
        if (word % 4 || used[(word / 4) % 8]) return false;
        used[(word / 4) % 8] = true;
      }
    }
  return true;
}
static_assert(qs_layout_ok<64>() && qs_layout_ok<128>() && qs_layout_ok<256>(), "qs_word: conflicts");

// The epilogue's shared memory (after the tile loop, over the queries and the ring, which are no
// longer needed), from the end of the lookup tables: every warp's unnormalised output, the merged
// output, per-(warp, head) max and sum, per-head max and sum, per-CTA weights of the cross-CTA
// merge, a flag.
template <int D, int W>
struct Epilogue {
  float* wo;   // [W][kMaxGroup][D]
  float* fin;  // [kMaxGroup][D]
  float* wml;  // [W][kMaxGroup]{max, sum}
  float* hml;  // [kMaxGroup]{max, sum}; then the final log2-sum-exp in hml[2 j]
  float* cw;   // [kMaxSplits / W][kMaxGroup]
  int* flag;
  __device__ explicit Epilogue(uint32_t* base)
      : wo(reinterpret_cast<float*>(base)),
        fin(wo + W * kMaxGroup * D),
        wml(fin + kMaxGroup * D),
        hml(wml + W * kMaxGroup * 2),
        cw(hml + 2 * kMaxGroup),
        flag(reinterpret_cast<int*>(cw + (kMaxSplits / W) * kMaxGroup)) {}
};

// The tile loop of CTA `cta` of the (sequence, kv head) (b, hkv): warp w runs split cta * W + w
// of the key range p describes and leaves its unnormalised output and its max and sum in the
// Epilogue at smem + KLUT + VLUT (wo, wml), the CTA synchronised.
template <int D, int KK, int VK, int W, int VA = va_default(D, KK, VK)>
__device__ __forceinline__ void decode_splits(const DecodeParams& p, int cta, int hkv, int b, uint32_t* smem) {
  using T = Traits<D, KK, VK, W, VA>;
  constexpr bool KBF = T::KBF, VBF = T::VBF;
  constexpr int KSTEPS = D / 16;  // k-steps of S = Q K^T, and m-tiles of O^T
  uint32_t* klut_all = smem;
  uint32_t* vlut_all = shared_lut(KK, VK) ? smem : smem + T::KLUT;
  float* qs = reinterpret_cast<float*>(smem + T::KLUT + T::VLUT);  // [kMaxGroup][D], quarters rotated (qs_word)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int split = cta * T::WARPS + warp;
  const int group = p.group;

  // This warp's range of tiles. The page ids of its first tiles, seq_lens[b] and the queries are
  // requested together and the tables are built while they are in flight; the first pages are
  // issued as soon as their ids arrive, and the queries are rotated while the pages load.
  // Tiles per split come from the plan's max_seq_len, not from this sequence's length, so the
  // page ids of the warp's first tiles are read while seq_lens[b] is still in flight. (The last
  // split takes any tiles beyond max_seq_len: a longer sequence stays correct, only slower.)
  const int32_t* bt = p.block_tables + static_cast<int64_t>(b) * p.bt_stride;
  // With key-range cuts the splits share the tiles of [lo, hi) (so they need len first).
  int per = ((p.max_seq_len + kTileTokens - 1) / kTileTokens + p.num_splits - 1) / p.num_splits;
  int lo = 0, hi = 0, first = split * per;
  if (p.ranged) {
    const int n = p.seq_lens[b];
    lo = max(0, max(p.min_key_pos, p.window > 0 ? n - p.window : 0));
    hi = max(lo, n - p.exclude_recent);
    if (p.spread) {
      const int span = (hi + kTileTokens - 1) / kTileTokens - lo / kTileTokens;
      per = max(1, (span + p.num_splits - 1) / p.num_splits);
      first = split * per;
    }
    first += lo / kTileTokens;
  }
  constexpr int NPRE = T::ASYNC ? T::NST - 1 : 1;
  int pre[NPRE];
#pragma unroll
  for (int i = 0; i < NPRE; ++i) {
    const int idx = (first + i) >> p.tpp_log2;
    pre[i] = idx < p.bt_stride ? __ldg(bt + idx) : 0;
  }
  if (!p.ranged) hi = p.seq_lens[b];
  // The queries of this kv head's group (one warp per head), into registers.
  constexpr int E = D / 32;
  constexpr int QPW = (kMaxGroup + T::WARPS - 1) / T::WARPS;  // query heads per warp
  float qx[QPW][E];
#pragma unroll
  for (int jj = 0; jj < QPW; ++jj) {
    const int j = warp + jj * T::WARPS;
    const int64_t q0 = (static_cast<int64_t>(b) * p.n_q_heads + hkv * group + j) * D + E * lane;
#pragma unroll
    for (int i = 0; i < E; ++i) qx[jj][i] = j < group ? load_elem(p.q, p.q_dtype, q0 + i) : 0.0f;
  }
  // Lookup tables (replicated per lane): the 32 copies of an entry are 8 16-byte stores (at
  // entry * 8, or * 16 for a key table with 256-byte entries; the other half is not used).
  constexpr int NKE = klut_entries(KK);
  for (int i = tid; i < NKE * 8 + T::VLUT / 4; i += blockDim.x) {
    const int e = i >> 3;
    uint32_t w = 0;
    if (e < NKE) {
      if constexpr (is_kmse(KK)) {
        constexpr int B = kbits_of(KK), M = (1 << B) - 1;
        w = pair_lut(B) ? p.tab.k_lv[e & M] | static_cast<uint32_t>(p.tab.k_lv[e >> B]) << 16 : p.tab.k_lv[e];
      }
    } else {
      const int x = e - NKE;
      if constexpr (is_vmse(VK)) {
        constexpr int B = vbits_of(VK), M = (1 << B) - 1;
        w = pair_lut(B) ? p.tab.v_lv[x & M] | static_cast<uint32_t>(p.tab.v_lv[x >> B]) << 16 : p.tab.v_lv[x];
      } else if constexpr (is_uniform(VK)) {  // the codes themselves (exact in fp16)
        constexpr int B = vbits_of(VK), M = (1 << B) - 1;
        w = pair_lut(B) ? pack_h2(static_cast<float>(x & M), static_cast<float>(x >> B)) : pack_h2(static_cast<float>(x), 0.0f);
      }
    }
    const int at = e < NKE ? (T::K256 ? e * 16 + (i & 7) : i) : T::KLUT / 4 + (i - NKE * 8);
    reinterpret_cast<uint4*>(smem)[at] = make_uint4(w, w, w, w);
  }
  const int ntiles = (hi + kTileTokens - 1) / kTileTokens;
  const int t_begin = min(ntiles, first);
  const int t_end = split == p.num_splits - 1 ? ntiles : min(ntiles, t_begin + per);
  const int64_t sec_off = p.geo.section_offset(hkv);
  const int bs = p.block_size;

  // Offsets within head 0's section (the same within every section).
  ThreadOffsets to;
  to.k[0] = static_cast<int>(p.geo.key_codes(g, 0)) + c * T::KCH;
  to.k[1] = static_cast<int>(p.geo.key_codes(8 + g, 0)) + c * T::KCH;
  {
    const int toks[4] = {2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9};
#pragma unroll
    for (int i = 0; i < 4; ++i) to.v[i] = static_cast<int>(p.geo.value_codes(toks[i], 0)) + g * T::VCH;
  }
  to.km[0] = static_cast<int>(p.geo.key_meta(g, 0));
  to.km[1] = static_cast<int>(p.geo.key_meta(8 + g, 0));
  to.vm[0] = static_cast<int>(p.geo.value_meta(g, 0, 0));
  to.vm[1] = static_cast<int>(p.geo.value_meta(8 + g, 0, 0));
  to.vz[0] = static_cast<int>(p.geo.value_meta(g, 0, 1));
  to.vz[1] = static_cast<int>(p.geo.value_meta(8 + g, 0, 1));
  const int tpp_mask = (1 << p.tpp_log2) - 1;
  auto section = [&](int tile, int& off) {
    off = (tile & tpp_mask) * kTileTokens;
    return p.pages + static_cast<int64_t>(__ldg(bt + (tile >> p.tpp_log2))) * p.page_bytes + sec_off;
  };

  Raw<D, KK, VK> cur;
  [[maybe_unused]] const uint8_t* ring = reinterpret_cast<const uint8_t*>(smem) + T::LUT_BYTES + warp * T::NST * T::STAGE;
  [[maybe_unused]] const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  [[maybe_unused]] int rd = 0, wr = T::NST - 1;
  [[maybe_unused]] const IssueOffsets io = issue_offsets<D, KK, VK>(lane, bs);
  // Block size 16 with 8- or 16-byte value pieces (the common case): the lean copy of issue_page16.
  [[maybe_unused]] const bool page16 = T::PAGE16 && bs == 16;
  [[maybe_unused]] const uint32_t sec_lane = static_cast<uint32_t>(sec_off) + 16u * lane;
  [[maybe_unused]] const int vsrc_lane = T::KPL - (16 - T::PV) * lane;  // issue_page16, 8-byte pieces
  // This lane's value pieces' offsets in a stage (issue_page16).
  [[maybe_unused]] uint32_t dst_v_lane[T::NVK];
#pragma unroll
  for (int k = 0; k < T::NVK; ++k) {
    const int i = lane + 32 * k;
    dst_v_lane[k] = T::NVK == 1 ? io.v_dst : T::KPL + (i / T::VPR) * T::VROW + (i % T::VPR) * T::PV;
  }
  auto issue = [&](int page, int tile, int stage) {
    const uint32_t st = ring_s + stage * T::STAGE;
    if constexpr (T::PAGE16) {
      if (page16) {
        const uint8_t* src = p.pages + static_cast<uint64_t>(static_cast<uint32_t>(page)) * static_cast<uint32_t>(p.page_bytes) + sec_lane;
        issue_page16<D, KK, VK>(src, st, dst_v_lane, lane, vsrc_lane);
        return;
      }
    }
    const uint8_t* sec = p.pages + static_cast<int64_t>(page) * p.page_bytes + sec_off;
    issue_tile<D, KK, VK>(st, sec, (tile & tpp_mask) * kTileTokens, bs, lane, io);
  };
  if constexpr (T::ASYNC) {
#pragma unroll
    for (int i = 0; i < T::NST - 1; ++i) {
      if (t_begin + i < t_end) issue(pre[i], t_begin + i, i);
      cp_async_commit();
    }
  } else if (t_begin < t_end) {
    load_tile(cur, p.pages + static_cast<int64_t>(pre[0]) * p.page_bytes + sec_off, (t_begin & tpp_mask) * kTileTokens, to);
  }
  // Rotate the queries in registers (keys live in the rotated domain) and keep them in smem.
#pragma unroll
  for (int jj = 0; jj < QPW; ++jj) {
    const int j = warp + jj * T::WARPS;
    if (j < group) {
      if (p.keys_rotated) {
#pragma unroll
        for (int i = 0; i < E; ++i)
          if (sign_negative(p.tab, E * lane + i)) qx[jj][i] = -qx[jj][i];
        warp_fwht<E>(qx[jj], lane);
      }
#pragma unroll
      for (int i = 0; i < E; ++i) qs[qs_word<D>(j, E * lane + i)] = qx[jj][i];
    }
  }
  __syncthreads();
  const float qscale = p.scale_log2 * (p.keys_rotated ? p.tab.rot_scale : 1.0f);
  // bf16 keeps only 8 significant bits: for the bf16 cache the query is split into a bf16 head
  // and a bf16 remainder (two MMAs), so only the cache's own rounding remains.
  uint32_t qa[KSTEPS][2];
  [[maybe_unused]] uint32_t qlo[KBF ? KSTEPS : 1][2];
#pragma unroll
  for (int s = 0; s < KSTEPS; ++s) {
    float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (g < group) {
      const float4 q4 = *reinterpret_cast<const float4*>(qs + qs_word<D>(g, (D / 4) * c + 4 * s));
      x[0] = q4.x * qscale;
      x[1] = q4.y * qscale;
      x[2] = q4.z * qscale;
      x[3] = q4.w * qscale;
    }
    qa[s][0] = pack2<KBF>(x[0], x[1]);
    qa[s][1] = pack2<KBF>(x[2], x[3]);
    if constexpr (KBF) {
      qlo[s][0] = pack2<KBF>(x[0] - __bfloat162float(__float2bfloat16_rn(x[0])),
                            x[1] - __bfloat162float(__float2bfloat16_rn(x[1])));
      qlo[s][1] = pack2<KBF>(x[2] - __bfloat162float(__float2bfloat16_rn(x[2])),
                            x[3] - __bfloat162float(__float2bfloat16_rn(x[3])));
    }
  }
  const char* klut = reinterpret_cast<const char*>(klut_all);
  const char* vlut = reinterpret_cast<const char*>(vlut_all);
  const uint32_t lane4 = static_cast<uint32_t>(lane) * 4u;
  // fp16x2 1024 (0x64006400) for value_frag, in a register the compiler cannot fold: LOP3 takes
  // one immediate, so (x & mask) | 0x64006400 with both as immediates is two LOP3; with the
  // constant in a register it is one (16 LOP3 less per tile at d = 64, 32 at d = 128).
  // p.group is in [1, kMaxGroup], so its bit 31 is 0.
  const uint32_t h1024 = 0x64006400u | (static_cast<uint32_t>(p.group) & 0x80000000u);
  constexpr bool kVReg = !(VA & kVaValueSmem) && vreg_lut(VK);
  [[maybe_unused]] const ValueRegs vr = value_regs<VK>(p.tab);
  // The A registers of O^T's m-tile m for the token pairs (2c, 2c+1) and (2c+8, 2c+9).
  auto value_frags = [&](const Raw<D, KK, VK>& r, int m, uint32_t& a0, uint32_t& a1, uint32_t& a2, uint32_t& a3) {
    if constexpr (kVReg) {
      value_frag_reg<D, KK, VK>(r.v[0], r.v[1], m, vr, a0, a1);
      value_frag_reg<D, KK, VK>(r.v[2], r.v[3], m, vr, a2, a3);
    } else {
      value_frag<D, KK, VK, T::K256>(r.v[0], r.v[1], m, vlut, lane4, h1024, a0, a1);
      value_frag<D, KK, VK, T::K256>(r.v[2], r.v[3], m, vlut, lane4, h1024, a2, a3);
    }
  };

  float o[KSTEPS][4];
#pragma unroll
  for (int m = 0; m < KSTEPS; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.0f;
  // Running max / sum / zero-point sum of query heads 2c and 2c+1 (partial over this lane's tokens).
  float m_run0 = -INFINITY, m_run1 = -INFINITY, l_run0 = 0.0f, l_run1 = 0.0f, z_run0 = 0.0f, z_run1 = 0.0f;
  [[maybe_unused]] float s1_run0 = 0.0f, s1_run1 = 0.0f;  // is_direct: running sum of P (see value_frag)

  // d = 64: one online-softmax step per two tiles (32 tokens). A d = 64 tile has half the MMAs of
  // a d = 128 one but the same softmax (tile max shuffles, alphas, the rescale vote), so the pair
  // shares one max, one pair of alphas and one vote, and its two key products and lookups are
  // independent work in flight together. (At d = 128 the second tile's registers would spill at
  // two CTAs per SM.)
  constexpr bool kPair = T::ASYNC && D == 64;
  if constexpr (kPair) {
    // The steps of a tile. next_stage: the ring step (issue the tile NST - 1 ahead, wait for
    // `tile`'s stage, read it into r).
    const uint8_t* sb = reinterpret_cast<const uint8_t*>(smem);
    const StageReads sr = stage_reads<D, KK, VK>(static_cast<uint32_t>(ring - sb), g, c);
    uint32_t so = 0;  // the stage to read: rd * STAGE
    auto next_stage = [&](Raw<D, KK, VK>& r, int tile) {
      if (tile + T::NST - 1 < t_end) issue(__ldg(bt + ((tile + T::NST - 1) >> p.tpp_log2)), tile + T::NST - 1, wr);
      cp_async_commit();
      cp_async_wait<T::NST - 1>();
      __syncwarp();
      read_stage_at(r, sb, so, sr);
      __syncwarp();  // the stage may be refilled from the next tile on
      so = so + T::STAGE == T::NST * T::STAGE ? 0u : so + T::STAGE;
      wr = wr + 1 == T::NST ? 0 : wr + 1;
    };
    // S^T = K Q^T: M = 16 tokens, N = 8 query heads (two accumulators halve the MMA chain), the
    // key norms folded in, and tokens outside [nlo, nv) masked (their scores -inf, their values 0).
    // sc[i]: token g (i = 0, 1) or 8+g (i = 2, 3), query head 2c + (i & 1).
    auto scores = [&](Raw<D, KK, VK>& r, int nv, int nlo, float (&sc)[4]) {
      float sacc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int s = 0; s < KSTEPS; ++s) {
        uint32_t a0, a1, a2, a3;
        key_frag<D, KK, VK, T::K256>(r.k[0], s, klut, lane4, a0, a2);
        key_frag<D, KK, VK, T::K256>(r.k[1], s, klut, lane4, a1, a3);
        mma<KBF>(sacc[s & 1], a0, a1, a2, a3, qa[s][0], qa[s][1]);
        if constexpr (KBF) mma<KBF>(sacc[s & 1], a0, a1, a2, a3, qlo[s][0], qlo[s][1]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[i] = sacc[0][i] + sacc[1][i];
      if constexpr (T::KMB) {
        const float n0 = h_lo(r.kn[0]), n1 = h_lo(r.kn[1]);
        sc[0] *= n0;
        sc[1] *= n0;
        sc[2] *= n1;
        sc[3] *= n1;
      }
      if (nv < kTileTokens || nlo > 0) {
        const int toks[4] = {2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9};
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (toks[i] >= nv || toks[i] < nlo) {
#pragma unroll
            for (int w = 0; w < T::VW; ++w) r.v[i][w] = 0u;
          }
        if (g >= nv || g < nlo) sc[0] = sc[1] = -INFINITY, r.vs[0] = r.vz[0] = 0u;
        if (g + 8 >= nv || g + 8 < nlo) sc[2] = sc[3] = -INFINITY, r.vs[1] = r.vz[1] = 0u;
      }
    };
    // P of a tile (pr: exp2 of its scores) times the value scales, packed and transposed into the
    // B fragment of O^T += V^T P^T (pb0, pb1: tokens 0-7, 8-15, so that each thread holds (head g,
    // tokens 2c, 2c+1)); zs: its zero-point terms (uniform values) and P sums (direct values) of
    // heads 2c, 2c+1.
    auto p_frag = [&](const Raw<D, KK, VK>& r, const float (&pr)[4], float (&zs)[4], uint32_t& pb0, uint32_t& pb1) {
      float w[4] = {pr[0], pr[1], pr[2], pr[3]};
      if constexpr (is_uniform(VK) || is_vmse(VK)) {
        const float v0 = h_lo(r.vs[0]), v1 = h_lo(r.vs[1]);
        w[0] *= v0;
        w[1] *= v0;
        w[2] *= v1;
        w[3] *= v1;
      }
      if constexpr (is_uniform(VK)) {
        const float zz0 = h_lo(r.vz[0]), zz1 = h_lo(r.vz[1]);
        zs[0] = pr[0] * zz0 + pr[2] * zz1;
        zs[1] = pr[1] * zz0 + pr[3] * zz1;
      }
      const uint32_t pw0 = pack2<VBF>(w[0], w[1]), pw1 = pack2<VBF>(w[2], w[3]);
      if constexpr (is_direct(VK)) {  // sum of P exactly as the MMA sees it (fp16-rounded)
        const float2 f0 = __half22float2(*reinterpret_cast<const __half2*>(&pw0));
        const float2 f1 = __half22float2(*reinterpret_cast<const __half2*>(&pw1));
        zs[2] = f0.x + f1.x;
        zs[3] = f0.y + f1.y;
      }
      pb0 = movmatrix_trans(pw0);
      pb1 = movmatrix_trans(pw1);
    };
    // O^T's columns are query heads 2c, 2c+1: this thread's own alphas. Skip the rescale when
    // no head's running max moved (the common case after the first tiles).
    auto rescale = [&](float al0, float al1) {
      if (__any_sync(0xffffffffu, al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
        for (int m = 0; m < KSTEPS; ++m) {
          o[m][0] *= al0;
          o[m][1] *= al1;
          o[m][2] *= al0;
          o[m][3] *= al1;
        }
      }
    };
    auto pv = [&](const Raw<D, KK, VK>& r, uint32_t pb0, uint32_t pb1) {
#pragma unroll
      for (int m = 0; m < KSTEPS; ++m) {
        uint32_t a0, a1, a2, a3;
        value_frags(r, m, a0, a1, a2, a3);
        mma<VBF>(o[m], a0, a1, a2, a3, pb0, pb1);
      }
    };
    for (int tile = t_begin; tile < t_end; tile += 2) {
      // An odd split's last pair runs a phantom second tile: its stage is stale (never issued),
      // every token masked (nv = 0), so it adds nothing.
      Raw<D, KK, VK> r[2];
      next_stage(r[0], tile);
      next_stage(r[1], tile + 1);
      float sc[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int t = tile + j;
        scores(r[j], t < t_end ? min(kTileTokens, hi - t * kTileTokens) : 0, lo - t * kTileTokens, sc[j]);
      }
      float mx0 = fmaxf(fmaxf(sc[0][0], sc[0][2]), fmaxf(sc[1][0], sc[1][2]));
      float mx1 = fmaxf(fmaxf(sc[0][1], sc[0][3]), fmaxf(sc[1][1], sc[1][3]));
#pragma unroll
      for (int sh = 4; sh < 32; sh <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, sh));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, sh));
      }
      const float mn0 = fmaxf(m_run0, mx0), mn1 = fmaxf(m_run1, mx1);
      const float al0 = fast_exp2(m_run0 - mn0), al1 = fast_exp2(m_run1 - mn1);
      m_run0 = mn0;
      m_run1 = mn1;
      float pr[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) pr[j][i] = fast_exp2(sc[j][i] - (i & 1 ? mn1 : mn0));
      l_run0 = l_run0 * al0 + ((pr[0][0] + pr[0][2]) + (pr[1][0] + pr[1][2]));
      l_run1 = l_run1 * al1 + ((pr[0][1] + pr[0][3]) + (pr[1][1] + pr[1][3]));
      float zs[2][4];
      uint32_t pb[2][2];
#pragma unroll
      for (int j = 0; j < 2; ++j) p_frag(r[j], pr[j], zs[j], pb[j][0], pb[j][1]);
      if constexpr (is_uniform(VK)) {
        z_run0 = z_run0 * al0 + (zs[0][0] + zs[1][0]);
        z_run1 = z_run1 * al1 + (zs[0][1] + zs[1][1]);
      }
      if constexpr (is_direct(VK)) {
        s1_run0 = s1_run0 * al0 + (zs[0][2] + zs[1][2]);
        s1_run1 = s1_run1 * al1 + (zs[0][3] + zs[1][3]);
      }
      rescale(al0, al1);
      pv(r[0], pb[0][0], pb[0][1]);
      pv(r[1], pb[1][0], pb[1][1]);
    }
  } else {
    // One softmax step per tile (d = 128 and 256, the 16-bit formats): the same steps as the pair
    // loop's lambdas, written out (through them, ptxas emitted 4 more instructions per tile for
    // the uniform-value formats at d = 128).
    [[maybe_unused]] const StageReads sr128 =
        stage_reads<D, KK, VK>(static_cast<uint32_t>(ring - reinterpret_cast<const uint8_t*>(smem)), g, c);
    // Two tiles per iteration for the ring-fed formats: fewer loop and ring-bookkeeping instructions
    // (no spills at 128 registers); the 16-bit formats hold a whole tile in registers.
    constexpr int kUnroll = T::ASYNC ? 2 : 1;
#pragma unroll kUnroll
    for (int tile = t_begin; tile < t_end; ++tile) {
      if constexpr (T::ASYNC) {
        if (tile + T::NST - 1 < t_end) issue(__ldg(bt + ((tile + T::NST - 1) >> p.tpp_log2)), tile + T::NST - 1, wr);
        cp_async_commit();
        cp_async_wait<T::NST - 1>();
        __syncwarp();
        read_stage_at(cur, reinterpret_cast<const uint8_t*>(smem), rd * T::STAGE, sr128);
        __syncwarp();  // the stage may be refilled from the next iteration on
        rd = rd + 1 == T::NST ? 0 : rd + 1;
        wr = wr + 1 == T::NST ? 0 : wr + 1;
      }
      const int nv = min(kTileTokens, hi - tile * kTileTokens);  // valid tokens in this tile: [nlo, nv)
      const int nlo = lo - tile * kTileTokens;

      // S^T = K Q^T: M = 16 tokens, N = 8 query heads. Two accumulators halve the MMA chain.
      float sacc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int s = 0; s < KSTEPS; ++s) {
        uint32_t a0, a1, a2, a3;
        key_frag<D, KK, VK, T::K256>(cur.k[0], s, klut, lane4, a0, a2);
        key_frag<D, KK, VK, T::K256>(cur.k[1], s, klut, lane4, a1, a3);
        mma<KBF>(sacc[s & 1], a0, a1, a2, a3, qa[s][0], qa[s][1]);
        if constexpr (KBF) mma<KBF>(sacc[s & 1], a0, a1, a2, a3, qlo[s][0], qlo[s][1]);
      }
      // sc[i]: token g (i = 0, 1) or 8+g (i = 2, 3), query head 2c + (i & 1).
      float sc[4] = {sacc[0][0] + sacc[1][0], sacc[0][1] + sacc[1][1], sacc[0][2] + sacc[1][2],
                     sacc[0][3] + sacc[1][3]};
      if constexpr (T::KMB) {
        const float n0 = h_lo(cur.kn[0]), n1 = h_lo(cur.kn[1]);
        sc[0] *= n0;
        sc[1] *= n0;
        sc[2] *= n1;
        sc[3] *= n1;
      }
      if (nv < kTileTokens || nlo > 0) {
        const int toks[4] = {2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9};
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (toks[i] >= nv || toks[i] < nlo) {
#pragma unroll
            for (int w = 0; w < T::VW; ++w) cur.v[i][w] = 0u;
          }
        if (g >= nv || g < nlo) sc[0] = sc[1] = -INFINITY, cur.vs[0] = cur.vz[0] = 0u;
        if (g + 8 >= nv || g + 8 < nlo) sc[2] = sc[3] = -INFINITY, cur.vs[1] = cur.vz[1] = 0u;
      }
      // Per-head tile max over the 16 tokens (lanes with the same c).
      float mx0 = fmaxf(sc[0], sc[2]), mx1 = fmaxf(sc[1], sc[3]);
#pragma unroll
      for (int sh = 4; sh < 32; sh <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, sh));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, sh));
      }
      const float mn0 = fmaxf(m_run0, mx0), mn1 = fmaxf(m_run1, mx1);
      const float al0 = fast_exp2(m_run0 - mn0), al1 = fast_exp2(m_run1 - mn1);
      m_run0 = mn0;
      m_run1 = mn1;
      const float pr[4] = {fast_exp2(sc[0] - mn0), fast_exp2(sc[1] - mn1), fast_exp2(sc[2] - mn0),
                           fast_exp2(sc[3] - mn1)};
      l_run0 = l_run0 * al0 + (pr[0] + pr[2]);
      l_run1 = l_run1 * al1 + (pr[1] + pr[3]);
      float w[4] = {pr[0], pr[1], pr[2], pr[3]};
      if constexpr (is_uniform(VK) || is_vmse(VK)) {
        const float s0 = h_lo(cur.vs[0]), s1 = h_lo(cur.vs[1]);
        w[0] *= s0;
        w[1] *= s0;
        w[2] *= s1;
        w[3] *= s1;
      }
      if constexpr (is_uniform(VK)) {
        const float z0 = h_lo(cur.vz[0]), z1 = h_lo(cur.vz[1]);
        z_run0 = z_run0 * al0 + (pr[0] * z0 + pr[2] * z1);
        z_run1 = z_run1 * al1 + (pr[1] * z0 + pr[3] * z1);
      }
      // P^T as the B fragment of O^T += V^T P^T: transpose the two 8x8 blocks (tokens 0-7, 8-15)
      // of packed (token, head) pairs so that each thread holds (head g, tokens 2c, 2c+1).
      const uint32_t pw0 = pack2<VBF>(w[0], w[1]), pw1 = pack2<VBF>(w[2], w[3]);
      if constexpr (is_direct(VK)) {  // sum of P exactly as the MMA sees it (fp16-rounded)
        const float2 f0 = __half22float2(*reinterpret_cast<const __half2*>(&pw0));
        const float2 f1 = __half22float2(*reinterpret_cast<const __half2*>(&pw1));
        s1_run0 = s1_run0 * al0 + (f0.x + f1.x);
        s1_run1 = s1_run1 * al1 + (f0.y + f1.y);
      }
      const uint32_t pb0 = movmatrix_trans(pw0);
      const uint32_t pb1 = movmatrix_trans(pw1);
      // O^T's columns are query heads 2c, 2c+1: this thread's own alphas. Skip the rescale when
      // no head's running max moved (the common case after the first tiles).
      if (__any_sync(0xffffffffu, al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
        for (int m = 0; m < KSTEPS; ++m) {
          o[m][0] *= al0;
          o[m][1] *= al1;
          o[m][2] *= al0;
          o[m][3] *= al1;
        }
      }
#pragma unroll
      for (int m = 0; m < KSTEPS; ++m) {
        uint32_t a0, a1, a2, a3;
        value_frags(cur, m, a0, a1, a2, a3);
        mma<VBF>(o[m], a0, a1, a2, a3, pb0, pb1);
      }
      if constexpr (!T::ASYNC) {
        if (tile + 1 < t_end) {
          int off;
          const uint8_t* sec = section(tile + 1, off);
          load_tile(cur, sec, off, to);
        }
      }
    }
  }

  // Finalise: sums over the lanes sharing c, then normalised partial outputs and log2-sum-exp.
#pragma unroll
  for (int sh = 4; sh < 32; sh <<= 1) {
    l_run0 += __shfl_xor_sync(0xffffffffu, l_run0, sh);
    l_run1 += __shfl_xor_sync(0xffffffffu, l_run1, sh);
    z_run0 += __shfl_xor_sync(0xffffffffu, z_run0, sh);
    z_run1 += __shfl_xor_sync(0xffffffffu, z_run1, sh);
    if constexpr (is_direct(VK)) {
      s1_run0 += __shfl_xor_sync(0xffffffffu, s1_run0, sh);
      s1_run1 += __shfl_xor_sync(0xffffffffu, s1_run1, sh);
    }
  }
  if constexpr (is_direct(VK)) {
    constexpr float inv = 1.0f / static_cast<float>(1 << vbits_of(VK));  // the upper code's factor
#pragma unroll
    for (int m = 0; m < KSTEPS; ++m) {
      o[m][0] -= 1024.0f * s1_run0;
      o[m][1] -= 1024.0f * s1_run1;
      o[m][2] = (o[m][2] - 1024.0f * s1_run0) * inv;
      o[m][3] = (o[m][3] - 1024.0f * s1_run1) * inv;
    }
  }
  // Each warp's partial into the epilogue's shared memory.
  const bool empty = t_begin >= t_end;
  if constexpr (T::ASYNC) cp_async_wait<0>();
  __syncthreads();
  const Epilogue<D, W> ep(smem + T::KLUT + T::VLUT);
  float* wo = ep.wo;
  float* wml = ep.wml;
  {
    const int h0 = 2 * c, h1 = 2 * c + 1;
    if (g == 0) {
      wml[(warp * kMaxGroup + h0) * 2] = empty ? -INFINITY : m_run0;
      wml[(warp * kMaxGroup + h0) * 2 + 1] = empty ? 0.0f : l_run0;
      wml[(warp * kMaxGroup + h1) * 2] = empty ? -INFINITY : m_run1;
      wml[(warp * kMaxGroup + h1) * 2 + 1] = empty ? 0.0f : l_run1;
    }
    float* w0 = wo + (warp * kMaxGroup + h0) * D;
    float* w1 = wo + (warp * kMaxGroup + h1) * D;
#pragma unroll
    for (int m = 0; m < KSTEPS; ++m) {
      const int dim = (D / 8) * g + 2 * m;
      *reinterpret_cast<float2*>(w0 + dim) = make_float2(o[m][0] + z_run0, o[m][2] + z_run0);
      *reinterpret_cast<float2*>(w1 + dim) = make_float2(o[m][1] + z_run1, o[m][3] + z_run1);
    }
  }
  __syncthreads();
}

// The CTA's warps merged: per head the CTA's max and sum (hml) and each warp's weight (wml), then
// each element of the CTA's normalised output handed to put(head, dim, value).
template <int D, int W, typename Put>
__device__ __forceinline__ void combine_warps(const Epilogue<D, W>& ep, int group, Put put) {
  const int tid = threadIdx.x;
  if (tid < group) {
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; ++w) mx = fmaxf(mx, ep.wml[(w * kMaxGroup + tid) * 2]);
    float l = 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      float& mw = ep.wml[(w * kMaxGroup + tid) * 2];
      mw = mw == -INFINITY ? 0.0f : exp2f(mw - mx);
      l += mw * ep.wml[(w * kMaxGroup + tid) * 2 + 1];
    }
    ep.hml[2 * tid] = mx;
    ep.hml[2 * tid + 1] = l;
  }
  __syncthreads();
  for (int e = tid; e < group * D; e += blockDim.x) {
    const int j = e / D, i = e % D;
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w) acc += ep.wml[(w * kMaxGroup + j) * 2] * ep.wo[(w * kMaxGroup + j) * D + i];
    const float l = ep.hml[2 * j + 1];
    put(j, i, l > 0.0f ? acc / l : 0.0f);
  }
}

// The CTA's log2-sum-exp of head j (after combine_warps).
template <int D, int W>
__device__ __forceinline__ float cta_lse2(const Epilogue<D, W>& ep, int j) {
  return ep.hml[2 * j + 1] > 0.0f ? ep.hml[2 * j] + log2f(ep.hml[2 * j + 1]) : -INFINITY;
}

// The workspace merge of a (sequence, kv head) `unit` of `ctas` CTAs, once this CTA (`cta`) wrote
// its normalised partial output to o_part: writes its log2-sum-exp, counts itself in, and in the
// last CTA to finish merges every CTA's partial into ep.fin and their log2-sum-exps into
// ep.hml[2 j] (then resets the counter). Returns false in the other CTAs.
template <int D, int W>
__device__ __forceinline__ bool merge_workspace(const Epilogue<D, W>& ep, const float* o_part, float* lse_part,
                                                uint32_t* counters, int64_t unit, int ctas, int cta, int group) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* lse_fin = ep.hml;
  if (tid < group) lse_part[(unit * ctas + cta) * group + tid] = cta_lse2(ep, tid);
  // The CTA's partial writes, then one gpu-scope acq_rel add (release: the barrier orders the
  // other threads' writes before it; acquire: the last CTA sees every CTA's partial).
  __syncthreads();
  if (tid == 0) {
    const uint32_t old = atom_add_acq_rel_gpu(counters + unit, 1u);
    // 1: the last CTA; 0: another is; -1: the workspace was not prepared (init_decode_workspace).
    *ep.flag = (old & kCounterTagMask) != kCounterTag ? -1 : (old & ~kCounterTagMask) == static_cast<uint32_t>(ctas - 1);
  }
  __syncthreads();
  const int f = *ep.flag;
  if (f == 0) return false;
  if (f < 0) {  // loud, never a silently wrong merge
    for (int e = tid; e < group * D; e += blockDim.x) ep.fin[e] = __int_as_float(0x7fc00000);
    if (tid < group) lse_fin[2 * tid] = __int_as_float(0x7fc00000);
    return true;
  }
  // Per head, one warp: the max of the CTAs' log2-sum-exps and their weights.
  for (int j = warp; j < group; j += W) {
    float mx = -INFINITY;
    for (int k = lane; k < ctas; k += 32) mx = fmaxf(mx, __ldcg(lse_part + (unit * ctas + k) * group + j));
    mx = warp_max(mx);
    float den = 0.0f;
    for (int k = lane; k < ctas; k += 32) {
      const float l = __ldcg(lse_part + (unit * ctas + k) * group + j);
      const float w = l == -INFINITY ? 0.0f : exp2f(l - mx);
      ep.cw[k * kMaxGroup + j] = w;
      den += w;
    }
#pragma unroll
    for (int o2 = 16; o2 > 0; o2 >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o2);
    if (lane == 0) lse_fin[2 * j] = den > 0.0f ? mx + log2f(den) : -INFINITY, lse_fin[2 * j + 1] = den;
  }
  __syncthreads();
  for (int e = tid; e < group * D; e += blockDim.x) {
    const int j = e / D, i = e % D;
    const float* op = o_part + (unit * ctas * group + j) * D + i;
    float acc = 0.0f;
#pragma unroll 4
    for (int k = 0; k < ctas; ++k) acc += ep.cw[k * kMaxGroup + j] * __ldcg(op + static_cast<int64_t>(k) * group * D);
    const float den = lse_fin[2 * j + 1];
    ep.fin[e] = den > 0.0f ? acc / den : 0.0f;
  }
  if (tid == 0) counters[unit] = kCounterTag;  // ready for the next launch
  return true;
}

// The cluster merge of a (sequence, kv head) whose `ctas` CTAs form one thread-block cluster
// (between two cl.sync() of the caller): each CTA holds its normalised partial of head j at
// xo[j * D ...] and its log2-sum-exp at xlse[lse_stride * j], at the same shared-memory offsets in
// every CTA; head j is merged by warp j / ctas of CTA j % ctas, which reads all the cluster's
// partials through distributed shared memory and hands put(j, x, lse2) the merged values (lane l:
// dims [E l, E l + E)).
template <int D, int W, typename Put>
__device__ __forceinline__ void merge_cluster(const cooperative_groups::cluster_group& cl, float* xo, float* xlse,
                                              int lse_stride, int ctas, int cta, int group, Put put) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int j = cta + ctas * warp; j < group; j += ctas * W) {
    const float l = lane < ctas ? cl.map_shared_rank(xlse, lane)[lse_stride * j] : -INFINITY;
    const float mx = warp_max(l);
    float w = l == -INFINITY ? 0.0f : exp2f(l - mx);
    float den = w;
#pragma unroll
    for (int o2 = 16; o2 > 0; o2 >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o2);
    float x[E];
#pragma unroll
    for (int i = 0; i < E; ++i) x[i] = 0.0f;
    // Eight CTAs' partials at a time: all the remote loads first, then the sums.
    for (int k0 = 0; k0 < ctas; k0 += 8) {
      float r[8][E];
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        const float* rf = cl.map_shared_rank(xo, k0 + kk < ctas ? k0 + kk : 0) + j * D + E * lane;
#pragma unroll
        for (int i = 0; i < E; ++i) r[kk][i] = k0 + kk < ctas ? rf[i] : 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        const float wk = __shfl_sync(0xffffffffu, w, (k0 + kk) & 31);
#pragma unroll
        for (int i = 0; i < E; ++i) x[i] += wk * r[kk][i];
      }
    }
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
#pragma unroll
    for (int i = 0; i < E; ++i) x[i] *= inv;
    put(j, x, den > 0.0f ? mx + log2f(den) : -INFINITY);
  }
}

// Epilogue. The warps of the CTA merge in shared memory; a CTA that covers its whole (sequence,
// kv head) writes the output, otherwise the CTAs merge as a cluster in distributed shared memory
// or each writes a partial and the last one to finish (counted in p.counters) merges them. One
// launch, a fixed grid: capturable in a CUDA graph.
template <int D, int KK, int VK, int VA = va_default(D, KK, VK)>
__global__ void __launch_bounds__(Traits<D, KK, VK>::WARPS * 32, Traits<D, KK, VK>::MIN_BLOCKS) decode_kernel(const __grid_constant__ DecodeParams p) {
  using T = Traits<D, KK, VK, 0, VA>;
  constexpr int W = T::WARPS, E = D / 32;
  extern __shared__ __align__(16) uint32_t smem[];
  decode_splits<D, KK, VK, W, VA>(p, blockIdx.x, blockIdx.y, blockIdx.z, smem);
  const Epilogue<D, W> ep(smem + T::KLUT + T::VLUT);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hkv = blockIdx.y, b = blockIdx.z, group = p.group, ctas = gridDim.x;
  const int64_t unit = static_cast<int64_t>(b) * p.n_kv_heads + hkv;
  float* fin = ep.fin;
  combine_warps<D, W>(ep, group, [&](int j, int i, float v) {
    if (ctas == 1 || p.cluster) fin[j * D + i] = v;
    else p.o_part[((unit * ctas + blockIdx.x) * group + j) * D + i] = v;
  });
  float* lse_fin = ep.hml;  // per head: the final log2-sum-exp, written over the CTA's max
  if (ctas == 1) {
    __syncthreads();
    if (tid < group) lse_fin[2 * tid] = cta_lse2(ep, tid);
  } else if (p.cluster) {
    // The CTAs of this (sequence, kv head) form one cluster: each keeps its normalised partial in
    // its own shared memory, and head j is merged by warp j / ctas of CTA j % ctas, which reads
    // the partials of all the cluster's CTAs through distributed shared memory.
    namespace cg = cooperative_groups;
    const cg::cluster_group cl = cg::this_cluster();
    __syncthreads();
    if (tid < group) lse_fin[2 * tid] = cta_lse2(ep, tid);
    cl.sync();
    merge_cluster<D, W>(cl, fin, lse_fin, 2, ctas, blockIdx.x, group, [&](int j, float(&x)[E], float lse2) {
      write_head<D>(p, x, lane, static_cast<int64_t>(b) * p.n_q_heads + hkv * group + j, lse2);
    });
    cl.sync();  // no CTA leaves while its partial may still be read
    return;
  } else if (!merge_workspace<D, W>(ep, p.o_part, p.lse_part, p.counters, unit, ctas, blockIdx.x, group)) {
    return;
  }
  __syncthreads();
  // Output, one warp per query head.
  for (int j = warp; j < group; j += W) {
    float x[E];
#pragma unroll
    for (int i = 0; i < E; ++i) x[i] = fin[j * D + E * lane + i];
    write_head<D>(p, x, lane, static_cast<int64_t>(b) * p.n_q_heads + hkv * group + j, lse_fin[2 * j]);
  }
}

// The fused decode of a layer kept in three parts (the compressed middle, the recent window's
// copies, the sinks' f16 copies; run_fused_decode): one grid whose CTAs [cta_end[i-1], cta_end[i])
// along x run part i's splits, each part with its own pool, codec, tables, lengths and key range.
// Every CTA rotates its partial back to the original domain (the parts rotate values
// differently) and writes it to the workspace, where the last CTA of a (sequence, kv head) merges
// them all by log-sum-exp, so no separate merge runs; or, where the plan makes the CTAs of a
// (sequence, kv head) one thread-block cluster (batch 1), they merge in distributed shared memory.
struct FusedParams {
  DecodeParams part[3];  // their out / lse / workspace fields are unused
  int cta_end[3];
  float* o_part;       // [batch, n_kv_heads, ctas, group, D]: each CTA's normalised partial, original domain
  float* lse_part;     // [batch, n_kv_heads, ctas, group]: its log2-sum-exp
  uint32_t* counters;  // [batch, n_kv_heads]: CTAs done under kCounterTag
  void* out;           // [batch, n_q_heads, D]
  DType out_dtype;
  float* lse;          // optional [batch, n_q_heads], natural log
  // The CTAs of a (sequence, kv head) form one thread-block cluster and merge in distributed
  // shared memory (the workspace is then unused).
  bool cluster;
  // Without a cluster: a one-dimensional grid whose first CTAs are every (sequence, kv head)'s
  // window and sink CTAs, then every middle CTA. The scheduler starts CTAs in grid order, so the
  // short parts run first and the middle's CTAs, the long ones, all start in the wave they
  // leave; in the (CTA, kv head, sequence) grid the later sequences' middle CTAs waited behind
  // the earlier ones' short CTAs.
  bool short_first;
  // Each row's own position, folded in after the parts' merge (newest.k null: none; f32 queries).
  NewestKv newest;
};

// Folds decode row b's own position into query head j's merged output x (lane l: dims [E l,
// E l + E)) and log2-sum-exp: its key and value as computed (NewestKv), one key scored like the
// parts' (scale_log2). A NaN log-sum-exp (an unprepared workspace) stays NaN.
template <int D>
__device__ __forceinline__ void fold_newest(const NewestKv& nk, const DecodeParams& p, int64_t b, int hkv, int j,
                                            float (&x)[D / 32], float& lse2, int lane) {
  constexpr int E = D / 32;
  const int64_t tok = nk.rows ? nk.rows[b] : b;
  const int64_t kv = (tok * p.n_kv_heads + hkv) * D + E * lane;
  const float* q = static_cast<const float*>(p.q) + (b * p.n_q_heads + hkv * p.group + j) * D + E * lane;
  float dot = 0.0f;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const float k = nk.key_mean ? nk.k[kv + i] - nk.key_mean[hkv * D + E * lane + i] : nk.k[kv + i];
    dot += q[i] * k;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  if (lse2 != lse2) return;
  const float s2 = dot * p.scale_log2, m = fmaxf(lse2, s2);
  const float wo = lse2 == -INFINITY ? 0.0f : exp2f(lse2 - m), wn = exp2f(s2 - m), inv = 1.0f / (wo + wn);
#pragma unroll
  for (int i = 0; i < E; ++i) x[i] = (wo * x[i] + wn * nk.v[kv + i]) * inv;
  lse2 = m + log2f(wo + wn);
}

// The fused kernel's warps per CTA (every part's) and shared memory (the largest part's).
template <int D, int KK, int VK, int WK, int WV>
struct FusedTraits {
  static constexpr int W = Traits<D, KK, VK>::WARPS;
  static constexpr int S0 = Traits<D, KK, VK, W>::SMEM, S1 = Traits<D, WK, WV, W>::SMEM,
                       S2 = Traits<D, K_F16, V_F16, W>::SMEM;
  static constexpr int SMEM = S0 > S1 ? (S0 > S2 ? S0 : S2) : (S1 > S2 ? S1 : S2);
};

template <int D, int KK, int VK, int WK, int WV>
__global__ void __launch_bounds__(Traits<D, KK, VK>::WARPS * 32, Traits<D, KK, VK>::MIN_BLOCKS)
    fused_decode_kernel(const __grid_constant__ FusedParams fp) {
  constexpr int W = FusedTraits<D, KK, VK, WK, WV>::W, E = D / 32;
  static_assert(W >= 2, "the cluster merge's exchange area stays below every part's merged output");
  extern __shared__ __align__(16) uint32_t smem[];
  const int ctas = fp.cta_end[2];  // per (sequence, kv head)
  int x = blockIdx.x, hkv = blockIdx.y, b = blockIdx.z;
  if (fp.short_first) {
    const int nkv = fp.part[0].n_kv_heads, mid = fp.cta_end[0], others = ctas - mid;
    const int64_t i = blockIdx.x, units = static_cast<int64_t>(gridDim.x) / ctas;
    int64_t u;
    if (i < units * others) {
      u = i / others;
      x = mid + static_cast<int>(i % others);
    } else {
      u = (i - units * others) / mid;
      x = static_cast<int>((i - units * others) % mid);
    }
    hkv = static_cast<int>(u % nkv);
    b = static_cast<int>(u / nkv);
  }
  const DecodeParams* p;
  uint32_t* base;
  if (x < fp.cta_end[0]) {
    p = &fp.part[0];
    decode_splits<D, KK, VK, W>(*p, x, hkv, b, smem);
    base = smem + Traits<D, KK, VK>::KLUT + Traits<D, KK, VK>::VLUT;
  } else if (x < fp.cta_end[1]) {
    p = &fp.part[1];
    decode_splits<D, WK, WV, W>(*p, x - fp.cta_end[0], hkv, b, smem);
    base = smem + Traits<D, WK, WV>::KLUT + Traits<D, WK, WV>::VLUT;
  } else {
    p = &fp.part[2];
    decode_splits<D, K_F16, V_F16, W>(*p, x - fp.cta_end[1], hkv, b, smem);
    base = smem;
  }
  const Epilogue<D, W> ep(base);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = fp.part[0].group;
  const int64_t unit = static_cast<int64_t>(b) * fp.part[0].n_kv_heads + hkv;
  combine_warps<D, W>(ep, group, [&](int j, int i, float v) { ep.fin[j * D + i] = v; });
  __syncthreads();
  // Cluster merge: the parts' epilogues start at different offsets (their tables differ), so every
  // CTA puts its partial (original domain) and log2-sum-exps at the start of its shared memory
  // (the tables' or the warps' outputs there are no longer read: at most kMaxGroup * (D + 1)
  // floats, below the sinks' epilogue's merged output).
  float* xo = reinterpret_cast<float*>(smem);
  float* xlse = xo + kMaxGroup * D;
  for (int j = warp; j < group; j += W) {
    float v[E];
#pragma unroll
    for (int i = 0; i < E; ++i) v[i] = ep.fin[j * D + E * lane + i];
    if (p->values_rotated) rotate_back<D>(p->tab, v, lane);
    float* dst = fp.cluster ? xo + j * D + E * lane : fp.o_part + ((unit * ctas + x) * group + j) * D + E * lane;
#pragma unroll
    for (int i = 0; i < E; ++i) dst[i] = v[i];
  }
  if (fp.cluster) {
    namespace cg = cooperative_groups;
    const cg::cluster_group cl = cg::this_cluster();
    if (tid < group) xlse[tid] = cta_lse2(ep, tid);
    cl.sync();
    merge_cluster<D, W>(cl, xo, xlse, 1, ctas, x, group, [&](int j, float(&v)[E], float lse2) {
      if (fp.newest.k) fold_newest<D>(fp.newest, fp.part[0], b, hkv, j, v, lse2, lane);
      write_out<D>(fp.out, fp.out_dtype, fp.lse, v, lane, static_cast<int64_t>(b) * fp.part[0].n_q_heads + hkv * group + j,
                   lse2);
    });
    cl.sync();  // no CTA leaves while its partial may still be read
    return;
  }
  if (!merge_workspace<D, W>(ep, fp.o_part, fp.lse_part, fp.counters, unit, ctas, x, group)) return;
  __syncthreads();
  for (int j = warp; j < group; j += W) {
    float v[E];
#pragma unroll
    for (int i = 0; i < E; ++i) v[i] = ep.fin[j * D + E * lane + i];
    float lse2 = ep.hml[2 * j];
    if (fp.newest.k) fold_newest<D>(fp.newest, fp.part[0], b, hkv, j, v, lse2, lane);
    write_out<D>(fp.out, fp.out_dtype, fp.lse, v, lane,
                 static_cast<int64_t>(b) * fp.part[0].n_q_heads + hkv * group + j, lse2);
  }
}

using KernelFn = void (*)(DecodeParams);

struct Kernel {
  KernelFn fn = nullptr;
  int smem = 0;
  int warps = 0;
};

// What the environment variable `name` asks of a variant bit (read at every pick): 1 if it is
// `on`, 0 if the other name it takes, -1 if unset (the default).
inline int env_variant(const char* name, const char* on) {
  const std::optional<std::string> e = env_choice_if_set(name);
  return !e ? -1 : *e == on ? 1 : 0;
}

template <int D, int KK, int VK, int VA>
Kernel kernel_of() {
  return Kernel{&decode_kernel<D, KK, VK, VA>, Traits<D, KK, VK, 0, VA>::SMEM, Traits<D, KK, VK, 0, VA>::WARPS};
}

template <int D, int KK, int VK>
Kernel make_kernel() {
  constexpr int def = va_default(D, KK, VK);
  int va = def;
  if constexpr (vreg_lut(VK)) {
    const int e = env_variant("TQKV_DECODE_VALUE_LUT", "smem");
    if (e >= 0) va = e ? va | kVaValueSmem : va & ~kVaValueSmem;
  }
  if constexpr (key256_ok(D, KK)) {
    const int e = env_variant("TQKV_DECODE_KEY_LUT", "256");
    if (e >= 0) va = e ? va | kVaKey256 : va & ~kVaKey256;
  }
  if constexpr (vreg_lut(VK))
    if (va == (def ^ kVaValueSmem)) return kernel_of<D, KK, VK, def ^ kVaValueSmem>();
  if constexpr (key256_ok(D, KK))
    if (va == (def ^ kVaKey256)) return kernel_of<D, KK, VK, def ^ kVaKey256>();
  if constexpr (vreg_lut(VK) && key256_ok(D, KK))
    if (va == (def ^ kVaValueSmem ^ kVaKey256)) return kernel_of<D, KK, VK, def ^ kVaValueSmem ^ kVaKey256>();
  return kernel_of<D, KK, VK, def>();
}

using FusedKernelFn = void (*)(FusedParams);

struct FusedKernel {
  FusedKernelFn fn = nullptr;
  int smem = 0;
  int warps = 0;
};

template <int D, int KK, int VK, int WK, int WV>
FusedKernel make_fused_kernel() {
  using F = FusedTraits<D, KK, VK, WK, WV>;
  return FusedKernel{&fused_decode_kernel<D, KK, VK, WK, WV>, F::SMEM, F::W};
}

}  // namespace tqkv::cuda::detail
