// Model architectures: each family's definition written once over the device interface
// (device.h), found by the GGUF's general.architecture in a small registry.
//
//   arch_llama.cpp   llama, mistral, qwen2 (QKV bias, NeoX RoPE)
//   arch_gemma3.cpp  gemma3 (QK norms, sandwich norms, GeGLU, local/global layers)
//
// An architecture reads what its family adds to the shared config (model.cpp reads sizes,
// norms and RoPE), names the weights it loads, and runs one forward step. Adding one: a file
// arch_<name>.cpp defining an Architecture, one line in kArchitectures (architecture.cpp),
// a NumPy reference in tests/integration/reference_forward.py and a test against it.
#pragma once
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/batch.h"
#include "engine/device/device.h"
#include "engine/cache/kv_cache.h"
#include "engine/core/model_config.h"

namespace tqkv::engine {

class GgufFile;

// A layer's weights. Optional ones (biases, Gemma's extra norms) are empty when absent.
struct LayerWeights {
  DeviceBuffer attn_norm, bq, bk, bv, ffn_norm;
  DeviceBuffer q_norm, k_norm;                 // per-head RMSNorm of q and k [head_dim] (Gemma 3)
  DeviceBuffer post_attn_norm, post_ffn_norm;  // RMSNorm of the attention / FFN output [d_model] (Gemma 3)
  std::unique_ptr<DeviceMatrix> wq, wk, wv, wo, w_gate, w_up, w_down;
};

struct ModelWeights {
  std::unique_ptr<DeviceMatrix> tok_embd;  // [n_vocab, d_model]
  DeviceBuffer out_norm;                   // [d_model]
  std::unique_ptr<DeviceMatrix> output;    // [n_vocab, d_model]; null when tied to tok_embd
  std::vector<LayerWeights> layers;

  size_t bytes() const;
};

// Loads weights by GGUF tensor name onto a device; throws tqkv::Error(Format) naming a missing
// or mis-shaped tensor, or one holding NaN or infinity.
class WeightLoader {
 public:
  WeightLoader(const GgufFile& f, Device& dev) : f_(f), dev_(dev) {}
  bool has(const std::string& name) const;
  std::unique_ptr<DeviceMatrix> matrix(const std::string& name, int cols, int rows) const;
  DeviceBuffer vec(const std::string& name, int n) const;
  DeviceBuffer optional_vec(const std::string& name, int n) const { return has(name) ? vec(name, n) : DeviceBuffer(); }
  // Throws tqkv::Error(Format) naming a tensor of the file that nothing loaded (other than those
  // the config read, e.g. rope_freqs.weight): a weight the engine would silently skip.
  void check_all_used(const std::string& arch) const;

 private:
  const GgufFile& f_;
  Device& dev_;
  mutable std::set<std::string, std::less<>> used_;
};

struct Architecture {
  std::string_view name;
  // What the family adds to the config read from the shared keys (c.arch is set).
  void (*configure)(const GgufFile& f, ModelConfig& c);
  void (*load)(const WeightLoader& w, const ModelConfig& c, ModelWeights& out);
  // One forward step of a batch that the cache has checked; logits [batch.n_logits(), n_vocab]
  // (or their argmax) to `out`.
  void (*forward)(const ModelConfig& c, const ModelWeights& w, Device& dev, const Batch& batch, KvCache& cache,
                  const LogitsOut& out);
  // The {arch}.* keys the family reads beyond the shared ones (model.cpp): any other key refuses
  // the model, naming it.
  std::span<const std::string_view> keys = {};
};

// The architecture of general.architecture; throws tqkv::Error(Format) naming it when the
// engine does not run it (and why, for families it knows it cannot run correctly).
const Architecture& find_architecture(const std::string& arch);

// The matrix products of one forward step. One product covers every row of the batch, except on
// a device whose products depend on how many rows are multiplied together
// (Device::row_count_changes_products: the CPU's quantized kernels for 1-2 rows, SGEMM beyond)
// with a batch of several sequences: there each sequence's run gets the product it would get
// alone, so batching changes no sequence's logits (the server's greedy answers equal
// generate()'s); Device::matmul_runs multiplies the runs together where that changes no
// result (on the CPU, every sequence's decode row in one pass over the quantized weights).
class StepProducts {
 public:
  StepProducts(Device& dev, const Batch& batch);
  // y[rows, w.rows] = x[rows, w.cols] * w^T (+ bias) for the batch's rows.
  void matmul(const float* x, const DeviceMatrix& w, float* y, const float* bias = nullptr) const;
  // products[0 .. count) over the same x for the batch's rows, each equal bit for bit to its
  // matmul: Device::matmul_group, unless the runs are multiplied separately (then one matmul
  // each) or grouping is off (group_products()).
  void matmul_group(const float* x, const GroupProduct* products, int count) const;
  // A layer's Q, K, V (with its biases where it has them) from one input, as one group.
  void qkv(const float* x, const LayerWeights& L, float* q, float* k, float* v) const;
  // Its gate and up from one input, as one group.
  void gate_up(const float* x, const LayerWeights& L, float* gate, float* up) const;
  // Its gate and up, then the GLU (Device::glu with product_input): gate holds the result, up is
  // scratch. Device::matmul_glu where the rows are multiplied as one group, else gate_up and glu.
  void gate_up_glu(Device::Glu kind, const float* x, const LayerWeights& L, float* gate, float* up) const;
  // The same for rows that are only the batch's logit rows (in batch order).
  void matmul_logit_rows(const float* x, const DeviceMatrix& w, float* y) const;

 private:
  Device& dev_;
  const Batch& batch_;
  bool per_run_;
  std::vector<RowRun> runs_;        // with per_run_: each run's rows
  std::vector<RowRun> logit_runs_;  // and its logit rows (among the batch's logit rows)
};

// Whether StepProducts multiplies products that share an input as one group: set_group_products,
// else TQKV_GROUP_PRODUCTS (0 = off, read once), else on. The results are the same either way.
bool group_products();
void set_group_products(bool on);  // for the whole process

// Shared by the architectures: final RMSNorm of the rows that want logits, the output head
// (tok_embd when tied), to `out` (Device::logits_out).
void output_logits(const ModelConfig& c, const ModelWeights& w, Device& dev, const StepProducts& products,
                   const Batch& batch, float* x, float* tmp, const LogitsOut& out);

extern const Architecture kLlamaArchitecture;
extern const Architecture kGemma3Architecture;

}  // namespace tqkv::engine
