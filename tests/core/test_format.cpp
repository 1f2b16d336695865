#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "tqkv/codec.h"
#include "tqkv/error.h"
#include "tqkv/format.h"
#include "tqkv/half.h"

namespace tqkv {
namespace {

TEST(Format, VllmPresetSlotSizes) {
  struct Row {
    const char* name;
    size_t s128, s64;
  };
  for (const Row& r : {Row{"turboquant_k8v4", 196, 100}, Row{"turboquant_4bit_nc", 134, 70},
                       Row{"turboquant_k3v4_nc", 118, 62}, Row{"turboquant_3bit_nc", 102, 54}}) {
    EXPECT_EQ(find_format(r.name).slot_bytes(128), r.s128) << r.name;
    EXPECT_EQ(find_format(r.name).slot_bytes(64), r.s64) << r.name;
  }
  EXPECT_DOUBLE_EQ(find_format("turboquant_4bit_nc").bits_per_element(64), 4.375);
  EXPECT_DOUBLE_EQ(find_format("turboquant_3bit_nc").bits_per_element(64), 3.375);
}

TEST(Format, SpecPairsAndDefault) {
  EXPECT_STREQ(find_format(kDefaultFormat).name, "tq-k4v2");
  const Format& f = find_format("tq-k4v2");
  EXPECT_EQ(f.key_bits, 4);
  EXPECT_EQ(f.value_bits, 2);
  EXPECT_EQ(f.key_bytes(128), 66u);
  EXPECT_EQ(f.value_bytes(128), 34u);
  EXPECT_EQ(f.slot_bytes(128), 100u);
  for (const char* n : {"tq-k3v2", "tq-k4v3", "tq-k4v4"}) EXPECT_NO_THROW(find_format(n));
  EXPECT_EQ(&mse_pair_format(3, 2), &find_format("tq-k3v2"));
  EXPECT_THROW(mse_pair_format(5, 2), std::invalid_argument);
}

TEST(Format, SlotsAreEvenAndOffsetsConsistent) {
  for (const Format& f : all_formats())
    for (int d : {64, 96, 128, 160, 256, 30}) {
      EXPECT_EQ(f.slot_bytes(d) % 2, 0u) << f.name;
      EXPECT_GE(f.slot_bytes(d), f.key_bytes(d) + f.value_bytes(d));
      EXPECT_LE(f.slot_bytes(d), f.key_bytes(d) + f.value_bytes(d) + 1);
    }
}

TEST(Format, UnknownNameListsValidOnes) {
  try {
    find_format("turboquant_5bit");
    FAIL() << "expected an exception";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("turboquant_5bit"), std::string::npos);
    for (const Format& f : all_formats()) EXPECT_NE(msg.find(f.name), std::string::npos) << f.name;
  }
}

// Golden bytes derivable by hand. turboquant_k8v4 at d = 16: FP8 keys, 4-bit uniform values.
TEST(Format, GoldenBytesK8V4) {
  const int d = 16;
  const SlotCodec codec(find_format("turboquant_k8v4"), d);
  ASSERT_EQ(codec.slot_bytes(), 16u + 8u + 4u);
  float k[d] = {1.0f, -2.0f, 0.5f, 448.0f, 416.0f, 0.0f, 0.015625f, -0.001953125f,
                1.0625f, 1.125f, 3.0f, -0.75f, 240.0f, 0.25f, -1.0f, 2.0f};
  float v[d];
  for (int i = 0; i < d; ++i) v[i] = static_cast<float>(i);  // min 0, max 15 -> scale 1, codes 0..15
  std::vector<uint8_t> slot(codec.slot_bytes(), 0xEE);
  codec.encode(k, v, slot.data());
  const uint8_t expected[] = {
      0x38, 0xC0, 0x30, 0x7E, 0x7D, 0x00, 0x08, 0x81,  // 1, -2, .5, 448, 416, 0, 2^-6, -2^-9
      0x38, 0x39, 0x44, 0xB4, 0x77, 0x28, 0xB8, 0x40,  // 1 (1.0625 ties to even), 1.125, 3, -.75, 240, .25, -1, 2
      0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE,  // codes 0..15, low nibble first
      0x00, 0x3C, 0x00, 0x00,                          // scale fp16(1.0), zero fp16(0.0)
  };
  ASSERT_EQ(sizeof(expected), slot.size());
  for (size_t i = 0; i < slot.size(); ++i) EXPECT_EQ(slot[i], expected[i]) << "byte " << i;
}

// turboquant_4bit_nc at d = 16: key e_0 rotates (plain Hadamard) to y_i = 1/4 = 1/sqrt(d), i.e.
// 1.0 in unit-variance terms, which falls in the Gaussian Lloyd-Max cell of level 0.9424
// (index 11): every key code is 0xB. Norm correction stores 1/|c| = 1/0.9424.
TEST(Format, GoldenBytes4BitNc) {
  const int d = 16;
  const Format& f = find_format("turboquant_4bit_nc");
  const SlotCodec codec(f, d);
  ASSERT_EQ(codec.slot_bytes(), 8u + 2u + 8u + 4u);
  float k[d] = {1.0f}, v[d];
  for (int i = 0; i < d; ++i) v[i] = -1.0f + 0.5f * i;  // min -1, max 6.5 -> scale 0.5
  std::vector<uint8_t> slot(codec.slot_bytes());
  codec.encode(k, v, slot.data());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(slot[i], 0xBB) << i;
  const float stored = half_to_float(static_cast<uint16_t>(slot[8] | (slot[9] << 8)));
  EXPECT_NEAR(stored, 1.0 / 0.9424, 2e-3);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(slot[10 + i], static_cast<uint8_t>((2 * i) | ((2 * i + 1) << 4)));
  EXPECT_EQ(slot[18] | (slot[19] << 8), 0x3800);  // 0.5
  EXPECT_EQ(slot[20] | (slot[21] << 8), 0xBC00);  // -1.0
}

}  // namespace
}  // namespace tqkv
