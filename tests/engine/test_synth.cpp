// Synthetic models (synth_model.h): the named shapes are the real models' (parameter counts), and
// a written model of each weight kind loads, tokenizes and runs with finite logits of a sensible
// spread. The shapes here are small; the named ones are written on the GPU machine.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

#include "engine/gguf/gguf.h"
#include "engine/model/model.h"
#include "engine/gguf/synth_model.h"
#include "engine/gguf/tokenizer.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

TEST(Synth, NamedShapesHaveTheRealParameterCounts) {
  // Published sizes (Hugging Face model cards), within 1%.
  const std::vector<std::pair<std::string, double>> sizes = {
      {"llama-3.1-8b", 8.03e9}, {"llama-3.1-70b", 70.6e9}, {"mistral-7b", 7.25e9}, {"qwen2.5-7b", 7.62e9},
      {"qwen2.5-32b", 32.8e9}};
  for (const auto& [name, params] : sizes)
    EXPECT_NEAR(synth_shape(name).parameters() / params, 1.0, 0.01) << name;
  EXPECT_THROW(synth_shape("gpt-5"), Error);
  EXPECT_THROW(synth_weights("q3"), Error);
}

TEST(Synth, WrittenModelsLoadAndRun) {
  SynthShape s = synth_shape("llama-3.1-8b");  // its features (Llama 3 RoPE factors), a small size
  s.layers = 2, s.d_model = 256, s.heads = 4, s.kv_heads = 2, s.d_ff = 512, s.vocab = 320;
  SynthShape qwen = synth_shape("qwen2.5-7b");
  qwen.layers = 2, qwen.d_model = 256, qwen.heads = 4, qwen.kv_heads = 1, qwen.d_ff = 512, qwen.vocab = 300;
  const std::string path = (std::filesystem::temp_directory_path() / ("tqkv_synth_" + std::to_string(::getpid()))).string();
  for (const SynthShape& shape : {s, qwen})
    for (const char* kind : {"q4_k_m", "q8_0", "bf16"}) {
      SCOPED_TRACE(shape.name + " " + kind);
      const size_t bytes = write_synthetic_model(path, shape, synth_weights(kind), 7);
      EXPECT_EQ(bytes, std::filesystem::file_size(path));
      GgufFile f = GgufFile::open(path);
      const Model m = Model::load(f);
      const ModelConfig& c = m.config();
      EXPECT_EQ(c.arch, shape.arch);
      EXPECT_EQ(c.n_layers, 2);
      EXPECT_EQ(c.n_kv_heads, shape.kv_heads);
      EXPECT_EQ(c.n_vocab, shape.vocab);
      EXPECT_EQ(c.qkv_bias, shape.qkv_bias);
      EXPECT_EQ(!c.rope.scaling.freq_factors.empty(), shape.llama3_rope);
      const Tokenizer tok = Tokenizer::from_gguf(f);
      const std::vector<int32_t> ids = tok.encode("the quick brown fox", false, false);
      ASSERT_FALSE(ids.empty());
      EXPECT_EQ(tok.decode(ids), "the quick brown fox");
      auto cache = m.make_cache("f32", 64);
      std::vector<float> logits(static_cast<size_t>(ids.size()) * c.n_vocab);
      m.forward(cache->add_sequence(), ids.data(), static_cast<int>(ids.size()), *cache, logits.data(), true);
      double sum = 0, sq = 0;
      for (float x : logits) {
        ASSERT_TRUE(std::isfinite(x));
        sum += x, sq += static_cast<double>(x) * x;
      }
      const double mean = sum / logits.size(), sd = std::sqrt(sq / logits.size() - mean * mean);
      EXPECT_GT(sd, 0.05);  // the random weights carry the signal through (not all zeros)
      EXPECT_LT(sd, 50.0);  // and keep it near unit scale (no blow-up through the layers)
    }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace tqkv::engine
