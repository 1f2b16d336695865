// CUDA kernels for a transformer's forward pass around the cache (src/cuda/ops/, one op per
// file): embedding rows, RMSNorm, RoPE, SwiGLU, residual adds and biases, row gathers and
// scatters, f32 <-> bf16, fused forms of some (a residual add with the RMSNorm after it, q and k
// RoPE in one launch, outputs written with the bf16 copy a product reads), key centring, and the
// causal prefill attention over a contiguous (dequantized) K/V. The engine's CUDA device (src/engine/device/cuda_device.h) is built from them.
//
// Every pointer is device memory unless noted; activations are float32, row-major. Every
// function is asynchronous on `stream` and throws tqkv::Error(InvalidArgument) on bad
// arguments or a CUDA launch error. bf16 arrays are passed as their raw 16-bit patterns
// (uint16_t), so this header needs no CUDA headers beyond the runtime API.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tqkv/cuda.h"  // NewestKv

namespace tqkv::cuda {

// x[t, :] = table[tokens[t], :] * scale. table: [rows, cols] bf16; tokens: [n]; x: [n, cols].
void embed_rows(const uint16_t* table, int cols, const int32_t* tokens, int n, float scale, float* x,
                cudaStream_t stream = nullptr);

// y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, rows of d floats (sum of squares in double, as
// the CPU); y may be x.
void rmsnorm(const float* x, const float* w, int n, int d, float eps, float* y, cudaStream_t stream = nullptr);

// RoPE in place on x [n, heads, head_dim], token t at positions[t] (device). inv_freq: host
// array of n_rot / 2 floats (the CPU's frequencies, scaling applied, rounded to float); angles
// are formed and turned into cos/sin in double, so positions in the thousands stay exact; cos
// and sin are scaled by mscale (YaRN's attention factor, else 1). halves = false: pairs
// (2i, 2i+1); true: (i, i + n_rot/2).
void rope(float* x, int n, int heads, int head_dim, const int64_t* positions, int n_rot, const float* inv_freq,
          float mscale, bool halves, cudaStream_t stream = nullptr);

// rope of q [n, q_heads, head_dim] and k [n, k_heads, head_dim] in one launch, both at
// positions[t]; inv_freq: a DEVICE array of n_rot / 2 floats (the host's copy for rope above).
// Each gives what rope gives for q and for k.
void rope_qk(float* q, int q_heads, float* k, int k_heads, int n, int head_dim, const int64_t* positions, int n_rot,
             const float* inv_freq, float mscale, bool halves, cudaStream_t stream = nullptr);

// gate[i] = silu(gate[i]) * up[i].
void swiglu(float* gate, const float* up, size_t n, cudaStream_t stream = nullptr);
// gate[i] = gelu(gate[i]) * up[i], GELU's tanh approximation (GeGLU).
void gelu_glu(float* gate, const float* up, size_t n, cudaStream_t stream = nullptr);
// swiglu (gelu = false) or gelu_glu (true), each element as they compute it, and where gate_bf16
// is not null also its bf16 copy (rounded as f32_to_bf16 rounds).
void glu(bool gelu, float* gate, const float* up, size_t n, uint16_t* gate_bf16, cudaStream_t stream = nullptr);
// x += delta (unless delta is null), then rmsnorm(x) into y, in one launch, and where y_bf16 is
// not null also y's bf16 copy (rounded as f32_to_bf16 rounds): the same values as add, rmsnorm and
// f32_to_bf16 in turn. y may be delta, not x.
void add_rmsnorm(float* x, const float* delta, const float* w, int n, int d, float eps, float* y, uint16_t* y_bf16,
                 cudaStream_t stream = nullptr);
// x[i] += y[i].
void add(float* x, const float* y, size_t n, cudaStream_t stream = nullptr);
// y[t, j] += bias[j] for rows of `cols`.
void add_bias(float* y, const float* bias, int n, int cols, cudaStream_t stream = nullptr);
// add_bias for count <= kMaxBiases pairs (y[j] [n, cols[j]], bias[j]) in one launch; the arrays
// of pointers are host arrays of device pointers.
inline constexpr int kMaxBiases = 4;
void add_biases(float* const* y, const float* const* bias, const int* cols, int count, int n,
                cudaStream_t stream = nullptr);
// y[i] = x[rows[i]] (rows of d floats; rows on the device).
void gather_rows(const float* x, int d, const int32_t* rows, int n, float* y, cudaStream_t stream = nullptr);
// out[r] = the index of row r's largest value (rows of `cols` floats; out on the device): ties to
// the lowest index, NaN never wins, a row with nothing larger than -inf gives 0 — the host's
// engine::argmax exactly.
void argmax_rows(const float* x, int rows, int cols, int32_t* out, cudaStream_t stream = nullptr);
// y[rows[i]] = x[i].
void scatter_rows(const float* x, int d, const int32_t* rows, int n, float* y, cudaStream_t stream = nullptr);

// Round to nearest even, NaN kept.
void f32_to_bf16(const float* x, uint16_t* y, size_t n, cudaStream_t stream = nullptr);
void bf16_to_f32(const uint16_t* x, float* y, size_t n, cudaStream_t stream = nullptr);
// Round to nearest even (beyond the fp16 range: infinity), NaN kept.
void f32_to_f16(const float* x, uint16_t* y, size_t n, cudaStream_t stream = nullptr);

// GGUF weights kept quantized on the device: n elements (whole blocks) of type `type` (a GGUF
// type id: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K) at `blocks` expanded to bf16 into out,
// bit for bit the CPU's dequantize rounded by float_to_bf16 (tqkv/gguf_blocks.h decodes both).
bool dequant_weights_supports(uint32_t type);
void dequant_weights_bf16(uint32_t type, const void* blocks, size_t n, uint16_t* out, cudaStream_t stream = nullptr);
// Decode's products on those blocks: y[t, r] = x[t] . W[r] (+ bias[r]) for n <= kQgemvMaxRows
// input rows, W [rows, cols] in GGUF blocks of `type`, each weight decoded as the CPU decodes it,
// float32 accumulation (so not bf16 weights: near the expanded product, not bit for bit). The
// input is float32 (x_f32) or bf16 (x_bf16): give exactly one.
inline constexpr int kQgemvMaxRows = 8;
bool qgemv_supports(uint32_t type, int n, int cols);
void qgemv(uint32_t type, const void* w, int rows, int cols, const float* x_f32, const uint16_t* x_bf16, int n, float* y,
           const float* bias, cudaStream_t stream = nullptr);

// Skinny products for decode steps (ops/skinny_gemm.cu): y[n, rows] = x[n, cols] * w[rows, cols]^T
// (+ bias[rows]) on the tensor cores, bf16 weights (raw patterns), float32 accumulation and
// output, for n <= kSkinnyMaxRows rows of x and cols a multiple of 8 (skinny_gemm_supports). The
// input is bf16 (x_bf16) or float32 (x_f32, rounded to bf16 as f32_to_bf16 rounds): give exactly
// one. One launch computes up to kMaxSkinnyProducts products over the same input (a layer's Q, K,
// V with their biases). A row's result does not depend on n or on the other rows.
inline constexpr int kSkinnyMaxRows = 64;
inline constexpr int kMaxSkinnyProducts = 4;
struct SkinnyProduct {
  const uint16_t* w = nullptr;  // [rows, cols] bf16
  int rows = 0;
  float* y = nullptr;            // [n, rows]
  const float* bias = nullptr;   // [rows] or null
};
bool skinny_gemm_supports(int n, int cols);
void skinny_gemm(const uint16_t* x_bf16, const float* x_f32, int n, int cols, const SkinnyProduct* products,
                 int count, cudaStream_t stream = nullptr);
// The gate and up products with the GLU applied (glu's expressions): y[t, r] = act(x[t] . w_gate[r])
// * (x[t] . w_up[r]), act = gelu (tanh form) or silu, and y's bf16 copy where y_bf16 is not null.
void skinny_gemm_glu(bool gelu, const uint16_t* x_bf16, const float* x_f32, int n, int cols, const uint16_t* w_gate,
                     const uint16_t* w_up, int rows, float* y, uint16_t* y_bf16, cudaStream_t stream = nullptr);

// Folds one part of an attention into a running result, row by row (rows of d floats with a
// natural-log log-sum-exp each; -inf: an empty part): out = (e^lse out + e^part_lse part) /
// (e^lse + e^part_lse), lse = log(e^lse + e^part_lse).
void merge_attention(float* out, float* lse, const float* part, const float* part_lse, int rows, int d,
                     cudaStream_t stream = nullptr);
// Folds each decode row's own position (NewestKv, tqkv/cuda.h) into its merged attention: row
// b's query head h scores its key (scale * q . k) and merges its value by that score, as
// merge_attention merges a part of one key. q, out: [batch, n_q_heads, d] f32; lse: [batch,
// n_q_heads], natural log (-inf: nothing merged yet).
void merge_newest(float* out, float* lse, const float* q, const NewestKv& newest, int batch, int n_q_heads,
                  int n_kv_heads, int d, float scale, cudaStream_t stream = nullptr);

// Key centring and channel scales (src/engine/cache/key_centring.h): k [n, n_kv_heads, head_dim] ->
// (k - mean) / scale; q [n, n_kv_heads * group, head_dim] *= scale of its kv head when
// scale_queries. mean, scale: [n_kv_heads, head_dim].
void centre_keys(float* k, float* q, const float* mean, const float* scale, int n, int n_kv_heads, int group,
                 int head_dim, bool scale_queries, cudaStream_t stream = nullptr);

// Causal attention of a run of queries against a contiguous K/V (a prefill chunk against its
// sequence's dequantized cache): query i sits at position pos0 + i and sees keys at positions
// kp <= pos0 + i - shift (and kp > pos0 + i - window when window > 0), key j at position j.
// Tiled, with an online softmax and GQA (query head h reads kv head h / group): 16-bit K/V on
// tensor cores (64 queries a CTA, 64-key tiles), f32 K/V exactly in f32 (16 queries, 32 keys).
struct PrefillArgs {
  const float* q = nullptr;  // [n_q, n_q_heads, head_dim], row stride q_stride floats
  int64_t q_stride = 0;      // 0: n_q_heads * head_dim
  const void* k = nullptr;   // [n_kv, n_kv_heads, head_dim]
  const void* v = nullptr;
  DType kv_dtype = DType::BF16;  // BF16 or F16: tensor cores; F32: the scalar kernel, exact in f32
  float* out = nullptr;      // [n_q, n_q_heads, head_dim], row stride out_stride floats
  int64_t out_stride = 0;    // 0: n_q_heads * head_dim
  int n_q = 0;
  int64_t pos0 = 0;          // position of query 0; n_kv >= pos0 + n_q
  int n_kv = 0;
  // k and v hold the keys [kv_start, n_kv) only (row 0 is position kv_start): a sliding window
  // must then exclude every earlier key of every query (pos0 - window + 1 >= kv_start).
  int64_t kv_start = 0;
  int n_q_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;          // 64, 128 or 256
  float scale = 0;           // 0: 1/sqrt(head_dim)
  int window = 0;
  // A query at p sees keys up to p - shift only (the copies' parts: the compressed middle stops
  // where the recent window starts, every part before the query's own position when it is folded
  // in apart).
  int shift = 0;
  // One part of a layer kept in parts: k and v hold keys [kv_start, n_kv) and no other key is
  // these queries' (no check that a window covers the keys before kv_start, and n_kv may end
  // before the last query); a query may then see no key at all (output 0, lse -inf).
  bool part = false;
  float* lse = nullptr;      // optional [n_q, n_q_heads]: each row's natural-log log-sum-exp
  // Keys split across CTAs (16-bit K/V): a run too short to fill the GPU by itself (a chunk over
  // a long history) has each CTA's key tiles shared by several CTAs, whose rows are merged by
  // their log-sum-exps after. 0: the op's choice (as many as keep one wave of CTAs;
  // TQKV_PREFILL_SPLITS=N caps it, 1 turns it off); N: exactly N (at most 64). Splits need a
  // device workspace of prefill_workspace_bytes(args) bytes; with less the run splits no more
  // than fits (none without one).
  int splits = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
void prefill_attention(const PrefillArgs& args, cudaStream_t stream = nullptr);
// The workspace prefill_attention would split `args` with (0: it would not split them).
size_t prefill_workspace_bytes(const PrefillArgs& args);

}  // namespace tqkv::cuda
