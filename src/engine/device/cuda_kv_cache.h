// The CUDA cache layer: per layer a page pool (tqkv::cuda::PagedKv, page layout, 16 tokens per
// page) of the layer's format, shared block ids across layers from one free list, and per
// sequence a block table on the host, mirrored to the device for each step.
//
// attend(): centring/scales (KeyCentring's numbers, uploaded once), the fused store of the
// batch's K/V through a slot mapping, then attention: the queries of the runs that attend as
// decode rows (single tokens, and prefill chunks by prefill_rows(), below) in one split-KV
// launch (cuda::run_decode; plans and workspaces kept per row count), every other run by
// dequantizing its sequence's positions [0, pos0 + count) to a workspace (bf16; float32 for
// uncompressed formats) and the tiled causal prefill kernel. Formats the decode kernel lacks
// (f32) take the tiled path for every run, decode tokens too; layers with a sliding window
// attend as rows cut by it (AttentionParams::window).
//
// Attention sinks and the recent window (sink<S>, w<N>, fill<B>, wq<B>; docs/FORMAT.md), as the
// CPU's RecentWindow: every compressed layer keeps, next to its pool, a pool of f16 copies of
// each sequence's first S positions and a ring pool of copies of its last N + 512 positions
// (f16, or the wq<B> Mse pair); the ring is a block table that repeats the sequence's ring
// blocks, so the decode kernel reads it like any paged cache. Every query of a step (prefill
// tokens included, 512 per step at most) then runs through the split-KV decode kernel three
// times, over the copies of [0, S), the compressed [S, p - N] and the copies of (p - N, p], and
// the parts merge by their log-sum-exps: in one fused launch (cuda::run_fused_decode, whose
// last CTA per (sequence, kv head) merges every part) where a fused kernel is compiled for the
// layer's pair and window pair (src/cuda/decode_pairs.cmake: a fixed set), else in three
// launches and two cuda::merge_attention (also above TQKV_FUSED_MAX_ROWS rows); in a recorded step
// (CUDA graphs) the three launches' window and sinks are forked onto two side streams, parallel
// branches beside the compressed one. A pair without a compiled decode kernel takes the three
// launches over an f16 conversion of its pool (Layer::generic), without graphs. Copies need no
// sliding-window layers.
//
// A fresh run (the sequence held nothing: attend_fresh) attends to its own keys and values,
// rounded to f16 (f32 layers: as they are), through the tiled kernel, at any length; the window's
// ring keeps its last positions. Other prefill chunks take one of two paths, chosen per chunk (prefill_rows();
// TQKV_PREFILL_PATH=auto|tiled|rows): every query as a row of the split-KV decode kernel over
// the pages, or dequantize + the tiled kernel, above (with copies: each part of the layer,
// prefill_parts). Auto
// takes the tiled kernel (tensor cores) for runs of 64 queries or more: on the H200, with a short
// run's keys split across CTAs, it beat the rows at 64 and 128 queries over histories of 1K-8K
// (256: from 2K on) and by 2-6x for runs of 512 and more (the numbers: kPrefillTiledFrom).
//
// CUDA graphs (cuda_graphs.h): a decode step padded to a bucket prepares into that bucket's
// fixed buffers (prepare_bucket) and keeps its recorded graphs (step_graph), so that a replay
// reads the step's slot mappings, tables and lengths where the recording read them.
//
// Decode plans (split counts, grids) are sized by the step's longest sequence, rounded up to a
// power of two of at least kMinPlanLen positions and at most the capacity (plan_len), not by the
// capacity itself: a 1K-token sequence in a 32K-position cache gets the splits of a 1K cache
// (on the H200, batch 1, f16: 495 against 735 tokens/s when planned for 33K). Recorded graphs
// are kept per (model, bucket, plan length), so a replay runs the plan of its own length class.
// A plan stays correct for any longer sequence (its last split takes the tiles beyond the
// plan's length; a part with cuts spreads its splits over its own range), only slower.
//
// Pairs without a compiled decode kernel (src/cuda/decode_pairs.cmake compiles a fixed set: the
// named formats and the widths of tqkv/format.h): without copies they attend through dequantize + the tiled kernel;
// with copies their compressed middle (or the window's ring) is dequantized each step into an f16
// pool of the same blocks and read by the f16 decode kernel, then merged with the other parts
// (Layer::generic). Not on the GPU yet (refused at creation with tqkv::Error(InvalidArgument)):
// 1-bit codes or f32 beside copies, copies with sliding-window layers, the CPU's Overflow check of a
// sink element beyond the fp16 range, head dims other than 64/128/256. A sequence holds at most
// `capacity` positions: a step past it throws Error(Capacity) in check().
//
// Sliding-window layers keep a ring of pages as on the CPU (CacheSpec::ring_positions: the
// window + 255 positions, where the model has full-attention layers too and the ring is shorter
// than the capacity): each such layer's pool holds a ring of blocks per sequence slot instead of
// blocks from the shared free list, steps take at most CacheSpec::kWindowStepTokens tokens, and
// every read of it is cut by its window (the decode rows by AttentionParams::window, the tiled
// path by dequantizing only the window's positions: PrefillArgs::kv_start).
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "engine/device/cuda_graphs.h"
#include "engine/cache/key_centring.h"
#include "engine/cache/kv_cache.h"
#include "tqkv/cuda.h"
#include "tqkv/cuda_ops.h"  // PrefillArgs

namespace tqkv::engine {

class CudaKvCache final : public KvCache, public StepRecorder {
 public:
  static constexpr int kBlockSize = 16;

  // stream: the device's (shared, so that a cache may outlive its device).
  CudaKvCache(const CacheSpec& spec, const CacheShape& shape, std::shared_ptr<CUstream_st> stream);
  ~CudaKvCache() override;

  int64_t add_sequence() override;
  void free_sequence(int64_t seq) override;
  int64_t seq_len(int64_t seq) const override;
  void check(const Batch& batch) const override;
  void attend(int layer, const Batch& batch, float* q, float* k, const float* v, float* out) override;
  void read(int layer, int64_t seq, int64_t start, int count, bool keys, float* out) const override;

  int free_blocks() const { return static_cast<int>(free_.size()); }
  // Device bytes of every layer's page pools (compressed pages, copies' rings and sinks): what
  // the cache holds on the GPU for max_seqs sequences of `capacity` positions.
  size_t pool_bytes() const;
  // Whether a run of `count` queries attends as decode rows (else: dequantize + tiled kernel).
  // Always for one token, and with copies where the model has sliding-window layers; else by the
  // environment's TQKV_PREFILL_PATH (auto, tiled, rows) and, for auto, the run's length against
  // the crossover (kPrefillTiledFrom; TQKV_PREFILL_TILED_FROM overrides it). Layers without a
  // decode kernel take the tiled path whatever this says.
  bool prefill_rows(int count) const;
  // Layers whose copies attend in one fused launch (tests).
  int fused_layers() const {
    int n = 0;
    for (const Layer& L : layers_) n += L.fused;
    return n;
  }
  // Layers whose copies read an f16 conversion of a pool without a compiled kernel (tests).
  int generic_layers() const {
    int n = 0;
    for (const Layer& L : layers_) n += L.generic || L.generic_window;
    return n;
  }
  // Fused-decode plans made so far whose CTAs merge as a thread-block cluster (tests).
  int fused_cluster_plans() const {
    int n = 0;
    for (const auto& entry : fused_plans_) n += entry.second.plan.cluster_merge;
    return n;
  }

  // CUDA graphs. True where every layer attends through the split-KV decode kernel (no format
  // without a decode kernel; sliding-window layers as rows) and no key hook is set.
  bool graphs_supported() const;
  StepRecorder* step_recorder() override { return graphs_supported() ? this : nullptr; }
  // StepRecorder (kv_cache.h); prepare_bucket checks the batch; step_graph keeps one graph per
  // plan length (plan_len).
  void prepare_bucket(const Batch& batch, int bucket) override;
  void cancel_bucket() override { bucket_pending_ = 0; }
  StepGraph& step_graph(const void* model, int bucket, int64_t longest) override;
  // The length decode steps whose longest sequence holds `longest` positions are planned for.
  int plan_len(int64_t longest) const;
  static constexpr int kMinPlanLen = 256;
  // How many steps are recorded (tests).
  int graphs_recorded() const;
  // Device bytes of the recorded steps' activations, all buckets (one set per model and bucket,
  // shared by its length classes: StepActivations).
  size_t graph_activation_bytes() const;
  // The activations of the steps at `bucket` (of the first model, by address, that ran one
  // there; null before the first step).
  const StepActivations* step_activations(int bucket) const;

 private:
  struct Layer {
    cuda::CacheCodec codec;
    cuda::PagedKv kv;
    bool decode = false;      // run_decode has a kernel for the format
    // Copies (compressed layers of a spec with sinks or a window): their codecs and pools.
    std::optional<cuda::CacheCodec> window_codec, sink_codec;
    cuda::PagedKv window_kv, sink_kv;
    bool fused = false;  // copies attend in one fused launch (cuda::run_fused_decode)
    // Copies beside a pair without a compiled decode kernel (src/cuda/decode_pairs.cmake): each
    // step dequantizes the step's blocks of that pool (the compressed middle, or the window's
    // ring) into an f16 pool of the same blocks (shadow_kv_, shadow_ring_kv_), which the f16
    // kernel then reads like the pool itself; the parts merge as in the three launches.
    bool generic = false, generic_window = false;
    // A sliding-window layer that keeps only its window (CacheSpec::ring_positions > 0, as the
    // CPU): a pool of slide_ring_blocks_ blocks per sequence slot, position p in block
    // slot * slide_ring_blocks_ + (p / 16) % slide_ring_blocks_, read through ring tables that
    // repeat them (every read of such a layer is cut by its window).
    bool ring = false;
  };
  struct Sequence {
    std::vector<int32_t> blocks;
    int64_t len = 0;
    int slot = 0;  // its ring and sink blocks: slot * ring_blocks_ + i, slot * sink_blocks_ + i
  };
  struct Plan {
    cuda::DecodePlan plan;
    void* workspace = nullptr;
  };
  struct FusedPlan {
    cuda::FusedDecodePlan plan;
    void* workspace = nullptr;
  };
  // What a step's layers share: uploaded slot mapping, block tables, decode rows.
  struct Step {
    std::vector<Batch::Run> runs;
    std::vector<uint8_t> as_rows;   // per run: its queries are decode rows (prefill_rows)
    int n_rows = 0;                  // decode rows: the tokens of the runs as_rows
    bool decode_contiguous = false;  // the decode rows are the whole batch, in order
  };

  // A step's buffers on the device: grown for op-by-op steps, fixed per graph bucket.
  struct StepBuffers {
    void* slots = nullptr;
    void* tables = nullptr;
    void* parts = nullptr;
  };

  const Sequence& at(int64_t seq) const;
  // bucket > 0: pad to `bucket` rows into the bucket's buffers.
  void prepare(const Batch& batch, int bucket = 0);
  void* grow(void*& p, size_t& have, size_t bytes);
  // The decode parts of a layer: which pool a launch reads. Each has its own plans (and
  // workspaces), so the parts may run at the same time.
  enum class Part { Main, Window, Sinks };
  Plan& plan_for(const cuda::CacheCodec& codec, const cuda::PagedKv& kv, Part part, int batch, int max_len,
                 cudaStream_t stream);
  bool copies() const { return sinks_ > 0 || window_ > 0; }
  // A ring layer's (Layer::ring) block holding the sequence's block b (positions 16b..16b+15).
  int32_t slide_block(int slot, int64_t b) const {
    return static_cast<int32_t>(slot * slide_ring_blocks_ + b % slide_ring_blocks_);
  }
  // The decode rows' block tables of layer L's own pool: its ring's, or the shared blocks'.
  const int32_t* row_tables(const Layer& L) const { return L.ring ? slide_dec_tables_ : dec_tables_; }
  // The compressed (or only) part's plan length in a layer with sliding window `layer_window`
  // (0: full attention): the step's, or the window's where that is shorter, so that the splits
  // cover the positions the layer reads, not the longest sequence.
  int layer_plan_len(int layer_window) const {
    return layer_window > 0 ? std::min(layer_window + kBlockSize, step_plan_len_) : step_plan_len_;
  }
  // The window part's plan length: its positions, or fewer where every sequence is shorter.
  int window_plan_len() const { return std::min(window_ + kBlockSize, step_plan_len_); }
  // Floats of the copies' parts for `rows` decode rows: the window's and the sinks' outputs
  // [rows, n_heads, head_dim] each, then the log-sum-exps of the compressed part, the window's
  // and the sinks' [rows, n_heads] each.
  size_t parts_floats(int rows) const {
    return static_cast<size_t>(rows) * spec().model.n_heads * (2 * static_cast<size_t>(spec().model.head_dim) + 3);
  }
  // The tiled kernel's arguments for run r's queries q (its first row) and outputs out over the
  // workspace (kws_, vws_) of type dtype; the caller sets the keys' range and the mask.
  cuda::PrefillArgs workspace_prefill(const Batch::Run& r, const float* q, float* out, cuda::DType dtype,
                                      float scale) const;
  // cuda::prefill_attention(pa) on the step's stream, with the split workspace (split_ws_) it asks
  // for where a run is too short to fill the GPU.
  void attend_prefill(cuda::PrefillArgs& pa);
  // A run of a sequence that held nothing before this step (pos0 0; not a bucket's padding).
  static bool fresh(const Batch::Run& r) { return r.seq >= 0 && r.pos0 == 0; }
  // A fresh run (fresh(r)): its queries through the tiled kernel over the run's own k and v.
  void attend_fresh(const Layer& L, const Batch::Run& r, const float* q, const float* k, const float* v, float* out,
                    float scale, int window);
  // A prefill run (step_.runs[run]) of a layer with copies through the tiled kernel: its parts
  // as the rows see them, merged into out (the run's rows of [n, n_heads, head_dim]).
  void prefill_parts(const Layer& L, size_t run, const float* q, const float* k, const float* v, float* out,
                     float scale, const float* key_mean, bool fold);
  // One decode launch over the step's rows into o [n_rows, n_heads, head_dim] and lse, on `stream`.
  void decode(const cuda::CacheCodec& codec, const cuda::PagedKv& kv, Part part, const int32_t* tables, int stride,
              const int32_t* lens, int max_len, const AttentionParams& ap, const float* q, float* o, float* lse,
              cudaStream_t stream);
  // The step's decode rows: q and o [n_rows, n_heads, head_dim] f32, attention parameters ap.
  cuda::DecodeArgs step_args(const float* q, float* o, const AttentionParams& ap) const;
  // The sinks, the compressed middle and the window of a layer with copies in one launch into o.
  // layer_window: the layer's sliding window (0: full attention), a cut of every part.
  void fused_decode(const Layer& L, int layer_window, const AttentionParams& ap, const float* q, float* o,
                    const cuda::NewestKv& nk);
  // A store of n_tokens f32 rows k, v to `slots` (the cache's store settings).
  cuda::StoreArgs store_args(const void* k, const void* v, const int64_t* slots, int n_tokens) const;
  // Positions [start, start + n_tokens) of the pages in `table` dequantized into kws_ / vws_
  // (grown; row 0 is position start).
  void dequantize_to_workspace(const cuda::CacheCodec& codec, const cuda::PagedKv& kv, const int32_t* table,
                               int start, int n_tokens, cuda::DType dtype);
  // The generic path's conversion: blocks [n_blocks] of `from` (read through `codec`) dequantized
  // and stored in f16 into the same blocks of `to` (slots [16 n_blocks]: block * 16 + i).
  void to_f16(const cuda::CacheCodec& codec, const cuda::PagedKv& from, const cuda::PagedKv& to, const int32_t* blocks,
              const int64_t* slots, int n_blocks);

  std::shared_ptr<CUstream_st> owner_;
  cudaStream_t stream_;
  KeyCentring centring_;
  float* mean_ = nullptr;   // [n_layers, n_kv_heads, head_dim]
  float* scale_ = nullptr;
  int blocks_per_seq_ = 0;
  int sinks_ = 0, window_ = 0;            // the spec's S and N (0: none)
  int slide_ = 0;  // with copies: the sliding window of the model's sliding-window layers (one size)
  int ring_blocks_ = 0, sink_blocks_ = 0;  // per sequence
  int slide_ring_blocks_ = 0;  // per sequence: the ring of each sliding-window layer (Layer::ring)
  std::vector<Layer> layers_;
  std::vector<int32_t> free_;
  std::vector<int> free_slots_;
  std::unordered_map<int64_t, Sequence> seqs_;
  int64_t next_id_ = 0;
  Step step_;
  std::map<std::tuple<std::string, Part, int, int>, Plan> plans_;
  // Layers with copies: one fused launch per layer (Layer::fused), plans by (middle format, window
  // format, rows, plan length). A layer's stores (compressed pages, window ring, sinks) and its key
  // centring are one launch too (cuda::store_many), keys and values by separate warps.
  // The fused decode's plan choices (cuda::FusedDecodeOptions): the defaults, but
  // TQKV_FUSED_CLUSTER=0 (no cluster merge) and TQKV_FUSED_SHORT_FIRST (the grid's order).
  cuda::FusedDecodeOptions fused_options_;
  // Prefill chunks (prefill_rows): auto, or forced to either path.
  enum class PrefillPath { Auto, Tiled, Rows };
  PrefillPath prefill_path_ = PrefillPath::Auto;
  int64_t tiled_from_ = 64;  // auto: runs of >= this many queries take the tiled kernel (kPrefillTiledFrom)
  bool workspace_bf16_ = false;  // TQKV_PREFILL_WORKSPACE=bf16: compressed formats dequantize to bf16, not f16
  // Above this many decode rows (prefill chunks whose queries run as decode rows) the three
  // launches stay: 1K-row prefill steps measured 5-20% slower fused on the H200, and still
  // 4-24% slower with the copies' parts capped at the middle's CTAs above 256 rows
  // (plan_fused_decode; docs/journal/RESULTS-journal.md, GPU serving, fourth run).
  // TQKV_FUSED_MAX_ROWS=N moves the limit (0: the three launches for every step). Decode steps of
  // every CUDA-graph bucket (at most 256 sequences) stay fused.
  static constexpr int kFusedMaxRows = 256;
  int fused_max_rows_ = kFusedMaxRows;
  std::map<std::tuple<std::string, std::string, int, int>, FusedPlan> fused_plans_;
  // Copies, while a step is recorded: the window's and the sinks' decodes go to side streams,
  // forked from and joined back into the step's stream (parallel branches of the graph), and so
  // does a covered layer's store where no decode reads it (fold_newest_: side_[2], join_[2]).
  cudaStream_t side_[3] = {nullptr, nullptr, nullptr};
  cudaEvent_t fork_ = nullptr, fork_store_ = nullptr;
  cudaEvent_t join_[3] = {nullptr, nullptr, nullptr};
  // Each decode row's own position is folded in from the layer's k and v as computed (f32), and
  // the copies' parts and the middle stop at p - 1 (cuda::NewestKv; the CPU's RecentWindow), so a
  // layer with copies reads nothing its step's store writes. TQKV_FOLD_NEWEST=0: every position
  // read back from the pools, as before (both devices).
  bool fold_newest_ = true;
  // Sliding-window layers without copies attend as decode rows cut by their window, as the
  // layers with copies do (on the H200, Gemma-3-270m f16 at batch 1: the tiled path per token
  // took 88% of a step), planned for their window (layer_plan_len); fused_decode gives no CTA to
  // a middle that the window covers. Prefill runs of layers with copies may take the tiled
  // kernel, part by part (prefill_rows).
  // Device buffers of the step (grown, never shrunk).
  void* slots_ = nullptr;  // int64 [n]
  size_t slots_bytes_ = 0;
  void* tables_ = nullptr;  // int32 [runs, blocks_per_seq] then decode [n_dec, blocks_per_seq], lens, rows
  size_t tables_bytes_ = 0;
  int64_t* step_slots_ = nullptr;   // this step's slot mapping and tables: slots_ / tables_ or a bucket's
  int32_t* step_tables_ = nullptr;
  int32_t* dec_tables_ = nullptr;
  int32_t* dec_lens_ = nullptr;
  int32_t* dec_rows_ = nullptr;
  int32_t* win_tables_ = nullptr;  // copies: [n_rows, blocks_per_seq] ring tables
  int32_t* sink_tables_ = nullptr;  // [n_rows, sink_blocks]
  int32_t* sink_lens_ = nullptr;    // [n_rows]: min(S, len), or min(S, len - 1) with fold_newest_
  int32_t* slide_sink_lens_ = nullptr;  // [n_rows], slide_ > 0: sink_lens_ while the sink is in the window, else 0
  int64_t* win_slots_ = nullptr;    // [n]: the new tokens' ring slots
  int64_t* sink_slots_ = nullptr;   // [n]: their sink slots (-1 past S)
  // Ring layers (Layer::ring): the new tokens' slots [n], the runs' ring tables [runs,
  // blocks_per_seq] and the decode rows' [n_rows, blocks_per_seq].
  int64_t* slide_slots_ = nullptr;
  int32_t* slide_run_tables_ = nullptr;
  int32_t* slide_dec_tables_ = nullptr;
  // Copies: the runs' ring tables [runs, blocks_per_seq] and sink tables [runs, sink_blocks]
  // (a run through the tiled path reads its window's and sinks' copies through them).
  int32_t* run_win_tables_ = nullptr;
  int32_t* run_sink_tables_ = nullptr;
  void* parts_ = nullptr;           // copies: the window and sink parts' outputs and the lses
  size_t parts_bytes_ = 0;
  float* step_parts_ = nullptr;     // the bucket's parts buffer (null: parts_)
  std::map<int, StepBuffers> buckets_;
  int bucket_pending_ = 0;
  std::map<std::tuple<const void*, int, int>, std::unique_ptr<StepGraph>> graphs_;
  std::map<std::pair<const void*, int>, std::shared_ptr<StepActivations>> step_acts_;  // per (model, bucket)
  // Plans by the step's longest sequence (plan_len).
  int step_plan_len_ = 0;  // this step's (prepare)
  // The generic path (Layer::generic, generic_window): the f16 codec and pools, and the step's
  // blocks to convert with their slots (the main pool's blocks of the step's sequences, their
  // ring blocks), uploaded by prepare().
  std::optional<cuda::CacheCodec> shadow_codec_;
  cuda::PagedKv shadow_kv_{}, shadow_ring_kv_{};
  void* conv_ = nullptr;
  size_t conv_bytes_ = 0;
  int32_t* conv_blocks_ = nullptr;
  int32_t* conv_ring_blocks_ = nullptr;
  int64_t* conv_slots_ = nullptr;
  int64_t* conv_ring_slots_ = nullptr;
  int32_t* conv_slide_blocks_ = nullptr;  // the ring layers' blocks of the step's sequences
  int64_t* conv_slide_slots_ = nullptr;
  int conv_n_ = 0, conv_ring_n_ = 0, conv_slide_n_ = 0;
  void* kws_ = nullptr;  // dequantized K, V
  size_t kws_bytes_ = 0;
  void* vws_ = nullptr;
  size_t vws_bytes_ = 0;
  void* split_ws_ = nullptr;  // the tiled prefill's key splits (cuda::prefill_workspace_bytes)
  size_t split_ws_bytes_ = 0;
  void* qbuf_ = nullptr;  // gathered decode queries, outputs
  size_t qbuf_bytes_ = 0;
  void* obuf_ = nullptr;
  size_t obuf_bytes_ = 0;
};

}  // namespace tqkv::engine
