// Quantized products of n activation rows (Google Benchmark), one thread, at the fastest level
// this CPU runs (TQKV_SIMD forces one): n single-row qgemv calls, each streaming the weights,
// against one qgemm call, which decodes each block once per group of 8 rows (same results, bit
// for bit). A 1536 x 768 matrix (about SmolLM2-135M's FFN up, 1536 x 576, with
// columns a multiple of the K-quants' 256) in each qgemv type.
// Counter: activation rows per second.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/gguf/gguf.h"
#include "engine/weights/block_groups.h"
#include "engine/weights/qgemv.h"
#include "tqkv/half.h"

namespace {

using tqkv::engine::TensorType;
constexpr int kRows = 1536, kCols = 768;  // 576 rounded up to the K-quants' 256

std::vector<uint8_t> blocks(TensorType type) {
  const auto* tr = tqkv::engine::tensor_type_traits(static_cast<uint32_t>(type));
  const size_t nb = static_cast<size_t>(kRows) * kCols / tr->block_elems;
  std::mt19937 rng(1);
  std::vector<uint8_t> b(nb * tr->block_bytes);
  for (auto& v : b) v = static_cast<uint8_t>(rng());
  const int at = type == TensorType::Q6_K ? 208 : 0;  // d (and Q4_1 / Q4_K's second field)
  const uint16_t h = tqkv::float_to_half(0.01f);
  for (size_t i = 0; i < nb; ++i) {
    std::memcpy(&b[i * tr->block_bytes + at], &h, 2);
    if (type == TensorType::Q4_1 || type == TensorType::Q4_K) std::memcpy(&b[i * tr->block_bytes + 2], &h, 2);
  }
  return b;
}

void products(benchmark::State& state, TensorType type, bool batched) {
  const int n = static_cast<int>(state.range(0));
  const auto w = blocks(type);
  std::vector<float> x(static_cast<size_t>(n) * kCols, 0.5f), y(static_cast<size_t>(n) * kRows);
  const auto t = static_cast<uint32_t>(type);
  for (auto _ : state) {
    if (batched) {
      tqkv::engine::qgemm(t, w.data(), kCols, 0, kRows, x.data(), n, y.data(), kRows);
    } else {
      for (int r = 0; r < n; ++r)
        tqkv::engine::qgemv(t, w.data(), kCols, 0, kRows, x.data() + static_cast<size_t>(r) * kCols,
                            y.data() + static_cast<size_t>(r) * kRows);
    }
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["rows"] = benchmark::Counter(static_cast<double>(n) * state.iterations(), benchmark::Counter::kIsRate);
}

#define TQKV_QGEMM_BENCH(T)                                                                          \
  BENCHMARK_CAPTURE(products, T##_qgemv_per_row, TensorType::T, false)->Arg(1)->Arg(8)->Arg(16); \
  BENCHMARK_CAPTURE(products, T##_qgemm, TensorType::T, true)->Arg(1)->Arg(4)->Arg(8)->Arg(16)

TQKV_QGEMM_BENCH(Q4_0);
TQKV_QGEMM_BENCH(Q4_1);
TQKV_QGEMM_BENCH(Q5_0);
TQKV_QGEMM_BENCH(Q8_0);
TQKV_QGEMM_BENCH(Q4_K);
TQKV_QGEMM_BENCH(Q6_K);

// One decode step's product from memory: a matrix of about 128 MB (more than any cache here) in
// one qgemv, as a small model's layers stream their weights once per token. 896 columns: Qwen2.5-
// 0.5B's width (28 blocks of 32, 3.5 of 256; the K-quants take 1024). Counter: weight bytes per
// second, to hold against the machine's read bandwidth.
void streamed(benchmark::State& state, TensorType type, bool groups = false) {
  const auto* tr = tqkv::engine::tensor_type_traits(static_cast<uint32_t>(type));
  const int cols = tr->block_elems == 256 ? 1024 : 896;
  const size_t row_bytes = static_cast<size_t>(cols) / tr->block_elems * tr->block_bytes;
  const int rows = static_cast<int>((size_t{128} << 20) / row_bytes);
  std::vector<uint8_t> w(row_bytes * rows);
  std::mt19937 rng(2);
  for (auto& v : w) v = static_cast<uint8_t>(rng());
  const int at = type == TensorType::Q6_K ? 208 : 0;
  const uint16_t h = tqkv::float_to_half(0.01f);
  for (size_t i = 0; i < w.size() / tr->block_bytes; ++i) {
    std::memcpy(&w[i * tr->block_bytes + at], &h, 2);
    if (type == TensorType::Q4_1 || type == TensorType::Q4_K) std::memcpy(&w[i * tr->block_bytes + 2], &h, 2);
  }
  std::vector<float> x(cols), y(rows);
  for (int c = 0; c < cols; ++c) x[c] = std::sin(0.37f * c);
  uint32_t t = static_cast<uint32_t>(type);
  if (groups) {  // as CpuDevice holds Q5_0, Q4_1 and Q8_0 where the AVX2 int8 kernels run
    std::vector<uint8_t> g(w.size());
    t = tqkv::engine::grouped_type(t);
    tqkv::engine::pack_group_rows(t, w.data(), rows, cols, g.data());
    w.swap(g);
  }
  for (auto _ : state) {
    tqkv::engine::qgemv(t, w.data(), cols, 0, rows, x.data(), y.data());
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(w.size()) * state.iterations());
}
BENCHMARK_CAPTURE(streamed, Q4_0, TensorType::Q4_0)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(streamed, Q4_1, TensorType::Q4_1)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(streamed, Q4_1_groups, TensorType::Q4_1, true)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(streamed, Q5_0, TensorType::Q5_0)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(streamed, Q5_0_groups, TensorType::Q5_0, true)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(streamed, Q8_0, TensorType::Q8_0)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(streamed, Q8_0_groups, TensorType::Q8_0, true)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(streamed, Q4_K, TensorType::Q4_K)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(streamed, Q6_K, TensorType::Q6_K)->Unit(benchmark::kMillisecond);

}  // namespace
