// The CPU device: float32 activations in host memory, matrix products through OpenBLAS (batches)
// or straight from the GGUF blocks (qgemv.h, 1-2 tokens), element-wise kernels on the thread
// pool, and the CPU cache layer (cpu_kv_cache.h).
//
// Weights are held once. A matrix in a type qgemv.h reads (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)
// keeps only its GGUF blocks: decoding one token streams every weight once, so it is
// memory-bound, and the kernels read 0.56-1.06 bytes per weight instead of 4. A batch of
// tokens (prefill, perplexity) dequantizes row tiles of the blocks into a per-thread scratch
// and runs OpenBLAS SGEMM per tile: the GEMM does 2 n flops per weight, so expanding each weight
// once per product costs little beside it at prefill sizes, and the result is the dequantized
// model that the NumPy reference computes (tests/integration/reference_forward.py). Other types
// (F32, F16, BF16, Q5_1) are expanded to float32 at load. Until 2026-12 every matrix was held
// as float32 as well (4 bytes per weight more: 7.7 GB for Qwen2.5-Coder-1.5B).
#pragma once
#include <chrono>
#include <cstdint>
#include <vector>

#include "engine/device/device.h"

namespace tqkv::engine {

// Up to this many tokens a product reads the quantized blocks once per token; beyond it one
// float32 GEMM per dequantized row tile is cheaper.
inline constexpr int kQuantizedMaxTokens = 2;
// Row tiles of a blocks-only matrix hold about this many floats (at least kTileMinRows rows):
// large enough that SGEMM's repacking of x per tile stays small beside the tile's flops.
inline constexpr int kTileFloats = 1 << 19;
inline constexpr int kTileMinRows = 64;

class CpuMatrix final : public DeviceMatrix {
 public:
  CpuMatrix(int rows, int cols) : DeviceMatrix(rows, cols) {}
  size_t bytes() const override { return f32.size() * sizeof(float) + q.size(); }
  std::vector<float> f32;  // [rows, cols], when q is empty
  uint32_t qtype = 0;      // GGUF tensor type of q
  std::vector<uint8_t> q;  // the GGUF blocks, when qgemv supports the type; else empty
  size_t row_bytes = 0;    // bytes of one row of q
};

class CpuDevice final : public Device {
 public:
  std::string name() const override { return "cpu"; }
  DeviceBuffer alloc(size_t n) override;
  void to_device(const float* host, size_t n, float* dst) override;
  void to_host(const float* src, size_t n, float* host) override;
  void logits_out(const float* src, int rows, int cols, const LogitsOut& out) override;
  std::unique_ptr<DeviceMatrix> load_matrix(const GgufTensor& t, int rows, int cols) override;
  void embed(const DeviceMatrix& table, const int32_t* tokens, int n, float scale, float* x) override;
  // qgemv on the GGUF blocks for 1-2 rows, SGEMM (per dequantized row tile) beyond.
  bool row_count_changes_products() const override { return true; }
  void matmul(const float* x, int n, const DeviceMatrix& w, float* y, const float* bias) override;
  // Every run of 1-2 rows in one qgemm pass (the rows matmul gives each alone); longer runs
  // one matmul each.
  void matmul_runs(const float* x, const RowRun* runs, int n_runs, const DeviceMatrix& w, float* y,
                   const float* bias) override;
  // 1-2 rows over blocks-only matrices: x quantized once, and all the products' output rows in
  // one parallel job, split by weight bytes. Otherwise one matmul each.
  void matmul_group(const float* x, int n, const GroupProduct* products, int count) override;
  void rmsnorm(const float* x, const float* w, int n, int d, float eps, float* y) override;
  void rope(float* x, int n, int heads, int head_dim, const int64_t* positions, const RopeParams& p) override;
  void swiglu(float* gate, const float* up, size_t n) override;
  void gelu_glu(float* gate, const float* up, size_t n) override;
  void add(float* x, const float* y, size_t n) override;
  void gather_rows(const float* x, int d, const int32_t* rows, int n, float* y) override;
  std::unique_ptr<KvCache> make_cache(const CacheSpec& spec, const CacheShape& shape) override;
  void set_attention_timing(bool on) override;
  double attention_seconds() override { return attention_s_; }
  void attention_begin() override;
  void attention_end() override;

 private:
  bool timing_ = false;
  double attention_s_ = 0;
  std::chrono::steady_clock::time_point attention_t0_;
};

}  // namespace tqkv::engine
