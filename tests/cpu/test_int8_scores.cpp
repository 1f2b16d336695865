// Int8 key scores (tqkv/simd.h KeyScores::Int8Keys: int8 scores, fp32 value sums; the int8
// value sums of KeyScores::Int8 are test_int8_values.cpp's) against the exact reference, with
// the error bound their quantization steps imply, and the same integers at every level that
// has them.
//
// The bound. Row q (rotated, times the softmax scale) is rounded to q8 with step s_q =
// max|q| / 127, the codebook levels L to L8 with step s_k = max|L| / 63. For a key of norm n
// and levels L_c, the exact score n * sum_c q_c L_c and the int8 one n * s_q s_k sum_c q8_c L8_c
// differ by
//   n * sum_c [(q_c - s_q q8_c) L_c + s_q q8_c (L_c - s_k L8_c)]
//   <= n * (s_q / 2 * sum_c |L_c| + s_k / 2 * s_q * sum_c |q8_c|) = eps_j.
// Scores moved by at most eps = max_j eps_j scale every softmax weight by a factor within
// [e^-2eps, e^2eps], so the output moves by at most (e^2eps - 1) * max_j ||v_j - o|| (in L2:
// o' - o = sum_j (p'_j - p_j)(v_j - o), |p'_j - p_j| <= p_j (e^2eps - 1)). Checked with the
// fp32 slack of the other reference tests (1e-5 of ||o||).
#include <gtest/gtest.h>

#include "../common/test_data.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <numeric>
#include <vector>

#include "tqkv/attention.h"
#include "tqkv/bitpack.h"
#include "tqkv/error.h"
#include "tqkv/half.h"
#include "tqkv/simd.h"

namespace tqkv {
namespace {

using testing_util::gaussian;
using testing_util::rel_error;

// Whether the kernel at `level` scores keys of `bits` (2-8; 6-8 in two-byte levels) in int8
// (kernel-*.cpp, isa-avx512.h: i8_block; AVX2 up to 6 bits, AVX-512 with VNNI + VBMI only).
bool level_has_int8(SimdLevel level, int d, int bits) {
  switch (level) {
    case SimdLevel::Scalar: return true;
    case SimdLevel::Avx2: return d % 32 == 0 && bits <= 6;
    case SimdLevel::Avx512: return testing_util::avx512_has_int8() && d % 64 == 0;
  }
  return false;
}

using testing_util::filled_cache;

struct Setup {
  const char* format;
  int d, H, Hq, T, n_q;
  float sigma_q;
};

double l2(const float* a, const float* b, int d) {
  double s = 0;
  for (int i = 0; i < d; ++i) s += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
  return std::sqrt(s);
}

void check(const Setup& c) {
  const Format f = find_format(c.format);
  std::vector<float> k;
  const ContiguousCache cache = filled_cache(c.format, c.H, c.d, c.T, 21, &k);
  const int d = c.d, G = c.Hq / c.H;
  const auto q = gaussian(static_cast<size_t>(c.n_q) * c.Hq * d, 23, c.sigma_q);
  const int64_t pos0 = c.T - c.n_q;
  AttentionParams p;
  p.n_q_heads = c.Hq;
  std::vector<float> ref(q.size());
  attention_reference(cache, 0, q.data(), c.n_q, pos0, p, ref.data());

  // Per key: ||y||_1 = n * sum|L| (y: the key decoded in the rotated domain) and the norm n.
  const SlotCodec& codec = cache.codec(0);
  const Codebook& cb = *codec.key_codebook();
  float lmax = 0;
  for (float x : cb.levels_f32) lmax = std::max(lmax, std::fabs(x));
  const double s_k = lmax / (f.key_bits == 6 ? 63.0 * 64 : 63.0);  // 6 bits: two-byte levels
  std::vector<double> y1(static_cast<size_t>(c.T) * c.H), norm(y1.size());
  std::vector<uint8_t> bytes(codec.key_bytes());
  std::vector<float> y(d);
  for (size_t j = 0; j < y1.size(); ++j) {
    codec.encode_key(k.data() + j * d, bytes.data());
    codec.decode_key_domain(bytes.data(), y.data());
    for (float x : y) y1[j] += std::fabs(x);
    uint16_t h;
    std::memcpy(&h, bytes.data() + f.key_code_bytes(d), 2);
    norm[j] = half_to_float(h);
  }
  std::vector<float> vd(k.size());
  cache.decode(0, 0, c.T, false, vd.data());

  // Per row: eps and the bound on ||o' - o||.
  std::vector<double> bound(static_cast<size_t>(c.n_q) * c.Hq);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int t = 0; t < c.n_q; ++t)
    for (int h = 0; h < c.Hq; ++h) {
      const size_t row = static_cast<size_t>(t) * c.Hq + h;
      std::vector<float> qr(q.begin() + static_cast<std::ptrdiff_t>(row * d),
                            q.begin() + static_cast<std::ptrdiff_t>((row + 1) * d));
      codec.rotation().apply(qr.data());
      float amax = 0;
      for (float& x : qr) amax = std::max(amax, std::fabs(x *= scale));
      const double s_q = amax / 127.0;
      double q8_l1 = 0;
      for (float x : qr) q8_l1 += std::fabs(std::nearbyint(x / (amax / 127.0f)));
      double eps = 0, spread = 0;
      const int kvh = h / G;
      for (int64_t j = 0; j <= pos0 + t; ++j) {
        const size_t key = static_cast<size_t>(j) * c.H + kvh;
        eps = std::max(eps, s_q / 2 * y1[key] + norm[key] * s_k / 2 * s_q * q8_l1);
        spread = std::max(spread, l2(vd.data() + key * d, ref.data() + row * d, d));
      }
      eps *= 1.01;  // s_q, q8 recomputed here in float and double: a hair of room
      bound[row] = std::expm1(2 * eps) * spread;
    }

  testing_util::LevelGuard guard;
  testing_util::ScoresGuard int8(KeyScores::Int8Keys);  // fp32 value sums: the key contract alone
  std::vector<float> scalar_out;
  for (SimdLevel level : testing_util::supported_levels()) {
    set_simd_level(level);
    std::vector<float> out(q.size(), NAN);
    attention(cache, 0, q.data(), c.n_q, pos0, p, out.data());
    double err_max = 0;
    for (size_t row = 0; row < bound.size(); ++row) {
      const double err = l2(out.data() + row * d, ref.data() + row * d, d);
      const double slack = 1e-5 * std::sqrt(std::inner_product(ref.begin() + row * d, ref.begin() + (row + 1) * d,
                                                               ref.begin() + row * d, 0.0));
      EXPECT_LE(err, bound[row] + slack) << c.format << " d " << d << " level " << simd_level_name(level) << " row "
                                         << row;
      err_max = std::max(err_max, err);
    }
    if (level_has_int8(level, d, f.key_bits)) {
      EXPECT_GT(err_max, 1e-6) << "int8 scores not in use: " << c.format << " level " << simd_level_name(level);
      // The same integers at every level: equal to the scalar kernel's int8 scores.
      if (level == SimdLevel::Scalar)
        scalar_out = out;
      else
        EXPECT_LT(rel_error(out, scalar_out), 1e-5) << c.format << " d " << d << " " << simd_level_name(level);
    }
  }
}

// The int8 contract itself (kernel.h, kernel_impl.h "Int8 scores") computed here in double from
// the codes: every level with the int8 path must give it within the kernels' fp32 error (the
// bound above allows ~1000x the error actually seen, so it cannot tell a wrong table or order).
void check_contract(const char* name, int d, int G, int T) {
  const Format f = find_format(name);
  std::vector<float> k;
  const ContiguousCache cache = filled_cache(name, 1, d, T, 31, &k);
  const auto q = gaussian(static_cast<size_t>(G) * d, 33, 1.5f);
  const SlotCodec& codec = cache.codec(0);
  const Codebook& cb = *codec.key_codebook();
  float lmax = 0;
  for (float x : cb.levels_f32) lmax = std::max(lmax, std::fabs(x));
  const float s_k = lmax / (f.key_bits >= 6 ? 63.0f * 64 : 63.0f);  // 6-8 bits: two-byte levels
  std::vector<float> vd(k.size());
  cache.decode(0, 0, T, false, vd.data());
  std::vector<float> want(q.size());
  std::vector<uint8_t> bytes(codec.key_bytes());
  for (int r = 0; r < G; ++r) {
    std::vector<float> qr(q.begin() + r * d, q.begin() + (r + 1) * d);
    codec.rotation().apply(qr.data());
    float amax = 0;
    for (float& x : qr) amax = std::max(amax, std::fabs(x *= 1.0f / std::sqrt(static_cast<float>(d))));
    const float s_q = amax / 127.0f;
    std::vector<double> score(T);
    double mx = -1e300;
    for (int j = 0; j < T; ++j) {
      codec.encode_key(k.data() + static_cast<size_t>(j) * d, bytes.data());
      uint16_t h;
      std::memcpy(&h, bytes.data() + f.key_code_bytes(d), 2);
      long long dot = 0;
      for (int c = 0; c < d; ++c)
        dot += static_cast<long long>(std::nearbyint(qr[c] / s_q)) *
               static_cast<long long>(std::nearbyint(cb.levels_f32[unpack_one(bytes.data(), c, f.key_bits)] / s_k));
      score[j] = static_cast<double>(half_to_float(h)) * s_q * s_k * static_cast<double>(dot);
      mx = std::max(mx, score[j]);
    }
    double sum = 0;
    std::vector<double> o(d);
    for (int j = 0; j < T; ++j) {
      const double w = std::exp(score[j] - mx);
      sum += w;
      for (int c = 0; c < d; ++c) o[c] += w * vd[static_cast<size_t>(j) * d + c];
    }
    for (int c = 0; c < d; ++c) want[static_cast<size_t>(r) * d + c] = static_cast<float>(o[c] / sum);
  }
  AttentionParams p;
  p.n_q_heads = G;
  testing_util::LevelGuard guard;
  testing_util::ScoresGuard int8(KeyScores::Int8Keys);  // fp32 value sums: the key contract alone
  for (SimdLevel level : testing_util::supported_levels()) {
    if (!level_has_int8(level, d, f.key_bits)) continue;
    set_simd_level(level);
    std::vector<float> out(q.size(), NAN);
    attention(cache, 0, q.data(), 1, T - 1, p, out.data());
    EXPECT_LT(rel_error(out, want), 1e-5) << name << " d " << d << " G " << G << " " << simd_level_name(level);
  }
}

TEST(Int8Scores, EveryLevelComputesTheContract) {
  for (const char* name : {"turboquant_4bit_nc", "turboquant_3bit_nc", "tq-k2v2", "k5v3", "k5v5", "k6v4", "k7v3", "k8v4"})
    for (int d : {64, 128, 256})
      for (int G : {1, 4, 9}) check_contract(name, d, G, 203);  // 203: a tile tail of 11 keys
}

TEST(Int8Scores, WithinTheQuantizationBoundAtEveryLevel) {
  for (const char* name : {"turboquant_4bit_nc", "tq-k4v2", "turboquant_3bit_nc", "tq-k3v2", "tq-k2v2", "k5v4", "k5v2",
                           "k6v6", "k7v2", "k8v4"})
    for (int d : {64, 128, 256}) {
      check({name, d, 2, 8, 300, 1, 1.0f});   // decode, GQA 4:1
      check({name, d, 1, 3, 200, 7, 2.0f});   // causal chunk, GQA 3:1, larger scores
    }
  check({"tq-k4v2", 96, 2, 4, 150, 2, 1.0f});  // 96: no int8 block on AVX-512 / AVX2 (scalar only)
}

// The switch: exact scores equal the reference within the kernels' fp32 error, int8 not.
TEST(Int8Scores, ExactSwitchRestoresReferenceParity) {
  const ContiguousCache cache = filled_cache("turboquant_4bit_nc", 2, 128, 256, 1, nullptr);
  const auto q = gaussian(8 * 128, 3);
  AttentionParams p;
  p.n_q_heads = 8;
  std::vector<float> ref(q.size()), exact(q.size()), int8(q.size());
  attention_reference(cache, 0, q.data(), 1, 255, p, ref.data());
  testing_util::ScoresGuard guard(KeyScores::Exact);
  attention(cache, 0, q.data(), 1, 255, p, exact.data());
  set_key_scores(KeyScores::Int8);
  attention(cache, 0, q.data(), 1, 255, p, int8.data());
  EXPECT_LT(rel_error(exact, ref), 1e-5);
  EXPECT_GT(rel_error(int8, ref), 1e-5);
  // A non-finite query row (not checked by attention) leaves the other rows as they were and
  // rounds nothing out of int range (its int8 scores are NaN, UBSan-clean).
  auto bad = q;
  bad[5] = NAN;
  bad[128 + 7] = INFINITY;
  std::vector<float> out(q.size());
  attention(cache, 0, bad.data(), 1, 255, p, out.data());
  for (size_t i = 2 * 128; i < q.size(); ++i) ASSERT_EQ(out[i], int8[i]) << i;
  EXPECT_EQ(parse_key_scores("exact"), KeyScores::Exact);
  EXPECT_EQ(parse_key_scores("int8"), KeyScores::Int8);
  EXPECT_THROW(parse_key_scores("fp8"), Error);
}

// 6-bit values take two-byte int8 levels where the build has them (scalar, AVX2, AVX-512 with
// VNNI + VBMI: Int8 differs from Int8Keys' fp32 sums, by little) and stay fp32 where it does
// not (AVX-512 without them: bit for bit).
TEST(Int8Scores, SixBitValuesTakeTwoByteLevelsWhereTheBuildHasThem) {
  const ContiguousCache cache = filled_cache("k6v6", 2, 128, 200, 5, nullptr);
  const auto q = gaussian(8 * 128, 7);
  AttentionParams p;
  p.n_q_heads = 8;
  testing_util::LevelGuard levels;
  for (SimdLevel level : testing_util::supported_levels()) {
    set_simd_level(level);
    std::vector<float> keys(q.size()), int8(q.size());
    testing_util::ScoresGuard guard(KeyScores::Int8Keys);
    attention(cache, 0, q.data(), 1, 199, p, keys.data());
    set_key_scores(KeyScores::Int8);
    attention(cache, 0, q.data(), 1, 199, p, int8.data());
    if (level == SimdLevel::Avx512 && !testing_util::avx512_has_int8()) {
      EXPECT_EQ(int8, keys);
    } else {
      EXPECT_NE(int8, keys) << simd_level_name(level);
      EXPECT_LT(testing_util::rel_error(int8, keys), 1e-2) << simd_level_name(level);
    }
  }
}

}  // namespace
}  // namespace tqkv
