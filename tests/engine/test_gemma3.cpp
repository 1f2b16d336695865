// Gemma-3-270m (gemma3: QK norms, sandwich norms, GeGLU, embedding scale, five sliding-window
// layers per global one, 262K SentencePiece vocabulary), skipped when models/ does not have it
// (scripts/fetch_models.sh gemma-3-270m): config, tokenizer against sentencepiece, logits
// against the NumPy reference within and beyond the sliding window, batched and token by
// token, greedy text, every cache format.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/model/generate.h"
#include "engine/model/model.h"
#include "engine/gguf/tokenizer.h"
#include "real_models.h"
#include "reference.h"
#include "tqkv/format.h"

namespace tqkv::engine {
namespace {

using testing_util::have_python;
using testing_util::have_python_reference;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Real text every Debian system carries, longer than the 512-position window once tokenized.
const char* kLongText = "/usr/share/common-licenses/GPL-3";

class Gemma3 : public testing_util::Gemma3ModelTest {
 protected:
  std::vector<int32_t> prompt(const std::string& text) const { return tok_->encode(text, false, tok_->add_bos()); }
  std::vector<float> run_all(const std::vector<int32_t>& ids, const std::string& spec) const {
    auto cache = model_->make_cache(spec, 1024);
    std::vector<float> logits(ids.size() * model_->config().n_vocab);
    model_->forward(cache->add_sequence(), ids.data(), static_cast<int>(ids.size()), *cache, logits.data(), true);
    return logits;
  }
  std::vector<int32_t> greedy(const std::vector<int32_t>& p, const std::string& spec, int n) const {
    auto cache = model_->make_cache(spec, 1024);
    GenerateOptions g;
    g.n_predict = n;
    g.stop_at_end_of_generation = false;
    std::vector<int32_t> out;
    generate(*model_, *tok_, *cache, cache->add_sequence(), p, g, [&](int32_t id) { out.push_back(id); });
    return out;
  }
};

TEST_F(Gemma3, Config) {
  const ModelConfig& c = model_->config();
  EXPECT_EQ(c.arch, "gemma3");
  EXPECT_EQ(c.n_layers, 18);
  EXPECT_EQ(c.d_model, 640);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 1);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.n_vocab, 262144);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.rope.layout, RopeLayout::Halves);
  for (int l = 0; l < c.n_layers; ++l) {
    SCOPED_TRACE(l);
    const bool global = (l + 1) % 6 == 0;  // layers 5, 11, 17
    EXPECT_EQ(c.window(l), global ? 0 : 512);
    EXPECT_FLOAT_EQ(c.rope_at(l).base, global ? 1e6f : 1e4f);
  }
}

// Grouped Q, K, V and gate, up (GeGLU) give the logits of the products one by one, bit for bit.
TEST_F(Gemma3, GroupedProductsLeaveLogitsUnchanged) {
  testing_util::expect_grouped_products_change_nothing(*model_, prompt("The capital of France is a city called"));
}

TEST_F(Gemma3, Tokenizer) {
  EXPECT_EQ(tok_->kind(), Tokenizer::Kind::SentencePiece);
  EXPECT_TRUE(tok_->add_bos());
  EXPECT_EQ(tok_->bos(), 2);
  // Expected ids: sentencepiece (tests/integration/reference_tokenize.py). No dummy prefix;
  // whitespace runs and newlines are user-defined pieces, matched even in plain text.
  const std::vector<std::pair<std::string, std::vector<int32_t>>> cases = {
      {"The capital of France is", {818, 5279, 529, 7001, 563}},
      {"hello  world\n\nfoo   bar\tbaz\n", {23391, 138, 12392, 108, 26537, 139, 2230, 255968, 80432, 107}},
  };
  for (const auto& [text, ids] : cases) {
    SCOPED_TRACE(text);
    EXPECT_EQ(tok_->encode(text, false), ids);
    EXPECT_EQ(tok_->decode(ids), text);
  }
  EXPECT_EQ(tok_->encode("<start_of_turn>user\n"), (std::vector<int32_t>{105, 2364, 107}));
  EXPECT_TRUE(tok_->is_end_of_generation(tok_->token_id("<end_of_turn>")));
  // The file has no chat template: Gemma's, from its turn markers.
  EXPECT_TRUE(tok_->chat_template().empty());
  EXPECT_EQ(tok_->apply_chat_template({{"user", "Hi"}}, true), "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n");
}

// Identical ids to Google's sentencepiece, given the same pieces, on edge cases, the licences
// every Debian system carries and, when installed, the evaluation text.
TEST_F(Gemma3, TokenizerMatchesSentencePieceOnRealText) {
  if (!have_python("numpy, gguf, sentencepiece")) GTEST_SKIP() << "python3 with numpy, gguf and sentencepiece not available";
  const std::string edge = testing_util::temp_path("tqkv_edge") + ".txt";
  std::ofstream(edge, std::ios::binary)
      << "Hello world. The year 2024 was   great!\ndon't you'll I'M\n  leading\ttabs\n\n\nnewlines  \n"
         "def f(x):\n    return x**2  # square\n"
         "Caf\xc3\xa9 na\xc3\xafve \xe2\x80\x94 \xe2\x80\x9cquotes\xe2\x80\x9d \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e "
         "\xf0\x9f\x98\x80 emoji \xf0\x9f\xa6\x80\xf0\x9f\xa7\xac x\xc2\xb2=\xc2\xbd\n<b>bold</b> <start_of_turn>\n";
  std::vector<std::string> files = {edge};
  for (const char* f : {"/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0",
                        TQKV_REPO_DIR "/data/kjv-genesis.txt"})
    if (std::filesystem::exists(f)) files.push_back(f);
  const std::vector<std::vector<int32_t>> ref = testing_util::reference_token_ids(testing_util::kGemma3Model, files);
  for (size_t k = 0; k < files.size(); ++k) {
    SCOPED_TRACE(files[k]);
    const std::string text = read_text(files[k]);
    const std::vector<int32_t> got = tok_->encode(text, false);
    ASSERT_FALSE(ref[k].empty());
    const auto diff = std::mismatch(got.begin(), got.end(), ref[k].begin(), ref[k].end());
    EXPECT_TRUE(diff.first == got.end() && diff.second == ref[k].end())
        << "first difference at token " << (diff.first - got.begin()) << " of " << got.size()
        << " (sentencepiece: " << ref[k].size() << ")";
    EXPECT_EQ(tok_->decode(got), text);
  }
  std::filesystem::remove(edge);
}

// Logits of every position of a short prompt within 1e-3 x max|logit| of
// tests/integration/reference_forward.py (NumPy, float64, the gguf package's dequantizers).
TEST_F(Gemma3, LogitsMatchNumpyReference) {
  if (!have_python_reference()) GTEST_SKIP() << "python3 with numpy + gguf not available";
  const std::vector<int32_t> ids = prompt("Question: What is the capital of France?\nAnswer: The capital of France is");
  const int V = model_->config().n_vocab;
  const std::vector<float> ref = testing_util::reference_logits(testing_util::kGemma3Model, ids, V);
  const std::vector<float> got = run_all(ids, "f32");
  for (size_t t = 0; t < ids.size(); ++t) {
    const auto e = testing_util::max_err(got.data() + t * V, ref.data() + t * V, V);
    EXPECT_LE(e.err, 1e-3 * e.mag) << "position " << t << ": max |diff| " << e.err << ", max |logit| " << e.mag;
  }
  const float* last = got.data() + (ids.size() - 1) * V;
  EXPECT_EQ(tok_->piece(static_cast<int32_t>(std::max_element(last, last + V) - last)), " Paris");
}

// Beyond the 512-position window the local layers see only the window: the last positions of
// an 800-token text, by a batched prefill (in steps of 256) and by token-by-token decode
// after it, against the reference's exact windowed attention. The local layers' ring holds
// 767 positions, so it has wrapped.
TEST_F(Gemma3, SlidingWindowMatchesNumpyReference) {
  // Float references are matched under the f32 path (the int8 path: Smol.Int8DecodeAgrees...).
  testing_util::QdotModeScope f32(QdotMode::F32);
  if (!have_python_reference()) GTEST_SKIP() << "python3 with numpy + gguf not available";
  if (!std::filesystem::exists(kLongText)) GTEST_SKIP() << "no real text at " << kLongText;
  std::vector<int32_t> ids = prompt(read_text(kLongText));
  ASSERT_GT(ids.size(), 800u);
  ids.resize(800);
  const int V = model_->config().n_vocab, n = static_cast<int>(ids.size()), tail = 4;
  const std::vector<float> ref = testing_util::reference_logits(testing_util::kGemma3Model, ids, V, tail);
  const std::vector<float> batched = run_all(ids, "f32");
  auto cache = model_->make_cache("f32", 1024);
  const int64_t seq = cache->add_sequence();
  std::vector<float> stepped(static_cast<size_t>(tail) * V), scratch(V);
  model_->forward(seq, ids.data(), n - tail, *cache, scratch.data(), false);
  for (int t = 0; t < tail; ++t)
    model_->forward(seq, &ids[n - tail + t], 1, *cache, stepped.data() + static_cast<size_t>(t) * V, false);
  for (int t = 0; t < tail; ++t) {
    const float* r = ref.data() + static_cast<size_t>(t) * V;
    const auto eb = testing_util::max_err(batched.data() + static_cast<size_t>(n - tail + t) * V, r, V);
    const auto es = testing_util::max_err(stepped.data() + static_cast<size_t>(t) * V, r, V);
    EXPECT_LE(eb.err, 1e-3 * eb.mag) << "batched, position " << n - tail + t << ": max |diff| " << eb.err;
    EXPECT_LE(es.err, 1e-3 * es.mag) << "token by token, position " << n - tail + t << ": max |diff| " << es.err;
  }
}

TEST_F(Gemma3, GreedyTextIsSensible) {
  const std::vector<int32_t> p = prompt("Question: What is the capital of France?\nAnswer:");
  const std::vector<int32_t> a = greedy(p, "f32", 16);
  const std::string text = tok_->decode(a, true);
  EXPECT_NE(text.find("Paris"), std::string::npos) << text;
  EXPECT_EQ(greedy(p, "f16", 16), a);
}

TEST_F(Gemma3, EveryCacheFormatRuns) {
  const std::vector<int32_t> ids = prompt("Question: What is the capital of France?\nAnswer: The capital of France is");
  // At 3 bits the next token (" Paris") can fall further on this model (turboquant_3bit_nc
  // ranked it 14th): top three only from 4 bits up.
  testing_util::check_every_cache_format(*model_, ids, 4);
}

// The local layers keep a ring of their window plus one step; the byte accounting counts it,
// with copies too (their window no longer than the layers').
TEST_F(Gemma3, WindowLayersKeepARing) {
  const ModelConfig& c = model_->config();
  const CacheSpec spec = model_->resolve("tq-k4v4");
  const int64_t ring = 512 + CacheSpec::kWindowStepTokens - 1;
  size_t row_full = 0, row_ring = 0;  // bytes per position of the global / local layers
  for (int l = 0; l < c.n_layers; ++l) {
    EXPECT_EQ(spec.ring_positions(l, 4096), c.window(l) > 0 ? ring : 0) << "layer " << l;
    (c.window(l) > 0 ? row_ring : row_full) += spec.layers[l].slot_bytes(c.head_dim) * c.n_kv_heads;
  }
  EXPECT_EQ(spec.bytes(300, 4096).slots, (row_full + row_ring) * 300);
  EXPECT_EQ(spec.bytes(3000, 4096).slots, row_full * 3000 + row_ring * ring);
  EXPECT_EQ(spec.ring_positions(0, 512), 0) << "a ring no smaller than the cache";
  EXPECT_EQ(model_->resolve("tq-k4v4+w8").ring_positions(0, 4096), ring) << "copies keep the rings";
  EXPECT_EQ(model_->resolve("tq-k4v4+w1000").window_at(4096), 512) << "no longer than the local layers' window";

  auto cache = model_->make_cache(spec, 4096);
  const int64_t s = cache->add_sequence();
  std::vector<int32_t> ids = prompt(read_text(kLongText));
  ids.resize(900);
  std::vector<float> logits(static_cast<size_t>(c.n_vocab));
  model_->forward(s, ids.data(), static_cast<int>(ids.size()), *cache, logits.data(), false);
  EXPECT_EQ(cache->bytes(s).slots, row_full * 900 + row_ring * ring);
  EXPECT_LT(cache->bytes(s).slots, (row_full + row_ring) * 900);
}

}  // namespace
}  // namespace tqkv::engine

namespace tqkv::engine {
namespace {

// Copies (f16 sinks, a 6-bit recent window) in layers that keep a ring give the logits of the
// same spec in a cache too small for rings (every position kept, the window cut at attention):
// past the local window the sinks drop out of the local layers. The same steps both ways and no
// key centring (whose centred channels depend on the capacity), so the codes are the same.
TEST_F(Gemma3, CopiesWithRingsMatchEveryPositionKept) {
  testing_util::QdotModeScope f32(QdotMode::F32);  // the same products however the steps are cut
  if (!std::filesystem::exists(kLongText)) GTEST_SKIP() << "no real text at " << kLongText;
  const ModelConfig& c = model_->config();
  std::vector<int32_t> ids = prompt(read_text(kLongText));
  ids.resize(620);
  const int tail = 2, n = static_cast<int>(ids.size()), V = c.n_vocab;
  const CacheSpec spec = model_->resolve("k3v2+skip0+sink2+wq6+w64");
  std::vector<float> logits[2];
  for (int ringed = 0; ringed < 2; ++ringed) {
    const int capacity = ringed ? 4096 : n;  // 767-position rings only where they are smaller
    ASSERT_EQ(spec.ring_positions(0, capacity) > 0, ringed == 1);
    auto cache = model_->make_cache(spec, capacity);
    const int64_t seq = cache->add_sequence();
    logits[ringed].resize(static_cast<size_t>(tail) * V);
    for (int p = 0; p < n - tail; p += CacheSpec::kWindowStepTokens)
      model_->forward(seq, ids.data() + p, std::min(CacheSpec::kWindowStepTokens, n - tail - p), *cache, nullptr, false);
    for (int t = 0; t < tail; ++t)
      model_->forward(seq, &ids[n - tail + t], 1, *cache, logits[ringed].data() + static_cast<size_t>(t) * V, false);
  }
  for (int t = 0; t < tail; ++t) {
    const auto e = testing_util::max_err(logits[1].data() + static_cast<size_t>(t) * V,
                                         logits[0].data() + static_cast<size_t>(t) * V, V);
    EXPECT_LE(e.err, 1e-4 * e.mag) << "position " << n - tail + t << ": max |diff| " << e.err;
  }
}

}  // namespace
}  // namespace tqkv::engine
