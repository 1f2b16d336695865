#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "tqkv/codec.h"
#include "tqkv/error.h"
#include "tqkv/format.h"

namespace tqkv {
namespace {

std::vector<float> gaussian(int n, std::mt19937_64& rng, float sigma = 1.0f) {
  std::normal_distribution<float> g(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = g(rng);
  return v;
}

double sq_norm(const float* x, int d) {
  double s = 0;
  for (int i = 0; i < d; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

// An MSE key/value format without norm correction: its error on random unit vectors is the
// codebook's own expected error.
Format plain_mse(int bits, Law law) {
  return Format{KeyCodec::Mse, static_cast<uint8_t>(bits), ValueCodec::Mse, static_cast<uint8_t>(bits), false, law,
                RotationKind::Srht};
}

TEST(Codec, MseMatchesCodebookOnRandomUnitVectors) {
  const int d = 128, n = 10000;
  for (Law law : {Law::Sphere, Law::Gauss}) {
    for (int b = 1; b <= 4; ++b) {
      const Format f = plain_mse(b, law);
      const SlotCodec codec(f, d, 1234);
      std::mt19937_64 rng(b * 10 + static_cast<int>(law));
      std::vector<uint8_t> key(codec.key_bytes());
      std::vector<float> back(d);
      double err = 0;
      for (int t = 0; t < n; ++t) {
        auto x = gaussian(d, rng);
        const double nrm = std::sqrt(sq_norm(x.data(), d));
        for (auto& v : x) v = static_cast<float>(v / nrm);
        codec.encode_key(x.data(), key.data());
        codec.decode_key(key.data(), back.data());
        for (int i = 0; i < d; ++i) err += std::pow(static_cast<double>(x[i]) - back[i], 2);
      }
      const double measured = err / n;
      const double expected = get_codebook(law, d, b).mse;
      EXPECT_NEAR(measured / expected, 1.0, 0.03) << "law " << law_name(law) << " bits " << b << ": measured "
                                                  << measured << " vs " << expected;
    }
  }
}

TEST(Codec, NormCorrectionRestoresTheNorm) {
  const int d = 128;
  const SlotCodec codec(find_format("turboquant_4bit_nc"), d);
  std::mt19937_64 rng(5);
  std::vector<uint8_t> key(codec.key_bytes());
  std::vector<float> back(d);
  for (int t = 0; t < 100; ++t) {
    auto x = gaussian(d, rng, 3.0f);
    codec.encode_key(x.data(), key.data());
    codec.decode_key(key.data(), back.data());
    EXPECT_NEAR(std::sqrt(sq_norm(back.data(), d)) / std::sqrt(sq_norm(x.data(), d)), 1.0, 1.5e-3);
  }
}

TEST(Codec, UniformValuesWithinHalfAStep) {
  const int d = 64;
  for (const char* name : {"turboquant_4bit_nc", "turboquant_3bit_nc"}) {
    const SlotCodec codec(find_format(name), d);
    std::mt19937_64 rng(9);
    std::vector<uint8_t> val(codec.value_bytes());
    std::vector<float> back(d);
    for (int t = 0; t < 100; ++t) {
      auto v = gaussian(d, rng, 2.0f);
      codec.encode_value(v.data(), val.data());
      codec.decode_value(val.data(), back.data());
      const float lo = *std::min_element(v.begin(), v.end()), hi = *std::max_element(v.begin(), v.end());
      const float step = (hi - lo) / ((1 << codec.format().value_bits) - 1);
      for (int i = 0; i < d; ++i) EXPECT_LE(std::abs(back[i] - v[i]), 0.5f * step * 1.01f + 2e-3f);
    }
  }
}

TEST(Codec, EveryFormatRoundTripsWithSmallError) {
  std::mt19937_64 rng(11);
  for (const NamedFormat& nf : named_formats()) {
    const Format& f = nf.format;
    for (int d : {64, 96, 128}) {
      const SlotCodec codec(f, d);
      std::vector<uint8_t> slot(codec.slot_bytes());
      std::vector<float> kb(d), vb(d);
      double kerr = 0, kref = 0, verr = 0, vref = 0;
      for (int t = 0; t < 200; ++t) {
        auto k = gaussian(d, rng), v = gaussian(d, rng);
        codec.encode(k.data(), v.data(), slot.data());
        codec.decode_key(slot.data(), kb.data());
        codec.decode_value(slot.data() + codec.key_bytes(), vb.data());
        for (int i = 0; i < d; ++i) {
          kerr += std::pow(k[i] - kb[i], 2.0);
          verr += std::pow(v[i] - vb[i], 2.0);
        }
        kref += sq_norm(k.data(), d);
        vref += sq_norm(v.data(), d);
      }
      // Loose per-bit bounds: 2 bits ~ 0.12, 3 bits ~ 0.035, 4 bits ~ 0.01 (+ margin).
      const double kbound = f.key_bits >= 8 ? 2e-3 : f.key_bits == 4 ? 0.015 : f.key_bits == 3 ? 0.05 : 0.15;
      const double vbound = f.value_bits >= 8 ? 2e-3 : f.value_bits == 4 ? 0.02 : f.value_bits == 3 ? 0.06 : 0.15;
      EXPECT_LT(kerr / kref, kbound) << f.name() << " d " << d;
      EXPECT_LT(verr / vref, vbound) << f.name() << " d " << d;
    }
  }
}

TEST(Codec, NonFiniteInputThrowsAndLeavesSlotUntouched) {
  const int d = 64;
  for (const NamedFormat& nf : named_formats()) {
    const Format& f = nf.format;
    const SlotCodec codec(f, d);
    std::vector<float> k(d, 1.0f), v(d, 1.0f);
    std::vector<uint8_t> slot(codec.slot_bytes(), 0x5A);
    const auto before = slot;
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      k[3] = bad;
      try {
        codec.encode(k.data(), v.data(), slot.data());
        FAIL() << f.name();
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::NonFinite);
      }
      k[3] = 1.0f;
      v[5] = bad;
      EXPECT_THROW(codec.encode(k.data(), v.data(), slot.data()), Error) << f.name();
      v[5] = 1.0f;
      EXPECT_EQ(slot, before) << f.name();
    }
  }
}

TEST(Codec, EdgeCases) {
  const int d = 128;
  for (const NamedFormat& nf : named_formats()) {
    const Format& f = nf.format;
    const SlotCodec codec(f, d);
    std::vector<uint8_t> slot(codec.slot_bytes());
    std::vector<float> kb(d), vb(d);
    // All zero decodes to exactly zero.
    std::vector<float> zero(d, 0.0f);
    codec.encode(zero.data(), zero.data(), slot.data());
    codec.decode_key(slot.data(), kb.data());
    codec.decode_value(slot.data() + codec.key_bytes(), vb.data());
    for (int i = 0; i < d; ++i) {
      EXPECT_EQ(kb[i], 0.0f) << f.name();
      EXPECT_EQ(vb[i], 0.0f) << f.name();
    }
    // Constant vectors, large and small magnitudes: finite output, bounded relative error.
    // A constant vector is the worst case of the plain Hadamard rotation (vLLM's choice):
    // H maps it onto one coordinate, which the codebook clips, and norm correction then
    // inflates the stored norm (it can even leave the fp16 range). SRHT's random signs
    // spread it. FP8 has no scale, so 1e-3 is below its resolution (2^-9).
    const bool hadamard_mse_key = f.key == KeyCodec::Mse && f.rotation == RotationKind::Hadamard;
    const bool fp8 = f.key == KeyCodec::Fp8 || f.value == ValueCodec::Fp8;
    for (float c : {0.7f, -3.0f, 2000.0f, 1e-3f}) {
      std::vector<float> x(d, c);
      if (std::abs(c) > 448 && fp8) {
        EXPECT_THROW(codec.encode(x.data(), x.data(), slot.data()), Error) << f.name();
        continue;
      }
      try {
        codec.encode(x.data(), x.data(), slot.data());
      } catch (const Error& e) {
        EXPECT_TRUE(hadamard_mse_key && e.code() == ErrorCode::Overflow) << f.name() << " c=" << c << ": " << e.what();
        continue;
      }
      codec.decode_key(slot.data(), kb.data());
      codec.decode_value(slot.data() + codec.key_bytes(), vb.data());
      double ek = 0, ev = 0;
      for (int i = 0; i < d; ++i) {
        ASSERT_TRUE(std::isfinite(kb[i]) && std::isfinite(vb[i])) << f.name();
        ek += std::pow(kb[i] - c, 2.0);
        ev += std::pow(vb[i] - c, 2.0);
      }
      const double ref = static_cast<double>(c) * c * d;
      const bool below_fp8 = fp8 && std::abs(c) < 0.01f;
      if (!hadamard_mse_key && !below_fp8) {
        EXPECT_LT(ek / ref, 0.3) << f.name() << " c=" << c;
      }
      if (!below_fp8) {
        EXPECT_LT(ev / ref, 0.3) << f.name() << " c=" << c;
      }
    }
  }
}

TEST(Codec, BeyondFp16RangeThrowsOverflow) {
  const int d = 64;
  std::vector<float> big(d, 1e5f), one(d, 1.0f);
  for (const char* name : {"turboquant_4bit_nc", "tq-k4v2", "f16"}) {
    const SlotCodec codec(find_format(name), d);
    std::vector<uint8_t> slot(codec.slot_bytes(), 0x11);
    const auto before = slot;
    try {
      codec.encode(big.data(), one.data(), slot.data());
      FAIL() << name;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Overflow) << name;
    }
    EXPECT_EQ(slot, before);
  }
  // f32 and bf16 have the range.
  const SlotCodec bf(find_format("bf16"), d);
  std::vector<uint8_t> slot(bf.slot_bytes());
  EXPECT_NO_THROW(bf.encode(big.data(), big.data(), slot.data()));
}

TEST(Codec, DotProductsPreserved) {
  const int d = 128;
  const SlotCodec codec(find_format("tq-k4v4"), d);
  std::mt19937_64 rng(21);
  std::vector<uint8_t> key(codec.key_bytes());
  std::vector<float> kb(d);
  double err = 0, ref = 0;
  for (int t = 0; t < 500; ++t) {
    auto q = gaussian(d, rng), k = gaussian(d, rng);
    codec.encode_key(k.data(), key.data());
    codec.decode_key(key.data(), kb.data());
    double a = 0, b = 0;
    for (int i = 0; i < d; ++i) {
      a += static_cast<double>(q[i]) * k[i];
      b += static_cast<double>(q[i]) * kb[i];
    }
    err += (a - b) * (a - b);
    ref += sq_norm(q.data(), d) * sq_norm(k.data(), d) / d;
  }
  EXPECT_LT(err / ref, 0.02);  // 4-bit: ~0.01 of the typical squared dot product
}

}  // namespace
}  // namespace tqkv
