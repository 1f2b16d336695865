#include "engine/device/cpu_device.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "engine/device/cpu_kv_cache.h"
#include "engine/weights/dequant.h"
#include "engine/gguf/gguf.h"
#include "engine/weights/block_groups.h"
#include "engine/weights/qgemv.h"
#include "engine/core/sampler.h"
#include "cpu/thread_pool.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

// Rows [r0, r0 + n) of a blocks-only matrix as float32.
void dequantize_rows(const CpuMatrix& m, size_t r0, int n, float* dst) {
  const uint8_t* src = m.q.data() + r0 * m.row_bytes;
  const int64_t count = static_cast<int64_t>(n) * m.cols();
  if (is_grouped(m.qtype)) return dequantize_group_rows(m.qtype, src, static_cast<size_t>(n), m.cols(), dst);
  dequantize(m.qtype, src, dst, count);
}

}  // namespace

DeviceBuffer CpuDevice::alloc(size_t n) {
  float* p = n ? static_cast<float*>(std::malloc(n * sizeof(float))) : nullptr;
  if (n && !p) throw Error(ErrorCode::Capacity, "cpu: out of memory allocating " + std::to_string(n) + " floats");
  return DeviceBuffer(p, n, [](float* q) { std::free(q); });
}

void CpuDevice::to_device(const float* host, size_t n, float* dst) {
  if (n) std::memcpy(dst, host, n * sizeof(float));
}

void CpuDevice::to_host(const float* src, size_t n, float* host) {
  if (n) std::memcpy(host, src, n * sizeof(float));
}

void CpuDevice::logits_out(const float* src, int rows, int cols, const LogitsOut& out) {
  if (out.logits) to_host(src, static_cast<size_t>(rows) * static_cast<size_t>(cols), out.logits);
  if (out.argmax)  // in host memory already: picked where they are
    for (int r = 0; r < rows; ++r) out.argmax[r] = argmax(src + static_cast<size_t>(r) * cols, cols);
}

std::unique_ptr<DeviceMatrix> CpuDevice::load_matrix(const GgufTensor& t, int rows, int cols) {
  auto m = std::make_unique<CpuMatrix>(rows, cols);
  if (!qgemv_supported(t.type)) {
    m->f32 = expand_tensor(t, cols, rows);
    return m;
  }
  check_tensor_shape(t, cols, rows);  // cols is a whole number of blocks: the GGUF reader checked ne[0]
  m->qtype = t.type;
  m->row_bytes = t.nbytes / rows;
  if (const uint32_t grouped = group_at_load(t.type)) {
    m->qtype = grouped;
    m->q.resize(t.nbytes);
    pack_group_rows(grouped, t.data, static_cast<size_t>(rows), cols, m->q.data());
  } else {
    m->q.assign(t.data, t.data + t.nbytes);
  }
  return m;
}

void CpuDevice::embed(const DeviceMatrix& table, const int32_t* tokens, int n, float scale, float* x) {
  const auto& m = static_cast<const CpuMatrix&>(table);
  const int d = m.cols();
  for (int t = 0; t < n; ++t) {
    const size_t r = static_cast<size_t>(tokens[t]);
    float* xt = x + static_cast<size_t>(t) * d;
    if (m.q.empty()) {
      std::memcpy(xt, &m.f32[r * d], d * sizeof(float));
    } else {
      dequantize_rows(m, r, 1, xt);
    }
    if (scale != 1.0f)
      for (int i = 0; i < d; ++i) xt[i] *= scale;
  }
}

// OpenBLAS runs single-threaded inside our blocking pool (thread_pool.h), whose workers
// split the output features: OpenBLAS's own spinning threads next to anyone else's spinning
// OpenMP workers made prefill 5x slower on two cores.
void CpuDevice::matmul(const float* x, int n, const DeviceMatrix& wm, float* y, const float* bias) {
  static const bool once = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)once;
  const auto& w = static_cast<const CpuMatrix&>(wm);
  const int in = w.cols(), out = w.rows();
  const bool quantized = n <= kQuantizedMaxTokens && !w.q.empty();
  // Slices of at least 64 output rows, so small matrices are not split into tiny products.
  const int parts = std::max(1, std::min(cpu::pool_threads(), out / 64));
  cpu::parallel_for(parts, [&](int p) {
    const int o0 = static_cast<int>(static_cast<int64_t>(out) * p / parts);
    const int o1 = static_cast<int>(static_cast<int64_t>(out) * (p + 1) / parts);
    const int m = o1 - o0;
    if (m <= 0) return;
    if (quantized) {
      qgemm(w.qtype, w.q.data(), in, o0, o1, x, n, y + o0, out);  // each row as qgemv alone
    } else if (!w.q.empty()) {
      // Tiles depend on the part and the matrix only, never on n, so a row's products do
      // not change with the batch beyond what SGEMM itself does for a different n.
      const int tile = std::max(kTileMinRows, kTileFloats / in);
      thread_local std::vector<float> scratch;
      for (int t0 = o0; t0 < o1; t0 += tile) {
        const int tm = std::min(tile, o1 - t0);
        scratch.resize(static_cast<size_t>(tm) * in);
        dequantize_rows(w, static_cast<size_t>(t0), tm, scratch.data());
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, tm, in, 1.0f, x, in, scratch.data(), in, 0.0f, y + t0,
                    out);
      }
    } else {
      const float* wp = w.f32.data() + static_cast<size_t>(o0) * in;
      if (n == 1) {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, m, in, 1.0f, wp, in, x, 1, 0.0f, y + o0, 1);
      } else {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, in, 1.0f, x, in, wp, in, 0.0f, y + o0, out);
      }
    }
    if (bias)
      for (int t = 0; t < n; ++t)
        for (int o = o0; o < o1; ++o) y[static_cast<size_t>(t) * out + o] += bias[o];
  });
}

// Runs of up to kQuantizedMaxTokens rows get qgemv per row from matmul, so all of them can
// share one qgemm pass over the blocks (bit-identical rows, weights read once per group of rows
// instead of once per sequence); longer runs (prefill chunks) get matmul's SGEMM each.
void CpuDevice::matmul_runs(const float* x, const RowRun* runs, int n_runs, const DeviceMatrix& wm, float* y,
                            const float* bias) {
  const auto& w = static_cast<const CpuMatrix&>(wm);
  if (w.q.empty()) return Device::matmul_runs(x, runs, n_runs, wm, y, bias);
  const int in = w.cols(), out = w.rows();
  std::vector<RowRun> stretches;  // consecutive rows of short runs
  for (int i = 0; i < n_runs; ++i) {
    const RowRun& r = runs[i];
    if (r.count > kQuantizedMaxTokens) {
      matmul(x + static_cast<size_t>(r.begin) * in, r.count, wm, y + static_cast<size_t>(r.begin) * out, bias);
    } else if (!stretches.empty() && stretches.back().begin + stretches.back().count == r.begin) {
      stretches.back().count += r.count;
    } else if (r.count > 0) {
      stretches.push_back(r);
    }
  }
  if (stretches.empty()) return;
  const int parts = std::max(1, std::min(cpu::pool_threads(), out / 64));
  cpu::parallel_for(parts, [&](int p) {
    const int o0 = static_cast<int>(static_cast<int64_t>(out) * p / parts);
    const int o1 = static_cast<int>(static_cast<int64_t>(out) * (p + 1) / parts);
    for (const RowRun& r : stretches) {
      float* yr = y + static_cast<size_t>(r.begin) * out;
      qgemm(w.qtype, w.q.data(), in, o0, o1, x + static_cast<size_t>(r.begin) * in, r.count, yr + o0, out);
      if (bias)
        for (int t = 0; t < r.count; ++t)
          for (int o = o0; o < o1; ++o) yr[static_cast<size_t>(t) * out + o] += bias[o];
    }
  });
}

// The products' rows in one job: each part takes the rows whose first weight byte falls in its
// share of the group's bytes (every row exactly once, rows in proportion to what they cost to
// read), so two threads meet once per group instead of once per product. A row's result does
// not depend on which part computes it (qgemm per row slice), so it equals matmul's.
void CpuDevice::matmul_group(const float* x, int n, const GroupProduct* products, int count) {
  bool quantized = n >= 1 && n <= kQuantizedMaxTokens && count > 1;
  int64_t bytes = 0, rows = 0;
  for (int i = 0; i < count && quantized; ++i) {
    const auto& w = static_cast<const CpuMatrix&>(*products[i].w);
    if (w.cols() != products[0].w->cols())
      throw Error(ErrorCode::InvalidArgument, "matmul_group: products over inputs of different widths");
    quantized = !w.q.empty();
    bytes += static_cast<int64_t>(w.rows()) * static_cast<int64_t>(w.row_bytes);
    rows += w.rows();
  }
  if (!quantized) return Device::matmul_group(x, n, products, count);
  bool k_quants = true;
  for (int i = 0; i < count; ++i) k_quants = k_quants && is_k_quant(static_cast<const CpuMatrix&>(*products[i].w).qtype);
  thread_local QgemmInput input;
  input.prepare(x, n, products[0].w->cols(), k_quants);
  const QgemmInput& xin = input;  // the caller's, for the workers
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(cpu::pool_threads(), rows / 64)));
  cpu::parallel_for(parts, [&](int p) {
    const int64_t b0 = bytes * p / parts, b1 = bytes * (p + 1) / parts;
    int64_t at = 0;  // the product's first byte in the group
    for (int i = 0; i < count; ++i) {
      const auto& w = static_cast<const CpuMatrix&>(*products[i].w);
      const int out = w.rows();
      const auto rb = static_cast<int64_t>(w.row_bytes);
      // The first row starting at or past byte b.
      auto first = [&](int64_t b) { return b <= at ? 0 : static_cast<int>(std::min<int64_t>(out, (b - at + rb - 1) / rb)); };
      const int o0 = first(b0), o1 = first(b1);
      at += out * rb;
      if (o1 <= o0) continue;
      float* y = products[i].y;
      qgemm(w.qtype, w.q.data(), o0, o1, xin, y + o0, out);
      if (const float* bias = products[i].bias)
        for (int t = 0; t < n; ++t)
          for (int o = o0; o < o1; ++o) y[static_cast<size_t>(t) * out + o] += bias[o];
    }
  });
}

void CpuDevice::rmsnorm(const float* x, const float* w, int n, int d, float eps, float* y) {
  for (int t = 0; t < n; ++t) {
    const float* xi = x + static_cast<size_t>(t) * d;
    float* yi = y + static_cast<size_t>(t) * d;
    double ss = 0;
    for (int i = 0; i < d; ++i) ss += static_cast<double>(xi[i]) * xi[i];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / d + eps));
    for (int i = 0; i < d; ++i) yi[i] = xi[i] * r * w[i];
  }
}

void CpuDevice::rope(float* x, int n, int heads, int head_dim, const int64_t* positions, const RopeParams& p) {
  const int half = p.n_rot / 2;
  const std::vector<float> inv_freq = p.inv_freq();
  const double mscale = p.mscale();
  for (int t = 0; t < n; ++t) {
    const double pos = static_cast<double>(positions[t]);
    for (int i = 0; i < half; ++i) {
      // Angles in double: at positions in the thousands float loses the low bits of pos*freq.
      const double a = pos * inv_freq[i];
      const float c = static_cast<float>(std::cos(a) * mscale), s = static_cast<float>(std::sin(a) * mscale);
      const int i0 = p.layout == RopeLayout::Adjacent ? 2 * i : i;
      const int i1 = p.layout == RopeLayout::Adjacent ? 2 * i + 1 : i + half;
      for (int h = 0; h < heads; ++h) {
        float* v = x + (static_cast<size_t>(t) * heads + h) * head_dim;
        const float a0 = v[i0], a1 = v[i1];
        v[i0] = a0 * c - a1 * s;
        v[i1] = a0 * s + a1 * c;
      }
    }
  }
}

void CpuDevice::swiglu(float* gate, const float* up, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float g = gate[i];
    gate[i] = g / (1.0f + std::exp(-g)) * up[i];  // silu(gate) * up
  }
}

void CpuDevice::gelu_glu(float* gate, const float* up, size_t n) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  for (size_t i = 0; i < n; ++i) {
    const float g = gate[i];
    gate[i] = 0.5f * g * (1.0f + std::tanh(kSqrt2OverPi * (g + 0.044715f * g * g * g))) * up[i];
  }
}

void CpuDevice::add(float* x, const float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] += y[i];
}

void CpuDevice::gather_rows(const float* x, int d, const int32_t* rows, int n, float* y) {
  for (int i = 0; i < n; ++i)
    std::memmove(y + static_cast<size_t>(i) * d, x + static_cast<size_t>(rows[i]) * d, d * sizeof(float));
}

std::unique_ptr<KvCache> CpuDevice::make_cache(const CacheSpec& spec, const CacheShape& shape) {
  return std::make_unique<CpuKvCache>(spec, shape);
}

void CpuDevice::set_attention_timing(bool on) {
  timing_ = on;
  attention_s_ = 0;
}

void CpuDevice::attention_begin() {
  if (timing_) attention_t0_ = std::chrono::steady_clock::now();
}

void CpuDevice::attention_end() {
  if (timing_) attention_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - attention_t0_).count();
}

}  // namespace tqkv::engine
