// The CUDA cache layer: per layer a page pool (tqkv::cuda::PagedKv, page layout, 16 tokens per
// page) of the layer's format, shared block ids across layers from one free list, and per
// sequence a block table on the host, mirrored to the device for each step.
//
// attend(): centring/scales (KeyCentring's numbers, uploaded once), the fused store of the
// batch's K/V through a slot mapping, then attention: the single-token runs of a step (decode)
// in one split-KV launch (cuda::run_decode; plans and workspaces kept per batch size), every
// other run (prefill chunks) by dequantizing its sequence's positions [0, pos0 + count) to a
// workspace (bf16; float32 for uncompressed formats) and the tiled causal prefill kernel. Layers
// with a sliding window, and formats the decode kernel lacks (f32), take the prefill path for
// decode tokens too.
//
// Not on the GPU yet (refused at creation with tqkv::Error(InvalidArgument)): attention sinks,
// the recent window (w<N>, fill<B>, wq<B>), formats the CUDA codecs cannot store (codes wider
// than 4 bits), head dims other than 64/128/256. A sequence holds at most `capacity` positions
// (the pool has no ring): a step past it throws Error(Capacity) in check().
#pragma once
#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "key_centring.h"
#include "kv_cache.h"
#include "tqkv/cuda.h"

namespace tqkv::engine {

class CudaKvCache final : public KvCache {
 public:
  static constexpr int kBlockSize = 16;

  // stream: the device's (shared, so that a cache may outlive its device).
  CudaKvCache(const CacheSpec& spec, const CacheShape& shape, std::shared_ptr<CUstream_st> stream);
  ~CudaKvCache() override;

  int64_t add_sequence() override;
  void free_sequence(int64_t seq) override;
  int64_t seq_len(int64_t seq) const override;
  int max_step_tokens() const override;
  void check(const Batch& batch) const override;
  void attend(int layer, const Batch& batch, float* q, float* k, const float* v, float* out) override;
  void read(int layer, int64_t seq, int64_t start, int count, bool keys, float* out) const override;

  int free_blocks() const { return static_cast<int>(free_.size()); }

 private:
  struct Layer {
    cuda::CacheCodec codec;
    cuda::PagedKv kv;
    bool decode = false;      // run_decode has a kernel for the format
    bool f32_workspace = false;
  };
  struct Sequence {
    std::vector<int32_t> blocks;
    int64_t len = 0;
  };
  struct Plan {
    cuda::DecodePlan plan;
    void* workspace = nullptr;
  };
  // What a step's layers share: uploaded slot mapping, block tables, decode rows.
  struct Step {
    std::vector<Batch::Run> runs;
    std::vector<int> decode_runs;   // indices into runs (single tokens)
    bool decode_contiguous = false;  // the decode runs are the whole batch, in order
  };

  const Sequence& at(int64_t seq) const;
  void prepare(const Batch& batch);
  void* grow(void*& p, size_t& have, size_t bytes);
  Plan& plan_for(const Layer& L, int batch);

  std::shared_ptr<CUstream_st> owner_;
  cudaStream_t stream_;
  KeyCentring centring_;
  float* mean_ = nullptr;   // [n_layers, n_kv_heads, head_dim]
  float* scale_ = nullptr;
  int blocks_per_seq_ = 0;
  std::vector<Layer> layers_;
  std::vector<int32_t> free_;
  std::unordered_map<int64_t, Sequence> seqs_;
  int64_t next_id_ = 0;
  Step step_;
  std::map<std::pair<std::string, int>, Plan> plans_;
  // Device buffers of the step (grown, never shrunk).
  void* slots_ = nullptr;  // int64 [n]
  size_t slots_bytes_ = 0;
  void* tables_ = nullptr;  // int32 [runs, blocks_per_seq] then decode [n_dec, blocks_per_seq], lens, rows
  size_t tables_bytes_ = 0;
  int32_t* dec_tables_ = nullptr;
  int32_t* dec_lens_ = nullptr;
  int32_t* dec_rows_ = nullptr;
  void* kws_ = nullptr;  // dequantized K, V
  size_t kws_bytes_ = 0;
  void* vws_ = nullptr;
  size_t vws_bytes_ = 0;
  void* qbuf_ = nullptr;  // gathered decode queries, outputs
  size_t qbuf_bytes_ = 0;
  void* obuf_ = nullptr;
  size_t obuf_bytes_ = 0;
};

}  // namespace tqkv::engine
