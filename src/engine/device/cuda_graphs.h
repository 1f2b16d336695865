// CUDA graphs of decode steps, as vLLM captures its decode batches: a decode step (one token
// for each of B sequences) is padded to a batch-size bucket, recorded once per (model, cache,
// bucket) as a CUDA graph, and then replayed with one launch instead of the ~15 launches per
// layer it is made of (a batch-1 step of a small model is bound by launch overhead).
//
// What a replay reads is in fixed device buffers that the host rewrites before each launch:
// token ids and positions (StepGraph), slot mappings, block tables and lengths, the sink and
// window ring tables (the cache's bucket buffers, CudaKvCache::prepare_bucket). Padding rows
// have slot -1 (their stores are skipped), block 0 and length 1; their outputs are dropped.
// Everything else a step touches is fixed as well: the activations the recorded step allocated
// (StepActivations: one set per bucket, shared by the bucket's graphs of every length class), the
// decode plans of the bucket (planned for its longest sequence's length class: graphs are kept
// per bucket and class, CudaKvCache::plan_len),
// cuBLAS's workspace (set once per device) and the device's product input buffer.
//
// The step runs op by op once per bucket first (a warm-up: it makes the plans and workspaces
// outside the capture), is recorded at its second use, and replayed from then on. A batch with
// exactly a bucket's rows runs the same kernels with the same shapes recorded or not, so its
// logits are bit-identical; a padded batch runs the bucket's shapes (its products and its
// decode split may round differently from the unpadded op-by-op step).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/device/device.h"

namespace tqkv::engine {

// The largest decode batch recorded; larger steps run op by op.
constexpr int kMaxGraphBatch = 256;

// The bucket a decode step of n sequences is padded to: 1, 2, 4, 8, 16, 24, 32, 48, 64, 96,
// 128, 192, 256; 0 when n is out of (0, kMaxGraphBatch].
int graph_bucket(int n);

// The activations of a bucket's recorded steps. A step never reads an activation before writing
// it, and the graphs of one bucket never run at once (one stream), so every length class's graph
// of a bucket is recorded over the same buffers: the i-th buffer a step allocates is the set's
// i-th where it is large enough (a step of the same model and bucket asks for the same sizes in
// the same order whatever its length class), else a new one appended to the set. Adding a length
// class then costs its graph and its plans, not another set of activations (311 MB at bucket 256
// for Qwen2.5-1.5B, 268 MB of it the logits' buffer: 155 MB in a power-of-two size class).
struct StepActivations {
  std::vector<DeviceBuffer> held;
  size_t bytes = 0;  // device bytes of `held` (the pool's size classes)
};

// One recorded decode step of `bucket` rows.
struct StepGraph {
  // Allocates the inputs; throws tqkv::Error on a CUDA error. `acts`: the bucket's activations.
  StepGraph(int bucket, std::shared_ptr<StepActivations> acts);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  int bucket;
  int64_t* positions = nullptr;  // device [bucket], then
  int32_t* tokens = nullptr;     // device [bucket] in the same allocation
  int warm_runs = 0;             // op-by-op runs so far (the first one warms up)
  cudaGraphExec_t exec = nullptr;
  std::shared_ptr<StepActivations> acts;  // the bucket's activations, which the graph reads and writes
  const float* logits = nullptr;    // device [bucket, n_vocab], written by each replay
  size_t logit_floats = 0;
};

}  // namespace tqkv::engine
