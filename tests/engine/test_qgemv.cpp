// Quantized matrix-vector kernels: every SIMD level (set_simd_level) against the float32
// product of the dequantized matrix (dequant.cpp is itself checked against the gguf package
// in test_gguf.cpp). The kernels keep x in float32 and only factor each block's scale and
// offset out of its dot product, so they differ from the reference by float summation order
// alone: the tolerance is a few float epsilons (2^-24 ~ 6e-8) times the number of terms per
// partial sum, relative to sum |w_c x_c| (1e-5 covers 768 terms with room).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>

#include "engine/device/cpu_device.h"
#include "engine/weights/dequant.h"
#include "engine/gguf/gguf.h"
#include "engine/weights/block_groups.h"
#include "engine/weights/qgemv.h"
#include "tqkv/error.h"
#include "tqkv/half.h"
#include "tqkv/simd.h"
#include "tqkv/threads.h"

namespace tqkv::engine {
namespace {

std::vector<uint8_t> random_blocks(TensorType type, int rows, int cols, std::mt19937& rng) {
  const TensorTypeTraits* tr = tensor_type_traits(static_cast<uint32_t>(type));
  const int nb = rows * cols / tr->block_elems;
  std::vector<uint8_t> b(static_cast<size_t>(nb) * tr->block_bytes);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  // Byte offsets of the fp16 fields (random bytes there could be NaN or huge).
  std::vector<int> fp16_at = {0};
  if (type == TensorType::Q4_1 || type == TensorType::Q4_K) fp16_at = {0, 2};
  if (type == TensorType::Q6_K) fp16_at = {208};
  for (int i = 0; i < nb; ++i)
    for (int at : fp16_at) {
      const uint16_t h = float_to_half(scale(rng));
      std::memcpy(&b[static_cast<size_t>(i) * tr->block_bytes + at], &h, 2);
    }
  return b;
}

// A GGUF tensor "w" of rows x cols over the bytes b (which must outlive it).
GgufTensor tensor_over(uint32_t type, int rows, int cols, const std::vector<uint8_t>& b) {
  GgufTensor t;
  t.name = "w";
  t.shape = {cols, rows};
  t.type = type;
  t.data = b.data();
  t.nbytes = b.size();
  return t;
}

// Restores the SIMD level and the qgemv mode a test changes.
struct Restore {
  SimdLevel level = active_simd_level();
  QdotMode mode = qdot_mode();
  ~Restore() {
    set_simd_level(level);
    set_qdot_mode(mode);
  }
};

constexpr TensorType kTypes[] = {TensorType::Q4_0, TensorType::Q4_1, TensorType::Q5_0,
                                 TensorType::Q8_0, TensorType::Q4_K, TensorType::Q6_K};

// The f32 path (TQKV_QDOT=f32).
TEST(Qgemv, MatchesDequantizedProductOnEveryIsa) {
  std::mt19937 rng(3);
  const int rows = 70, cols = 768;  // a multiple of Q4_K's 256
  std::vector<float> x(cols);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  Restore restore;
  set_qdot_mode(QdotMode::F32);
  for (TensorType type : {TensorType::Q4_0, TensorType::Q4_1, TensorType::Q5_0, TensorType::Q8_0, TensorType::Q4_K,
                          TensorType::Q6_K}) {
    const uint32_t t = static_cast<uint32_t>(type);
    ASSERT_TRUE(qgemv_supported(t));
    const std::vector<uint8_t> w = random_blocks(type, rows, cols, rng);
    std::vector<float> wf(static_cast<size_t>(rows) * cols);
    dequantize(t, w.data(), wf.data(), static_cast<int64_t>(wf.size()));
    for (SimdLevel level : {SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512}) {
      if (!simd_level_supported(level)) continue;
      set_simd_level(level);
      EXPECT_EQ(qgemv_isa(), simd_level_name(level));
      SCOPED_TRACE(tensor_type_name(t) + " " + std::string(simd_level_name(level)));
      std::vector<float> y(rows - 5);
      qgemv(t, w.data(), cols, 5, rows, x.data(), y.data());  // a row range not starting at 0
      for (int r = 5; r < rows; ++r) {
        double ref = 0, mag = 0;
        for (int c = 0; c < cols; ++c) {
          ref += static_cast<double>(wf[static_cast<size_t>(r) * cols + c]) * x[c];
          mag += std::fabs(static_cast<double>(wf[static_cast<size_t>(r) * cols + c]) * x[c]);
        }
        EXPECT_NEAR(y[r - 5], ref, 1e-5 * mag + 1e-7) << "row " << r;
      }
    }
  }
  EXPECT_FALSE(qgemv_supported(static_cast<uint32_t>(TensorType::Q5_1)));
  EXPECT_THROW(qgemv(static_cast<uint32_t>(TensorType::Q5_1), nullptr, 32, 0, 0, x.data(), nullptr), std::exception);
  EXPECT_THROW(qgemv(static_cast<uint32_t>(TensorType::Q6_K), nullptr, 32, 0, 0, x.data(), nullptr), std::exception);
}

// The int8 path (TQKV_QDOT=int8): every ISA equals the scalar twin (the contract of
// qgemv_kernels.h: integer lane sums, then the same float operations in the same order) bit
// for bit, for qgemv and qgemm, with an odd number of 32-element blocks per row (AVX-512's half
// vector), an all-zero block, signed zeros and an outlier; and each product is within the
// activation rounding of the float one: |y - W x| <= sum_b (step_b / 2) sum_{c in b} |w_c| over
// the 32-element activation blocks b, step_b = max_b |x| / 127 (Q4_K and Q6_K, whose blocks
// take integer sub-scales of a scale per 256 elements i: at most max_b |x| / 127 +
// max_i |x| / (127 kSub)), plus float rounding (1e-5 of sum |w_c x_c|, as the f32 path).
TEST(Qgemv, Int8PathEqualsScalarTwinAndStaysWithinRoundingBound) {
  std::mt19937 rng(11);
  Restore restore;
  set_qdot_mode(QdotMode::Int8);
  std::normal_distribution<float> nd;
  for (TensorType type : kTypes) {
    const uint32_t ty = static_cast<uint32_t>(type);
    const bool k_quant = type == TensorType::Q4_K || type == TensorType::Q6_K;
    for (int cols : k_quant ? std::vector<int>{256, 768} : std::vector<int>{32 * 13, 768}) {
      const int rows = 37, r0 = 5, n = 3;
      const std::vector<uint8_t> w = random_blocks(type, rows, cols, rng);
      std::vector<float> wf(static_cast<size_t>(rows) * cols);
      dequantize(ty, w.data(), wf.data(), static_cast<int64_t>(wf.size()));
      std::vector<float> x(static_cast<size_t>(n) * cols);
      for (auto& v : x) v = nd(rng);
      for (int c = 0; c < 32; ++c) x[32 + c] = c % 2 ? -0.0f : 0.0f;  // an all-zero block
      x[70] = 40.0f;                                                  // an outlier
      if (cols == 768) std::fill(x.begin() + 1024, x.begin() + 1280, 0.0f);  // an all-zero super-block
      set_simd_level(SimdLevel::Scalar);
      std::vector<float> twin(static_cast<size_t>(n) * (rows - r0));
      qgemm(ty, w.data(), cols, r0, rows, x.data(), n, twin.data(), rows - r0);
      for (int t = 0; t < n; ++t) {
        const float* xt = x.data() + static_cast<size_t>(t) * cols;
        for (int r = r0; r < rows; ++r) {
          double ref = 0, mag = 0, bound = 0;
          for (int b = 0; b < cols / 32; ++b) {
            double amax = 0, wsum = 0, top = 0;
            for (int c = 256 * (b / 8); c < 256 * (b / 8) + 256 && k_quant; ++c)
              top = std::max(top, std::fabs(static_cast<double>(xt[c])));
            for (int c = 32 * b; c < 32 * b + 32; ++c) {
              const double wc = wf[static_cast<size_t>(r) * cols + c];
              ref += wc * xt[c];
              mag += std::fabs(wc * xt[c]);
              amax = std::max(amax, std::fabs(static_cast<double>(xt[c])));
              wsum += std::fabs(wc);
            }
            bound += (amax + top / detail::kSub) / 254 * wsum;
          }
          ASSERT_NEAR(twin[static_cast<size_t>(t) * (rows - r0) + (r - r0)], ref, bound + 1e-5 * mag + 1e-7)
              << tensor_type_name(ty) << " cols " << cols << " row " << t << ", " << r;
        }
      }
      for (SimdLevel level : {SimdLevel::Avx2, SimdLevel::Avx512}) {
        if (!simd_level_supported(level)) continue;
        set_simd_level(level);
        SCOPED_TRACE(tensor_type_name(ty) + " " + qdot_isa() + " cols " + std::to_string(cols));
        std::vector<float> y(twin.size());
        qgemm(ty, w.data(), cols, r0, rows, x.data(), n, y.data(), rows - r0);
        ASSERT_EQ(std::memcmp(y.data(), twin.data(), y.size() * sizeof(float)), 0);
        qgemv(ty, w.data(), cols, r0, rows, x.data(), y.data());
        ASSERT_EQ(std::memcmp(y.data(), twin.data(), (rows - r0) * sizeof(float)), 0);
      }
    }
  }
  EXPECT_EQ(parse_qdot_mode("f32"), QdotMode::F32);
  EXPECT_EQ(parse_qdot_mode("int8"), QdotMode::Int8);
  EXPECT_THROW(parse_qdot_mode("int4"), Error);
}

// An activation block holding inf or NaN makes the int8 products NaN (not a silent finite
// value), as the float path does.
TEST(Qgemv, Int8PathPropagatesNonFinite) {
  Restore restore;
  set_qdot_mode(QdotMode::Int8);
  std::mt19937 rng(2);
  const std::vector<uint8_t> w = random_blocks(TensorType::Q4_0, 2, 64, rng);
  std::vector<float> x(64, 0.5f);
  x[40] = INFINITY;
  std::vector<float> y(2);
  qgemv(static_cast<uint32_t>(TensorType::Q4_0), w.data(), 64, 0, 2, x.data(), y.data());
  EXPECT_TRUE(std::isnan(y[0]) && std::isnan(y[1]));
  std::vector<float> xk(256, 0.5f);  // the K-quants' per-256 activations
  xk[200] = NAN;
  for (TensorType type : {TensorType::Q4_K, TensorType::Q6_K}) {
    const std::vector<uint8_t> wk = random_blocks(type, 2, 256, rng);
    for (SimdLevel level : {SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512}) {
      if (!simd_level_supported(level)) continue;
      set_simd_level(level);
      y.assign(2, 0.0f);
      qgemv(static_cast<uint32_t>(type), wk.data(), 256, 0, 2, xk.data(), y.data());
      EXPECT_TRUE(std::isnan(y[0]) && std::isnan(y[1])) << tensor_type_name(static_cast<uint32_t>(type)) << " " << qdot_isa();
    }
  }
}

// qgemm decodes each block once for up to 8 activation rows; every row must equal qgemv of
// that row alone bit for bit (the batch-invariance the server's greedy answers rely on), at
// every ISA and type, for row counts below, at and past a group of 8, over a row slice, with
// y rows strided (the padding between them untouched).
TEST(Qgemm, EqualsQgemvRowByRowBitForBit) {
  std::mt19937 rng(9);
  const int rows = 45, cols = 512, r0 = 3, r1 = 40, ldy = 41;
  Restore restore;
  std::normal_distribution<float> nd;
  std::vector<float> x(17 * static_cast<size_t>(cols));
  for (auto& v : x) v = nd(rng);
  for (int c = 0; c < 64; ++c) x[c] = c % 3 == 0 ? -0.0f : 0.0f;  // signed zeros in row 0
  for (TensorType type : kTypes) {
    const uint32_t ty = static_cast<uint32_t>(type);
    const std::vector<uint8_t> w = random_blocks(type, rows, cols, rng);
    for (QdotMode mode : {QdotMode::F32, QdotMode::Int8}) {
      set_qdot_mode(mode);
      for (SimdLevel level : {SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512}) {
        if (!simd_level_supported(level)) continue;
        set_simd_level(level);
        for (int n : {1, 2, 3, 5, 7, 8, 9, 13, 17}) {
          SCOPED_TRACE(tensor_type_name(ty) + " " + qdot_isa() + " " + qdot_mode_name(qdot_mode()) + " n " +
                       std::to_string(n));
          std::vector<float> y(static_cast<size_t>(n) * ldy, 12345.0f);
          qgemm(ty, w.data(), cols, r0, r1, x.data(), n, y.data(), ldy);
          for (int t = 0; t < n; ++t) {
            std::vector<float> one(r1 - r0);
            qgemv(ty, w.data(), cols, r0, r1, x.data() + static_cast<size_t>(t) * cols, one.data());
            ASSERT_EQ(std::memcmp(one.data(), &y[static_cast<size_t>(t) * ldy], one.size() * sizeof(float)), 0) << "row " << t;
            for (int k = r1 - r0; k < ldy; ++k) ASSERT_EQ(y[static_cast<size_t>(t) * ldy + k], 12345.0f) << "row " << t;
          }
        }
      }
    }
  }
  std::vector<float> y(2);
  EXPECT_THROW(qgemm(static_cast<uint32_t>(TensorType::Q5_1), nullptr, 32, 0, 0, x.data(), 2, y.data(), 1), std::exception);
  EXPECT_THROW(qgemm(static_cast<uint32_t>(TensorType::Q4_K), nullptr, 32, 0, 1, x.data(), 2, y.data(), 1), std::exception);
  EXPECT_THROW(qgemm(static_cast<uint32_t>(TensorType::Q4_0), nullptr, 32, 0, 1, x.data(), -1, y.data(), 1), std::exception);
  qgemm(static_cast<uint32_t>(TensorType::Q4_0), nullptr, 32, 0, 0, x.data(), 0, y.data(), 1);  // nothing to do
}

// An input prepared for K-quants only (no per-32 rows) gives Q4_K and Q6_K the same products
// bit for bit as a full one, at every ISA; any other type over it is refused.
TEST(Qgemm, KQuantOnlyInputEqualsFullInputBitForBit) {
  std::mt19937 rng(17);
  const int rows = 37, cols = 768, n = 3;
  Restore restore;
  set_qdot_mode(QdotMode::Int8);
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(n) * cols);
  for (auto& v : x) v = nd(rng);
  QgemmInput full, k_only;
  full.prepare(x.data(), n, cols);
  k_only.prepare(x.data(), n, cols, true);
  for (TensorType type : {TensorType::Q4_K, TensorType::Q6_K}) {
    const uint32_t ty = static_cast<uint32_t>(type);
    const std::vector<uint8_t> w = random_blocks(type, rows, cols, rng);
    for (SimdLevel level : {SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512}) {
      if (!simd_level_supported(level)) continue;
      set_simd_level(level);
      SCOPED_TRACE(tensor_type_name(ty) + " " + qdot_isa());
      std::vector<float> want(static_cast<size_t>(n) * rows), got(want.size(), 1.0f);
      qgemm(ty, w.data(), 0, rows, full, want.data(), rows);
      qgemm(ty, w.data(), 0, rows, k_only, got.data(), rows);
      ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0);
    }
  }
  const std::vector<uint8_t> w = random_blocks(TensorType::Q4_0, rows, cols, rng);
  std::vector<float> y(static_cast<size_t>(n) * rows);
  EXPECT_THROW(qgemm(static_cast<uint32_t>(TensorType::Q4_0), w.data(), 0, rows, k_only, y.data(), rows), tqkv::Error);
  qgemm(static_cast<uint32_t>(TensorType::Q4_0), w.data(), 0, rows, full, y.data(), rows);
}

// The per-256 activation quantization at SimdLevel::Avx512 equals the scalar pass bit for bit:
// normal rows, rows with zeros, a huge and a tiny super-block, signed zeros, inf and NaN.
TEST(Qgemm, Per256QuantizationEqualsScalarOnEveryIsa) {
  if (!simd_level_supported(SimdLevel::Avx512)) GTEST_SKIP() << "no AVX-512 here";
  std::mt19937 rng(5);
  const int n = 3, cols = 2048;
  Restore restore;
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(n) * cols);
  for (auto& v : x) v = nd(rng);
  for (int e = 0; e < 256; ++e) x[256 + e] = e % 5 == 0 ? 0.0f : (e % 7 == 0 ? -0.0f : x[256 + e]);
  for (int e = 0; e < 256; ++e) x[512 + e] = 0.0f;
  for (int e = 0; e < 256; ++e) x[768 + e] *= 1e30f;
  for (int e = 0; e < 256; ++e) x[1024 + e] *= 1e-38f;  // denormal steps
  x[1280 + 7] = std::numeric_limits<float>::infinity();
  x[1536 + 200] = std::nanf("");
  x[1792 + 3] = -std::numeric_limits<float>::infinity();
  for (int e = 0; e < 32; ++e) x[cols + 64 + e] *= 100.0f;  // a loud sub-block
  detail::QdotBuffers want, got;
  set_simd_level(SimdLevel::Scalar);
  detail::quantize_rows(x.data(), n, cols, want);
  set_simd_level(SimdLevel::Avx512);
  detail::quantize_rows(x.data(), n, cols, got);
  ASSERT_EQ(want.xk, got.xk);
  ASSERT_EQ(want.xkb, got.xkb);
  ASSERT_EQ(want.xku, got.xku);
  ASSERT_EQ(want.xkd.size(), got.xkd.size());
  ASSERT_EQ(std::memcmp(want.xkd.data(), got.xkd.data(), want.xkd.size() * sizeof(float)), 0);
}

// The CPU device holds a qgemv type's blocks only: one token goes through qgemv, a batch
// through SGEMM on dequantized row tiles (here 2+ tiles per thread's part), embedding rows
// are dequantized on demand. All against the float32 product of the dequantized matrix, so
// under the f32 path (the int8 path's bound is checked above).
TEST(CpuDevice, BlocksOnlyMatrixMatchesDequantizedProduct) {
  Restore restore;
  set_qdot_mode(QdotMode::F32);
  std::mt19937 rng(5);
  const int cols = kTileFloats / (2 * kTileMinRows), rows = 4 * 2 * kTileMinRows + 7;  // tiles of 2 * kTileMinRows rows
  for (TensorType type : {TensorType::Q6_K, TensorType::Q5_0}) {
    const uint32_t ty = static_cast<uint32_t>(type);
    SCOPED_TRACE(tensor_type_name(ty));
    std::vector<uint8_t> w = random_blocks(type, rows, cols, rng);
    std::vector<float> wf(static_cast<size_t>(rows) * cols);
    dequantize(ty, w.data(), wf.data(), static_cast<int64_t>(wf.size()));
    const GgufTensor t = tensor_over(ty, rows, cols, w);
    CpuDevice dev;
    const auto m = dev.load_matrix(t, rows, cols);
    EXPECT_EQ(m->bytes(), w.size()) << "no float32 copy";
    for (int n : {1, 2, 5}) {
      std::vector<float> x(static_cast<size_t>(n) * cols), y(static_cast<size_t>(n) * rows);
      std::normal_distribution<float> nd;
      for (auto& v : x) v = nd(rng);
      dev.matmul(x.data(), n, *m, y.data(), nullptr);
      for (int k = 0; k < n; ++k)
        for (int r = 0; r < rows; ++r) {
          double ref = 0, mag = 0;
          for (int c = 0; c < cols; ++c) {
            const double p = static_cast<double>(wf[static_cast<size_t>(r) * cols + c]) * x[static_cast<size_t>(k) * cols + c];
            ref += p;
            mag += std::fabs(p);
          }
          ASSERT_NEAR(y[static_cast<size_t>(k) * rows + r], ref, 1e-5 * mag + 1e-7) << "n " << n << ", row " << r;
        }
    }
    const int32_t tokens[2] = {rows - 1, 3};
    std::vector<float> e(2 * static_cast<size_t>(cols));
    dev.embed(*m, tokens, 2, 0.5f, e.data());
    for (int k = 0; k < 2; ++k)
      for (int c = 0; c < cols; ++c)
        ASSERT_EQ(e[static_cast<size_t>(k) * cols + c], 0.5f * wf[static_cast<size_t>(tokens[k]) * cols + c]);
  }
}

}  // namespace
}  // namespace tqkv::engine

namespace tqkv::engine {
namespace {

// A matrix of random blocks of `type` (F32: random floats) loaded onto the CPU device.
std::unique_ptr<DeviceMatrix> random_matrix(CpuDevice& dev, TensorType type, int rows, int cols, std::mt19937& rng,
                                            std::vector<std::vector<uint8_t>>& keep) {
  if (type == TensorType::F32) {
    std::normal_distribution<float> nd(0.0f, 0.05f);
    std::vector<float> f(static_cast<size_t>(rows) * cols);
    for (auto& v : f) v = nd(rng);
    keep.emplace_back(reinterpret_cast<const uint8_t*>(f.data()), reinterpret_cast<const uint8_t*>(f.data() + f.size()));
  } else {
    keep.push_back(random_blocks(type, rows, cols, rng));
  }
  return dev.load_matrix(tensor_over(static_cast<uint32_t>(type), rows, cols, keep.back()), rows, cols);
}

// A group of products over one input (Q, K, V; gate and up) equals its products one by one bit
// for bit: every quantized type alone and mixed (as Q4_K_M files mix Q4_K and Q6_K), with and
// without biases, odd row counts (so the byte split cuts rows at odd places), 1-3 input rows
// (3 takes SGEMM, one product at a time), a float32 matrix in the group (one product at a
// time), both qgemv paths, every ISA and 1-3 threads.
TEST(CpuDevice, MatmulGroupEqualsSeparateProductsBitForBit) {
  Restore restore;
  struct Threads {
    int n = num_threads();
    ~Threads() { set_num_threads(n); }
  } restore_threads;
  std::mt19937 rng(21);
  const int cols = 512;
  CpuDevice dev;
  std::vector<std::vector<uint8_t>> keep;
  std::vector<std::vector<TensorType>> groups;
  for (TensorType t : kTypes) groups.push_back({t, t, t});
  groups.push_back({TensorType::Q4_K, TensorType::Q6_K});
  groups.push_back({TensorType::Q4_K, TensorType::Q4_K, TensorType::Q6_K});
  groups.push_back({TensorType::Q8_0, TensorType::F32, TensorType::Q4_1});
  const int kRows[] = {97, 33, 161};
  std::normal_distribution<float> nd;
  std::vector<float> x(3 * static_cast<size_t>(cols));
  for (auto& v : x) v = nd(rng);
  for (const auto& types : groups) {
    std::vector<std::unique_ptr<DeviceMatrix>> m;
    std::vector<std::vector<float>> bias;
    std::string name;
    for (size_t i = 0; i < types.size(); ++i) {
      m.push_back(random_matrix(dev, types[i], kRows[i], cols, rng, keep));
      bias.emplace_back(i == 1 ? 0 : kRows[i]);  // the second without bias
      for (auto& b : bias.back()) b = nd(rng);
      name += tensor_type_name(static_cast<uint32_t>(types[i])) + " ";
    }
    for (QdotMode mode : {QdotMode::F32, QdotMode::Int8}) {
      set_qdot_mode(mode);
      for (SimdLevel level : {SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512}) {
        if (!simd_level_supported(level)) continue;
        set_simd_level(level);
        for (int th : {1, 2, 3}) {
          set_num_threads(th);
          for (int n : {1, 2, 3}) {
            SCOPED_TRACE(name + qdot_isa() + " " + qdot_mode_name(mode) + " threads " + std::to_string(th) + " n " +
                         std::to_string(n));
            std::vector<std::vector<float>> want, got;
            std::vector<GroupProduct> g;
            for (size_t i = 0; i < m.size(); ++i) {
              const float* b = bias[i].empty() ? nullptr : bias[i].data();
              want.emplace_back(static_cast<size_t>(n) * m[i]->rows());
              got.emplace_back(want.back().size(), 12345.0f);
              dev.matmul(x.data(), n, *m[i], want.back().data(), b);
              g.push_back({m[i].get(), got.back().data(), b});
            }
            dev.matmul_group(x.data(), n, g.data(), static_cast<int>(g.size()));
            for (size_t i = 0; i < m.size(); ++i)
              ASSERT_EQ(std::memcmp(want[i].data(), got[i].data(), want[i].size() * sizeof(float)), 0) << "product " << i;
          }
        }
      }
    }
  }
  // Products over inputs of different widths are refused.
  std::vector<std::unique_ptr<DeviceMatrix>> m;
  m.push_back(random_matrix(dev, TensorType::Q8_0, 32, 64, rng, keep));
  m.push_back(random_matrix(dev, TensorType::Q8_0, 32, 96, rng, keep));
  std::vector<float> y(64);
  const GroupProduct g[2] = {{m[0].get(), y.data()}, {m[1].get(), y.data() + 32}};
  EXPECT_THROW(dev.matmul_group(x.data(), 1, g, 2), Error);
}

// Q5_0, Q4_1 and Q8_0 matrices in groups of eight blocks (block_groups.h): the layouts byte for
// byte, the round trip, and every product over them equal to the product over the GGUF blocks
// bit for bit (the AVX2 int8 kernels that read them directly, and every other kernel through the
// restored rows), at every ISA and in both qgemv modes; the CPU device packs at load and gives
// the same products and embedding rows as unpacked.
constexpr auto kQ5_0 = static_cast<uint32_t>(TensorType::Q5_0);
constexpr auto kQ4_1 = static_cast<uint32_t>(TensorType::Q4_1);

// Each grouped type with its GGUF type.
struct GroupedCase {
  uint32_t grouped, gguf;
  const char* env;
};
constexpr GroupedCase kGroupedCases[] = {{kQ5_0Groups, kQ5_0, "TQKV_Q5_0_GROUPS"},
                                         {kQ4_1Groups, kQ4_1, "TQKV_Q4_1_GROUPS"},
                                         {kQ8_0Groups, static_cast<uint32_t>(TensorType::Q8_0), "TQKV_Q8_0_GROUPS"}};

// Element i's low nibble in a hand-made block j (below).
int made_nibble(int i, int j) { return i < 16 ? (i + j) & 15 : (15 - (i - 16)) & 15; }

// The documented layout on a hand-made group: block j's d at 2j, the high bit of element 4m + k
// at bit 8k + m of word j, the nibbles of blocks 2p and 2p + 1 in pair p's low and high halves.
TEST(BlockGroups, Q5_0LayoutIsTheDocumentedOne) {
  std::vector<uint8_t> gguf(8 * 22 + 22, 0);  // one group and a one-block tail
  for (int j = 0; j < 9; ++j) {
    uint8_t* b = gguf.data() + 22 * j;
    b[0] = static_cast<uint8_t>(0x10 + j);
    b[1] = 0x3c;
    const uint32_t qh = 1u << (5 + j);  // element 5 + j's high bit
    std::memcpy(b + 2, &qh, 4);
    for (int i = 0; i < 16; ++i) b[6 + i] = static_cast<uint8_t>(made_nibble(i, j) | made_nibble(i + 16, j) << 4);
  }
  std::vector<uint8_t> g(gguf.size());
  pack_group_rows(kQ5_0Groups, gguf.data(), 1, 9 * 32, g.data());
  for (int j = 0; j < 8; ++j) {
    EXPECT_EQ(g[2 * j], 0x10 + j);
    EXPECT_EQ(g[2 * j + 1], 0x3c);
    uint32_t w;
    std::memcpy(&w, &g[16 + 4 * j], 4);
    const int e = 5 + j, m = e / 4, k = e % 4;
    EXPECT_EQ(w, 1u << (8 * k + m)) << "block " << j;
    for (int i = 0; i < 32; ++i)
      EXPECT_EQ((g[48 + 32 * (j / 2) + i] >> (j % 2 ? 4 : 0)) & 15, made_nibble(i, j)) << "block " << j << " element " << i;
  }
  EXPECT_EQ(0, std::memcmp(&g[176], &gguf[176], 22)) << "the tail block stays in GGUF layout";
}

// Block j's d at 2j, its m at 16 + 2j, the nibble pairs from byte 32.
TEST(BlockGroups, Q4_1LayoutIsTheDocumentedOne) {
  std::vector<uint8_t> gguf(8 * 20 + 20, 0);
  for (int j = 0; j < 9; ++j) {
    uint8_t* b = gguf.data() + 20 * j;
    b[0] = static_cast<uint8_t>(0x10 + j);
    b[1] = 0x3c;
    b[2] = static_cast<uint8_t>(0x40 + j);
    b[3] = 0xbc;
    for (int i = 0; i < 16; ++i) b[4 + i] = static_cast<uint8_t>(made_nibble(i, j) | made_nibble(i + 16, j) << 4);
  }
  std::vector<uint8_t> g(gguf.size());
  pack_group_rows(kQ4_1Groups, gguf.data(), 1, 9 * 32, g.data());
  for (int j = 0; j < 8; ++j) {
    EXPECT_EQ(g[2 * j], 0x10 + j);
    EXPECT_EQ(g[2 * j + 1], 0x3c);
    EXPECT_EQ(g[16 + 2 * j], 0x40 + j);
    EXPECT_EQ(g[16 + 2 * j + 1], 0xbc);
    for (int i = 0; i < 32; ++i)
      EXPECT_EQ((g[32 + 32 * (j / 2) + i] >> (j % 2 ? 4 : 0)) & 15, made_nibble(i, j)) << "block " << j << " element " << i;
  }
  EXPECT_EQ(0, std::memcmp(&g[160], &gguf[160], 20)) << "the tail block stays in GGUF layout";
  EXPECT_THROW(pack_group_rows(kQ4_1, gguf.data(), 1, 9 * 32, g.data()), Error) << "not a grouped type";
}

TEST(BlockGroups, UnpackRestoresTheGgufBytesAndDequantizesAlike) {
  std::mt19937 rng(21);
  for (const GroupedCase& c : kGroupedCases) {
    EXPECT_TRUE(is_grouped(c.grouped));
    EXPECT_FALSE(is_grouped(c.gguf));
    EXPECT_EQ(ungrouped_type(c.grouped), c.gguf);
    EXPECT_EQ(grouped_type(c.gguf), c.grouped);
    for (int cols : {32, 256, 13 * 32, 896, 4864}) {
      SCOPED_TRACE(tensor_type_name(c.gguf) + " cols " + std::to_string(cols));
      const int rows = 3;
      const std::vector<uint8_t> w = random_blocks(static_cast<TensorType>(c.gguf), rows, cols, rng);
      std::vector<uint8_t> g(w.size()), back(w.size());
      pack_group_rows(c.grouped, w.data(), rows, cols, g.data());
      unpack_group_rows(c.grouped, g.data(), rows, cols, back.data());
      EXPECT_EQ(back, w);
      if (cols >= 256) {
        EXPECT_NE(g, w);
      }
      std::vector<float> a(static_cast<size_t>(rows) * cols), b(a.size());
      dequantize(c.gguf, w.data(), a.data(), static_cast<int64_t>(a.size()));
      dequantize_group_rows(c.grouped, g.data(), rows, cols, b.data());
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
    }
  }
  EXPECT_EQ(grouped_type(static_cast<uint32_t>(TensorType::Q4_K)), 0u);
}

// qgemm over the groups equals qgemm over the GGUF blocks bit for bit: full groups with and
// without a tail (odd and even), no full group, 1-17 activation rows (the N-row kernels, a
// second group of 8 and row tiles), a row range not starting at 0, every ISA, both modes.
TEST(BlockGroups, ProductsEqualTheGgufProductsBitForBit) {
  std::mt19937 rng(22);
  std::normal_distribution<float> nd;
  Restore restore;
  for (const GroupedCase& c : kGroupedCases) {
    for (QdotMode mode : {QdotMode::Int8, QdotMode::F32}) {
      set_qdot_mode(mode);
      for (int cols : {32, 256, 13 * 32, 896}) {
        const int rows = 41, r0 = 5;
        const std::vector<uint8_t> w = random_blocks(static_cast<TensorType>(c.gguf), rows, cols, rng);
        std::vector<uint8_t> g(w.size());
        pack_group_rows(c.grouped, w.data(), rows, cols, g.data());
        for (int n : {1, 2, 3, 8, 9, 17}) {
          std::vector<float> x(static_cast<size_t>(n) * cols);
          for (auto& v : x) v = nd(rng);
          x[7] = 30.0f;  // an outlier
          for (SimdLevel level : {SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512}) {
            if (!simd_level_supported(level)) continue;
            set_simd_level(level);
            SCOPED_TRACE(tensor_type_name(c.gguf) + " " + std::string(qdot_mode_name(mode)) + " " +
                         std::string(simd_level_name(level)) + " cols " + std::to_string(cols) + " n " +
                         std::to_string(n));
            std::vector<float> want(static_cast<size_t>(n) * (rows - r0)), got(want.size(), -1.0f);
            qgemm(c.gguf, w.data(), cols, r0, rows, x.data(), n, want.data(), rows - r0);
            qgemm(c.grouped, g.data(), cols, r0, rows, x.data(), n, got.data(), rows - r0);
            ASSERT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));
          }
        }
      }
    }
  }
}

// CpuDevice packs at load where asked (TQKV_Q5_0_GROUPS=1, TQKV_Q4_1_GROUPS=1) and its products
// (1-2 rows: qgemm; 5: the dequantized tiles' SGEMM) and embedding rows equal the unpacked
// matrix's.
TEST(BlockGroups, CpuDeviceProductsAndRowsEqualUnpacked) {
  std::mt19937 rng(23);
  const int rows = 300, cols = 896;
  for (const GroupedCase& c : kGroupedCases) {
    SCOPED_TRACE(tensor_type_name(c.gguf));
    const std::vector<uint8_t> w = random_blocks(static_cast<TensorType>(c.gguf), rows, cols, rng);
    const GgufTensor t = tensor_over(c.gguf, rows, cols, w);
    CpuDevice dev;
    const char* before = std::getenv(c.env);
    const std::string saved = before ? before : "";
    setenv(c.env, "1", 1);
    const auto packed = dev.load_matrix(t, rows, cols);
    setenv(c.env, "0", 1);
    const auto plain = dev.load_matrix(t, rows, cols);
    if (before) {
      setenv(c.env, saved.c_str(), 1);
    } else {
      unsetenv(c.env);
    }
    EXPECT_EQ(static_cast<const CpuMatrix&>(*packed).qtype, c.grouped);
    EXPECT_EQ(static_cast<const CpuMatrix&>(*plain).qtype, c.gguf);
    EXPECT_EQ(packed->bytes(), w.size());
    std::normal_distribution<float> nd;
    for (int n : {1, 2, 5}) {
      std::vector<float> x(static_cast<size_t>(n) * cols), a(static_cast<size_t>(n) * rows), b(a.size());
      for (auto& v : x) v = nd(rng);
      dev.matmul(x.data(), n, *plain, a.data(), nullptr);
      dev.matmul(x.data(), n, *packed, b.data(), nullptr);
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "n " << n;
    }
    const int32_t tokens[3] = {0, rows - 1, 77};
    std::vector<float> ea(3 * static_cast<size_t>(cols)), eb(ea.size());
    dev.embed(*plain, tokens, 3, 1.0f, ea.data());
    dev.embed(*packed, tokens, 3, 1.0f, eb.data());
    EXPECT_EQ(ea, eb);
  }
}

}  // namespace
}  // namespace tqkv::engine
