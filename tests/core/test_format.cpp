#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <utility>
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
  EXPECT_EQ(find_format(kDefaultFormat).name(), "tq-k4v2");
  const Format f = find_format("tq-k4v2");
  EXPECT_EQ(f.key_bits, 4);
  EXPECT_EQ(f.value_bits, 2);
  EXPECT_EQ(f.key_bytes(128), 66u);
  EXPECT_EQ(f.value_bytes(128), 34u);
  EXPECT_EQ(f.slot_bytes(128), 100u);
  for (const char* n : {"tq-k3v2", "tq-k4v3", "tq-k4v4"}) EXPECT_NO_THROW(find_format(n));
  EXPECT_EQ(mse_pair_format(3, 2), find_format("tq-k3v2"));
  EXPECT_EQ(mse_pair_format(5, 2).name(), "k5v2");
  EXPECT_EQ(mse_pair_format(2, 3).name(), "tq-k2v3");  // one of the nine named pairs
  for (auto [kb, vb] : {std::pair{0, 2}, {9, 2}, {4, 0}, {4, 9}}) {
    try {
      mse_pair_format(kb, vb);
      FAIL() << "expected an exception for K" << kb << "/V" << vb;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    }
  }
}

TEST(Format, SlotsAreEvenAndOffsetsConsistent) {
  for (const NamedFormat& nf : named_formats())
    for (int d : {64, 96, 128, 160, 256, 30}) {
      const Format& f = nf.format;
      EXPECT_EQ(f.slot_bytes(d) % 2, 0u) << nf.name;
      EXPECT_GE(f.slot_bytes(d), f.key_bytes(d) + f.value_bytes(d));
      EXPECT_LE(f.slot_bytes(d), f.key_bytes(d) + f.value_bytes(d) + 1);
    }
}

TEST(Format, UnknownNameListsValidOnes) {
  try {
    find_format("turboquant_5bit");
    FAIL() << "expected an exception";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("turboquant_5bit"), std::string::npos);
    for (const NamedFormat& f : named_formats()) EXPECT_NE(msg.find(f.name), std::string::npos) << f.name;
    EXPECT_NE(msg.find("k<K>v<V>"), std::string::npos);
  }
}

TEST(Format, NamedFormatsInOrder) {
  const std::vector<std::string> expected = {"f32", "f16", "bf16", "fp8", "turboquant_k8v4", "turboquant_4bit_nc",
                                             "turboquant_k3v4_nc", "turboquant_3bit_nc", "tq-k4v2", "tq-k3v2",
                                             "tq-k4v3", "tq-k4v4"};
  ASSERT_EQ(named_formats().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(named_formats()[i].name, expected[i]);
    EXPECT_EQ(named_formats()[i].format.name(), expected[i]);
    EXPECT_EQ(named_formats()[i].format.summary(), named_formats()[i].summary);
  }
  EXPECT_EQ(format_names_joined(","), "f32,f16,bf16,fp8,turboquant_k8v4,turboquant_4bit_nc,turboquant_k3v4_nc,"
                                      "turboquant_3bit_nc,tq-k4v2,tq-k3v2,tq-k4v3,tq-k4v4");
  for (int k = 2; k <= 4; ++k)
    for (int v = 2; v <= 4; ++v) {
      const std::string n = "tq-k" + std::to_string(k) + "v" + std::to_string(v);
      const NamedFormat* nf = find_named_format(n);
      ASSERT_NE(nf, nullptr) << n;
      EXPECT_EQ(nf->format, mse_pair_format(k, v));
      EXPECT_EQ(mse_pair_format(k, v).name(), n);
    }
  EXPECT_EQ(find_named_format("k5v4"), nullptr);
  EXPECT_EQ(Format{}.name(), "f16");  // the default value is f16
  EXPECT_EQ(mse_pair_format(5, 4).summary(), "variant");
}

TEST(Format, RoundTripOfNamedFormats) {
  for (const NamedFormat& nf : named_formats()) {
    const Format f = Format::parse(nf.name);
    EXPECT_EQ(f, nf.format) << nf.name;
    EXPECT_EQ(f.name(), nf.name);
    EXPECT_EQ(Format::parse(f.name()), f) << nf.name;
  }
}

// Every variant of the grammar: name() is canonical and parses back to an equal value.
TEST(Format, RoundTripOfVariants) {
  const KeyCodec keys[] = {KeyCodec::F32, KeyCodec::F16, KeyCodec::BF16, KeyCodec::Fp8, KeyCodec::Mse};
  const ValueCodec values[] = {ValueCodec::F32, ValueCodec::F16, ValueCodec::BF16, ValueCodec::Fp8,
                               ValueCodec::Uniform, ValueCodec::Mse};
  auto plain_bits = [](int codec) { return codec == 0 ? 32 : codec == 3 ? 8 : 16; };
  int checked = 0;
  for (KeyCodec kc : keys)
    for (ValueCodec vc : values)
      for (int kb = 1; kb <= 8; ++kb)
        for (int vb = 1; vb <= 8; ++vb)
          for (Law law : {Law::Sphere, Law::Gauss})
            for (RotationKind rot : {RotationKind::Srht, RotationKind::Hadamard, RotationKind::Dense})
              for (bool nc : {true, false}) {
                const bool kmse = kc == KeyCodec::Mse;
                const bool vcoded = vc == ValueCodec::Mse || vc == ValueCodec::Uniform;
                if (!kmse && kb != 1) continue;  // plain sides have one width
                if (!vcoded && vb != 1) continue;
                Format f{kc, static_cast<uint8_t>(kmse ? kb : plain_bits(static_cast<int>(kc))), vc,
                         static_cast<uint8_t>(vcoded ? vb : plain_bits(static_cast<int>(vc))), nc, law, rot};
                const std::string n = f.name();
                const std::optional<Format> back = Format::try_parse(n);
                ASSERT_TRUE(back.has_value()) << n;
                EXPECT_EQ(*back, f) << n;
                EXPECT_EQ(back->name(), n);
                EXPECT_EQ(back->slot_bytes(64), f.slot_bytes(64)) << n;
                ++checked;
              }
  EXPECT_GT(checked, 1000);
}

TEST(Format, VariantSpellings) {
  const Format k5v4 = Format::parse("k5v4");
  EXPECT_EQ(k5v4, (Format{KeyCodec::Mse, 5, ValueCodec::Mse, 4, true, Law::Sphere, RotationKind::Srht}));
  EXPECT_EQ(k5v4.name(), "k5v4");
  EXPECT_EQ(Format::parse("tq-k5v4"), k5v4);
  EXPECT_EQ(Format::parse("k4v2").name(), "tq-k4v2");  // equal to a named format: printed as it
  EXPECT_EQ(Format::parse("kfp8v4+gauss+had+vu+raw").name(), "turboquant_k8v4");
  EXPECT_EQ(Format::parse("kfp8v4+vu").name(), "turboquant_k8v4");  // law etc. do not matter without Mse
  EXPECT_EQ(Format::parse("k4v4+gauss+had+vu").name(), "turboquant_4bit_nc");
  EXPECT_EQ(Format::parse("k3v3+gauss+had+vu").name(), "turboquant_3bit_nc");
  EXPECT_EQ(Format::parse("kf16vf16").name(), "f16");
  EXPECT_EQ(Format::parse("kf32vf32").name(), "f32");
  EXPECT_EQ(Format::parse("kbf16vbf16").name(), "bf16");
  EXPECT_EQ(Format::parse("kfp8vfp8").name(), "fp8");
  EXPECT_EQ(Format::parse("k6vf16").name(), "k6vf16");
  EXPECT_EQ(Format::parse("kf16v3").name(), "kf16v3");
  EXPECT_EQ(Format::parse("k3v3+raw+gauss").name(), "k3v3+gauss+raw");  // canonical order
  const Format g = Format::parse("k4v3+gauss+had+vu+raw");
  EXPECT_EQ(g.law, Law::Gauss);
  EXPECT_EQ(g.rotation, RotationKind::Hadamard);
  EXPECT_EQ(g.value, ValueCodec::Uniform);
  EXPECT_FALSE(g.norm_correction);
  EXPECT_EQ(g.name(), "k4v3+gauss+had+vu+raw");
}

TEST(Format, EqualityIgnoresFieldsNoCodecUses) {
  const Format a{KeyCodec::Fp8, 8, ValueCodec::Uniform, 4, false, Law::Gauss, RotationKind::Hadamard};
  const Format b{KeyCodec::Fp8, 8, ValueCodec::Uniform, 4, true, Law::Sphere, RotationKind::Srht};
  EXPECT_EQ(a, b);
  EXPECT_EQ(b.name(), "turboquant_k8v4");
  EXPECT_EQ(find_format("f16"), (Format{KeyCodec::F16, 16, ValueCodec::F16, 16, true, Law::Sphere, RotationKind::Dense}));
  // With an Mse side every field counts.
  const Format m = mse_pair_format(4, 2);
  Format m2 = m;
  m2.law = Law::Gauss;
  EXPECT_NE(m, m2);
  m2 = m;
  m2.rotation = RotationKind::Hadamard;
  EXPECT_NE(m, m2);
  m2 = m;
  m2.norm_correction = false;
  EXPECT_NE(m, m2);
  m2 = m;
  m2.value_bits = 3;
  EXPECT_NE(m, m2);
  // Uniform values with Mse keys: the keys' law still counts.
  EXPECT_NE(find_format("turboquant_4bit_nc"), Format::parse("k4v4+vu"));
}

TEST(Format, BadSpellingsThrow) {
  for (const char* bad : {"", "k", "kv", "k4", "k4v", "k0v4", "k9v4", "k4v9", "k10v4", "k4v10", "k4v4+", "k4v4+foo",
                          "k4v4+gauss+gauss", "k4v4+had+had", "k4v4+vu+vu", "k4v4+raw+raw", "kfp8vfp8+vu", "K4V4",
                          "tq-", "tq-k4", "k4v4 ", "kf8v4", "kfp16v4", "k4vu4", "turboquant_5bit", "f17", "k4v4gauss"}) {
    EXPECT_FALSE(Format::try_parse(bad).has_value()) << bad;
    try {
      Format::parse(bad);
      ADD_FAILURE() << "expected an exception for '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << bad;
      EXPECT_NE(std::string(e.what()).find("f16"), std::string::npos) << bad;
    }
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
