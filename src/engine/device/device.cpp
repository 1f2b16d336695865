#include "engine/device/device.h"

#include <string>
#include <vector>

#include "engine/core/sampler.h"

namespace tqkv::engine {

DeviceBuffer Device::load_vector(const float* host, size_t n) {
  DeviceBuffer b = alloc(n);
  to_device(host, n, b.data());
  return b;
}

void Device::logits_out(const float* src, int rows, int cols, const LogitsOut& out) {
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  if (out.logits) to_host(src, n, out.logits);
  if (!out.argmax) return;
  std::vector<float> host;
  const float* v = out.logits;
  if (!v) {
    host.resize(n);
    to_host(src, n, host.data());
    v = host.data();
  }
  for (int r = 0; r < rows; ++r) out.argmax[r] = argmax(v + static_cast<size_t>(r) * cols, cols);
}

void Device::matmul_runs(const float* x, const RowRun* runs, int n_runs, const DeviceMatrix& w, float* y,
                         const float* bias) {
  for (int i = 0; i < n_runs; ++i)
    matmul(x + static_cast<size_t>(runs[i].begin) * w.cols(), runs[i].count, w,
           y + static_cast<size_t>(runs[i].begin) * w.rows(), bias);
}

void Device::matmul_group(const float* x, int n, const GroupProduct* products, int count) {
  for (int i = 0; i < count; ++i) matmul(x, n, *products[i].w, products[i].y, products[i].bias);
}

void Device::add_rmsnorm(float* x, const float* delta, const float* w, int n, int d, float eps, float* y,
                         bool product_input) {
  (void)product_input;
  if (delta) add(x, delta, static_cast<size_t>(n) * d);
  rmsnorm(x, w, n, d, eps, y);
}

void Device::glu(Glu kind, float* gate, const float* up, size_t n, bool product_input) {
  (void)product_input;
  if (kind == Glu::Silu)
    swiglu(gate, up, n);
  else
    gelu_glu(gate, up, n);
}

void Device::matmul_glu(Glu kind, const float* x, int n, const DeviceMatrix& w_gate, const DeviceMatrix& w_up,
                        float* gate, float* up, bool product_input) {
  const GroupProduct g[2] = {{&w_gate, gate}, {&w_up, up}};
  matmul_group(x, n, g, 2);
  glu(kind, gate, up, static_cast<size_t>(n) * w_gate.rows(), product_input);
}

void Device::rope_qk(float* q, int q_heads, float* k, int k_heads, int n, int head_dim, const int64_t* positions,
                     const RopeParams& p) {
  rope(q, n, q_heads, head_dim, positions, p);
  rope(k, n, k_heads, head_dim, positions, p);
}

}  // namespace tqkv::engine
