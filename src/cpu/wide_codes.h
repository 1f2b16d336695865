// Unpacking tables for 5-8-bit codes in the SIMD kernels (internal, shared by AVX2 / AVX-512).
//
// `lanes` codes of B bits sit in lanes * B / 8 bytes, which both kernels broadcast to every
// 128-bit lane. Code k starts at bit B*k: byte B*k/8, shift B*k%8, and shift + B <= 15, so a
// byte shuffle that moves those two bytes into 32-bit lane k (ctl) and a variable right shift
// (shift) put the code at bit 0. Bits above B then hold neighbours, which the table lookups
// mask or ignore.
#pragma once
#include <cstdint>

namespace tqkv::cpu {

template <int Lanes>
struct WideCodeTables {
  int8_t ctl[4 * Lanes];  // byte-shuffle control: -128 (high bit set) writes a zero byte
  int32_t shift[Lanes];
};

template <int B, int Lanes>
constexpr WideCodeTables<Lanes> wide_code_tables() {
  static_assert(B >= 5 && B <= 8 && Lanes * B <= 128, "5-8-bit codes within one 128-bit lane");
  WideCodeTables<Lanes> t{};
  for (int k = 0; k < Lanes; ++k) {
    const int byte = B * k / 8, sh = B * k % 8;
    t.ctl[4 * k] = static_cast<int8_t>(byte);
    t.ctl[4 * k + 1] = sh + B > 8 ? static_cast<int8_t>(byte + 1) : static_cast<int8_t>(-128);
    t.ctl[4 * k + 2] = t.ctl[4 * k + 3] = static_cast<int8_t>(-128);
    t.shift[k] = sh;
  }
  return t;
}

}  // namespace tqkv::cpu
