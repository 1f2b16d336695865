// The device interface: the operations a model's forward pass is made of, implemented once
// per device (cpu_device.h; the CUDA device adds its own). A model definition (model.cpp) is
// written over this interface only, so it runs unchanged on every device, as ggml's backends
// and vLLM's model/attention-backend split do.
//
// Memory: activations are float arrays in the device's memory (DeviceBuffer); weights are
// DeviceMatrix objects the device made from GGUF tensors. Integer batch metadata (token ids,
// positions, row indices) is passed as host arrays; a device copies what its kernels need.
// Attention is not a device operation of its own: it belongs to the cache (kv_cache.h), which
// a device makes, because what a cache spec adds (centring, sinks, window) is part of it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/rope.h"

namespace tqkv::engine {

struct GgufTensor;
struct Batch;
class KvCache;
struct CacheSpec;
struct CacheShape;

// Rows [begin, begin + count) of a product: one sequence's rows of a batch (Device::matmul_runs).
struct RowRun {
  int begin, count;
};

// One product of a group over a shared input (Device::matmul_group):
// y[n, w.rows] = x[n, w.cols] * w^T (+ bias[w.rows] when not null).
class DeviceMatrix;
struct GroupProduct {
  const DeviceMatrix* w;
  float* y;
  const float* bias = nullptr;
};

// A weight matrix [rows (outputs), cols (inputs)] in a device's memory and layout.
class DeviceMatrix {
 public:
  virtual ~DeviceMatrix() = default;
  int rows() const { return rows_; }
  int cols() const { return cols_; }
  virtual size_t bytes() const = 0;  // memory it holds

 protected:
  DeviceMatrix(int rows, int cols) : rows_(rows), cols_(cols) {}

 private:
  int rows_, cols_;
};

// An owned float array in a device's memory. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(float* data, size_t size, void (*release)(float*)) : data_(data, release), size_(size) {}
  float* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  std::unique_ptr<float, void (*)(float*)> data_{nullptr, nullptr};
  size_t size_ = 0;
};

// Where a step's logits rows go: to the host as they are (logits: [rows, n_vocab] floats), or
// only each row's greedy token (argmax: [rows] ids, engine::argmax's rule: ties to the lowest
// id, NaN never wins), which a GPU picks on the device so that only the ids cross to the host.
struct LogitsOut {
  float* logits = nullptr;
  int32_t* argmax = nullptr;
  LogitsOut() = default;
  LogitsOut(float* l) : logits(l) {}  // NOLINT(google-explicit-constructor): logits are the usual ask
  static LogitsOut greedy(int32_t* ids) {
    LogitsOut o;
    o.argmax = ids;
    return o;
  }
  // Rows r0.. of the same output (a batch run in pieces).
  LogitsOut from_row(size_t r0, int n_vocab) const {
    LogitsOut o;
    if (logits) o.logits = logits + r0 * static_cast<size_t>(n_vocab);
    if (argmax) o.argmax = argmax + r0;
    return o;
  }
};

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;

  // Memory.
  virtual DeviceBuffer alloc(size_t n) = 0;  // uninitialised
  virtual void to_device(const float* host, size_t n, float* dst) = 0;
  virtual void to_host(const float* src, size_t n, float* host) = 0;
  // A step's logits [rows, cols] (device memory) to where `out` asks. The default copies them
  // to the host and, for argmax, picks there.
  virtual void logits_out(const float* src, int rows, int cols, const LogitsOut& out);

  // Weights: a GGUF tensor of shape [cols (contiguous), rows], any type the GGUF reader
  // dequantizes (the device chooses how to hold it). Throws tqkv::Error(Format) on a shape
  // mismatch.
  virtual std::unique_ptr<DeviceMatrix> load_matrix(const GgufTensor& t, int rows, int cols) = 0;
  // A vector (norm weights, biases) copied to the device as float32.
  DeviceBuffer load_vector(const float* host, size_t n);

  // Operations. Shapes are row-major; n is the number of tokens (rows).
  // x[i] = row tokens[i] of the embedding matrix, times `scale`: x [n, table.cols].
  virtual void embed(const DeviceMatrix& table, const int32_t* tokens, int n, float scale, float* x) = 0;
  // y[n, w.rows] = x[n, w.cols] * w^T (+ bias[w.rows]).
  // row_count_changes_products: true where a row's result depends on how many rows are
  // multiplied together (different kernels by row count); the model then multiplies each
  // sequence's rows of a batch separately, so batching changes no sequence's logits.
  virtual bool row_count_changes_products() const { return false; }
  virtual void matmul(const float* x, int n, const DeviceMatrix& w, float* y, const float* bias = nullptr) = 0;
  // The same product over the rows of runs[0 .. n_runs) (in row order, disjoint), each run's rows
  // equal to matmul of that run alone: what a device whose row count changes products gives
  // each sequence of a batch. Default: one matmul per run; a device may share the weight reads
  // among runs when that changes no result (the CPU's quantized kernels for 1-2 rows).
  virtual void matmul_runs(const float* x, const RowRun* runs, int n_runs, const DeviceMatrix& w, float* y,
                           const float* bias = nullptr);
  // products[0 .. count) over the same x [n, cols] (every w has the same cols; no y overlaps x or
  // another y), each equal bit for bit to its matmul alone: Q, K, V from one normed row, gate
  // and up from another. Default: one matmul each. The CPU prepares x once for its quantized
  // kernels and splits the union of the products' output rows over its threads in one job.
  // The CUDA device converts x to bf16 once for the group instead of once per product.
  virtual void matmul_group(const float* x, int n, const GroupProduct* products, int count);
  // y[t] = x[t] / rms(x[t]) * w, over d features; y may be x. Per-head norms pass
  // n = tokens * heads rows of d = head_dim.
  virtual void rmsnorm(const float* x, const float* w, int n, int d, float eps, float* y) = 0;
  // Rotates each head of x [n, heads, head_dim] in place, token t at positions[t] (host).
  virtual void rope(float* x, int n, int heads, int head_dim, const int64_t* positions, const RopeParams& p) = 0;
  // gate[i] = silu(gate[i]) * up[i] (SwiGLU).
  virtual void swiglu(float* gate, const float* up, size_t n) = 0;
  // gate[i] = gelu(gate[i]) * up[i] (GeGLU), GELU in its tanh approximation
  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as Gemma's gelu_pytorch_tanh.
  virtual void gelu_glu(float* gate, const float* up, size_t n) = 0;
  // x[i] += y[i] (residuals).
  virtual void add(float* x, const float* y, size_t n) = 0;

  // Fused operations: each gives bit for bit what the plain operations it stands for give (the
  // defaults run those, so the CPU device is unchanged); a device may run them in fewer kernels.
  // product_input: the next operation of this device is a product (matmul or matmul_group) over
  // exactly the rows this one writes to y (gate), so a device may prepare that product's input
  // in the same kernel (the CUDA device writes the bf16 copy its GEMMs read, and the product then
  // converts nothing). The results are the same either way.
  //
  // x += delta (unless delta is null), then y = rmsnorm(x) * w: a residual add and the norm that
  // follows it. y may be delta (not x).
  virtual void add_rmsnorm(float* x, const float* delta, const float* w, int n, int d, float eps, float* y,
                           bool product_input = false);
  // swiglu (Silu) or gelu_glu (Gelu) of gate and up.
  enum class Glu { Silu, Gelu };
  virtual void glu(Glu kind, float* gate, const float* up, size_t n, bool product_input = false);
  // The feed-forward's gate and up products over x [n, w_gate.cols] followed by the GLU:
  // matmul_group of {w_gate -> gate, w_up -> up}, then glu(kind, gate, up, n * w_gate.rows,
  // product_input). `up` is scratch: a device that computes both products and the GLU in one kernel
  // (CUDA at a decode step's few rows) need not write it. Default: those two operations.
  virtual void matmul_glu(Glu kind, const float* x, int n, const DeviceMatrix& w_gate, const DeviceMatrix& w_up,
                          float* gate, float* up, bool product_input = false);
  // rope of q [n, q_heads, head_dim] and k [n, k_heads, head_dim] at the same positions.
  virtual void rope_qk(float* q, int q_heads, float* k, int k_heads, int n, int head_dim, const int64_t* positions,
                       const RopeParams& p);
  // Whether a device that fuses them runs the fused operations fused (on by default; the CUDA
  // device reads TQKV_FUSE_OPS=0 as off at construction). Off: the plain operations' kernels.
  virtual void set_fused_ops(bool on) { (void)on; }
  virtual bool fused_ops() const { return false; }
  // y[i] = x[rows[i]] for rows of d floats (rows: host indices).
  virtual void gather_rows(const float* x, int d, const int32_t* rows, int n, float* y) = 0;

  // A KV cache of this device for a resolved cache spec (cache_spec.h).
  virtual std::unique_ptr<KvCache> make_cache(const CacheSpec& spec, const CacheShape& shape) = 0;

  // One forward step of a batch the cache has checked: step(b, out) issues the step's
  // operations for batch b and writes b's logits rows (or their argmax) to the host. The default calls it once. The
  // CUDA device records decode steps (one token per sequence) as CUDA graphs, one per batch-size
  // bucket and model (`model` identifies it), and replays them (cuda_graphs.h); a replayed step
  // gives the logits the recorded one would.
  using StepFn = std::function<void(const Batch& b, const LogitsOut& out)>;
  virtual void run_step(const Batch& batch, KvCache& cache, const void* model, const LogitsOut& out, const StepFn& step) {
    (void)cache, (void)model;
    step(batch, out);
  }
  // Whether run_step may replay recorded steps (on by default where the device has them; a
  // device without them ignores the setting and answers false).
  virtual void set_step_graphs(bool on) { (void)on; }
  virtual bool step_graphs() const { return false; }

  // The benchmark's split of a step's time into attention and the rest: the architectures
  // bracket each layer's cache.attend with attention_begin()/attention_end(), and while timing
  // is on the device sums the time between them. attention_seconds() waits for the device and
  // returns the sum since timing was turned on. The CPU times by the clock; CUDA by events on its
  // stream, in steps run op by op only (a step replayed from a graph is not split). Off by
  // default, and then free.
  virtual void set_attention_timing(bool on) { (void)on; }
  virtual double attention_seconds() { return 0; }
  virtual void attention_begin() {}
  virtual void attention_end() {}
  // Marks the steps a profiler started with its collection off should see (CUDA:
  // cudaProfilerStart/Stop, so `ncu --profile-from-start off` skips the prefill's launches).
  // Without a profiler, and on the CPU, it does nothing.
  virtual void profile_range(bool on) { (void)on; }
};

// "cpu" (the default), "cuda", or "auto" (the GPU where one is built and present, else the
// CPU). Throws tqkv::Error(InvalidArgument) for an unknown name or a device not in this build.
std::shared_ptr<Device> make_device(std::string_view name = "cpu");

}  // namespace tqkv::engine
