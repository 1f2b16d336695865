// The CUDA device (built with TQKV_CUDA): float32 activations in GPU memory, weights
// dequantized at load (dequant.h, every GGUF type the CPU reads) and held as bf16 — or, with
// TQKV_CUDA_WEIGHTS=quantized, the layers' matrices kept in their GGUF blocks and expanded to the
// same bf16 by each product into a scratch slot (cuda::dequant_weights_bf16) — matrix
// products through cuBLAS (bf16 x bf16 with float32 accumulation and output) or, at a decode
// step's few rows (<= 16 by default, TQKV_CUDA_SKINNY_MAX), the skinny tensor-core products of
// cuda::skinny_gemm (a layer's Q, K, V and biases in one launch; gate, up and the GLU in one; a
// product alone unless it has very long rows or very many, where cuBLAS measured faster), the
// element-wise ops of tqkv/cuda_ops.h, and the CUDA cache layer (cuda_kv_cache.h). All work
// runs in order on one stream; to_host waits for it.
//
// Activations come from a caching pool (freed buffers are kept for the next step of the same
// shape; cudaFree would synchronise the device every step).
//
// Fused operations (Device::add_rmsnorm, glu, rope_qk) run as one kernel each unless
// set_fused_ops(false) or TQKV_FUSE_OPS=0: a residual add with the RMSNorm after it, the queries'
// and keys' RoPE (inverse frequencies uploaded once per (n_rot, base)), and, where the product
// that follows reads their output, its bf16 copy written by the same kernel: the product then
// converts nothing (stage_input finds its input staged). matmul_group then also adds the group's
// biases in one launch.
//
// Decode steps run as CUDA graphs (cuda_graphs.h) unless set_step_graphs(false): run_step pads
// the step to its bucket, writes its inputs to the bucket's fixed buffers and replays the
// bucket's graph. While a step is warmed up or recorded, the device reads the step's token ids
// and positions from those buffers instead of uploading them, keeps the activations it hands out
// for the graph, and leaves the logits on the device for run_step to copy.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "engine/device/device.h"

namespace tqkv::engine {

// True where the CUDA runtime reports at least one device.
bool cuda_device_present();

// A weight matrix [rows, cols] in device memory: bf16, or kept quantized as the GGUF file's
// blocks (TQKV_CUDA_WEIGHTS=quantized), which each product expands to bf16 just before it reads
// them (CudaDevice::weights).
class CudaMatrix final : public DeviceMatrix {
 public:
  CudaMatrix(int rows, int cols, const float* host);  // host: [rows, cols] float32, held as bf16
  // The blocks of a GGUF tensor of `type` (cuda::dequant_weights_supports), rows of cols elements.
  CudaMatrix(int rows, int cols, uint32_t type, const void* blocks, size_t bytes);
  ~CudaMatrix() override;
  CudaMatrix(const CudaMatrix&) = delete;
  CudaMatrix& operator=(const CudaMatrix&) = delete;
  size_t bytes() const override { return bytes_; }
  bool quantized() const { return blocks_ != nullptr; }
  const uint16_t* bf16() const { return w_; }  // [rows, cols], device memory (null when quantized)
  uint32_t type() const { return type_; }
  const void* blocks() const { return blocks_; }

 private:
  uint16_t* w_ = nullptr;
  void* blocks_ = nullptr;
  uint32_t type_ = 0;
  size_t bytes_ = 0;
};

class CudaDevice final : public Device {
 public:
  // Throws tqkv::Error(InvalidArgument) when no CUDA device is present.
  explicit CudaDevice(int ordinal = 0);
  ~CudaDevice() override;

  std::string name() const override { return "cuda"; }
  DeviceBuffer alloc(size_t n) override;
  void to_device(const float* host, size_t n, float* dst) override;
  void to_host(const float* src, size_t n, float* host) override;
  void logits_out(const float* src, int rows, int cols, const LogitsOut& out) override;
  std::unique_ptr<DeviceMatrix> load_matrix(const GgufTensor& t, int rows, int cols) override;
  void embed(const DeviceMatrix& table, const int32_t* tokens, int n, float scale, float* x) override;
  void matmul(const float* x, int n, const DeviceMatrix& w, float* y, const float* bias) override;
  void matmul_group(const float* x, int n, const GroupProduct* products, int count) override;
  void rmsnorm(const float* x, const float* w, int n, int d, float eps, float* y) override;
  void rope(float* x, int n, int heads, int head_dim, const int64_t* positions, const RopeParams& p) override;
  void swiglu(float* gate, const float* up, size_t n) override;
  void gelu_glu(float* gate, const float* up, size_t n) override;
  void add(float* x, const float* y, size_t n) override;
  void add_rmsnorm(float* x, const float* delta, const float* w, int n, int d, float eps, float* y,
                   bool product_input) override;
  void glu(Glu kind, float* gate, const float* up, size_t n, bool product_input) override;
  void matmul_glu(Glu kind, const float* x, int n, const DeviceMatrix& w_gate, const DeviceMatrix& w_up, float* gate,
                  float* up, bool product_input) override;
  void rope_qk(float* q, int q_heads, float* k, int k_heads, int n, int head_dim, const int64_t* positions,
               const RopeParams& p) override;
  // Products of at most `rows` rows run as skinny products (0: cuBLAS for every product; clamped
  // to cuda::kSkinnyMaxRows). Default: TQKV_CUDA_SKINNY_MAX, else the device's default.
  void set_skinny_max(int rows);
  int skinny_max() const;
  void set_fused_ops(bool on) override;
  bool fused_ops() const override;
  void gather_rows(const float* x, int d, const int32_t* rows, int n, float* y) override;
  std::unique_ptr<KvCache> make_cache(const CacheSpec& spec, const CacheShape& shape) override;
  void run_step(const Batch& batch, KvCache& cache, const void* model, const LogitsOut& out, const StepFn& step) override;
  void set_step_graphs(bool on) override;
  bool step_graphs() const override;
  void set_attention_timing(bool on) override;
  void profile_range(bool on) override;
  double attention_seconds() override;
  void attention_begin() override;
  void attention_end() override;

  cudaStream_t stream() const;

 private:
  uint16_t* product_input(size_t nx);                                       // the bf16 input, >= nx
  // The bf16 weights a product reads: the matrix's own, or (quantized) expanded into scratch slot
  // `slot` (one per matrix a single launch reads: a group's products, gate and up).
  const uint16_t* weights(const DeviceMatrix& m, int slot);
  // A product of n rows over a quantized matrix that cuda::qgemv takes (decode's few rows),
  // reading x (float32) or, with `staged`, the bf16 input buffer: runs it and returns true;
  // anything else returns false and runs nothing.
  bool quantized_product(const DeviceMatrix& m, int n, const float* x, bool staged, float* y, const float* bias);
  void stage_input(const float* x, size_t nx);                              // x -> bf16 input
  void gemm_staged(int n, const DeviceMatrix& w, float* y, const float* bias);  // on the staged input
  bool skinny(int n, int cols) const;  // whether a group of products of n rows runs as skinny products
  bool skinny_single(int n, int rows, int cols) const;  // and a product alone
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

std::shared_ptr<Device> make_cuda_device();

}  // namespace tqkv::engine
