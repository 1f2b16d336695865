// CUDA kernels for the compressed paged KV cache (sm_90): a fused store (rotate, normalise,
// quantize, pack, scatter through a slot mapping), a split-KV decode attention with a merge
// step fused into one launch (plan/init/run), and a dequantize kernel (paged -> contiguous fp16/bf16).
//
// The bytes written and read are exactly those of docs/FORMAT.md ("Slot" and "Paged cache").
// All pointers in these structs are device pointers unless noted; every function is
// asynchronous on `stream` and throws tqkv::Error on bad arguments or a CUDA error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tqkv/attention_params.h"
#include "tqkv/format.h"
#include "tqkv/page_geometry.h"
#include "tqkv/rotation.h"

namespace tqkv::cuda {

enum class DType : uint8_t { F32, F16, BF16 };
using tqkv::PageLayout;  // page_geometry.h: FORMAT.md "slot layout" (vLLM AoS) / "page layout" (SoA)

// Host-side constants of one (format, head_dim, seed), passed to kernels by value: the
// float-rounded codebook levels and thresholds (codes of up to 8 bits: 256 levels, 255
// thresholds padded with +inf), their fp16 roundings (the decode kernel's lookup tables), the
// SRHT signs as a bit mask, 1/sqrt(d). The store and dequantize kernels take the whole struct
// (4 KiB of kernel parameters, sm_70+ with CUDA 12.1+); the decode kernel only the fp16 levels.
struct CodecTables {
  static constexpr int kMaxLevels = 256;
  float k_levels[kMaxLevels];
  float k_thresholds[kMaxLevels];
  float v_levels[kMaxLevels];
  float v_thresholds[kMaxLevels];
  uint16_t k_levels_h[kMaxLevels];  // fp16 bits of k_levels
  uint16_t v_levels_h[kMaxLevels];
  uint32_t sign_bits[8];  // bit i set: sign_i = -1 (Srht); all zero for Hadamard
  float rot_scale;        // 1/sqrt(d), rounded as the CPU reference rounds it
};

// A format at one head dimension. head_dim is 64, 128 or 256 (power-of-two rotations only).
// Mse keys and values and Uniform values take 1..8-bit codes; every format stores and
// dequantizes; decode_supported() says which pairs have a compiled split-KV decode kernel.
class CacheCodec {
 public:
  CacheCodec(const Format& format, int head_dim, uint64_t seed = kDefaultSeed);
  const Format& format() const { return format_; }
  int head_dim() const { return head_dim_; }
  uint64_t seed() const { return seed_; }
  size_t slot_bytes() const { return format_.slot_bytes(head_dim_); }
  const CodecTables& tables() const { return tables_; }
  // True where run_decode has a kernel for this format's key/value pair at this head_dim
  // (src/cuda/decode_pairs.cmake generates them: the named formats but f32 at every head dim,
  // the recipes' pairs and wq<B> windows at the recipes' head dims);
  // other formats attend through dequantize + a tiled kernel (engine::CudaKvCache).
  bool decode_supported() const;

 private:
  Format format_;
  int head_dim_;
  uint64_t seed_;
  CodecTables tables_;
};

// One layer's page pool. page_bytes = block_size * n_kv_heads * slot_bytes.
struct PagedKv {
  uint8_t* pages = nullptr;  // [num_blocks, page_bytes]
  int num_blocks = 0;
  int block_size = 16;  // tokens per page: 16, 32, 64 or 128
  int n_kv_heads = 0;
  PageLayout layout = PageLayout::Page;
};
size_t page_bytes(const CacheCodec& codec, const PagedKv& kv);

// Store a batch of new tokens. k, v: [n_tokens, n_kv_heads, head_dim] (row stride
// token_stride elements between tokens, heads contiguous), slot_mapping: [n_tokens]
// (slot = page * block_size + offset; negative = skip). Inputs must be finite and in the
// format's range (the CPU codec's Overflow/NonFinite checks are not repeated on the GPU).
struct StoreArgs {
  const void* k = nullptr;
  const void* v = nullptr;
  DType dtype = DType::BF16;
  int64_t token_stride = 0;  // 0: n_kv_heads * head_dim
  const int64_t* slot_mapping = nullptr;
  int n_tokens = 0;
  // One warp per (token, kv head) encodes its key and another its value, side by side (half the
  // dependent chain of a warp: what a decode step of few tokens waits for); false: one warp does
  // both, one after the other. The bytes are the same either way.
  bool split_kv = true;
};
void store(const CacheCodec& codec, const PagedKv& kv, const StoreArgs& args, cudaStream_t stream = nullptr);

// The same K/V rows stored into up to kMaxStoreTargets page pools in one launch, each through its
// own codec and slot mapping (a layer's compressed pages and its copies: the recent window's ring,
// the sinks), so a decode step pays one launch per layer for all of them. Every target's bytes
// are what store() writes for it. key_mean/key_scale ([n_kv_heads * head_dim], both or neither)
// centre the keys on the way, (k - mean) / scale per channel in the same float operations as
// centre_keys (args.k itself is not modified). Targets share head_dim and n_kv_heads;
// args.slot_mapping is not used.
constexpr int kMaxStoreTargets = 3;
struct StoreTarget {
  const CacheCodec* codec = nullptr;
  PagedKv kv{};
  const int64_t* slot_mapping = nullptr;
};
void store_many(const StoreTarget* targets, int n_targets, const StoreArgs& args, const float* key_mean = nullptr,
                const float* key_scale = nullptr, cudaStream_t stream = nullptr);

// Split-KV decode attention, one query token per sequence (at its last position), GQA (query
// head h uses kv head h / (n_q_heads / n_kv_heads)). Needs the page layout.
// params (attention_params.h, as the CPU paths): n_q_heads, head_dim (0 or the codec's), scale
// (0: 1/sqrt(head_dim)), lse ([batch, n_q_heads] device memory, natural log of the softmax
// denominator; -inf for an empty key range) and the key-range cuts: the query of sequence b sits
// at position p = seq_lens[b] - 1 and reads keys [lo, hi) with lo = max(min_key_pos, p + 1 -
// window if window > 0), hi = seq_lens[b] - exclude_recent (the CPU attention's semantics, so
// sinks, a recent window and the compressed middle merge by their log-sum-exps).
// Each decode row's own position given apart (run_fused_decode, merge_newest): its key and value
// as the layer computed them, attended exactly and folded into the parts' merge by its score,
// where the parts stop at p - 1 (engine::CudaKvCache; the CPU's RecentWindow::attention). Then a
// decode reads nothing its step's store writes, and the store may run beside it.
struct NewestKv {
  const float* k = nullptr;  // [tokens, n_kv_heads, head_dim] f32; null: no fold
  const float* v = nullptr;  // [tokens, n_kv_heads, head_dim] f32
  const int32_t* rows = nullptr;  // [batch]: the token of decode row b (null: token b)
  // [n_kv_heads, head_dim]: subtracted from k first, where the store centres the keys itself
  // (null: k is as stored, centred or not).
  const float* key_mean = nullptr;
};

struct DecodeArgs {
  const void* q = nullptr;  // [batch, n_q_heads, head_dim], original domain
  DType q_dtype = DType::BF16;
  void* out = nullptr;  // [batch, n_q_heads, head_dim]
  DType out_dtype = DType::F32;
  const int32_t* block_tables = nullptr;  // [batch, block_table_stride]
  int block_table_stride = 0;
  const int32_t* seq_lens = nullptr;  // [batch]
  int batch = 0;
  AttentionParams params;
};
// Host decisions, fixed for a CUDA graph: how many splits each (sequence, kv head) gets and
// the workspace the partial outputs need. max_seq_len bounds every seq_lens[b].
struct DecodePlan {
  int num_splits = 0;
  int batch = 0;
  int n_q_heads = 0;
  int max_seq_len = 0;
  size_t workspace_bytes = 0;
  // With 2..8 CTAs per (sequence, kv head) (16 where the device fits such a cluster), they run as one thread-block cluster and merge
  // through distributed shared memory (no workspace round trip); false: the last CTA to finish
  // merges through the workspace. plan_decode sets it; clearing it forces the workspace path.
  bool cluster_merge = false;
};
DecodePlan plan_decode(const CacheCodec& codec, const PagedKv& kv, int batch, int n_q_heads, int max_seq_len,
                       int num_splits = 0 /* 0: choose from the device */);
// One kernel launch: each CTA covers plan.num_splits / (its warps) of a (sequence, kv head)'s
// range, merges its warps' partial results in shared memory, and the last CTA of the (sequence,
// kv head) to finish merges the CTAs' partials and writes the output (a counter per (sequence, kv
// head) in the workspace finds it and is reset by it). The grid is fixed by the plan, so the
// launch can be captured in a CUDA graph and replayed.
// workspace: device memory of plan.workspace_bytes (256-byte aligned), prepared once by
// init_decode_workspace before its first run_decode (and again if a run was aborted); every run
// leaves it prepared. An unprepared workspace gives NaN outputs, never a wrong merge.
void init_decode_workspace(const CacheCodec& codec, const PagedKv& kv, const DecodePlan& plan, void* workspace,
                           cudaStream_t stream = nullptr);
void run_decode(const CacheCodec& codec, const PagedKv& kv, const DecodeArgs& args, const DecodePlan& plan,
                void* workspace, cudaStream_t stream = nullptr);

// Fused decode of a layer kept in three parts (engine::CudaKvCache's attention sinks and recent
// window, beside the compressed middle): one launch in which each part's CTAs read its own pool
// (codec, block tables, lengths, key-range cuts), and the last CTA of a (sequence, kv head) merges
// every part's partial outputs by log-sum-exp (or its CTAs merge as one thread-block cluster:
// FusedDecodeOptions::cluster), so no separate merge runs. Parts: kFusedMain,
// kFusedWindow, kFusedSinks; a part without a codec is absent (no CTAs); the sinks are f16.
enum FusedPart : int { kFusedMain = 0, kFusedWindow = 1, kFusedSinks = 2 };
struct DecodePart {
  const CacheCodec* codec = nullptr;  // host pointer; null: no such part
  PagedKv kv;
  const int32_t* block_tables = nullptr;  // [batch, block_table_stride]
  int block_table_stride = 0;
  const int32_t* seq_lens = nullptr;  // [batch]: the query of sequence b sits at seq_lens[b] - 1
  int max_seq_len = 0;                // bounds the part's key positions (its splits' tiles)
  int min_key_pos = 0, window = 0, exclude_recent = 0;  // the cuts of AttentionParams
};
struct FusedDecodePlan {
  int batch = 0;
  int n_q_heads = 0;
  int ctas[3] = {0, 0, 0};  // CTAs per (sequence, kv head) of each part
  size_t workspace_bytes = 0;
  bool cluster_merge = false;  // the CTAs of a (sequence, kv head) merge as one cluster, in DSMEM
  bool short_first = false;    // without a cluster merge: the window's and sinks' CTAs start first
};
// The choices of plan_fused_decode; the defaults are the measured ones
// (docs/journal/RESULTS-journal.md, "Batch 1, kernel by kernel"), the others stay selectable
// (engine: TQKV_FUSED_CLUSTER, TQKV_FUSED_SHORT_FIRST).
struct FusedDecodeOptions {
  // Where every (sequence, kv head)'s CTAs fit one resident thread-block cluster (at most 16, the
  // whole grid resident: batch 1), they merge in distributed shared memory, not through the
  // workspace and a counter.
  bool cluster = true;
  // Without a cluster merge, the grid starts every (sequence, kv head)'s window and sink CTAs
  // before any middle CTA (the longest), instead of one (sequence, kv head) after another:
  // 1 always, 0 never, -1 (the default) where the grid takes more than one wave.
  int short_first = -1;
};
// True where a fused kernel exists for the middle's and the window's pairs at this head dim
// (src/cuda/decode_pairs.cmake: the recipes' pairs with their windows); window null: no window part.
bool fused_decode_supported(const CacheCodec& main, const CacheCodec* window);
FusedDecodePlan plan_fused_decode(const DecodePart (&parts)[3], int batch, int n_q_heads,
                                  const FusedDecodeOptions& options = {});
// The workspace as init_decode_workspace's: prepared once, left prepared by every run.
void init_fused_decode_workspace(const FusedDecodePlan& plan, int n_kv_heads, void* workspace,
                                 cudaStream_t stream = nullptr);
// args: q, out, their dtypes, batch and params (n_q_heads, head_dim, scale, lse); its block
// tables, lengths and cuts are unused (each part has its own). newest.k given (f32 queries only):
// each row's own position is folded in after the parts merge (the parts' cuts must then leave
// it out), by the CTA that writes the row.
void run_fused_decode(const DecodePart (&parts)[3], const DecodeArgs& args, const FusedDecodePlan& plan,
                      void* workspace, cudaStream_t stream = nullptr, const NewestKv& newest = {});

// Dequantize tokens [start, start + n_tokens) of one sequence into contiguous
// k_out, v_out: [n_tokens, n_kv_heads, head_dim] in the original domain (fp16/bf16/f32).
struct DequantArgs {
  const int32_t* block_table = nullptr;  // the sequence's pages
  int start = 0;
  int n_tokens = 0;
  void* k_out = nullptr;
  void* v_out = nullptr;
  DType out_dtype = DType::BF16;
};
void dequantize(const CacheCodec& codec, const PagedKv& kv, const DequantArgs& args, cudaStream_t stream = nullptr);

}  // namespace tqkv::cuda
