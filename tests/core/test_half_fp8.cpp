#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "tqkv/fp8.h"
#include "tqkv/half.h"

namespace tqkv {
namespace {

TEST(Half, AllFiniteCodesRoundTrip) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_half(f), h) << std::hex << h;
  }
}

TEST(Half, RoundsToNearestEven) {
  EXPECT_EQ(float_to_half(1.0f + 1.0f / 2048), 0x3c00);          // halfway, even stays
  EXPECT_EQ(float_to_half(1.0f + 3.0f / 2048), 0x3c02);          // halfway, odd rounds up
  EXPECT_EQ(float_to_half(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_half(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_half(65520.0f), 0x7c00);                    // overflow -> inf
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -24)), 0x0001);       // smallest subnormal
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -25)), 0x0000);       // tie to even -> 0
  EXPECT_EQ(float_to_half(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Bf16, RoundTripAndRounding) {
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f)), 1.0f);
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);  // tie to even
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(3.0f, -8)), 0x3f82);
}

// Reference decode of E4M3 written independently of the header, from the definition.
double e4m3_value(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

TEST(Fp8E4m3, AllCodesDecodeAndRoundTrip) {
  for (int b = 0; b < 256; ++b) {
    const float f = fp8_e4m3_to_float(static_cast<uint8_t>(b));
    if ((b & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << b;
      continue;
    }
    EXPECT_EQ(static_cast<double>(f), e4m3_value(static_cast<uint8_t>(b))) << b;
    const uint8_t back = float_to_fp8_e4m3(f);
    if (b == 0x80) {
      EXPECT_EQ(back, 0x80);  // -0 keeps its sign
    } else {
      EXPECT_EQ(back, b) << b;
    }
  }
}

TEST(Fp8E4m3, RoundToNearestEvenAndSaturate) {
  // Brute force: every float on a fine grid maps to the nearest code, ties to even mantissa.
  for (int i = -460 * 64; i <= 460 * 64; ++i) {
    const float x = i / 64.0f;
    const uint8_t got = float_to_fp8_e4m3(x);
    double best = 1e30;
    int best_code = -1;
    for (int b = 0; b < 256; ++b) {
      if ((b & 0x7f) == 0x7f) continue;
      const double val = e4m3_value(static_cast<uint8_t>(b));
      const double err = std::abs(val - std::min<double>(std::max<double>(x, -448), 448));
      const bool tie = best_code >= 0 && std::abs(err - best) <= 1e-12 && val != e4m3_value(best_code);
      if (err < best - 1e-12 || (tie && (b & 1) == 0)) {
        best = err;
        best_code = b;
      }
    }
    ASSERT_EQ(fp8_e4m3_to_float(got), e4m3_value(static_cast<uint8_t>(best_code))) << x;
  }
  EXPECT_EQ(float_to_fp8_e4m3(1e9f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(-1e9f), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal: tie to 0
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(3.0f, -10)), 0x02);  // 1.5 ulp: tie to even (2)
}

}  // namespace
}  // namespace tqkv
