#include "engine/device/cuda_kv_cache.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <optional>
#include <cmath>
#include <string>

#include "tqkv/cuda_ops.h"
#include "tqkv/options.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::Device, std::string("cuda cache: ") + what + ": " + cudaGetErrorString(e));
}

[[noreturn]] void not_yet(const std::string& what) {
  throw Error(ErrorCode::InvalidArgument, "cache spec: " + what + " is not on the GPU yet (use --device cpu)");
}

// Prefill runs, TQKV_PREFILL_PATH=auto: runs of at least this many queries dequantize their
// history and take the tiled kernel (tensor cores), shorter ones attend as decode rows. Measured
// on the H200 (SmolLM2-135M: d = 64, 9 query : 3 kv heads; `tqkv bench decode --prefill-chunk
// C`, 2026-12-04, docs/journal/RESULTS-journal.md), whole-model prefill tokens/s, tiled / rows,
// f16:
//   chunks of 512 over (4K, 8K]: 132K / 40K; over (8K, 16K]: 99K / 23K; one run of 7,168: 309K / 53K.
//   Since a short run's CTAs split the history's keys (cuda::prefill_attention's splits), the
//   tiled kernel also wins at 64 queries: chunks of 64 over (1K, 4K] 21K / 17K, over (2K, 8K]
//   24K / 19K; chunks of 128 39K / 33K and 31K / 28K (before the splits the rows won below 192).
// Shorter runs (a chat turn's tail) stay on the rows, whose CTAs split the history as well
// (not measured below 64). TQKV_PREFILL_TILED_FROM moves the crossover.
constexpr int64_t kPrefillTiledFrom = 64;

// What a pool of format f dequantizes to for the tiled prefill kernel: uncompressed formats
// exactly (f16 and bf16 as themselves: the kernel's tensor cores take either; f32 as f32),
// compressed ones to f16, the decode kernel's precision (its lookups and weights are f16; bf16
// keeps 3 bits fewer of each key, value and weight), or to bf16 where `compressed_bf16`
// (TQKV_PREFILL_WORKSPACE=bf16, read by the cache's constructor).
cuda::DType workspace_dtype(const Format& f, bool compressed_bf16) {
  if (!f.compressed() && f.value == ValueCodec::F32) return cuda::DType::F32;
  if (!f.compressed() && f.value == ValueCodec::F16) return cuda::DType::F16;
  if (!f.compressed()) return cuda::DType::BF16;
  return compressed_bf16 ? cuda::DType::BF16 : cuda::DType::F16;
}

size_t pool_bytes(const Format& f, int head_dim, int n_kv_heads, int blocks) {
  return static_cast<size_t>(blocks) *
         page_geometry(f, head_dim, CudaKvCache::kBlockSize, n_kv_heads, cuda::PageLayout::Page).page_bytes();
}

uint8_t* alloc_pool(const Format& f, int head_dim, int n_kv_heads, int blocks) {
  uint8_t* p = nullptr;
  ck(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(pool_bytes(f, head_dim, n_kv_heads, blocks), 1)),
     "allocating a page pool");
  return p;
}

void zero_pool(const Format& f, int head_dim, const cuda::PagedKv& kv) {
  ck(cudaMemset(kv.pages, 0, pool_bytes(f, head_dim, kv.n_kv_heads, kv.num_blocks)), "clearing a page pool");
}

}  // namespace

CudaKvCache::CudaKvCache(const CacheSpec& spec, const CacheShape& shape, std::shared_ptr<CUstream_st> stream)
    : KvCache(spec, shape), owner_(std::move(stream)), stream_(owner_.get()), centring_(spec, shape.capacity) {
  const ModelConfig& m = spec.model;
  const CachePlan& p = plan();  // checked the shape and the spec's layers
  sinks_ = p.sinks;
  window_ = p.window;
  fold_newest_ = env_bool("TQKV_FOLD_NEWEST");
  fused_options_.cluster = env_bool("TQKV_FUSED_CLUSTER");
  const std::string short_first = env_choice("TQKV_FUSED_SHORT_FIRST");
  fused_options_.short_first = short_first == "0" ? 0 : short_first == "1" ? 1 : -1;
  const std::string path = env_choice("TQKV_PREFILL_PATH");
  prefill_path_ = path == "tiled" ? PrefillPath::Tiled : path == "rows" ? PrefillPath::Rows : PrefillPath::Auto;
  fused_max_rows_ = static_cast<int>(env_count("TQKV_FUSED_MAX_ROWS", kFusedMaxRows));
  tiled_from_ = env_count("TQKV_PREFILL_TILED_FROM", kPrefillTiledFrom);
  workspace_bf16_ = env_choice("TQKV_PREFILL_WORKSPACE") == "bf16";
  if (copies()) {
    // Sliding-window layers take the copies with their window as a cut of every part; a sink is
    // read while it is inside the window (one sink: all or nothing, so one per-row length).
    for (int l = 0; l < m.n_layers; ++l) {
      if (m.window(l) <= 0) continue;
      if (slide_ > 0 && m.window(l) != slide_)
        not_yet("attention sinks or a recent window with sliding-window layers of different windows");
      slide_ = m.window(l);
    }
    if (slide_ > 0 && sinks_ > 1) not_yet("more than one attention sink with sliding-window layers");
    if (m.n_heads / m.n_kv_heads > 8) not_yet("attention sinks or a recent window with more than 8 query heads per kv head");
    ring_blocks_ = window_ > 0 ? static_cast<int>((plan().copy_ring_positions() + kBlockSize - 1) / kBlockSize) + 1 : 0;
    sink_blocks_ = (sinks_ + kBlockSize - 1) / kBlockSize;
  }
  if (m.head_dim != 64 && m.head_dim != 128 && m.head_dim != 256)
    not_yet("head_dim " + std::to_string(m.head_dim) + " (the kernels take 64, 128, 256)");
  blocks_per_seq_ = (shape.capacity + kBlockSize - 1) / kBlockSize;
  const int num_blocks = blocks_per_seq_ * shape.max_seqs;
  // Sliding-window layers keep a ring where the CPU keeps one (Layer::ring): blocks for the
  // longest ring, plus one for a ring that does not start at a block's first position.
  int64_t longest_ring = 0;
  for (const LayerPlan& L : p.layers) longest_ring = std::max(longest_ring, L.ring);
  if (longest_ring > 0) slide_ring_blocks_ = static_cast<int>((longest_ring + kBlockSize - 1) / kBlockSize) + 1;
  if (slide_ring_blocks_ >= blocks_per_seq_) slide_ring_blocks_ = 0;  // no smaller than the whole sequence
  layers_.reserve(m.n_layers);
  try {
    for (int l = 0; l < m.n_layers; ++l) {
      const Format& f = spec.layers[l];
      std::optional<cuda::CacheCodec> codec;
      try {
        codec.emplace(f, m.head_dim);
      } catch (const Error& e) {
        not_yet("layer " + std::to_string(l) + "'s format " + f.name() + " (" + e.what() + ")");
      }
      Layer L{*codec, {}, false, std::nullopt, std::nullopt, {}, {}, false};
      L.ring = slide_ring_blocks_ > 0 && p.layers[l].ring > 0;
      L.kv = cuda::PagedKv{nullptr, L.ring ? slide_ring_blocks_ * shape.max_seqs : num_blocks, kBlockSize,
                           m.n_kv_heads, cuda::PageLayout::Page};
      L.decode = L.codec.decode_supported() && m.n_heads / m.n_kv_heads <= 8;
      if (p.layers[l].copies) {
        const Format wf = p.window_format ? *p.window_format : find_format("f16");
        L.window_codec.emplace(wf, m.head_dim);
        L.sink_codec.emplace(find_format("f16"), m.head_dim);
        // A pair without a compiled kernel reads an f16 conversion of its pool (Layer::generic);
        // sides without any decode kernel (1-bit codes, f32) are refused.
        L.generic = !L.decode;
        L.generic_window = window_ > 0 && !L.window_codec->decode_supported();
        for (const Format* g : {&f, &wf})
          if (g->key == KeyCodec::F32 || g->value == ValueCodec::F32 ||
              (g->key == KeyCodec::Mse && g->key_bits < 2) ||
              ((g->value == ValueCodec::Mse || g->value == ValueCodec::Uniform) && g->value_bits < 2))
            not_yet("attention sinks or a recent window for layer " + std::to_string(l) + "'s format " + f.name() +
                    " or the window format " + wf.name() + " (no decode kernel for 1-bit codes or f32)");
        L.window_kv = cuda::PagedKv{nullptr, ring_blocks_ * shape.max_seqs, kBlockSize, m.n_kv_heads, cuda::PageLayout::Page};
        L.sink_kv = cuda::PagedKv{nullptr, sink_blocks_ * shape.max_seqs, kBlockSize, m.n_kv_heads, cuda::PageLayout::Page};
        L.fused = !L.generic && !L.generic_window &&
                  cuda::fused_decode_supported(*codec, window_ > 0 ? &*L.window_codec : nullptr);
      }
      layers_.push_back(L);
      Layer& P = layers_.back();  // pools allocated once the layer is listed (freed on a throw below)
      P.kv.pages = alloc_pool(f, m.head_dim, m.n_kv_heads, P.kv.num_blocks);
      if (P.window_codec && window_ > 0)
        P.window_kv.pages = alloc_pool(P.window_codec->format(), m.head_dim, m.n_kv_heads, P.window_kv.num_blocks);
      if (P.sink_codec && sinks_ > 0)
        P.sink_kv.pages = alloc_pool(P.sink_codec->format(), m.head_dim, m.n_kv_heads, P.sink_kv.num_blocks);
      // The generic path converts whole blocks: slots never written must decode to finite values
      // (zero codes and norms decode to 0).
      if (P.generic) zero_pool(P.codec.format(), m.head_dim, P.kv);
      if (P.generic_window) zero_pool(P.window_codec->format(), m.head_dim, P.window_kv);
      if ((P.generic || P.generic_window) && !shadow_codec_) {
        const Format& f16 = find_format("f16");
        shadow_codec_.emplace(f16, m.head_dim);
        shadow_kv_ = cuda::PagedKv{nullptr, num_blocks, kBlockSize, m.n_kv_heads, cuda::PageLayout::Page};
        shadow_kv_.pages = alloc_pool(f16, m.head_dim, m.n_kv_heads, num_blocks);
        zero_pool(f16, m.head_dim, shadow_kv_);
        if (window_ > 0) {
          shadow_ring_kv_ = P.window_kv;
          shadow_ring_kv_.pages = alloc_pool(f16, m.head_dim, m.n_kv_heads, P.window_kv.num_blocks);
          zero_pool(f16, m.head_dim, shadow_ring_kv_);
        }
      }
    }
    if (centring_.active()) {
      const size_t per_layer = static_cast<size_t>(m.n_kv_heads) * m.head_dim, total = per_layer * m.n_layers;
      ck(cudaMalloc(reinterpret_cast<void**>(&mean_), total * sizeof(float)), "allocating centring");
      ck(cudaMalloc(reinterpret_cast<void**>(&scale_), total * sizeof(float)), "allocating centring");
      ck(cudaMemcpy(mean_, centring_.mean(0), total * sizeof(float), cudaMemcpyHostToDevice), "uploading centring");
      ck(cudaMemcpy(scale_, centring_.scale(0), total * sizeof(float), cudaMemcpyHostToDevice), "uploading centring");
    }
  } catch (...) {
    for (Layer& L : layers_) {
      cudaFree(L.kv.pages);
      cudaFree(L.window_kv.pages);
      cudaFree(L.sink_kv.pages);
    }
    cudaFree(shadow_kv_.pages);
    cudaFree(shadow_ring_kv_.pages);
    cudaFree(mean_);
    cudaFree(scale_);
    throw;
  }
  if (copies()) {
    for (cudaStream_t& side : side_) ck(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "creating a stream");
    for (cudaEvent_t* e : {&fork_, &fork_store_}) ck(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "creating an event");
    for (cudaEvent_t& e : join_) ck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "creating an event");
  }
  free_.reserve(num_blocks);
  for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
  for (int i = shape.max_seqs - 1; i >= 0; --i) free_slots_.push_back(i);
}

CudaKvCache::~CudaKvCache() {
  cudaStreamSynchronize(stream_);
  for (Layer& L : layers_) {
    cudaFree(L.kv.pages);
    cudaFree(L.window_kv.pages);
    cudaFree(L.sink_kv.pages);
  }
  graphs_.clear();
  step_acts_.clear();
  cudaFree(shadow_kv_.pages);
  cudaFree(shadow_ring_kv_.pages);
  cudaFree(conv_);
  for (cudaStream_t side : side_)
    if (side) {
      cudaStreamSynchronize(side);
      cudaStreamDestroy(side);
    }
  for (cudaEvent_t e : {fork_, fork_store_, join_[0], join_[1], join_[2]})
    if (e) cudaEventDestroy(e);
  for (auto& [key, p] : plans_) cudaFree(p.workspace);
  for (auto& [key, p] : fused_plans_) cudaFree(p.workspace);
  for (auto& [bucket, b] : buckets_)
    for (void* p : {b.slots, b.tables, b.parts}) cudaFree(p);
  for (void* p : {static_cast<void*>(mean_), static_cast<void*>(scale_), slots_, tables_, kws_, vws_, split_ws_, qbuf_, obuf_, parts_})
    cudaFree(p);
}

size_t CudaKvCache::pool_bytes() const {
  const ModelConfig& m = spec().model;
  size_t n = 0;
  for (const Layer& L : layers_) {
    n += ::tqkv::engine::pool_bytes(L.codec.format(), m.head_dim, m.n_kv_heads, L.kv.num_blocks);
    if (L.window_codec && window_ > 0)
      n += ::tqkv::engine::pool_bytes(L.window_codec->format(), m.head_dim, m.n_kv_heads, L.window_kv.num_blocks);
    if (L.sink_codec && sinks_ > 0)
      n += ::tqkv::engine::pool_bytes(L.sink_codec->format(), m.head_dim, m.n_kv_heads, L.sink_kv.num_blocks);
  }
  return n;
}

int64_t CudaKvCache::add_sequence() {
  if (static_cast<int>(seqs_.size()) >= max_seqs())
    throw Error(ErrorCode::Capacity, "cache: all " + std::to_string(max_seqs()) + " sequences are in use");
  const int64_t id = next_id_++;
  Sequence s;
  s.slot = free_slots_.back();
  free_slots_.pop_back();
  seqs_.emplace(id, std::move(s));
  return id;
}

void CudaKvCache::free_sequence(int64_t seq) {
  at(seq);
  Sequence& s = seqs_.at(seq);
  free_.insert(free_.end(), s.blocks.rbegin(), s.blocks.rend());
  free_slots_.push_back(s.slot);
  seqs_.erase(seq);
}

const CudaKvCache::Sequence& CudaKvCache::at(int64_t seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw Error(ErrorCode::OutOfRange, "cache: unknown sequence " + std::to_string(seq));
  return it->second;
}

int64_t CudaKvCache::seq_len(int64_t seq) const { return at(seq).len; }

bool CudaKvCache::prefill_rows(int count) const {
  if (count == 1) return true;
  // Copies: each query has its own window, so the tiled path runs a layer's parts one by one
  // (prefill_parts); a model with sliding-window layers keeps the rows (its parts are cut by
  // the layer's window as well).
  if (copies() && slide_ > 0) return true;
  switch (prefill_path_) {
    case PrefillPath::Tiled: return false;
    case PrefillPath::Rows: return true;
    case PrefillPath::Auto: break;
  }
  return count < tiled_from_;
}

void CudaKvCache::check(const Batch& batch) const {
  for (const Batch::Run& r : batch.runs()) {
    const Sequence& s = at(r.seq);
    if (r.pos0 != s.len)
      throw Error(ErrorCode::OutOfRange, "forward: position " + std::to_string(r.pos0) + " of sequence " +
                                             std::to_string(r.seq) + " does not follow the cache (" +
                                             std::to_string(s.len) + " tokens held)");
    if (r.pos0 + r.count > capacity())
      throw Error(ErrorCode::Capacity, "forward: " + std::to_string(r.pos0 + r.count) + " positions of sequence " +
                                           std::to_string(r.seq) + " exceed the cache capacity of " +
                                           std::to_string(capacity()));
  }
}

void* CudaKvCache::grow(void*& p, size_t& have, size_t bytes) {
  if (bytes > have) {
    if (p) cudaStreamSynchronize(stream_);  // the old buffer may still be read
    cudaFree(p);
    p = nullptr;
    have = 0;
    const size_t want = std::max<size_t>(bytes, 256) * 3 / 2;
    ck(cudaMalloc(&p, want), "allocating a workspace");
    have = want;
  }
  return p;
}

// Once per step (at layer 0): blocks for the new positions, the slot mappings, block tables.
// With a bucket, padding runs of no sequence (kPadSeq) follow the batch's: slot -1, block 0,
// length 1.
void CudaKvCache::prepare(const Batch& batch, int bucket) {
  constexpr int64_t kPadSeq = -1;
  step_ = Step{};
  step_.runs = batch.runs();
  const int n = std::max(batch.size(), bucket);
  for (int i = batch.size(); i < n; ++i) step_.runs.push_back({kPadSeq, i, 1, 0});
  const int bps = blocks_per_seq_;
  // Blocks first (check() guaranteed room: each sequence holds at most capacity positions).
  for (const Batch::Run& r : step_.runs) {
    if (r.seq == kPadSeq) continue;
    Sequence& s = seqs_.at(r.seq);
    const size_t need = static_cast<size_t>((r.pos0 + r.count + kBlockSize - 1) / kBlockSize);
    while (s.blocks.size() < need) {
      if (free_.empty()) throw Error(ErrorCode::Capacity, "cache: the page pool is exhausted");
      s.blocks.push_back(free_.back());
      free_.pop_back();
    }
  }
  // Slots of the new tokens: the main pool's, then (copies) the window ring's and the sinks',
  // then (ring layers) the sliding-window layers' ring's.
  const int n_slot_sets = copies() ? 3 : 1;
  const int RS = slide_ring_blocks_;
  const size_t slide_at = static_cast<size_t>(n) * n_slot_sets;
  std::vector<int64_t> slots(slide_at + (RS > 0 ? n : 0), -1);
  // Decode rows: the tokens of the runs prefill_rows() picks (single tokens and runs shorter than
  // the tiled kernel's crossover), each query a row of its own.
  std::vector<int> row_run;
  std::vector<int32_t> row_tok, row_len;
  const size_t n_runs = step_.runs.size();
  const int R = ring_blocks_, SB = sink_blocks_;
  auto slot_of = [&](const Batch::Run& r) { return r.seq == kPadSeq ? 0 : seqs_.at(r.seq).slot; };
  for (size_t j = 0; j < n_runs; ++j) {
    const Batch::Run& r = step_.runs[j];
    const Sequence* s = r.seq == kPadSeq ? nullptr : &seqs_.at(r.seq);
    // A fresh run attends to its own keys and values (attend_fresh), never as rows.
    const bool as_rows = !fresh(r) && prefill_rows(r.count);
    step_.as_rows.push_back(as_rows);
    // The window's ring keeps the run's last positions (a fresh run may be longer than the ring;
    // none of its queries read it): at most copy_ring_positions() <= (R - 1) blocks, distinct slots.
    const int64_t ring_from = plan().copy_ring_from(r.pos0, r.count);
    for (int i = 0; i < r.count; ++i) {
      const int64_t pos = r.pos0 + i;
      if (s) {
        const int64_t slot = s->slot;
        slots[r.begin + i] = static_cast<int64_t>(s->blocks[pos / kBlockSize]) * kBlockSize + pos % kBlockSize;
        if (R > 0 && pos >= ring_from)
          slots[n + r.begin + i] = (slot * R + (pos / kBlockSize) % R) * kBlockSize + pos % kBlockSize;
        if (pos < sinks_) slots[2 * n + r.begin + i] = (slot * SB + pos / kBlockSize) * kBlockSize + pos % kBlockSize;
        if (RS > 0) slots[slide_at + r.begin + i] = int64_t{slide_block(s->slot, pos / kBlockSize)} * kBlockSize + pos % kBlockSize;
      }
      if (as_rows) {
        row_run.push_back(static_cast<int>(j));
        row_tok.push_back(r.begin + i);
        row_len.push_back(static_cast<int32_t>(pos + 1));
      }
    }
  }
  const size_t n_dec = row_run.size();
  step_.n_rows = static_cast<int>(n_dec);
  step_plan_len_ = plan_len(row_len.empty() ? capacity() : *std::max_element(row_len.begin(), row_len.end()));
  step_.decode_contiguous = static_cast<int>(n_dec) == n;
  for (size_t i = 0; i < n_dec && step_.decode_contiguous; ++i) step_.decode_contiguous = row_tok[i] == static_cast<int32_t>(i);
  // Int32 block tables: [n_runs, bps] for every run, [n_dec, bps] for the rows, then the rows'
  // lengths [n_dec] and batch rows [n_dec]; with copies the rows' ring tables [n_dec, bps], sink
  // tables [n_dec, SB] and sink lengths [n_dec] (with sliding-window layers twice: theirs after).
  // Then (ring layers) the runs' and the rows' ring tables [n_runs + n_dec, bps].
  const size_t copy_ints = copies() ? n_dec * (bps + SB + (slide_ > 0 ? 2 : 1)) : 0;
  const size_t slide_ints = RS > 0 ? (n_runs + n_dec) * bps : 0;
  const size_t run_copy_ints = copies() ? n_runs * (bps + SB) : 0;
  std::vector<int32_t> ints((n_runs + n_dec) * bps + 2 * n_dec + copy_ints + slide_ints + run_copy_ints, 0);
  for (size_t j = 0; j < n_runs; ++j) {
    if (step_.runs[j].seq == kPadSeq) continue;
    const Sequence& s = seqs_.at(step_.runs[j].seq);
    std::copy(s.blocks.begin(), s.blocks.end(), ints.begin() + j * bps);
  }
  const size_t lens_at = (n_runs + n_dec) * bps, win_at = lens_at + 2 * n_dec, sink_at = win_at + n_dec * bps,
               sink_lens_at = sink_at + n_dec * SB, slide_tables_at = lens_at + 2 * n_dec + copy_ints;
  const size_t run_win_at = slide_tables_at + slide_ints, run_sink_at = run_win_at + n_runs * bps;
  if (copies())
    for (size_t j = 0; j < n_runs; ++j) {
      const int slot = slot_of(step_.runs[j]);
      if (R > 0)
        for (int b = 0; b < bps; ++b) ints[run_win_at + j * bps + b] = slot * R + b % R;
      for (int b = 0; b < SB; ++b) ints[run_sink_at + j * SB + b] = slot * SB + b;
    }
  if (RS > 0) {
    for (size_t j = 0; j < n_runs; ++j)
      for (int b = 0; b < bps; ++b) ints[slide_tables_at + j * bps + b] = slide_block(slot_of(step_.runs[j]), b);
    for (size_t i = 0; i < n_dec; ++i)
      std::copy_n(ints.begin() + slide_tables_at + row_run[i] * bps, bps,
                  ints.begin() + slide_tables_at + (n_runs + i) * bps);
  }
  for (size_t i = 0; i < n_dec; ++i) {
    std::copy(ints.begin() + row_run[i] * bps, ints.begin() + (row_run[i] + 1) * bps, ints.begin() + (n_runs + i) * bps);
    ints[lens_at + i] = row_len[i];
    ints[lens_at + n_dec + i] = row_tok[i];
    if (!copies()) continue;
    const int slot = slot_of(step_.runs[row_run[i]]);
    if (R > 0)
      for (int b = 0; b < bps; ++b) ints[win_at + i * bps + b] = slot * R + b % R;
    for (int b = 0; b < SB; ++b) ints[sink_at + i * SB + b] = slot * SB + b;
    ints[sink_lens_at + i] = std::min(row_len[i] - (fold_newest_ ? 1 : 0), sinks_);
    // Position 0 is inside a sliding window of W while the query's position p = len - 1 < W.
    if (slide_ > 0) ints[sink_lens_at + n_dec + i] = row_len[i] <= slide_ ? ints[sink_lens_at + i] : 0;
  }
  const size_t slot_bytes = slots.size() * sizeof(int64_t), int_bytes = ints.size() * sizeof(int32_t);
  void* slot_buf = nullptr;
  void* table_buf = nullptr;
  step_parts_ = nullptr;
  if (bucket > 0) {  // fixed: a recorded step reads them where it read them when recorded
    StepBuffers& b = buckets_[bucket];
    if (!b.slots) {
      const size_t parts = copies() ? parts_floats(static_cast<int>(n_dec)) * sizeof(float) : 0;
      ck(cudaMalloc(&b.slots, slot_bytes), "allocating a bucket's slot mapping");
      ck(cudaMalloc(&b.tables, int_bytes), "allocating a bucket's block tables");
      if (parts) ck(cudaMalloc(&b.parts, parts), "allocating a bucket's attention parts");
    }
    slot_buf = b.slots;
    table_buf = b.tables;
    step_parts_ = static_cast<float*>(b.parts);
  } else {
    slot_buf = grow(slots_, slots_bytes_, slot_bytes);
    table_buf = grow(tables_, tables_bytes_, int_bytes);
  }
  ck(cudaMemcpyAsync(slot_buf, slots.data(), slot_bytes, cudaMemcpyHostToDevice, stream_), "uploading the slot mapping");
  ck(cudaMemcpyAsync(table_buf, ints.data(), int_bytes, cudaMemcpyHostToDevice, stream_), "uploading block tables");
  auto* base = static_cast<int32_t*>(table_buf);
  step_slots_ = static_cast<int64_t*>(slot_buf);
  step_tables_ = base;
  dec_tables_ = base + n_runs * bps;
  dec_lens_ = base + lens_at;
  dec_rows_ = dec_lens_ + n_dec;
  win_tables_ = base + win_at;
  sink_tables_ = base + sink_at;
  sink_lens_ = base + sink_lens_at;
  slide_sink_lens_ = slide_ > 0 ? sink_lens_ + n_dec : nullptr;
  win_slots_ = step_slots_ + n;
  sink_slots_ = step_slots_ + 2 * static_cast<size_t>(n);
  slide_slots_ = RS > 0 ? step_slots_ + slide_at : nullptr;
  slide_run_tables_ = RS > 0 ? base + slide_tables_at : nullptr;
  slide_dec_tables_ = RS > 0 ? base + slide_tables_at + n_runs * bps : nullptr;
  run_win_tables_ = copies() ? base + run_win_at : nullptr;
  run_sink_tables_ = copies() ? base + run_sink_at : nullptr;
  for (const Batch::Run& r : step_.runs)
    if (r.seq != kPadSeq) seqs_.at(r.seq).len = r.pos0 + r.count;
  if (shadow_codec_) {  // the generic path's blocks to convert (graphs are off: no bucket here)
    std::vector<int32_t> blocks, ring, slide;
    for (const Batch::Run& r : step_.runs) {
      if (r.seq == kPadSeq) continue;
      const Sequence& s = seqs_.at(r.seq);
      blocks.insert(blocks.end(), s.blocks.begin(), s.blocks.end());
      for (int b = 0; b < R; ++b) ring.push_back(s.slot * R + b);
      for (int b = 0; b < RS; ++b) slide.push_back(slide_block(s.slot, b));
    }
    conv_n_ = static_cast<int>(blocks.size());
    conv_ring_n_ = static_cast<int>(ring.size());
    conv_slide_n_ = static_cast<int>(slide.size());
    const size_t n_blocks = blocks.size() + ring.size() + slide.size();
    const size_t n_ints = (n_blocks + 1) & ~size_t{1};  // the slots 8-byte aligned
    std::vector<int64_t> conv(n_ints / 2 + n_blocks * kBlockSize);
    auto* ints = reinterpret_cast<int32_t*>(conv.data());
    std::copy(blocks.begin(), blocks.end(), ints);
    std::copy(ring.begin(), ring.end(), ints + blocks.size());
    std::copy(slide.begin(), slide.end(), ints + blocks.size() + ring.size());
    int64_t* slot = conv.data() + n_ints / 2;
    for (const std::vector<int32_t>* list : {&blocks, &ring, &slide})
      for (int32_t b : *list)
        for (int i = 0; i < kBlockSize; ++i) *slot++ = static_cast<int64_t>(b) * kBlockSize + i;
    void* buf = grow(conv_, conv_bytes_, conv.size() * sizeof(int64_t));
    ck(cudaMemcpyAsync(buf, conv.data(), conv.size() * sizeof(int64_t), cudaMemcpyHostToDevice, stream_),
       "uploading the blocks to convert");
    conv_blocks_ = static_cast<int32_t*>(buf);
    conv_ring_blocks_ = conv_blocks_ + blocks.size();
    conv_slide_blocks_ = conv_ring_blocks_ + ring.size();
    conv_slots_ = static_cast<int64_t*>(buf) + n_ints / 2;
    conv_ring_slots_ = conv_slots_ + blocks.size() * kBlockSize;
    conv_slide_slots_ = conv_ring_slots_ + ring.size() * kBlockSize;
  }
}

cuda::StoreArgs CudaKvCache::store_args(const void* k, const void* v, const int64_t* slots, int n_tokens) const {
  cuda::StoreArgs sa;
  sa.k = k;
  sa.v = v;
  sa.dtype = cuda::DType::F32;
  sa.slot_mapping = slots;
  sa.n_tokens = n_tokens;
  return sa;
}

void CudaKvCache::dequantize_to_workspace(const cuda::CacheCodec& codec, const cuda::PagedKv& kv,
                                          const int32_t* table, int start, int n_tokens, cuda::DType dtype) {
  const ModelConfig& m = spec().model;
  const size_t bytes =
      static_cast<size_t>(n_tokens) * m.n_kv_heads * m.head_dim * (dtype == cuda::DType::F32 ? sizeof(float) : 2);
  cuda::DequantArgs dq;
  dq.block_table = table;
  dq.start = start;
  dq.n_tokens = n_tokens;
  dq.k_out = grow(kws_, kws_bytes_, bytes);
  dq.v_out = grow(vws_, vws_bytes_, bytes);
  dq.out_dtype = dtype;
  cuda::dequantize(codec, kv, dq, stream_);
}

void CudaKvCache::to_f16(const cuda::CacheCodec& codec, const cuda::PagedKv& from, const cuda::PagedKv& to,
                         const int32_t* blocks, const int64_t* slots, int n_blocks) {
  if (n_blocks == 0) return;
  const int n_tokens = n_blocks * kBlockSize;
  dequantize_to_workspace(codec, from, blocks, 0, n_tokens, cuda::DType::F32);
  cuda::store(*shadow_codec_, to, store_args(kws_, vws_, slots, n_tokens), stream_);
}

bool CudaKvCache::graphs_supported() const {
  if (key_hook()) return false;  // host code between the layers
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    // A sliding-window layer attends as rows too (replayable), its window a cut.
    if (!L.decode || L.generic_window) return false;
  }
  return true;
}

void CudaKvCache::prepare_bucket(const Batch& batch, int bucket) {
  if (batch.size() > bucket) throw Error(ErrorCode::InvalidArgument, "cache: a step larger than its bucket");
  for (int t = 0; t < batch.size(); ++t)
    if (t > 0 && batch.seqs[t] == batch.seqs[t - 1])
      throw Error(ErrorCode::InvalidArgument, "cache: a graph bucket takes one token per sequence");
  prepare(batch, bucket);
  bucket_pending_ = bucket;
}

int CudaKvCache::graphs_recorded() const {
  int n = 0;
  for (const auto& [key, g] : graphs_) n += g->exec != nullptr;
  return n;
}

int CudaKvCache::plan_len(int64_t longest) const {
  int64_t c = kMinPlanLen;
  while (c < longest) c *= 2;
  return static_cast<int>(std::min<int64_t>(c, capacity()));
}

size_t CudaKvCache::graph_activation_bytes() const {
  size_t n = 0;
  for (const auto& [key, a] : step_acts_) n += a->bytes;
  return n;
}

const StepActivations* CudaKvCache::step_activations(int bucket) const {
  for (const auto& [key, a] : step_acts_)
    if (key.second == bucket) return a.get();
  return nullptr;
}

StepGraph& CudaKvCache::step_graph(const void* model, int bucket, int64_t longest) {
  auto& g = graphs_[{model, bucket, plan_len(longest)}];
  if (!g) {
    auto& acts = step_acts_[{model, bucket}];
    if (!acts) acts = std::make_shared<StepActivations>();
    g = std::make_unique<StepGraph>(bucket, acts);
  }
  return *g;
}

CudaKvCache::Plan& CudaKvCache::plan_for(const cuda::CacheCodec& codec, const cuda::PagedKv& kv, Part part, int batch,
                                         int max_len, cudaStream_t stream) {
  const auto key = std::make_tuple(codec.format().name(), part, batch, max_len);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  Plan p;
  p.plan = cuda::plan_decode(codec, kv, batch, spec().model.n_heads, max_len);
  ck(cudaMalloc(&p.workspace, std::max<size_t>(p.plan.workspace_bytes, 256)), "allocating a decode workspace");
  try {
    cuda::init_decode_workspace(codec, kv, p.plan, p.workspace, stream);  // before its first run, on its stream
  } catch (...) {
    cudaFree(p.workspace);
    throw;
  }
  return plans_.emplace(key, p).first->second;
}

cuda::DecodeArgs CudaKvCache::step_args(const float* q, float* o, const AttentionParams& ap) const {
  cuda::DecodeArgs da;
  da.q = q;
  da.q_dtype = cuda::DType::F32;
  da.out = o;
  da.out_dtype = cuda::DType::F32;
  da.batch = step_.n_rows;
  da.params = ap;
  return da;
}

void CudaKvCache::decode(const cuda::CacheCodec& codec, const cuda::PagedKv& kv, Part part, const int32_t* tables,
                         int stride, const int32_t* lens, int max_len, const AttentionParams& ap, const float* q,
                         float* o, float* lse, cudaStream_t stream) {
  Plan& p = plan_for(codec, kv, part, step_.n_rows, max_len, stream);
  cuda::DecodeArgs da = step_args(q, o, ap);
  da.block_tables = tables;
  da.block_table_stride = stride;
  da.seq_lens = lens;
  da.params.lse = lse;
  cuda::run_decode(codec, kv, da, p.plan, p.workspace, stream);
}

void CudaKvCache::fused_decode(const Layer& L, int layer_window, const AttentionParams& ap, const float* q, float* o,
                               const cuda::NewestKv& nk) {
  // The old path's three ranges: the window's (p - N, p] of the ring, the middle [S, p - N], the sinks [0, S).
  cuda::DecodePart parts[3];
  // With the fold, every part stops at p - 1 (the sinks by their lengths) and p comes from k, v.
  const int newest = fold_newest_ ? 1 : 0;
  // In a sliding-window layer whose recent copy spans the whole window (Gemma's tq-3.375 from a
  // capacity of ~5.9K), the middle [S, p - N] never meets the window (p - W, p]: no CTA for it.
  const bool middle_empty = layer_window > 0 && std::max(window_, newest) >= layer_window;
  const int main_len = middle_empty ? 0 : layer_plan_len(layer_window);
  parts[cuda::kFusedMain] = {&L.codec, L.kv, row_tables(L), blocks_per_seq_, dec_lens_, main_len, sinks_,
                             layer_window, std::max(window_, newest)};
  if (window_ > 0)
    parts[cuda::kFusedWindow] = {&*L.window_codec, L.window_kv, win_tables_, blocks_per_seq_, dec_lens_,
                                 window_plan_len(), sinks_, window_, newest};
  if (sinks_ > 0)
    parts[cuda::kFusedSinks] = {&*L.sink_codec, L.sink_kv,  sink_tables_, sink_blocks_,
                                layer_window > 0 ? slide_sink_lens_ : sink_lens_, sinks_, 0, 0, 0};
  const int rows = step_.n_rows;
  const auto key = std::make_tuple(L.codec.format().name(), L.window_codec->format().name(), rows, main_len);
  auto it = fused_plans_.find(key);
  if (it == fused_plans_.end()) {
    FusedPlan p;
    p.plan = cuda::plan_fused_decode(parts, rows, spec().model.n_heads, fused_options_);
    ck(cudaMalloc(&p.workspace, std::max<size_t>(p.plan.workspace_bytes, 256)), "allocating a decode workspace");
    try {
      cuda::init_fused_decode_workspace(p.plan, spec().model.n_kv_heads, p.workspace, stream_);
    } catch (...) {
      cudaFree(p.workspace);
      throw;
    }
    it = fused_plans_.emplace(key, p).first;
  }
  cuda::run_fused_decode(parts, step_args(q, o, ap), it->second.plan, it->second.workspace, stream_, nk);
}

void CudaKvCache::attend(int layer, const Batch& batch, float* q, float* k, const float* v, float* out) {
  const ModelConfig& m = spec().model;
  const int n = batch.size();
  if (n == 0) return;
  if (layer == 0 && bucket_pending_) {  // prepared by prepare_bucket: `batch` is the padded step
    const int bucket = bucket_pending_;
    bucket_pending_ = 0;
    if (n != bucket) throw Error(ErrorCode::InvalidArgument, "cache: the step is not the size of its prepared bucket");
  } else if (layer == 0) {
    plan().check_steps(batch.runs());  // before anything is written
    prepare(batch);
  }
  const int D = m.head_dim, hq = m.n_heads, hkv = m.n_kv_heads;
  const size_t q_row = static_cast<size_t>(hq) * D;
  const size_t centring_off = static_cast<size_t>(layer) * hkv * D;
  // The one-launch store centres the keys itself, unless the queries need the channel scales too
  // or a hook must see the centred keys.
  const bool centre_in_store = centring_.active() && !centring_.scales() && !key_hook();
  if (centring_.active() && !centre_in_store)
    cuda::centre_keys(k, q, mean_ + centring_off, scale_ + centring_off, n, hkv, hq / hkv, D, centring_.scales(),
                      stream_);
  if (key_hook()) key_hook()(layer, n, k, q);
  Layer& L = layers_[layer];
  const int64_t* main_slots = L.ring ? slide_slots_ : step_slots_;
  cuda::StoreArgs sa = store_args(k, v, main_slots, n);
  const bool covered = L.window_codec.has_value();  // the layer keeps copies (same centred keys)
  const int window = m.window(layer);
  // A sliding-window layer attends as rows too, its window a cut of every part (the tiled path
  // stays for layers without a decode kernel).
  const bool rows = (L.decode || L.generic) && step_.n_rows > 0;
  // The fold: each row's own position from k and v as computed (the keys centred as stored).
  const bool fold = fold_newest_ && covered && rows;
  cuda::NewestKv nk;
  if (fold) {
    nk.k = k;
    nk.v = v;
    nk.rows = step_.decode_contiguous ? nullptr : dec_rows_;
    nk.key_mean = centre_in_store ? mean_ + centring_off : nullptr;
  }
  // While a step of one token per sequence is recorded, a folded layer's store runs on a side
  // branch of the graph beside its decode (which reads none of what it writes), joined after.
  // (Only layers with copies ask: the others neither fork the store nor the copies' decodes.)
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (covered && rows) ck(cudaStreamIsCapturing(stream_, &capture), "querying the stream");
  const bool capturing = capture == cudaStreamCaptureStatusActive;
  // One token per sequence: as many runs as tokens, every token a decode row.
  const bool store_aside = capturing && fold && !L.generic && !L.generic_window &&
                           step_.n_rows == n && static_cast<int>(step_.runs.size()) == n;
  const cudaStream_t store_stream = store_aside ? side_[2] : stream_;
  if (store_aside) {
    ck(cudaEventRecord(fork_store_, stream_), "forking the store");
    ck(cudaStreamWaitEvent(store_stream, fork_store_, 0), "forking the store");
  }
  {  // the compressed pages and the copies in one launch
    cuda::StoreTarget targets[cuda::kMaxStoreTargets];
    int n_targets = 0;
    targets[n_targets++] = {&L.codec, L.kv, main_slots};
    if (covered && window_ > 0) targets[n_targets++] = {&*L.window_codec, L.window_kv, win_slots_};
    if (covered && sinks_ > 0) targets[n_targets++] = {&*L.sink_codec, L.sink_kv, sink_slots_};
    cuda::store_many(targets, n_targets, sa, centre_in_store ? mean_ + centring_off : nullptr,
                     centre_in_store ? scale_ + centring_off : nullptr, store_stream);
    if (store_aside) ck(cudaEventRecord(join_[2], store_stream), "joining the store");
  }

  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  if (rows) {
    const int n_dec = step_.n_rows;
    const size_t out_floats = static_cast<size_t>(n_dec) * q_row;
    const float* q_in = q;
    float* o = out;
    if (!step_.decode_contiguous) {
      q_in = static_cast<float*>(grow(qbuf_, qbuf_bytes_, out_floats * sizeof(float)));
      o = static_cast<float*>(grow(obuf_, obuf_bytes_, out_floats * sizeof(float)));
      cuda::gather_rows(q, static_cast<int>(q_row), dec_rows_, n_dec, const_cast<float*>(q_in), stream_);
    }
    AttentionParams ap;
    ap.n_q_heads = hq;
    ap.head_dim = D;
    ap.scale = scale;
    if (!covered) {
      AttentionParams cut = ap;
      cut.window = window;
      decode(L.codec, L.kv, Part::Main, row_tables(L), blocks_per_seq_, dec_lens_,
             layer_plan_len(window), cut, q_in, o, nullptr, stream_);
    } else if (L.fused && n_dec <= fused_max_rows_) {
      fused_decode(L, window, ap, q_in, o, nk);
    } else {
      // Parts: the compressed [S, p - N] into o, the window's (p - N, p] and the sinks' [0, S)
      // into the parts buffer, merged into o by their log-sum-exps (the CPU's RecentWindow), the
      // window first. While a step is recorded, the window's and the sinks' launches go to the
      // side streams (parallel branches of the graph); op by op they stay on the step's stream,
      // where the events cost more than the overlap gains (tq-4.375, batch 1: 150 against ~196
      // tokens/s). Either way the same kernels write the same buffers.
      const bool fork = capturing;
      const int newest = fold ? 1 : 0;  // the parts stop at p - 1; p is merged last
      cudaStream_t window_stream = fork ? side_[0] : stream_, sink_stream = fork ? side_[1] : stream_;
      const size_t rows_h = static_cast<size_t>(n_dec) * hq;
      float* part = step_parts_ ? step_parts_
                                : static_cast<float*>(grow(parts_, parts_bytes_, parts_floats(n_dec) * sizeof(float)));
      float* part_w = part;
      float* part_s = part + out_floats;
      float* lse_main = part + 2 * out_floats;
      float* lse_w = lse_main + rows_h;
      float* lse_s = lse_w + rows_h;
      if (fork) ck(cudaEventRecord(fork_, stream_), "forking the copies' decodes");
      // The generic path: the pools without a compiled kernel, converted to f16 (Layer::generic).
      const cuda::CacheCodec& main_codec = L.generic ? *shadow_codec_ : L.codec;
      const cuda::CacheCodec& window_codec = L.generic_window ? *shadow_codec_ : *L.window_codec;
      const cuda::PagedKv& main_kv = L.generic ? shadow_kv_ : L.kv;
      const cuda::PagedKv& window_kv = L.generic_window ? shadow_ring_kv_ : L.window_kv;
      if (L.generic && L.ring)
        to_f16(L.codec, L.kv, shadow_kv_, conv_slide_blocks_, conv_slide_slots_, conv_slide_n_);
      else if (L.generic)
        to_f16(L.codec, L.kv, shadow_kv_, conv_blocks_, conv_slots_, conv_n_);
      if (L.generic_window)
        to_f16(*L.window_codec, L.window_kv, shadow_ring_kv_, conv_ring_blocks_, conv_ring_slots_, conv_ring_n_);
      if (window_ > 0) {
        AttentionParams recent = ap;
        recent.min_key_pos = sinks_;
        recent.window = window_;
        recent.exclude_recent = newest;
        if (fork) ck(cudaStreamWaitEvent(window_stream, fork_, 0), "forking the window's decode");
        decode(window_codec, window_kv, Part::Window, win_tables_, blocks_per_seq_, dec_lens_, window_plan_len(),
               recent, q_in, part_w, lse_w, window_stream);
        if (fork) ck(cudaEventRecord(join_[0], window_stream), "joining the window's decode");
      }
      if (sinks_ > 0) {
        if (fork) ck(cudaStreamWaitEvent(sink_stream, fork_, 0), "forking the sinks' decode");
        decode(*L.sink_codec, L.sink_kv, Part::Sinks, sink_tables_, sink_blocks_,
               window > 0 ? slide_sink_lens_ : sink_lens_, sinks_, ap, q_in, part_s,
               lse_s, sink_stream);
        if (fork) ck(cudaEventRecord(join_[1], sink_stream), "joining the sinks' decode");
      }
      AttentionParams older = ap;
      older.min_key_pos = sinks_;
      older.window = window;
      older.exclude_recent = std::max(window_, newest);
      decode(main_codec, main_kv, Part::Main, row_tables(L), blocks_per_seq_, dec_lens_,
             layer_plan_len(window), older, q_in, o, lse_main, stream_);
      if (window_ > 0) {
        if (fork) ck(cudaStreamWaitEvent(stream_, join_[0], 0), "joining the window's decode");
        cuda::merge_attention(o, lse_main, part_w, lse_w, static_cast<int>(rows_h), D, stream_);
      }
      if (sinks_ > 0) {
        if (fork) ck(cudaStreamWaitEvent(stream_, join_[1], 0), "joining the sinks' decode");
        cuda::merge_attention(o, lse_main, part_s, lse_s, static_cast<int>(rows_h), D, stream_);
      }
      if (fold) cuda::merge_newest(o, lse_main, q_in, nk, n_dec, hq, hkv, D, scale, stream_);
    }
    if (!step_.decode_contiguous) cuda::scatter_rows(o, static_cast<int>(q_row), dec_rows_, n_dec, out, stream_);
  }
  if (store_aside) ck(cudaStreamWaitEvent(stream_, join_[2], 0), "joining the store");
  for (size_t j = 0; j < step_.runs.size(); ++j) {
    const Batch::Run& r = step_.runs[j];
    if (rows && step_.as_rows[j]) continue;  // attended as decode rows
    if (fresh(r)) {
      attend_fresh(L, r, q, k, v, out, scale, window);
      continue;
    }
    if (covered) {
      prefill_parts(L, j, q, k, v, out, scale, centre_in_store ? mean_ + centring_off : nullptr, fold_newest_);
      continue;
    }
    const int n_kv = static_cast<int>(r.pos0 + r.count);
    // A sliding window's queries read nothing before pos0 - window + 1 (a ring holds no more).
    const int kv_start = window > 0 ? static_cast<int>(std::max<int64_t>(0, r.pos0 - window + 1)) : 0;
    const int32_t* table = (L.ring ? slide_run_tables_ : step_tables_) + j * blocks_per_seq_;
    const cuda::DType dt = workspace_dtype(L.codec.format(), workspace_bf16_);
    dequantize_to_workspace(L.codec, L.kv, table, kv_start, n_kv - kv_start, dt);
    cuda::PrefillArgs pa = workspace_prefill(r, q + static_cast<size_t>(r.begin) * q_row,
                                             out + static_cast<size_t>(r.begin) * q_row, dt, scale);
    pa.n_kv = n_kv;
    pa.kv_start = kv_start;
    pa.window = window;
    attend_prefill(pa);
  }
}

void CudaKvCache::attend_prefill(cuda::PrefillArgs& pa) {
  if (const size_t bytes = cuda::prefill_workspace_bytes(pa)) {
    pa.workspace = grow(split_ws_, split_ws_bytes_, bytes);
    pa.workspace_bytes = split_ws_bytes_;
  }
  cuda::prefill_attention(pa, stream_);
}

// A fresh run's queries over its own keys and values as computed (k centred as the queries
// expect, or not at all where the store centres: a shift of every key by one vector moves each
// query's scores by one constant, which the softmax does not see): rounded to f16 for the tensor
// cores, or as they are (the exact scalar kernel) in f32 layers, whose cache is the reference.
void CudaKvCache::attend_fresh(const Layer& L, const Batch::Run& r, const float* q, const float* k, const float* v,
                               float* out, float scale, int window) {
  const ModelConfig& m = spec().model;
  const size_t kv_row = static_cast<size_t>(m.n_kv_heads) * m.head_dim, q_row = static_cast<size_t>(m.n_heads) * m.head_dim;
  const float* kr = k + static_cast<size_t>(r.begin) * kv_row;
  const float* vr = v + static_cast<size_t>(r.begin) * kv_row;
  const bool exact = workspace_dtype(L.codec.format(), workspace_bf16_) == cuda::DType::F32;
  cuda::PrefillArgs pa = workspace_prefill(r, q + static_cast<size_t>(r.begin) * q_row,
                                           out + static_cast<size_t>(r.begin) * q_row, cuda::DType::F32, scale);
  if (exact) {
    pa.k = kr;
    pa.v = vr;
  } else {
    const size_t n = static_cast<size_t>(r.count) * kv_row;
    auto* kh = static_cast<uint16_t*>(grow(kws_, kws_bytes_, n * sizeof(uint16_t)));
    auto* vh = static_cast<uint16_t*>(grow(vws_, vws_bytes_, n * sizeof(uint16_t)));
    cuda::f32_to_f16(kr, kh, n, stream_);
    cuda::f32_to_f16(vr, vh, n, stream_);
    pa.k = kh;
    pa.v = vh;
    pa.kv_dtype = cuda::DType::F16;
  }
  pa.n_kv = r.count;
  pa.kv_start = 0;
  pa.window = window;
  attend_prefill(pa);
}

cuda::PrefillArgs CudaKvCache::workspace_prefill(const Batch::Run& r, const float* q, float* out, cuda::DType dtype,
                                                 float scale) const {
  const ModelConfig& m = spec().model;
  cuda::PrefillArgs pa;
  pa.q = q;
  pa.k = kws_;
  pa.v = vws_;
  pa.kv_dtype = dtype;
  pa.out = out;
  pa.n_q = r.count;
  pa.pos0 = r.pos0;
  pa.n_q_heads = m.n_heads;
  pa.n_kv_heads = m.n_kv_heads;
  pa.head_dim = m.head_dim;
  pa.scale = scale;
  return pa;
}

// The parts are those the rows read (docs/FORMAT.md, "Recent-token window and attention sinks"),
// for the query at p: the compressed middle [S, p - max(N, f)], the window's copies
// (p - N, p - f] from S on, the sinks' [0, S) up to p - f, where f is 1 when the row's own
// position is folded in afterwards from k and v (else 0). Each part's keys are dequantized and
// attended by the tiled kernel as a part (PrefillArgs::part: its keys, a shift of the causal
// edge, the window), the first into out, the others merged in by their log-sum-exps (the window
// before the sinks, as the rows), then the own position. Ring positions: the ring holds the
// window and one step (ring_blocks_), so (pos0 - N, pos0 + count) is still there.
void CudaKvCache::prefill_parts(const Layer& L, size_t run, const float* q, const float* k, const float* v, float* out,
                                float scale, const float* key_mean, bool fold) {
  const ModelConfig& m = spec().model;
  const Batch::Run& r = step_.runs[run];
  const int D = m.head_dim, hq = m.n_heads, hkv = m.n_kv_heads;
  const size_t q_row = static_cast<size_t>(hq) * D, rows_h = static_cast<size_t>(r.count) * hq;
  const int f = fold ? 1 : 0;
  const int64_t S = sinks_, N = window_, end = r.pos0 + r.count;  // positions held after the store
  float* o = out + static_cast<size_t>(r.begin) * q_row;
  const float* qr = q + static_cast<size_t>(r.begin) * q_row;
  auto* buf = static_cast<float*>(grow(parts_, parts_bytes_, rows_h * (D + 2) * sizeof(float)));
  float* part = buf;
  float* lse = buf + rows_h * D;
  float* lse_part = lse + rows_h;
  bool first = true;
  // Keys [from, to) of a pool, seen by the query at p up to p - shift (and after p - win).
  auto attend_part = [&](const cuda::CacheCodec& codec, const cuda::PagedKv& kv, const int32_t* table, int64_t from,
                         int64_t to, int shift, int win) {
    if (to <= from) return;
    const cuda::DType dt = workspace_dtype(codec.format(), workspace_bf16_);
    dequantize_to_workspace(codec, kv, table, static_cast<int>(from), static_cast<int>(to - from), dt);
    cuda::PrefillArgs pa = workspace_prefill(r, qr, first ? o : part, dt, scale);
    pa.lse = first ? lse : lse_part;
    pa.kv_start = from;
    pa.n_kv = static_cast<int>(to);
    pa.part = true;
    pa.shift = shift;
    pa.window = win;
    attend_prefill(pa);
    if (!first) cuda::merge_attention(o, lse, part, lse_part, static_cast<int>(rows_h), D, stream_);
    first = false;
  };
  const int middle_cut = static_cast<int>(std::max<int64_t>(N, f));
  attend_part(L.codec, L.kv, step_tables_ + run * blocks_per_seq_, S, end - middle_cut, middle_cut, 0);
  if (N > 0)
    attend_part(*L.window_codec, L.window_kv, run_win_tables_ + run * blocks_per_seq_, std::max(S, r.pos0 - N + 1),
                end - f, f, static_cast<int>(N));
  if (S > 0) attend_part(*L.sink_codec, L.sink_kv, run_sink_tables_ + run * sink_blocks_, 0, std::min(S, end - f), f, 0);
  // (Some part was attended: with sinks theirs holds position 0 for every run of two or more
  // queries; without, the window holds at least the run's first query.)
  if (fold) {
    cuda::NewestKv nk;
    nk.k = k + static_cast<size_t>(r.begin) * hkv * D;
    nk.v = v + static_cast<size_t>(r.begin) * hkv * D;
    nk.key_mean = key_mean;
    cuda::merge_newest(o, lse, qr, nk, r.count, hq, hkv, D, scale, stream_);
  }
}

// Not a hot path (tests, tools, bindings): temporary buffers, a synchronous copy.
void CudaKvCache::read(int layer, int64_t seq, int64_t start, int count, bool keys, float* out) const {
  const Sequence& s = at(seq);
  if (layer < 0 || layer >= static_cast<int>(layers_.size()))
    throw Error(ErrorCode::OutOfRange, "cache: layer " + std::to_string(layer) + " out of range");
  if (start < 0 || count < 0 || start + count > s.len)
    throw Error(ErrorCode::OutOfRange, "cache: positions [" + std::to_string(start) + ", " +
                                           std::to_string(start + count) + ") of sequence " + std::to_string(seq) +
                                           " are not held (" + std::to_string(s.len) + " held)");
  if (count == 0) return;
  const Layer& L = layers_[layer];
  const int64_t ring = L.ring ? spec().ring_positions(layer, capacity()) : 0;
  if (ring > 0 && start < s.len - ring)
    throw Error(ErrorCode::OutOfRange, "cache: positions [" + std::to_string(start) + ", " +
                                           std::to_string(s.len - ring) + ") of sequence " + std::to_string(seq) +
                                           " have left layer " + std::to_string(layer) + "'s sliding window (its ring holds the last " +
                                           std::to_string(ring) + ")");
  std::vector<int32_t> blocks = s.blocks;
  if (L.ring)
    for (size_t b = 0; b < blocks.size(); ++b) blocks[b] = slide_block(s.slot, static_cast<int64_t>(b));
  const size_t n = static_cast<size_t>(count) * spec().model.n_kv_heads * spec().model.head_dim;
  int32_t* table = nullptr;
  float* kd = nullptr;
  float* vd = nullptr;
  ck(cudaMalloc(reinterpret_cast<void**>(&table), blocks.size() * sizeof(int32_t)), "cudaMalloc");
  ck(cudaMalloc(reinterpret_cast<void**>(&kd), n * sizeof(float)), "cudaMalloc");
  ck(cudaMalloc(reinterpret_cast<void**>(&vd), n * sizeof(float)), "cudaMalloc");
  std::unique_ptr<void, void (*)(void*)> free_table(table, [](void* p) { cudaFree(p); });
  std::unique_ptr<void, void (*)(void*)> free_k(kd, [](void* p) { cudaFree(p); });
  std::unique_ptr<void, void (*)(void*)> free_v(vd, [](void* p) { cudaFree(p); });
  ck(cudaMemcpyAsync(table, blocks.data(), blocks.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_),
     "cudaMemcpyAsync");
  cuda::DequantArgs dq;
  dq.block_table = table;
  dq.start = static_cast<int>(start);
  dq.n_tokens = count;
  dq.k_out = kd;
  dq.v_out = vd;
  dq.out_dtype = cuda::DType::F32;
  cuda::dequantize(L.codec, L.kv, dq, stream_);
  ck(cudaMemcpyAsync(out, keys ? kd : vd, n * sizeof(float), cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync");
  ck(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  if (keys) centring_.restore(layer, count, out);
}

}  // namespace tqkv::engine
