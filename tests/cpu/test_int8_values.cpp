// Int8 value sums (tqkv/simd.h KeyScores::Int8; kernel.h, kernel_impl.h "Int8 values"): the
// contract recomputed from the codes, the same integers at every level that has the path, the
// error bound their rounding implies, the switch, and non-finite rows.
//
// The bound. A tile's weights w_j = e_j f_j (e_j = exp(s_j - m), f_j the value's scale) are
// rounded to w'_j = u8_j * mx / 255 (mx the tile's largest), so |w'_j - w_j| <= mx / 510 <= M / 510
// with M = max_j w_j over all keys (every tile shares the normalisation of its own max). The
// levels c_j (Mse: L[code], Uniform: code - mid) become c'_j = step * L8[code]. In the value
// domain (rotations are orthonormal), with l = sum_j e_j,
//   ||o' - o|| <= (M / 510 * sum_j ||c'_j|| + sum_j w_j ||c'_j - c_j||) / l.
#include <gtest/gtest.h>

#include "../common/test_data.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "tqkv/attention.h"
#include "tqkv/bitpack.h"
#include "tqkv/half.h"
#include "tqkv/simd.h"

namespace tqkv {
namespace {

using testing_util::gaussian;
using testing_util::rel_error;

// Whether the kernel at `level` sums `bits`-bit values in int8 (kernel-*.cpp, isa-avx512.h:
// i8v_block): 2-6 bits on every build that has the path (AVX-512: with VNNI + VBMI).
bool level_has_int8_values(SimdLevel level, int d, int bits) {
  switch (level) {
    case SimdLevel::Scalar: return true;
    case SimdLevel::Avx2: return d % 32 == 0;
    case SimdLevel::Avx512: return testing_util::avx512_has_int8() && d % 64 == 0 && bits <= 6;
  }
  return false;
}

using testing_util::filled_cache;

// A value as the int8 path sees it: scale f, zero point z (Uniform: zero + f * mid, else 0),
// exact levels c and int8 levels L8 [d] (c' = step * L8), from the value's bytes.
struct IntValue {
  double f = 0, z = 0;
  std::vector<double> c;
  std::vector<int> l8;
};

struct ValueTable {
  float step = 0;
  std::vector<int> l8;  // [2^bits]
};

// The kernel's int8 level table (attention_driver.cpp), rebuilt here.
ValueTable value_table(const SlotCodec& codec) {
  const Format& f = codec.format();
  const int n = 1 << f.value_bits;
  ValueTable t;
  if (f.value == ValueCodec::Uniform) {
    t.step = 0.5f;
    for (int j = 0; j < n; ++j) t.l8.push_back(2 * j - (n - 1));
  } else {  // 6 bits: two-byte levels, a grid 64 times finer (kernel.h value_wide)
    const Codebook& cb = *codec.value_codebook();
    float amax = 0;
    for (float x : cb.levels_f32) amax = std::max(amax, std::fabs(x));
    t.step = amax / (f.value_bits == 6 ? 64.0f * 63.0f : 63.0f);
    for (int j = 0; j < n; ++j) t.l8.push_back(static_cast<int>(std::nearbyint(cb.levels_f32[j] / t.step)));
  }
  return t;
}

std::vector<IntValue> int_values(const SlotCodec& codec, const std::vector<float>& v, int H, int T, int kvh) {
  const Format& f = codec.format();
  const int d = codec.dim(), n = 1 << f.value_bits;
  const ValueTable t = value_table(codec);
  std::vector<IntValue> out(T);
  std::vector<uint8_t> bytes(codec.value_bytes());
  for (int j = 0; j < T; ++j) {
    codec.encode_value(v.data() + (static_cast<size_t>(j) * H + kvh) * d, bytes.data());
    const size_t at = f.value_code_bytes(d);
    uint16_t h;
    std::memcpy(&h, bytes.data() + at, 2);
    IntValue& x = out[j];
    x.f = half_to_float(h);
    if (f.value == ValueCodec::Uniform) {
      std::memcpy(&h, bytes.data() + at + 2, 2);
      x.z = static_cast<double>(half_to_float(h) + static_cast<float>(x.f) * (0.5f * static_cast<float>(n - 1)));
    }
    for (int c = 0; c < d; ++c) {
      const unsigned code = unpack_one(bytes.data(), c, f.value_bits);
      x.c.push_back(f.value == ValueCodec::Uniform ? code - 0.5 * (n - 1) : codec.value_codebook()->levels_f32[code]);
      x.l8.push_back(t.l8[code]);
    }
  }
  return out;
}

double norm2(const std::vector<double>& x) {
  return std::sqrt(std::inner_product(x.begin(), x.end(), x.begin(), 0.0));
}

// The contract in double, with zero queries (every score 0, so every weight is the value's
// fp16 scale in every build, and the u8 rounding is the same float arithmetic here): a causal
// chunk of n_q tokens, G query heads per kv head, one run of tiles of 64 from position 0.
void check_contract(const char* name, int d, int G, int T, int n_q) {
  const int H = 2, Hq = H * G;
  std::vector<float> v;
  const ContiguousCache cache = filled_cache(name, H, d, T, 41, nullptr, &v);
  const SlotCodec& codec = cache.codec(0);
  const float step = value_table(codec).step;
  const int64_t pos0 = T - n_q;
  std::vector<float> want(static_cast<size_t>(n_q) * Hq * d);
  for (int kvh = 0; kvh < H; ++kvh) {
    const auto iv = int_values(codec, v, H, T, kvh);
    for (int t = 0; t < n_q; ++t) {
      const int n_vis = static_cast<int>(pos0 + t + 1);
      std::vector<double> o(d);
      double zs = 0;
      for (int j0 = 0; j0 < n_vis; j0 += 64) {
        const int nt = std::min(64, n_vis - j0);
        float mx = 0;
        for (int j = j0; j < j0 + nt; ++j) mx = std::max(mx, static_cast<float>(iv[j].f));
        if (!(mx > 0)) continue;
        const float inv = 255.0f / mx, s_w = mx / 255.0f * step;
        std::vector<long long> sum(d);
        for (int j = j0; j < j0 + nt; ++j) {
          const auto u8 = static_cast<long long>(std::min(255.0f, std::nearbyint(static_cast<float>(iv[j].f) * inv)));
          for (int c = 0; c < d; ++c) sum[c] += u8 * iv[j].l8[c];
        }
        for (int c = 0; c < d; ++c) o[c] += static_cast<double>(s_w) * static_cast<double>(sum[c]);
      }
      for (int j = 0; j < n_vis; ++j) zs += iv[j].z;
      std::vector<float> of(d);
      for (int c = 0; c < d; ++c) of[c] = static_cast<float>((o[c] + zs) / n_vis);
      if (codec.format().values_rotated()) codec.rotation().inverse(of.data());
      for (int g = 0; g < G; ++g)
        std::copy(of.begin(), of.end(), want.begin() + ((static_cast<size_t>(t) * Hq) + kvh * G + g) * d);
    }
  }
  const std::vector<float> q(want.size(), 0.0f);
  AttentionParams p;
  p.n_q_heads = Hq;
  testing_util::LevelGuard guard;
  set_attention_parallel_threshold(1LL << 40);  // one thread, one run: the tiles above
  testing_util::ScoresGuard int8(KeyScores::Int8);
  std::vector<float> scalar_out;
  for (SimdLevel level : testing_util::supported_levels()) {
    if (!level_has_int8_values(level, d, codec.format().value_bits)) continue;
    set_simd_level(level);
    std::vector<float> out(q.size(), NAN);
    attention(cache, 0, q.data(), n_q, pos0, p, out.data());
    EXPECT_LT(rel_error(out, want), 1e-5) << name << " d " << d << " G " << G << " " << simd_level_name(level);
    // The same integers at every level: equal to the scalar kernel's sums up to fp32 rounding.
    if (level == SimdLevel::Scalar)
      scalar_out = out;
    else
      EXPECT_LT(rel_error(out, scalar_out), 1e-6) << name << " d " << d << " " << simd_level_name(level);
  }
}

TEST(Int8Values, EveryLevelComputesTheContract) {
  for (const char* name : {"turboquant_4bit_nc", "turboquant_3bit_nc", "tq-k4v2", "tq-k2v3", "tq-k3v4", "k2v5", "k6v5", "k2v6",
                           "k6v6"})
    for (int d : {64, 128, 256}) {
      for (int G : {1, 4, 6}) check_contract(name, d, G, 203, 3);  // 203: tile tails of 9-11 keys
      check_contract(name, d, 7, 203, 1);  // 7 rows: passes of 3, 2, 2 (AVX2); 12, 18: of 3
    }
}

// Random queries on keys scored exactly (fp8, f16): every level within the bound above
// of the exact reference, the int8 levels equal to the scalar kernel's.
void check_bound(const char* name, int d, int H, int Hq, int T, int n_q, float sigma_q) {
  const Format f = find_format(name);
  std::vector<float> v;
  const ContiguousCache cache = filled_cache(name, H, d, T, 51, nullptr, &v);
  const SlotCodec& codec = cache.codec(0);
  const int G = Hq / H;
  const auto q = gaussian(static_cast<size_t>(n_q) * Hq * d, 53, sigma_q);
  const int64_t pos0 = T - n_q;
  AttentionParams p;
  p.n_q_heads = Hq;
  std::vector<float> ref(q.size());
  attention_reference(cache, 0, q.data(), n_q, pos0, p, ref.data());
  std::vector<float> kd(static_cast<size_t>(T) * H * d);
  cache.decode(0, 0, T, true, kd.data());
  const float step = value_table(codec).step;

  std::vector<double> bound(static_cast<size_t>(n_q) * Hq);
  for (int kvh = 0; kvh < H; ++kvh) {
    const auto iv = int_values(codec, v, H, T, kvh);
    std::vector<double> c_int(T), c_err(T);  // ||c'_j||, ||c'_j - c_j||
    for (int j = 0; j < T; ++j) {
      std::vector<double> ci(d), ce(d);
      for (int c = 0; c < d; ++c) {
        ci[c] = static_cast<double>(step) * iv[j].l8[c];
        ce[c] = ci[c] - iv[j].c[c];
      }
      c_int[j] = norm2(ci);
      c_err[j] = norm2(ce);
    }
    for (int t = 0; t < n_q; ++t)
      for (int g = 0; g < G; ++g) {
        const int h = kvh * G + g;
        const size_t row = static_cast<size_t>(t) * Hq + h;
        const int n_vis = static_cast<int>(pos0 + t + 1);
        std::vector<double> s(n_vis);
        double m = -1e300;
        for (int j = 0; j < n_vis; ++j) {
          double dot = 0;
          for (int c = 0; c < d; ++c)
            dot += static_cast<double>(q[row * d + c]) * kd[(static_cast<size_t>(j) * H + kvh) * d + c];
          s[j] = dot / std::sqrt(static_cast<double>(d));
          m = std::max(m, s[j]);
        }
        double l = 0, big = 0, a = 0, b = 0;
        for (int j = 0; j < n_vis; ++j) {
          const double e = std::exp(s[j] - m);
          l += e;
          big = std::max(big, e * iv[j].f);
          a += c_int[j];
          b += e * iv[j].f * c_err[j];
        }
        bound[row] = 1.01 * (big / 510 * a + b) / l;  // 1.01: float scores and steps vs double here
      }
  }

  testing_util::LevelGuard guard;
  testing_util::ScoresGuard int8(KeyScores::Int8);
  std::vector<float> scalar_out;
  for (SimdLevel level : testing_util::supported_levels()) {
    set_simd_level(level);
    std::vector<float> out(q.size(), NAN);
    attention(cache, 0, q.data(), n_q, pos0, p, out.data());
    double err_max = 0;
    for (size_t row = 0; row < bound.size(); ++row) {
      double err = 0, ref2 = 0;
      for (int c = 0; c < d; ++c) {
        const double x = static_cast<double>(out[row * d + c]) - ref[row * d + c];
        err += x * x;
        ref2 += static_cast<double>(ref[row * d + c]) * ref[row * d + c];
      }
      err = std::sqrt(err);
      EXPECT_LE(err, bound[row] + 1e-5 * std::sqrt(ref2))
          << name << " d " << d << " level " << simd_level_name(level) << " row " << row;
      err_max = std::max(err_max, err);
    }
    if (level_has_int8_values(level, d, f.value_bits)) {
      EXPECT_GT(err_max, 1e-6) << "int8 values not in use: " << name << " level " << simd_level_name(level);
      if (level == SimdLevel::Scalar)
        scalar_out = out;
      else  // the same integers up to exp's last bit between builds, where a u8 may round the other way
        EXPECT_LT(rel_error(out, scalar_out), 2e-3) << name << " d " << d << " " << simd_level_name(level);
    }
  }
  (void)f;
}

TEST(Int8Values, WithinTheRoundingBoundAtEveryLevel) {
  for (const char* name : {"turboquant_k8v4", "kf16v2", "kfp8v3", "kf16v5", "kfp8v5", "kf16v6"})
    for (int d : {64, 128, 256}) {
      check_bound(name, d, 2, 8, 300, 1, 1.0f);  // decode, GQA 4:1
      check_bound(name, d, 1, 3, 200, 7, 2.0f);  // causal chunk, GQA 3:1, sharper weights
    }
  check_bound("kf16v2", 96, 2, 4, 150, 2, 1.0f);  // 96: no int8 block on AVX-512 (scalar, AVX2)
}

// The switch: Int8Keys keeps fp32 value sums (equal to Exact on exactly scored keys), Int8 not.
// A corrupt value scale (Inf, negative) makes its kv head's rows NaN, not wrong numbers, and
// leaves the other rows alone (a non-finite query row: Int8Scores.ExactSwitch..., which runs
// int8 values too).
void check_switch_and_non_finite() {
  ContiguousCache cache = filled_cache("turboquant_k8v4", 2, 128, 256, 1, nullptr);
  const auto q = gaussian(8 * 128, 3);
  AttentionParams p;
  p.n_q_heads = 8;
  std::vector<float> exact(q.size()), keys(q.size()), int8(q.size());
  testing_util::ScoresGuard guard(KeyScores::Exact);
  attention(cache, 0, q.data(), 1, 255, p, exact.data());
  set_key_scores(KeyScores::Int8Keys);
  attention(cache, 0, q.data(), 1, 255, p, keys.data());
  set_key_scores(KeyScores::Int8);
  attention(cache, 0, q.data(), 1, 255, p, int8.data());
  EXPECT_EQ(keys, exact);  // fp8 keys: no int8 scores
  if (level_has_int8_values(active_simd_level(), 128, 4)) {
    EXPECT_GT(rel_error(int8, exact), 1e-6);
  }
  EXPECT_LT(rel_error(int8, exact), 1e-2);
  std::vector<float> out(q.size());
  const Format& f = cache.codec(0).format();
  auto* scale = const_cast<uint8_t*>(cache.slot(0, 0, 10)) + f.key_bytes(128) + f.value_code_bytes(128);
  for (uint16_t h : {uint16_t{0x7c00}, uint16_t{0xbc00}}) {  // +Inf, -1
    std::memcpy(scale, &h, 2);
    attention(cache, 0, q.data(), 1, 255, p, out.data());
    for (size_t i = 0; i < 4 * 128; ++i) ASSERT_TRUE(std::isnan(out[i])) << h << " " << i;
    for (size_t i = 4 * 128; i < q.size(); ++i) ASSERT_EQ(out[i], int8[i]) << i;
  }
  EXPECT_EQ(parse_key_scores("int8-keys"), KeyScores::Int8Keys);
  EXPECT_EQ(key_scores_name(KeyScores::Int8Keys), "int8-keys");
}

TEST(Int8Values, SwitchAndNonFiniteRows) {
  testing_util::LevelGuard level_guard;
  for (SimdLevel level : testing_util::supported_levels()) {
    SCOPED_TRACE(std::string(simd_level_name(level)));
    set_simd_level(level);
    check_switch_and_non_finite();
  }
}

}  // namespace
}  // namespace tqkv
