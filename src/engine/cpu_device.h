// The CPU device: float32 activations in host memory, matrix products through OpenBLAS (batches)
// or straight from the GGUF blocks (qgemv.h, 1-2 tokens), element-wise kernels on the thread
// pool, and the CPU cache layer (cpu_kv_cache.h).
//
// Weights are held twice. (1) Expanded to float32 at load: a batch of tokens (prefill,
// perplexity) is a GEMM that OpenBLAS runs near peak on float32, and its result is the
// dequantized model that the independent NumPy reference computes
// (tests/integration/reference_forward.py). (2) The GGUF blocks as stored, for Q4_0, Q4_1 and
// Q8_0 matrices: decoding one token streams every weight once, so it is memory-bound, and
// qgemv.h's kernels read 0.6-1.1 bytes per weight instead of 4 (decode ~3x faster on two
// cores). Both compute the same products up to float summation order. The price is memory:
// ~0.54 GB + the file's size for SmolLM2-135M.
#pragma once
#include <cstdint>
#include <vector>

#include "device.h"

namespace tqkv::engine {

// Up to this many tokens a product reads the quantized blocks once per token; beyond it one
// float32 GEMM is cheaper.
inline constexpr int kQuantizedMaxTokens = 2;

class CpuMatrix final : public DeviceMatrix {
 public:
  CpuMatrix(int rows, int cols) : DeviceMatrix(rows, cols) {}
  size_t bytes() const override { return f32.size() * sizeof(float) + q.size(); }
  std::vector<float> f32;  // [rows, cols]
  uint32_t qtype = 0;      // GGUF tensor type of q
  std::vector<uint8_t> q;  // the GGUF blocks, when qgemv supports the type; else empty
};

class CpuDevice final : public Device {
 public:
  std::string name() const override { return "cpu"; }
  DeviceBuffer alloc(size_t n) override;
  void to_device(const float* host, size_t n, float* dst) override;
  void to_host(const float* src, size_t n, float* host) override;
  std::unique_ptr<DeviceMatrix> load_matrix(const GgufTensor& t, int rows, int cols) override;
  void embed(const DeviceMatrix& table, const int32_t* tokens, int n, float scale, float* x) override;
  // qgemv on the GGUF blocks for 1-2 rows, SGEMM on the float32 copy beyond.
  bool row_count_changes_products() const override { return true; }
  void matmul(const float* x, int n, const DeviceMatrix& w, float* y, const float* bias) override;
  void rmsnorm(const float* x, const float* w, int n, int d, float eps, float* y) override;
  void rope(float* x, int n, int heads, int head_dim, const int64_t* positions, const RopeParams& p) override;
  void swiglu(float* gate, const float* up, size_t n) override;
  void gelu_glu(float* gate, const float* up, size_t n) override;
  void add(float* x, const float* y, size_t n) override;
  void gather_rows(const float* x, int d, const int32_t* rows, int n, float* y) override;
  std::unique_ptr<KvCache> make_cache(const CacheSpec& spec, const CacheShape& shape) override;
};

}  // namespace tqkv::engine
