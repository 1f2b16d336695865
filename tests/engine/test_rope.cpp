// RoPE as the GGUF declares it (rope.h, model.cpp): the scaled frequencies' defining properties,
// the metadata that sets them, and every key or tensor the engine does not implement refused by
// name. The numbers themselves are held to transformers by tests/python/test_architectures.py.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "engine/gguf/gguf.h"
#include "engine/model/model.h"
#include "engine/core/rope.h"
#include "gguf_builder.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

RopeParams rope(int n_rot, float base) {
  RopeParams p;
  p.n_rot = n_rot;
  p.base = base;
  return p;
}

TEST(Rope, UnscaledFrequenciesAreBasePowers) {
  const RopeParams p = rope(64, 10000.0f);
  const std::vector<float> f = p.inv_freq();
  ASSERT_EQ(f.size(), 32u);
  for (int i = 0; i < 32; ++i) EXPECT_FLOAT_EQ(f[i], static_cast<float>(std::pow(10000.0, -2.0 * i / 64)));
  EXPECT_EQ(p.mscale(), 1.0f);
}

TEST(Rope, LinearAndLlama3DivideEachPair) {
  RopeParams lin = rope(64, 10000.0f);
  lin.scaling.kind = RopeScaling::Kind::Linear;
  lin.scaling.factor = 4.0;
  RopeParams l3 = rope(64, 10000.0f);
  for (int i = 0; i < 32; ++i) l3.scaling.freq_factors.push_back(1.0f + i);
  const std::vector<float> plain = rope(64, 10000.0f).inv_freq(), a = lin.inv_freq(), b = l3.inv_freq();
  for (int i = 0; i < 32; ++i) {
    EXPECT_FLOAT_EQ(a[i], plain[i] / 4.0f);
    EXPECT_FLOAT_EQ(b[i], plain[i] / (1.0f + i));
  }
  EXPECT_EQ(lin.mscale(), 1.0f);
  EXPECT_EQ(l3.mscale(), 1.0f);
}

// YaRN: the fast pairs (many turns over the original context) keep their frequency, the slow
// ones are divided by the factor, a monotone blend between; cos and sin grow by 0.1 ln(s) + 1.
TEST(Rope, YarnKeepsFastPairsAndInterpolatesSlowOnes) {
  RopeParams p = rope(128, 1e6f);
  p.scaling.kind = RopeScaling::Kind::Yarn;
  p.scaling.factor = 4.0;
  p.scaling.original_context = 32768;
  const std::vector<float> plain = rope(128, 1e6f).inv_freq(), f = p.inv_freq();
  EXPECT_FLOAT_EQ(f[0], plain[0]);
  EXPECT_FLOAT_EQ(f[63], plain[63] / 4.0f);
  double prev = 0;
  for (int i = 0; i < 64; ++i) {
    const double r = plain[i] / f[i];  // 1 (kept) .. 4 (interpolated)
    EXPECT_GE(r, 1.0 - 1e-6);
    EXPECT_LE(r, 4.0 + 1e-5);
    EXPECT_GE(r, prev - 1e-6) << "pair " << i;
    prev = r;
  }
  EXPECT_NEAR(p.mscale(), 0.1 * std::log(4.0) + 1.0, 1e-6);
  p.scaling.attn_factor = 1.25;  // transformers' attention_factor, given
  EXPECT_FLOAT_EQ(p.mscale(), 1.25f);
}

TEST(Rope, InconsistentScalingIsAFormatError) {
  auto bad = [](const std::function<void(RopeParams&)>& edit) {
    RopeParams p = rope(64, 10000.0f);
    edit(p);
    try {
      p.validate();
      return false;
    } catch (const Error& e) {
      return e.code() == ErrorCode::Format;
    }
  };
  EXPECT_TRUE(bad([](RopeParams& p) { p.base = 0.5f; }));
  EXPECT_TRUE(bad([](RopeParams& p) { p.base = NAN; }));
  EXPECT_TRUE(bad([](RopeParams& p) { p.scaling.freq_factors.assign(31, 1.0f); }));
  EXPECT_TRUE(bad([](RopeParams& p) { p.scaling.freq_factors.assign(32, -1.0f); }));
  EXPECT_TRUE(bad([](RopeParams& p) {
    p.scaling.kind = RopeScaling::Kind::Linear;
    p.scaling.factor = 0.5;
  }));
  EXPECT_TRUE(bad([](RopeParams& p) {
    p.scaling.kind = RopeScaling::Kind::Yarn;
    p.scaling.factor = 4;
  }));  // no original context
  EXPECT_TRUE(bad([](RopeParams& p) {
    p.scaling.kind = RopeScaling::Kind::Yarn;
    p.scaling.factor = 4;
    p.scaling.original_context = 64;
    p.scaling.beta_slow = 64;
  }));
  EXPECT_FALSE(bad([](RopeParams&) {}));
}

// A complete one-layer llama GGUF of f32 weights; `edit` adds metadata or tensors.
std::vector<uint8_t> tiny_llama(const std::function<void(test::GgufBuilder&)>& edit = {}, const char* arch = "llama") {
  const uint64_t d = 16, ff = 32, vocab = 8;
  const std::string a = arch;
  test::GgufBuilder g;
  g.str("general.architecture", arch)
      .u32(a + ".block_count", 1)
      .u32(a + ".embedding_length", static_cast<uint32_t>(d))
      .u32(a + ".attention.head_count", 2)
      .u32(a + ".feed_forward_length", static_cast<uint32_t>(ff))
      .u32(a + ".context_length", 64)
      .f32_tensor("token_embd.weight", {d, vocab}, std::vector<float>(d * vocab, 0.1f))
      .f32_tensor("output_norm.weight", {d}, std::vector<float>(d, 1.0f))
      .f32_tensor("blk.0.attn_norm.weight", {d}, std::vector<float>(d, 1.0f))
      .f32_tensor("blk.0.ffn_norm.weight", {d}, std::vector<float>(d, 1.0f));
  for (const char* m : {"attn_q", "attn_k", "attn_v", "attn_output"})
    g.f32_tensor(std::string("blk.0.") + m + ".weight", {d, d}, std::vector<float>(d * d, 0.01f));
  g.f32_tensor("blk.0.ffn_gate.weight", {d, ff}, std::vector<float>(d * ff, 0.01f))
      .f32_tensor("blk.0.ffn_up.weight", {d, ff}, std::vector<float>(d * ff, 0.01f))
      .f32_tensor("blk.0.ffn_down.weight", {ff, d}, std::vector<float>(d * ff, 0.01f));
  if (edit) edit(g);
  return g.build();
}

// The error Model::load gives, or "" when it loads.
std::string load_error(const std::vector<uint8_t>& bytes) {
  GgufFile f = GgufFile::parse(bytes);
  try {
    Model::load(f);
    return "";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Format) << e.what();
    return e.what();
  }
}

ModelConfig config_of(const std::vector<uint8_t>& bytes) {
  GgufFile f = GgufFile::parse(bytes);
  return Model::load(f).config();
}

TEST(RopeMetadata, ScalingIsReadAsDeclared) {
  EXPECT_EQ(config_of(tiny_llama()).rope.scaling.kind, RopeScaling::Kind::None);
  const ModelConfig yarn = config_of(tiny_llama([](test::GgufBuilder& g) {
    g.str("llama.rope.scaling.type", "yarn")
        .f32("llama.rope.scaling.factor", 4.0f)
        .u32("llama.rope.scaling.original_context_length", 16)
        .f32("llama.rope.scaling.yarn_beta_fast", 16.0f);
  }));
  EXPECT_EQ(yarn.rope.scaling.kind, RopeScaling::Kind::Yarn);
  EXPECT_EQ(yarn.rope.scaling.factor, 4.0);
  EXPECT_EQ(yarn.rope.scaling.original_context, 16);
  EXPECT_EQ(yarn.rope.scaling.beta_fast, 16.0);
  EXPECT_EQ(yarn.rope.scaling.beta_slow, 1.0);
  // A factor without a type is linear (llama.cpp's reading), also under the older key.
  for (const char* key : {"llama.rope.scaling.factor", "llama.rope.scale_linear"}) {
    const ModelConfig lin = config_of(tiny_llama([&](test::GgufBuilder& g) { g.f32(key, 2.0f); }));
    EXPECT_EQ(lin.rope.scaling.kind, RopeScaling::Kind::Linear) << key;
    EXPECT_EQ(lin.rope.scaling.factor, 2.0) << key;
  }
  const ModelConfig l3 = config_of(tiny_llama([](test::GgufBuilder& g) {
    g.f32_tensor("rope_freqs.weight", {4}, {1.0f, 2.0f, 4.0f, 8.0f});
  }));
  EXPECT_EQ(l3.rope.scaling.freq_factors, (std::vector<float>{1.0f, 2.0f, 4.0f, 8.0f}));
}

TEST(RopeMetadata, SlidingWindowsOfTheLlamaFamilyAreKept) {
  const ModelConfig all = config_of(tiny_llama([](test::GgufBuilder& g) { g.u32("llama.attention.sliding_window", 8); }));
  EXPECT_EQ(all.layer_window, std::vector<int>{8});
  const ModelConfig none = config_of(tiny_llama([](test::GgufBuilder& g) { g.u32("llama.attention.sliding_window", 0); }));
  EXPECT_EQ(none.layer_window, std::vector<int>{0});
}

// What the engine does not implement is refused, naming it: never run with silently wrong output.
TEST(RopeMetadata, WhatTheEngineDoesNotDoIsRefusedByName) {
  const std::vector<std::pair<std::function<void(test::GgufBuilder&)>, std::string>> cases = {
      {[](test::GgufBuilder& g) { g.str("llama.rope.scaling.type", "longrope"); }, "longrope"},
      {[](test::GgufBuilder& g) { g.f32("llama.rope.scaling.yarn_log_multiplier", 0.1f); }, "yarn_log_multiplier"},
      {[](test::GgufBuilder& g) { g.f32("llama.attention.scale", 0.1f); }, "llama.attention.scale"},
      {[](test::GgufBuilder& g) { g.f32("llama.logit_scale", 0.5f); }, "llama.logit_scale"},
      {[](test::GgufBuilder& g) { g.f32("llama.final_logit_softcapping", 30.0f); }, "final_logit_softcapping"},
      {[](test::GgufBuilder& g) { g.boolean("llama.attention.causal", false); }, "attention.causal"},
      {[](test::GgufBuilder& g) { g.u32("llama.expert_count", 8); }, "expert_count"},
      {[](test::GgufBuilder& g) { g.u32("llama.attention.value_length", 4); }, "value_length"},
      {[](test::GgufBuilder& g) { g.f32_tensor("rope_freqs.weight", {3}, {1.0f, 2.0f, 4.0f}); }, "rope_freqs"},
      {[](test::GgufBuilder& g) { g.f32_tensor("blk.0.attn_q_norm.weight", {8}, std::vector<float>(8, 1.0f)); },
       "blk.0.attn_q_norm.weight"},
      {[](test::GgufBuilder& g) { g.f32("llama.attention.layer_norm_rms_epsilon", -1.0f); }, "layer_norm_rms_epsilon"},
      {[](test::GgufBuilder& g) { g.f32("llama.rope.freq_base", 0.0f); }, "freq_base"},
      {[](test::GgufBuilder& g) { g.str("llama.rope.scaling.type", "yarn").f32("llama.rope.scaling.factor", 0.5f); },
       "factor"},
  };
  for (const auto& [edit, name] : cases) {
    const std::string e = load_error(tiny_llama(edit));
    EXPECT_NE(e.find(name), std::string::npos) << "expected an error naming " << name << ", got '" << e << "'";
  }
  // Keys that describe rather than compute load.
  EXPECT_EQ(load_error(tiny_llama([](test::GgufBuilder& g) {
              g.u32("llama.vocab_size", 8).boolean("llama.rope.scaling.finetuned", true).str("general.name", "x");
            })),
            "");
}

}  // namespace
}  // namespace tqkv::engine
