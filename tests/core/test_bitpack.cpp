#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "tqkv/bitpack.h"

namespace tqkv {
namespace {

TEST(BitPack, PackedSizes) {
  EXPECT_EQ(packed_bytes(128, 4), 64u);
  EXPECT_EQ(packed_bytes(128, 3), 48u);
  EXPECT_EQ(packed_bytes(128, 2), 32u);
  EXPECT_EQ(packed_bytes(64, 3), 24u);
  EXPECT_EQ(packed_bytes(5, 3), 2u);
  EXPECT_EQ(packed_bytes(1, 1), 1u);
}

TEST(BitPack, EveryCodeValueRoundTripsAtEveryWidth) {
  for (int bits = 1; bits <= 8; ++bits) {
    for (int n : {1, 7, 8, 9, 64, 96, 128, 257}) {
      // Cycle through every code value at every position parity.
      for (int offset = 0; offset < (1 << bits); offset += std::max(1, (1 << bits) / 8)) {
        std::vector<uint8_t> codes(n), back(n);
        for (int i = 0; i < n; ++i) codes[i] = static_cast<uint8_t>((i + offset) % (1 << bits));
        std::vector<uint8_t> packed(packed_bytes(n, bits), 0xAB);
        pack_bits(codes.data(), n, bits, packed.data());
        unpack_bits(packed.data(), n, bits, back.data());
        ASSERT_EQ(codes, back) << "bits " << bits << " n " << n;
        for (int i = 0; i < n; ++i) ASSERT_EQ(unpack_one(packed.data(), i, bits), codes[i]);
      }
    }
  }
}

TEST(BitPack, GoldenLayouts) {
  // 4-bit: low nibble first.
  const uint8_t c4[4] = {0x1, 0x2, 0xF, 0x0};
  uint8_t p4[2];
  pack_bits(c4, 4, 4, p4);
  EXPECT_EQ(p4[0], 0x21);
  EXPECT_EQ(p4[1], 0x0F);
  // 2-bit: four per byte, lowest bits first.
  const uint8_t c2[4] = {1, 2, 3, 0};
  uint8_t p2[1];
  pack_bits(c2, 4, 2, p2);
  EXPECT_EQ(p2[0], 0b00111001);
  // 3-bit: eight codes as one little-endian 24-bit integer.
  const uint8_t c3[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  uint8_t p3[3];
  pack_bits(c3, 8, 3, p3);
  uint32_t v = 0;
  for (int j = 0; j < 8; ++j) v |= static_cast<uint32_t>(c3[j]) << (3 * j);
  EXPECT_EQ(p3[0], v & 0xff);
  EXPECT_EQ(p3[1], (v >> 8) & 0xff);
  EXPECT_EQ(p3[2], (v >> 16) & 0xff);
  EXPECT_EQ(p3[0], 0x88);
  EXPECT_EQ(p3[1], 0xC6);
  EXPECT_EQ(p3[2], 0xFA);
}

TEST(BitPack, HighBitsIgnoredAndTrailingBitsZero) {
  const uint8_t codes[3] = {0xFF, 0xF0, 0x0F};
  uint8_t out[2] = {0xAA, 0xAA};
  pack_bits(codes, 3, 3, out);
  EXPECT_EQ(out[0], 0xC7);  // 7 | 0 << 3 | (7 << 6) & 0xff
  EXPECT_EQ(out[1], 0x01);  // bit 8 = top bit of code 2; bits 9..15 zero
}

}  // namespace
}  // namespace tqkv
