// FP8 E4M3 ("e4m3fn": bias 7, no infinities, 0x7f/0xff are NaN, max 448).
// Encoding rounds to nearest even and saturates to +-448 (the cache codecs reject inputs
// beyond 448 before they get here); NaN encodes to 0x7f. Decoding is exact.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>

namespace tqkv {

inline constexpr float kFp8E4m3Max = 448.0f;

constexpr float fp8_e4m3_to_float(uint8_t b) {
  const bool neg = (b & 0x80u) != 0;
  const uint32_t exp = (b >> 3) & 0xfu;
  const uint32_t mant = b & 0x7u;
  float v;
  if (exp == 0xfu && mant == 0x7u) {
    v = std::bit_cast<float>(0x7fc00000u);
  } else if (exp == 0) {
    v = static_cast<float>(mant) * (1.0f / 512.0f);  // subnormal: mant * 2^-9
  } else {
    v = std::bit_cast<float>(((exp + 120u) << 23) | (mant << 20));
  }
  return neg ? -v : v;
}

constexpr uint8_t float_to_fp8_e4m3(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7f;                 // NaN
  if (abs >= 0x43e00000u) return sign | 0x7e;          // >= 448 (and inf): saturate
  if (abs >= 0x3c800000u) {                            // >= 2^-6: normal range
    const uint32_t rounded = abs + 0x7ffffu + ((abs >> 20) & 1u);
    const uint32_t r = (rounded - 0x3c000000u) >> 20;  // rebias 127 -> 7
    return static_cast<uint8_t>(sign | (r > 0x7eu ? 0x7eu : r));
  }
  // Subnormal (and zero): value / 2^-9, rounded to nearest even integer 0..8.
  const float scaled = std::bit_cast<float>(abs) * 512.0f;
  uint32_t q = static_cast<uint32_t>(scaled);
  const float rem = scaled - static_cast<float>(q);
  if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
  return static_cast<uint8_t>(sign | q);  // q == 8 is exactly the smallest normal (0x08)
}

}  // namespace tqkv
