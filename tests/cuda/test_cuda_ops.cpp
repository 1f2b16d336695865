// The forward-pass ops (tqkv/cuda_ops.h) vs scalar CPU references written here the way the
// CPU device (src/engine/device/cpu_device.cpp) computes them. Every test skips without a CUDA device
// (fails under TQKV_REQUIRE_CUDA=1).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "../common/require_cuda.h"
#include "../common/scoped_env.h"
#include "tqkv/cuda_ops.h"
#include "tqkv/error.h"
#include "tqkv/gguf_blocks.h"
#include "tqkv/half.h"

namespace {

using namespace tqkv;

bool have_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define SKIP_WITHOUT_GPU() TQKV_SKIP_WITHOUT_CUDA(have_device())

// A device copy of a host vector, copied back by host().
template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(const std::vector<T>& h) : n(h.size()) {
    if (cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) throw std::bad_alloc();
    if (n) cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice);
  }
  explicit Dev(size_t count, T poison) : Dev(std::vector<T>(count, poison)) {}
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  std::vector<T> host() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    if (n) cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
};

std::vector<float> randn(size_t n, std::mt19937_64& rng, float s = 1.0f) {
  std::normal_distribution<float> nd(0.0f, s);
  std::vector<float> x(n);
  for (float& v : x) v = nd(rng);
  return x;
}

void expect_near_rel(const std::vector<float>& got, const std::vector<float>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * (1.0 + std::fabs(want[i]))) << "at " << i;
}

// The argmax picked on the device equals the host's rule (ties to the lowest index, NaN never
// wins, nothing above -inf gives 0) for row widths around the block size and a real vocabulary.
TEST(CudaOps, ArgmaxRowsPicksAsTheHostDoes) {
  SKIP_WITHOUT_GPU();
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  auto host_argmax = [](const float* v, int n) {
    int best = 0;
    float top = std::isnan(v[0]) ? -std::numeric_limits<float>::infinity() : v[0];
    for (int i = 1; i < n; ++i)
      if (v[i] > top) top = v[i], best = i;
    return best;
  };
  std::mt19937_64 rng(7);
  for (const int cols : {1, 31, 1024, 1025, 4099, 151936}) {
    const int rows = 9;
    std::vector<float> x = randn(static_cast<size_t>(rows) * cols, rng);
    auto row = [&](int r) { return x.data() + static_cast<size_t>(r) * cols; };
    // row 1: a tie at two far-apart places; row 2: NaN everywhere but one value; row 3: all NaN;
    // row 4: all -inf; row 5: +inf twice; row 6: NaN first; row 7: the max in the last column.
    if (cols > 1) {
      row(1)[cols - 1] = row(1)[cols / 3] = 100.0f;
      for (int c = 0; c < cols; ++c) row(2)[c] = nan;
      row(2)[cols / 2] = -5.0f;
      for (int c = 0; c < cols; ++c) row(3)[c] = nan, row(4)[c] = -inf;
      row(5)[cols / 2] = row(5)[cols - 1] = inf;
      row(6)[0] = nan;
      row(7)[cols - 1] = 50.0f;
    }
    Dev<float> dx(x);
    Dev<int32_t> out(static_cast<size_t>(rows), -1);
    cuda::argmax_rows(dx.p, rows, cols, out.p);
    const std::vector<int32_t> got = out.host();
    for (int r = 0; r < rows; ++r) EXPECT_EQ(got[r], host_argmax(row(r), cols)) << "cols " << cols << " row " << r;
  }
  EXPECT_THROW(cuda::argmax_rows(nullptr, 1, 4, nullptr), Error);
}

TEST(CudaOps, EmbedRows) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(1);
  const int rows = 50, cols = 96, n = 7;
  std::vector<uint16_t> table(rows * cols);
  const std::vector<float> f = randn(table.size(), rng);
  for (size_t i = 0; i < f.size(); ++i) table[i] = float_to_bf16(f[i]);
  const std::vector<int32_t> tokens{3, 0, 49, 3, 17, 8, 22};
  Dev<uint16_t> dt(table);
  Dev<int32_t> dtok(tokens);
  Dev<float> x(static_cast<size_t>(n) * cols, NAN);
  cuda::embed_rows(dt.p, cols, dtok.p, n, 0.5f, x.p);
  const std::vector<float> got = x.host();
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < cols; ++c) ASSERT_EQ(got[t * cols + c], bf16_to_float(table[tokens[t] * cols + c]) * 0.5f);
}

TEST(CudaOps, RmsNorm) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(2);
  for (int d : {64, 576, 1000}) {
    const int n = 5;
    const std::vector<float> x = randn(static_cast<size_t>(n) * d, rng, 3.0f), w = randn(d, rng);
    std::vector<float> want(x.size());
    for (int t = 0; t < n; ++t) {
      double ss = 0;
      for (int i = 0; i < d; ++i) ss += static_cast<double>(x[t * d + i]) * x[t * d + i];
      const float r = static_cast<float>(1.0 / std::sqrt(ss / d + 1e-5f));
      for (int i = 0; i < d; ++i) want[t * d + i] = x[t * d + i] * r * w[i];
    }
    Dev<float> dx(x), dw(w), dy(x.size(), NAN);
    cuda::rmsnorm(dx.p, dw.p, n, d, 1e-5f, dy.p);
    expect_near_rel(dy.host(), want, 1e-6);
    cuda::rmsnorm(dx.p, dw.p, n, d, 1e-5f, dx.p);  // in place
    expect_near_rel(dx.host(), want, 1e-6);
  }
}

// The CPU device's rope (angles in double), both layouts, positions up to 40,000.
TEST(CudaOps, RopeBothLayoutsAtLargePositions) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(3);
  for (bool halves : {false, true})
    for (int head_dim : {64, 128}) {
      const int n = 9, heads = 3, n_rot = head_dim == 64 ? 64 : 96;
      const float base = head_dim == 64 ? 10000.0f : 1000000.0f;
      const float mscale = halves ? 1.1386f : 1.0f;  // YaRN's attention factor at factor 4 on one layout
      std::vector<int64_t> pos{0, 1, 2, 17, 511, 4095, 8191, 12345, 40000};
      std::vector<float> x = randn(static_cast<size_t>(n) * heads * head_dim, rng);
      std::vector<float> inv(n_rot / 2);
      for (int i = 0; i < n_rot / 2; ++i) inv[i] = static_cast<float>(std::pow(static_cast<double>(base), -2.0 * i / n_rot));
      std::vector<float> want = x;
      const int half = n_rot / 2;
      for (int t = 0; t < n; ++t)
        for (int i = 0; i < half; ++i) {
          const double a = static_cast<double>(pos[t]) * inv[i];
          const float c = static_cast<float>(std::cos(a) * mscale), s = static_cast<float>(std::sin(a) * mscale);
          const int i0 = halves ? i : 2 * i, i1 = halves ? i + half : 2 * i + 1;
          for (int h = 0; h < heads; ++h) {
            float* v = want.data() + (static_cast<size_t>(t) * heads + h) * head_dim;
            const float a0 = v[i0], a1 = v[i1];
            v[i0] = a0 * c - a1 * s;
            v[i1] = a0 * s + a1 * c;
          }
        }
      Dev<float> dx(x);
      Dev<int64_t> dp(pos);
      cuda::rope(dx.p, n, heads, head_dim, dp.p, n_rot, inv.data(), mscale, halves);
      const std::vector<float> got = dx.host();
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_NEAR(got[i], want[i], 2e-6f * (1 + std::fabs(want[i]))) << "halves " << halves << " at " << i;
    }
}

TEST(CudaOps, SwigluAddBias) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(4);
  const int n = 6, cols = 130;
  const size_t total = static_cast<size_t>(n) * cols;
  const std::vector<float> g = randn(total, rng, 4.0f), u = randn(total, rng), b = randn(cols, rng);
  std::vector<float> want_sw(total), want_add(total), want_bias(total);
  for (size_t i = 0; i < total; ++i) {
    want_sw[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    want_add[i] = g[i] + u[i];
    want_bias[i] = g[i] + b[i % cols];
  }
  {
    Dev<float> dg(g), du(u);
    cuda::swiglu(dg.p, du.p, total);
    expect_near_rel(dg.host(), want_sw, 1e-6);
  }
  {
    std::vector<float> want_ge(total);
    for (size_t i = 0; i < total; ++i)
      want_ge[i] = 0.5f * g[i] * (1.0f + std::tanh(0.7978845608028654f * (g[i] + 0.044715f * g[i] * g[i] * g[i]))) * u[i];
    Dev<float> dg(g), du(u);
    cuda::gelu_glu(dg.p, du.p, total);
    expect_near_rel(dg.host(), want_ge, 1e-5);
  }
  {
    Dev<float> dg(g), du(u);
    cuda::add(dg.p, du.p, total);
    expect_near_rel(dg.host(), want_add, 0);
  }
  {
    Dev<float> dg(g), db(b);
    cuda::add_bias(dg.p, db.p, n, cols);
    expect_near_rel(dg.host(), want_bias, 0);
  }
}

TEST(CudaOps, GatherScatterRows) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(5);
  const int d = 33, n_src = 10;
  const std::vector<float> x = randn(static_cast<size_t>(n_src) * d, rng);
  const std::vector<int32_t> rows{9, 2, 5, 0};
  Dev<float> dx(x), dy(rows.size() * d, NAN);
  Dev<int32_t> dr(rows);
  cuda::gather_rows(dx.p, d, dr.p, static_cast<int>(rows.size()), dy.p);
  const std::vector<float> g = dy.host();
  for (size_t i = 0; i < rows.size(); ++i)
    for (int c = 0; c < d; ++c) ASSERT_EQ(g[i * d + c], x[rows[i] * d + c]);
  Dev<float> dz(static_cast<size_t>(n_src) * d, -1.0f);
  cuda::scatter_rows(dy.p, d, dr.p, static_cast<int>(rows.size()), dz.p);
  const std::vector<float> z = dz.host();
  for (int r = 0; r < n_src; ++r) {
    const bool hit = std::find(rows.begin(), rows.end(), r) != rows.end();
    for (int c = 0; c < d; ++c) ASSERT_EQ(z[r * d + c], hit ? x[r * d + c] : -1.0f);
  }
}

TEST(CudaOps, Bf16Conversion) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(6);
  std::vector<float> x = randn(5000, rng, 100.0f);
  x[0] = 0.0f, x[1] = -0.0f, x[2] = std::numeric_limits<float>::infinity(), x[3] = 1e-40f, x[4] = 3.0e38f;
  Dev<float> dx(x);
  Dev<uint16_t> dh(x.size(), 0);
  cuda::f32_to_bf16(dx.p, dh.p, x.size());
  const std::vector<uint16_t> h = dh.host();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(h[i], float_to_bf16(x[i])) << "at " << i << " x " << x[i];
  Dev<float> back(x.size(), NAN);
  cuda::bf16_to_f32(dh.p, back.p, x.size());
  const std::vector<float> b = back.host();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(b[i], bf16_to_float(h[i]));
}

// nb random blocks of type T whose fp16 scales are finite, in [-s, s] (Q6_K's at byte 208, the
// others' at 0 and 2).
template <gguf::TensorType T>
std::vector<uint8_t> random_blocks(size_t nb, float s, std::mt19937_64& rng) {
  constexpr int bb = gguf::block_bytes(T);
  std::vector<uint8_t> blocks(nb * bb);
  for (uint8_t& b : blocks) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(-s, s);
  for (size_t i = 0; i < nb; ++i)
    for (int at : T == gguf::TensorType::Q6_K ? std::vector<int>{208} : std::vector<int>{0, 2}) {
      const uint16_t h = float_to_half(scale(rng));
      blocks[i * bb + at] = static_cast<uint8_t>(h & 0xff);
      blocks[i * bb + at + 1] = static_cast<uint8_t>(h >> 8);
    }
  return blocks;
}

// Weights kept quantized: every GGUF block type the GPU decodes, random blocks (finite fp16
// scales), expanded on the device bit for bit as the CPU's decoder of the same header and
// float_to_bf16 give them; f32 -> f16 as float_to_half rounds (the fresh prompts' K/V).
template <gguf::TensorType T>
void check_dequant_weights(std::mt19937_64& rng) {
  constexpr int be = gguf::block_elems(T), bb = gguf::block_bytes(T);
  const int nb = 37;
  const std::vector<uint8_t> blocks = random_blocks<T>(nb, 0.5f, rng);
  const size_t n = static_cast<size_t>(nb) * be;
  Dev<uint8_t> d_blocks(blocks);
  Dev<uint16_t> out(n, 0);
  ASSERT_TRUE(cuda::dequant_weights_supports(static_cast<uint32_t>(T)));
  cuda::dequant_weights_bf16(static_cast<uint32_t>(T), d_blocks.p, n, out.p);
  const std::vector<uint16_t> got = out.host();
  for (size_t i = 0; i < n; ++i) {
    const float want = gguf::element<T>(blocks.data() + (i / be) * bb, static_cast<int>(i % be));
    ASSERT_EQ(got[i], float_to_bf16(want)) << "type " << static_cast<int>(T) << " element " << i;
  }
  EXPECT_THROW(cuda::dequant_weights_bf16(static_cast<uint32_t>(T), d_blocks.p, n - 1, out.p), Error);
}

// Decode's products on the blocks against the host's decoder and a double-precision product:
// 1-8 input rows (float32 and bf16 inputs), 37 output rows (not a multiple of the warps a
// block takes), with and without bias.
template <gguf::TensorType T>
void check_qgemv(std::mt19937_64& rng) {
  constexpr int be = gguf::block_elems(T), bb = gguf::block_bytes(T);
  const int rows = 37, cols = 2 * std::max(be, 128);
  const size_t nb = static_cast<size_t>(rows) * cols / be;
  const std::vector<uint8_t> blocks = random_blocks<T>(nb, 0.05f, rng);
  std::vector<float> w(static_cast<size_t>(rows) * cols);
  for (size_t i = 0; i < w.size(); ++i) w[i] = gguf::element<T>(blocks.data() + (i / be) * bb, static_cast<int>(i % be));
  const std::vector<float> bias = randn(rows, rng);
  Dev<uint8_t> d_blocks(blocks);
  Dev<float> d_bias(bias);
  for (int n : {1, 2, 3, 5, 8})
    for (bool bf16_in : {false, true})
      for (bool with_bias : {false, true}) {
        std::vector<float> x = randn(static_cast<size_t>(n) * cols, rng);
        std::vector<uint16_t> xb(x.size());
        for (size_t i = 0; i < x.size(); ++i) {
          xb[i] = float_to_bf16(x[i]);
          if (bf16_in) x[i] = bf16_to_float(xb[i]);
        }
        Dev<float> dx(x);
        Dev<uint16_t> dxb(xb);
        Dev<float> dy(static_cast<size_t>(n) * rows, NAN);
        ASSERT_TRUE(cuda::qgemv_supports(static_cast<uint32_t>(T), n, cols));
        cuda::qgemv(static_cast<uint32_t>(T), d_blocks.p, rows, cols, bf16_in ? nullptr : dx.p, bf16_in ? dxb.p : nullptr,
                    n, dy.p, with_bias ? d_bias.p : nullptr);
        const std::vector<float> y = dy.host();
        for (int t = 0; t < n; ++t)
          for (int r = 0; r < rows; ++r) {
            double want = with_bias ? bias[r] : 0.0, mag = std::fabs(want);
            for (int c = 0; c < cols; ++c) {
              const double p = static_cast<double>(w[static_cast<size_t>(r) * cols + c]) * x[static_cast<size_t>(t) * cols + c];
              want += p;
              mag += std::fabs(p);
            }
            ASSERT_NEAR(y[static_cast<size_t>(t) * rows + r], want, 1e-5 * mag + 1e-6)
                << "type " << static_cast<int>(T) << " n " << n << " row " << r << " input " << t;
          }
      }
  EXPECT_FALSE(cuda::qgemv_supports(static_cast<uint32_t>(T), cuda::kQgemvMaxRows + 1, cols));
  EXPECT_FALSE(cuda::qgemv_supports(static_cast<uint32_t>(T), 1, cols + 1));
}

// f(std::integral_constant<TensorType, T>) for every block type the GPU decodes.
template <typename F>
void for_each_gpu_block_type(F&& f) {
  using gguf::TensorType;
  f(std::integral_constant<TensorType, TensorType::Q4_0>{});
  f(std::integral_constant<TensorType, TensorType::Q4_1>{});
  f(std::integral_constant<TensorType, TensorType::Q5_0>{});
  f(std::integral_constant<TensorType, TensorType::Q5_1>{});
  f(std::integral_constant<TensorType, TensorType::Q8_0>{});
  f(std::integral_constant<TensorType, TensorType::Q4_K>{});
  f(std::integral_constant<TensorType, TensorType::Q6_K>{});
}

TEST(CudaOps, QgemvMatchesTheDecodedProduct) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(12);
  for_each_gpu_block_type([&](auto type) { check_qgemv<decltype(type)::value>(rng); });
}

TEST(CudaOps, DequantWeightsMatchTheHostDecoder) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(11);
  using gguf::TensorType;
  for_each_gpu_block_type([&](auto type) { check_dequant_weights<decltype(type)::value>(rng); });
  EXPECT_FALSE(cuda::dequant_weights_supports(static_cast<uint32_t>(TensorType::F32)));
  EXPECT_FALSE(cuda::dequant_weights_supports(static_cast<uint32_t>(TensorType::Q5_K)));
  // f32 -> f16, round to nearest even, beyond the range to infinity.
  const std::vector<float> x = {0.0f, -0.0f, 1.0f / 3, 65504.0f, 65520.0f, -1e6f, 6e-8f, 1e-3f};
  Dev<float> dx(x);
  Dev<uint16_t> dh(x.size(), 0);
  cuda::f32_to_f16(dx.p, dh.p, x.size());
  const std::vector<uint16_t> h = dh.host();
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(h[i], float_to_half(x[i])) << x[i];
}

TEST(CudaOps, CentreKeys) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(7);
  const int n = 4, kvh = 3, group = 3, hd = 64;
  const std::vector<float> k = randn(static_cast<size_t>(n) * kvh * hd, rng), q = randn(k.size() * group, rng),
                           mu = randn(kvh * hd, rng);
  std::vector<float> sc = randn(kvh * hd, rng);
  for (float& s : sc) s = 0.5f + std::fabs(s);
  std::vector<float> wk = k, wq = q;
  for (size_t i = 0; i < k.size(); ++i) wk[i] = (k[i] - mu[i % (kvh * hd)]) / sc[i % (kvh * hd)];
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < kvh; ++h)
      for (int g = 0; g < group; ++g)
        for (int i = 0; i < hd; ++i) wq[((static_cast<size_t>(t) * kvh + h) * group + g) * hd + i] *= sc[h * hd + i];
  Dev<float> dk(k), dq(q), dm(mu), ds(sc);
  cuda::centre_keys(dk.p, dq.p, dm.p, ds.p, n, kvh, group, hd, true);
  expect_near_rel(dk.host(), wk, 0);
  expect_near_rel(dq.host(), wq, 0);
}

// Causal attention in double over float K/V: query i at pos0 + i.
std::vector<float> reference_prefill(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                                     int n_q, int64_t pos0, int hq, int hkv, int d, int window) {
  std::vector<float> out(static_cast<size_t>(n_q) * hq * d);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int i = 0; i < n_q; ++i)
    for (int h = 0; h < hq; ++h) {
      const int kh = h / (hq / hkv);
      const int64_t p = pos0 + i;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      std::vector<double> s;
      double mx = -INFINITY;
      for (int64_t j = lo; j <= p; ++j) {
        double acc = 0;
        for (int c = 0; c < d; ++c) acc += static_cast<double>(q[(static_cast<size_t>(i) * hq + h) * d + c]) * k[(j * hkv + kh) * d + c];
        s.push_back(acc * scale);
        mx = std::max(mx, s.back());
      }
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - mx));
      for (int c = 0; c < d; ++c) {
        double acc = 0;
        for (int64_t j = lo; j <= p; ++j) acc += s[j - lo] * v[(j * hkv + kh) * d + c];
        out[(static_cast<size_t>(i) * hq + h) * d + c] = static_cast<float>(acc / sum);
      }
    }
  return out;
}

// Prefill arguments over K/V of type kv: the 16-bit patterns k16/v16, or the f32 k32/v32.
cuda::PrefillArgs prefill_args(const float* q, cuda::DType kv, const uint16_t* k16, const uint16_t* v16, const float* k32,
                               const float* v32, float* out, int n_q, int64_t pos0, int n_kv, int hq, int hkv, int d) {
  cuda::PrefillArgs a;
  a.q = q;
  a.k = kv != cuda::DType::F32 ? static_cast<const void*>(k16) : k32;
  a.v = kv != cuda::DType::F32 ? static_cast<const void*>(v16) : v32;
  a.kv_dtype = kv;
  a.out = out;
  a.n_q = n_q;
  a.pos0 = pos0;
  a.n_kv = n_kv;
  a.n_q_heads = hq;
  a.n_kv_heads = hkv;
  a.head_dim = d;
  return a;
}

// Both prefill kernels against the double reference: the scalar one (f32 K/V, or 16-bit K/V with
// TQKV_PREFILL_KERNEL=scalar) exactly up to f32 rounding; the tensor-core one (bf16 or f16 K/V) rounds
// the scaled query and the softmax weights to K's type, so with random queries it is held to 2^-7 of
// the largest |v| (a wrong fragment or mask moves outputs by far more), and with zero queries,
// where every visible key weighs exactly 1 in either kernel, to f32 rounding: that catches a key
// let in or left out by the causal mask, the window or the tiling. Cases span several CTAs of
// queries, several key tiles, partial tiles and windows at every head dim; the tensor cores run
// unsplit, with each CTA's keys in 3 splits (some empty where a CTA has fewer tiles) and as the
// op chooses.
TEST(CudaOps, PrefillAttentionMatchesReference) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(8);
  using cuda::DType;
  struct Case {
    int d, hq, hkv, n_q;
    int64_t pos0;
    int window;
    DType kv;
  };
  bool auto_split = false;  // the op split some run by itself (a chunk of 64 over 2,000 keys)
  for (const Case& c :
       {Case{64, 9, 3, 37, 0, 0, DType::F32}, Case{64, 9, 3, 5, 100, 0, DType::BF16}, Case{128, 8, 8, 50, 13, 0, DType::BF16},
        Case{128, 32, 8, 20, 70, 24, DType::F32}, Case{64, 8, 2, 40, 90, 32, DType::BF16}, Case{256, 4, 1, 17, 3, 0, DType::BF16},
        Case{64, 2, 1, 1, 300, 0, DType::F32}, Case{128, 12, 2, 200, 300, 0, DType::BF16}, Case{64, 9, 3, 130, 500, 100, DType::F16},
        Case{256, 8, 1, 70, 40, 0, DType::F16}, Case{128, 8, 8, 64, 0, 0, DType::BF16}, Case{256, 4, 2, 90, 200, 45, DType::BF16},
        Case{128, 4, 1, 129, 64, 63, DType::F16}, Case{64, 9, 3, 77, 150, 0, DType::F16},
        Case{64, 9, 3, 64, 2000, 0, DType::BF16}}) {
    const bool bf16 = c.kv == DType::BF16, f16 = c.kv == DType::F16;
    const int n_kv = static_cast<int>(c.pos0) + c.n_q;
    const std::vector<float> q_rand = randn(static_cast<size_t>(c.n_q) * c.hq * c.d, rng);
    std::vector<float> k = randn(static_cast<size_t>(n_kv) * c.hkv * c.d, rng), v = randn(k.size(), rng);
    std::vector<uint16_t> kb(k.size()), vb(v.size());
    float v_max = 0.0f;
    for (size_t i = 0; i < k.size(); ++i) {
      kb[i] = f16 ? float_to_half(k[i]) : float_to_bf16(k[i]);
      vb[i] = f16 ? float_to_half(v[i]) : float_to_bf16(v[i]);
      if (bf16) k[i] = bf16_to_float(kb[i]), v[i] = bf16_to_float(vb[i]);
      if (f16) k[i] = half_to_float(kb[i]), v[i] = half_to_float(vb[i]);
      v_max = std::max(v_max, std::fabs(v[i]));
    }
    Dev<float> dk(k), dv(v);
    Dev<uint16_t> dkb(kb), dvb(vb);
    for (const bool zero_q : {false, true}) {
      const std::vector<float> q = zero_q ? std::vector<float>(q_rand.size(), 0.0f) : q_rand;
      const std::vector<float> want = reference_prefill(q, k, v, c.n_q, c.pos0, c.hq, c.hkv, c.d, c.window);
      // The tensor cores with CTAs of 4 and of 8 warps (TQKV_PREFILL_WARPS).
      for (const std::string warps : {"4", "8"}) {
        tqkv::testing_util::ScopedEnv warps_env("TQKV_PREFILL_WARPS", warps.c_str());
        for (const bool scalar : {true, false}) {
          if (c.kv == DType::F32 && !scalar) continue;  // f32 K/V always take the scalar kernel
          if (scalar && warps == "8") continue;
          std::optional<tqkv::testing_util::ScopedEnv> env;
          if (scalar) env.emplace("TQKV_PREFILL_KERNEL", "scalar");
          // The tensor cores unsplit, in 3 splits of each CTA's keys (some of them empty), and in the
          // op's own choice (with its workspace).
          for (const int splits : scalar ? std::vector<int>{0} : std::vector<int>{1, 3, 0}) {
            const float tol = scalar || zero_q ? 2e-5f : v_max / 128;
            const std::string what = std::string(scalar ? "scalar" : "tensor-core") + (f16 ? ", f16" : bf16 ? ", bf16" : ", f32") +
                                     (zero_q ? ", zero queries" : "") + ", splits " + std::to_string(splits) + ", warps " + warps +
                                     ": d " + std::to_string(c.d) + " n_q " + std::to_string(c.n_q) + " pos0 " +
                                     std::to_string(c.pos0) + " window " + std::to_string(c.window);
            Dev<float> dq(q), out(want.size(), NAN);
            cuda::PrefillArgs a = prefill_args(dq.p, c.kv, dkb.p, dvb.p, dk.p, dv.p, out.p, c.n_q, c.pos0, n_kv, c.hq, c.hkv, c.d);
            a.window = c.window;
            a.splits = splits;
            Dev<float> ws(cuda::prefill_workspace_bytes(a) / sizeof(float), NAN);
            if (splits != 0) {
              EXPECT_EQ(ws.n > 0, splits > 1) << what;
            } else if (ws.n > 0) {
              auto_split = true;
            }
            a.workspace = ws.p;
            a.workspace_bytes = ws.n * sizeof(float);
            cuda::prefill_attention(a);
            const std::vector<float> got = out.host();
            double err_sum = 0;
            for (size_t i = 0; i < got.size(); ++i) {
              ASSERT_NEAR(got[i], want[i], tol) << what << " at " << i;
              err_sum += std::fabs(got[i] - want[i]);
            }
            if (!scalar && !zero_q) {
              EXPECT_LT(err_sum / got.size(), 2e-3) << what;  // the mean error of bf16 rounding
            }
            if (c.window <= 0 || c.pos0 - c.window + 1 <= 0) continue;
            a.splits = 1;  // (the workspace was sized for all keys)
            // The same queries with only the keys of their windows held (kv_start: a ring's dequantization).
            const int64_t start = c.pos0 - c.window + 1;
            const size_t row = static_cast<size_t>(c.hkv) * c.d;
            Dev<float> dkw(std::vector<float>(k.begin() + start * row, k.end())),
                dvw(std::vector<float>(v.begin() + start * row, v.end())), out_w(want.size(), NAN);
            Dev<uint16_t> dkbw(std::vector<uint16_t>(kb.begin() + start * row, kb.end())),
                dvbw(std::vector<uint16_t>(vb.begin() + start * row, vb.end()));
            a.k = c.kv != DType::F32 ? static_cast<const void*>(dkbw.p) : dkw.p;
            a.v = c.kv != DType::F32 ? static_cast<const void*>(dvbw.p) : dvw.p;
            a.out = out_w.p;
            a.kv_start = start;
            cuda::prefill_attention(a);
            const std::vector<float> got_w = out_w.host();
            for (size_t i = 0; i < got_w.size(); ++i) ASSERT_NEAR(got_w[i], want[i], tol) << what << ", kv_start " << start << " at " << i;
            a.kv_start = start + 1;  // a key inside the first query's window left out
            EXPECT_THROW(cuda::prefill_attention(a), tqkv::Error);
          }
        }
      }
    }
  }
  EXPECT_TRUE(auto_split);
  {  // A malformed warps knob is an error, not a silent default.
    tqkv::testing_util::ScopedEnv bad("TQKV_PREFILL_WARPS", "6");
    Dev<uint16_t> kv(std::vector<uint16_t>(64, 0));
    Dev<float> q1(std::vector<float>(64, 0.0f)), o1(std::vector<float>(64, 0.0f));
    cuda::PrefillArgs b = prefill_args(q1.p, DType::BF16, kv.p, kv.p, nullptr, nullptr, o1.p, 1, 0, 1, 1, 1, 64);
    EXPECT_THROW(cuda::prefill_attention(b), tqkv::Error);
  }
  {  // Splits past 64, or negative, are refused by both calls.
    Dev<uint16_t> kv(std::vector<uint16_t>(64, 0));
    Dev<float> q1(std::vector<float>(64, 0.0f)), o1(std::vector<float>(64, 0.0f));
    cuda::PrefillArgs b = prefill_args(q1.p, DType::BF16, kv.p, kv.p, nullptr, nullptr, o1.p, 1, 0, 1, 1, 1, 64);
    for (const int bad : {-1, 65}) {
      b.splits = bad;
      EXPECT_THROW(cuda::prefill_workspace_bytes(b), tqkv::Error);
      EXPECT_THROW(cuda::prefill_attention(b), tqkv::Error);
    }
  }
}

// One part of a layer kept in parts (PrefillArgs::part): keys [kv_start, n_kv) held, a query at
// p sees those up to p - shift (and after p - window), n_kv may end before the last query, and
// each row's log-sum-exp comes back. Against a double reference of exactly that, both kernels,
// the tolerances of the test above; rows that see no key give 0 and -inf.
TEST(CudaOps, PrefillAttentionPartsMatchReference) {
  SKIP_WITHOUT_GPU();
  using cuda::DType;
  std::mt19937_64 rng(81);
  struct Case {
    int d, hq, hkv, n_q;
    int64_t pos0, kv_start, n_kv;
    int shift, window;
    DType kv;
  };
  // The copies' three parts of a chunk at pos0 = 300 with a window of 40 and 4 sinks: the middle
  // [4, p - 40], the window (p - 40, p - 1] and the sinks [0, min(4, p)); then edge cases.
  for (const Case& c : {Case{64, 9, 3, 200, 300, 4, 460, 40, 0, DType::BF16}, Case{64, 9, 3, 200, 300, 261, 500, 1, 40, DType::BF16},
                        Case{64, 9, 3, 200, 300, 0, 4, 1, 0, DType::F16}, Case{128, 12, 2, 150, 0, 4, 110, 40, 0, DType::BF16},
                        Case{128, 12, 2, 150, 0, 0, 4, 1, 0, DType::F16}, Case{256, 4, 1, 70, 100, 20, 90, 5, 0, DType::BF16},
                        Case{64, 4, 2, 65, 10, 0, 75, 0, 0, DType::F32}, Case{128, 8, 8, 40, 5, 3, 3, 2, 0, DType::BF16}}) {
    const bool f16 = c.kv == DType::F16;
    const int held = static_cast<int>(c.n_kv - c.kv_start);
    const std::vector<float> q_rand = randn(static_cast<size_t>(c.n_q) * c.hq * c.d, rng);
    std::vector<float> k = randn(static_cast<size_t>(std::max(held, 1)) * c.hkv * c.d, rng), v = randn(k.size(), rng);
    std::vector<uint16_t> kb(k.size()), vb(v.size());
    float v_max = 0.0f;
    for (size_t i = 0; i < k.size(); ++i) {
      kb[i] = f16 ? float_to_half(k[i]) : float_to_bf16(k[i]);
      vb[i] = f16 ? float_to_half(v[i]) : float_to_bf16(v[i]);
      if (c.kv != DType::F32) {
        k[i] = f16 ? half_to_float(kb[i]) : bf16_to_float(kb[i]);
        v[i] = f16 ? half_to_float(vb[i]) : bf16_to_float(vb[i]);
      }
      v_max = std::max(v_max, std::fabs(v[i]));
    }
    Dev<float> dk(k), dv(v);
    Dev<uint16_t> dkb(kb), dvb(vb);
    for (const bool zero_q : {false, true}) {
      const std::vector<float> q = zero_q ? std::vector<float>(q_rand.size(), 0.0f) : q_rand;
      // The reference: out [n_q, hq, d] and lse [n_q, hq] in double.
      std::vector<float> want(q.size(), 0.0f), want_lse(static_cast<size_t>(c.n_q) * c.hq, -INFINITY);
      const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
      for (int i = 0; i < c.n_q; ++i)
        for (int h = 0; h < c.hq; ++h) {
          const int kh = h / (c.hq / c.hkv);
          const int64_t p = c.pos0 + i;
          std::vector<double> sc;
          std::vector<int64_t> keys;
          for (int64_t j = c.kv_start; j < c.n_kv; ++j) {
            if (j > p - c.shift || (c.window > 0 && j <= p - c.window)) continue;
            double acc = 0;
            for (int e = 0; e < c.d; ++e)
              acc += static_cast<double>(q[(static_cast<size_t>(i) * c.hq + h) * c.d + e]) * k[((j - c.kv_start) * c.hkv + kh) * c.d + e];
            sc.push_back(acc * scale);
            keys.push_back(j);
          }
          if (keys.empty()) continue;
          const double mx = *std::max_element(sc.begin(), sc.end());
          double sum = 0;
          for (double& x : sc) sum += (x = std::exp(x - mx));
          want_lse[static_cast<size_t>(i) * c.hq + h] = static_cast<float>(mx + std::log(sum));
          for (int e = 0; e < c.d; ++e) {
            double acc = 0;
            for (size_t t = 0; t < keys.size(); ++t) acc += sc[t] * v[((keys[t] - c.kv_start) * c.hkv + kh) * c.d + e];
            want[(static_cast<size_t>(i) * c.hq + h) * c.d + e] = static_cast<float>(acc / sum);
          }
        }
      // The tensor cores with CTAs of 4 and of 8 warps (TQKV_PREFILL_WARPS).
      for (const std::string warps : {"4", "8"}) {
        tqkv::testing_util::ScopedEnv warps_env("TQKV_PREFILL_WARPS", warps.c_str());
        for (const bool scalar : {true, false}) {
          if (c.kv == DType::F32 && !scalar) continue;
          if (scalar && warps == "8") continue;
          std::optional<tqkv::testing_util::ScopedEnv> env;
          if (scalar) env.emplace("TQKV_PREFILL_KERNEL", "scalar");
          for (const int splits : scalar ? std::vector<int>{0} : std::vector<int>{1, 3}) {
            const float tol = scalar || zero_q ? 2e-5f : v_max / 128, lse_tol = scalar || zero_q ? 1e-4f : 3e-2f;
            const std::string what = std::string(scalar ? "scalar" : "tensor-core") + (zero_q ? ", zero queries" : "") +
                                     ", splits " + std::to_string(splits) + ", warps " + warps +
                                     ": d " + std::to_string(c.d) + " pos0 " + std::to_string(c.pos0) + " keys [" +
                                     std::to_string(c.kv_start) + ", " + std::to_string(c.n_kv) + ") shift " +
                                     std::to_string(c.shift) + " window " + std::to_string(c.window);
            Dev<float> dq(q), out(want.size(), NAN), lse(want_lse.size(), NAN);
            cuda::PrefillArgs a = prefill_args(dq.p, c.kv, dkb.p, dvb.p, dk.p, dv.p, out.p, c.n_q, c.pos0,
                                               static_cast<int>(c.n_kv), c.hq, c.hkv, c.d);
            a.lse = lse.p;
            a.kv_start = c.kv_start;
            a.shift = c.shift;
            a.window = c.window;
            a.part = true;
            a.splits = splits;
            Dev<float> ws(cuda::prefill_workspace_bytes(a) / sizeof(float), NAN);
            a.workspace = ws.p;
            a.workspace_bytes = ws.n * sizeof(float);
            cuda::prefill_attention(a);
            const std::vector<float> got = out.host(), got_lse = lse.host();
            for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], tol) << what << " at " << i;
            for (size_t i = 0; i < got_lse.size(); ++i) {
              if (std::isinf(want_lse[i])) {
                EXPECT_TRUE(std::isinf(got_lse[i]) && got_lse[i] < 0) << what << " lse at " << i << ": " << got_lse[i];
              } else {
                ASSERT_NEAR(got_lse[i], want_lse[i], lse_tol) << what << " lse at " << i;
              }
            }
          }
        }
      }
    }
  }
  // Outside parts the keys must reach the last query.
  cuda::PrefillArgs a;
  std::vector<float> one(64, 0.0f);
  Dev<float> d1(one), d2(one), d3(one);
  a.q = d1.p;
  a.k = d2.p;
  a.v = d2.p;
  a.kv_dtype = DType::F32;
  a.out = d3.p;
  a.n_q = 1;
  a.pos0 = 1;
  a.n_kv = 1;
  a.n_q_heads = a.n_kv_heads = 1;
  a.head_dim = 64;
  EXPECT_THROW(cuda::prefill_attention(a), tqkv::Error);
  a.part = true;
  a.shift = -1;
  EXPECT_THROW(cuda::prefill_attention(a), tqkv::Error);
}

// The skinny products against a double-precision reference over the bf16-rounded operands: every
// row count up to the limit's tile sizes, column counts off the 128-column chunk, rows off the
// 16-row tile, both input types, biases, a group of products, and both GLUs with their bf16 copy.
struct SkinnyCase {
  std::vector<uint16_t> w;  // [rows, cols]
  std::vector<float> wf;    // its values
  int rows, cols;
};

SkinnyCase skinny_weights(int rows, int cols, std::mt19937_64& rng) {
  SkinnyCase c{std::vector<uint16_t>(static_cast<size_t>(rows) * cols), {}, rows, cols};
  const std::vector<float> f = randn(c.w.size(), rng, 0.5f);
  c.wf.resize(f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    c.w[i] = float_to_bf16(f[i]);
    c.wf[i] = bf16_to_float(c.w[i]);
  }
  return c;
}

// want[t, r] = sum_k xr[t, k] w[r, k] in double; bound[t, r] = 2e-5 sum_k |terms| + 1e-6 (float32
// accumulation in another order).
void skinny_reference(const std::vector<float>& xr, int n, const SkinnyCase& c, std::vector<double>& want,
                      std::vector<double>& bound) {
  want.assign(static_cast<size_t>(n) * c.rows, 0.0);
  bound.assign(want.size(), 1e-6);
  for (int t = 0; t < n; ++t)
    for (int r = 0; r < c.rows; ++r) {
      double s = 0, a = 0;
      for (int k = 0; k < c.cols; ++k) {
        const double term = static_cast<double>(xr[static_cast<size_t>(t) * c.cols + k]) * c.wf[static_cast<size_t>(r) * c.cols + k];
        s += term;
        a += std::fabs(term);
      }
      want[static_cast<size_t>(t) * c.rows + r] = s;
      bound[static_cast<size_t>(t) * c.rows + r] += 2e-5 * a;
    }
}

TEST(CudaOps, SkinnyGemmMatchesReference) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(11);
  // The last two split their columns over clusters of 2 and 4 blocks (few row tiles, many chunks).
  const int shapes[][2] = {{16, 8}, {40, 136}, {256, 576}, {24, 1544}, {32, 2056}, {16, 4104}};
  for (const auto& sh : shapes) {
    const SkinnyCase c = skinny_weights(sh[0], sh[1], rng);
    const std::vector<float> bias = randn(c.rows, rng);
    Dev<uint16_t> dw(c.w);
    Dev<float> db(bias);
    for (const int n : {1, 3, 8, 9, 16, 33, 64}) {
      const std::vector<float> x = randn(static_cast<size_t>(n) * c.cols, rng);
      std::vector<uint16_t> xb(x.size());
      std::vector<float> xr(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        xb[i] = float_to_bf16(x[i]);
        xr[i] = bf16_to_float(xb[i]);
      }
      std::vector<double> want, bound;
      skinny_reference(xr, n, c, want, bound);
      Dev<float> dx(x);
      Dev<uint16_t> dxb(xb);
      for (const bool f32 : {false, true})
        for (const bool with_bias : {false, true}) {
          Dev<float> dy(static_cast<size_t>(n) * c.rows, NAN);
          const cuda::SkinnyProduct pr{dw.p, c.rows, dy.p, with_bias ? db.p : nullptr};
          cuda::skinny_gemm(f32 ? nullptr : dxb.p, f32 ? dx.p : nullptr, n, c.cols, &pr, 1);
          const std::vector<float> got = dy.host();
          for (size_t i = 0; i < got.size(); ++i) {
            const double w = want[i] + (with_bias ? bias[i % c.rows] : 0.0);
            ASSERT_NEAR(got[i], w, bound[i]) << c.rows << "x" << c.cols << " n " << n << " f32 " << f32 << " at " << i;
          }
        }
    }
  }
}

TEST(CudaOps, SkinnyGemmGroupAndRowIndependence) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(12);
  const int cols = 200;
  const SkinnyCase a = skinny_weights(48, cols, rng), b = skinny_weights(20, cols, rng), c = skinny_weights(16, cols, rng);
  const std::vector<float> bias_b = randn(b.rows, rng);
  Dev<uint16_t> dwa(a.w), dwb(b.w), dwc(c.w);
  Dev<float> dbb(bias_b);
  const int n = 37;
  const std::vector<float> x = randn(static_cast<size_t>(n) * cols, rng);
  Dev<float> dx(x);
  Dev<float> ya(static_cast<size_t>(n) * a.rows, NAN), yb(static_cast<size_t>(n) * b.rows, NAN),
      yc(static_cast<size_t>(n) * c.rows, NAN);
  const cuda::SkinnyProduct group[3] = {{dwa.p, a.rows, ya.p, nullptr}, {dwb.p, b.rows, yb.p, dbb.p},
                                        {dwc.p, c.rows, yc.p, nullptr}};
  cuda::skinny_gemm(nullptr, dx.p, n, cols, group, 3);
  const std::vector<float> got_b = yb.host();
  // Each product equals its own launch bit for bit, and each row equals that row alone.
  Dev<float> yb1(static_cast<size_t>(n) * b.rows, NAN);
  const cuda::SkinnyProduct alone{dwb.p, b.rows, yb1.p, dbb.p};
  cuda::skinny_gemm(nullptr, dx.p, n, cols, &alone, 1);
  EXPECT_EQ(yb1.host(), got_b);
  for (const int t : {0, 13, 36}) {
    Dev<float> x1(std::vector<float>(x.begin() + static_cast<ptrdiff_t>(t) * cols, x.begin() + static_cast<ptrdiff_t>(t + 1) * cols));
    Dev<float> y1(static_cast<size_t>(b.rows), NAN);
    const cuda::SkinnyProduct one{dwb.p, b.rows, y1.p, dbb.p};
    cuda::skinny_gemm(nullptr, x1.p, 1, cols, &one, 1);
    const std::vector<float> r = y1.host();
    for (int i = 0; i < b.rows; ++i) ASSERT_EQ(r[i], got_b[static_cast<size_t>(t) * b.rows + i]) << "row " << t;
  }
  std::vector<float> xr(x.size());
  for (size_t i = 0; i < x.size(); ++i) xr[i] = bf16_to_float(float_to_bf16(x[i]));
  for (const auto& [cs, dy] : {std::pair<const SkinnyCase*, Dev<float>*>{&a, &ya}, {&c, &yc}}) {
    std::vector<double> want, bound;
    skinny_reference(xr, n, *cs, want, bound);
    const std::vector<float> got = dy->host();
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], bound[i]) << i;
  }
}

TEST(CudaOps, SkinnyGemmGlu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(13);
  for (const int cols : {264, 2056}) {  // 2056: clusters of 2 blocks
  const int rows = 72;
  const SkinnyCase gate = skinny_weights(rows, cols, rng), up = skinny_weights(rows, cols, rng);
  Dev<uint16_t> dg(gate.w), du(up.w);
  for (const int n : {1, 5, 17}) {
    const std::vector<float> x = randn(static_cast<size_t>(n) * cols, rng);
    std::vector<uint16_t> xb(x.size());
    std::vector<float> xr(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      xb[i] = float_to_bf16(x[i]);
      xr[i] = bf16_to_float(xb[i]);
    }
    std::vector<double> wg, bg, wu, bu;
    skinny_reference(xr, n, gate, wg, bg);
    skinny_reference(xr, n, up, wu, bu);
    Dev<uint16_t> dxb(xb);
    for (const bool gelu : {false, true}) {
      Dev<float> y(static_cast<size_t>(n) * rows, NAN);
      Dev<uint16_t> yb(static_cast<size_t>(n) * rows, 0);
      cuda::skinny_gemm_glu(gelu, dxb.p, nullptr, n, cols, dg.p, du.p, rows, y.p, yb.p);
      const std::vector<float> got = y.host();
      const std::vector<uint16_t> got_b = yb.host();
      for (size_t i = 0; i < got.size(); ++i) {
        const double g = wg[i], u = wu[i];
        const double act = gelu ? 0.5 * g * (1.0 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
                                : g / (1.0 + std::exp(-g));
        // The activation's slope is at most ~1.13, so the products' bounds carry over.
        ASSERT_NEAR(got[i], act * u, 1.2 * bg[i] * std::fabs(u) + std::fabs(act) * bu[i] + 1e-5 * (1 + std::fabs(act * u)))
            << (gelu ? "gelu" : "silu") << " n " << n << " at " << i;
        ASSERT_EQ(got_b[i], float_to_bf16(got[i])) << i;
      }
    }
  }
  }
}

TEST(CudaOps, SkinnyGemmRejectsBadShapes) {
  SKIP_WITHOUT_GPU();
  Dev<uint16_t> w(std::vector<uint16_t>(16 * 16, 0));
  Dev<float> x(std::vector<float>(65 * 16, 0.0f)), y(std::vector<float>(65 * 16, 0.0f));
  const cuda::SkinnyProduct pr{w.p, 16, y.p, nullptr};
  EXPECT_FALSE(cuda::skinny_gemm_supports(0, 16));
  EXPECT_FALSE(cuda::skinny_gemm_supports(65, 16));
  EXPECT_FALSE(cuda::skinny_gemm_supports(1, 12));
  EXPECT_TRUE(cuda::skinny_gemm_supports(64, 8));
  EXPECT_THROW(cuda::skinny_gemm(nullptr, x.p, 65, 16, &pr, 1), tqkv::Error);
  EXPECT_THROW(cuda::skinny_gemm(nullptr, x.p, 1, 12, &pr, 1), tqkv::Error);
  EXPECT_THROW(cuda::skinny_gemm(nullptr, nullptr, 1, 16, &pr, 1), tqkv::Error);
  EXPECT_THROW(cuda::skinny_gemm(w.p, x.p, 1, 16, &pr, 1), tqkv::Error);
  EXPECT_THROW(cuda::skinny_gemm(nullptr, x.p, 1, 16, &pr, 0), tqkv::Error);
  EXPECT_THROW(cuda::skinny_gemm_glu(false, nullptr, x.p, 1, 16, w.p, nullptr, 16, y.p, nullptr), tqkv::Error);
}

TEST(CudaOps, BadArgumentsThrow) {
  SKIP_WITHOUT_GPU();
  cuda::PrefillArgs a;
  a.n_q = 1;
  EXPECT_THROW(cuda::prefill_attention(a), tqkv::Error);
  EXPECT_THROW(cuda::rmsnorm(nullptr, nullptr, 1, 4, 1e-5f, nullptr), tqkv::Error);
}

}  // namespace
