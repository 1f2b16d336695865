// IEEE binary16 (fp16) and bfloat16 conversions, round-to-nearest-even.
// Scalar and exact; used for slot metadata and the uncompressed caches.
#pragma once
#include <bit>
#include <cstdint>

namespace tqkv {

// float -> fp16 bits, round to nearest even; overflow gives +-inf, NaN stays NaN.
constexpr uint16_t float_to_half(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (abs >= 0x38800000u) {  // normal fp16 range
    const uint32_t mant_round = abs + 0xfffu + ((abs >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((mant_round - 0x38000000u) >> 13));
  }
  if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // below half the smallest subnormal
  // Subnormal fp16: shift the 24-bit significand into place, round to nearest even.
  const uint32_t e = abs >> 23;
  const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  const uint32_t half_ulp = 1u << (shift - 1);
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  if (rem > half_ulp || (rem == half_ulp && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

constexpr float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return std::bit_cast<float>(sign);
  // Subnormal: value = mant * 2^-24, exact in float.
  const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
  return sign ? -v : v;
}

// Rounds a float to the nearest fp16 value (as a float).
constexpr float round_to_half(float f) { return half_to_float(float_to_half(f)); }

constexpr uint16_t float_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

constexpr float bf16_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

inline constexpr float kHalfMax = 65504.0f;

}  // namespace tqkv
