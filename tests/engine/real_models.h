// The real models shared by the engine suites: each loaded once per test suite; every test
// skips cleanly when models/ does not have the file (scripts/fetch_model.sh installs SmolLM2,
// scripts/fetch_models.sh the others).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/model/architecture.h"
#include "engine/gguf/gguf.h"
#include "engine/model/model.h"
#include "engine/cache/model_recipes.h"
#include "engine/weights/qgemv.h"
#include "engine/gguf/tokenizer.h"
#include "tqkv/format.h"
#include "tqkv/threads.h"

namespace tqkv::engine::testing_util {

// Products that share an input multiplied as groups (set_group_products: the CPU quantizes the
// input once and runs a group's rows in one job) and one by one give the same logits bit for
// bit: a prefill of ids (SGEMM, n - 3 tokens), then steps of 2 and 1 tokens (the quantized
// kernels), with the 4-bit cache on 2 threads.
inline void expect_grouped_products_change_nothing(const Model& model, const std::vector<int32_t>& ids) {
  const int V = model.config().n_vocab, n = static_cast<int>(ids.size());
  ASSERT_GE(n, 4);
  struct Restore {
    int threads = num_threads();
    ~Restore() {
      set_num_threads(threads);
      set_group_products(true);
    }
  } restore;
  set_num_threads(2);
  std::vector<float> logits[2];
  for (int grouped = 0; grouped < 2; ++grouped) {
    set_group_products(grouped != 0);
    auto cache = model.make_cache("tq-k4v4", 256);
    const int64_t seq = cache->add_sequence();
    logits[grouped].resize(static_cast<size_t>(n) * V);
    float* out = logits[grouped].data();
    model.forward(seq, ids.data(), n - 3, *cache, out, true);
    model.forward(seq, &ids[n - 3], 2, *cache, out + static_cast<size_t>(n - 3) * V, true);
    model.forward(seq, &ids[n - 1], 1, *cache, out + static_cast<size_t>(n - 1) * V, true);
  }
  EXPECT_EQ(std::memcmp(logits[0].data(), logits[1].data(), logits[0].size() * sizeof(float)), 0);
}

// The qgemv path for one scope (tests comparing against float references run under f32: the
// int8 path's own agreement is checked separately).
struct QdotModeScope {
  QdotMode saved = qdot_mode();
  explicit QdotModeScope(QdotMode m) { set_qdot_mode(m); }
  ~QdotModeScope() { set_qdot_mode(saved); }
  QdotModeScope(const QdotModeScope&) = delete;
  QdotModeScope& operator=(const QdotModeScope&) = delete;
};

inline const std::string kSmolModel = std::string(TQKV_REPO_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
inline const std::string kQwen05Model = std::string(TQKV_REPO_DIR) + "/models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf";
inline const std::string kQwen15Model = std::string(TQKV_REPO_DIR) + "/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf";
inline const std::string kGemma3Model = std::string(TQKV_REPO_DIR) + "/models/gemma-3-270m-q4_k_m.gguf";

// File: a type with `static const std::string& path()` and `static const char* fetch()`.
template <class File>
class RealModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(File::path())) return;
    file_ = new GgufFile(GgufFile::open(File::path()));
    tok_ = new Tokenizer(Tokenizer::from_gguf(*file_));
    model_ = new Model(Model::load(*file_));
    model_->set_spec_sources(model_spec_sources(*file_, model_->config()));
  }
  static void TearDownTestSuite() {
    delete model_;
    delete tok_;
    delete file_;
    model_ = nullptr;
    tok_ = nullptr;
    file_ = nullptr;
  }
  void SetUp() override {
    if (!model_) GTEST_SKIP() << "model not found at " << File::path() << " (run " << File::fetch() << ")";
  }
  inline static GgufFile* file_ = nullptr;
  inline static Tokenizer* tok_ = nullptr;
  inline static Model* model_ = nullptr;
};

struct SmolFile {
  static const std::string& path() { return kSmolModel; }
  static const char* fetch() { return "scripts/fetch_model.sh"; }
};
struct Qwen05File {
  static const std::string& path() { return kQwen05Model; }
  static const char* fetch() { return "scripts/fetch_models.sh qwen2.5-coder-0.5b"; }
};

struct Qwen15File {
  static const std::string& path() { return kQwen15Model; }
  static const char* fetch() { return "scripts/fetch_models.sh qwen2.5-coder-1.5b"; }
};
struct Gemma3File {
  static const std::string& path() { return kGemma3Model; }
  static const char* fetch() { return "scripts/fetch_models.sh gemma-3-270m"; }
};

using SmolModelTest = RealModelTest<SmolFile>;
using Qwen05ModelTest = RealModelTest<Qwen05File>;
using Qwen15ModelTest = RealModelTest<Qwen15File>;
using Gemma3ModelTest = RealModelTest<Gemma3File>;


// Every named cache format on one prompt: finite logits; the f32 cache's next token stays first
// with 8-bit caches and among the first three from `top3_from_bits` bits up (a small model's
// margins are thin, and summation order differs between builds); every compressed format takes
// fewer bytes than f16.
inline void check_every_cache_format(const Model& m, const std::vector<int32_t>& ids, int top3_from_bits) {
  const int V = m.config().n_vocab, n = static_cast<int>(ids.size());
  auto last_logits = [&](const std::string& spec) {
    auto cache = m.make_cache(spec, 256);
    std::vector<float> logits(static_cast<size_t>(V));
    m.forward(cache->add_sequence(), ids.data(), n, *cache, logits.data(), false);
    return logits;
  };
  auto bytes = [&](const std::string& spec) { return m.resolve(spec).bytes(1, 16).total(); };
  const std::vector<float> base = last_logits("f32");
  const int32_t base_top = static_cast<int32_t>(std::max_element(base.begin(), base.end()) - base.begin());
  for (const NamedFormat& nf : named_formats()) {
    const Format& f = nf.format;
    SCOPED_TRACE(f.name());
    const std::vector<float> last = last_logits(f.name());
    for (int i = 0; i < V; ++i) ASSERT_TRUE(std::isfinite(last[i]));
    int rank = 0;
    for (int i = 0; i < V; ++i) rank += last[i] > last[base_top];
    const int bits = std::min(f.key_bits, f.value_bits);
    if (bits >= 8) {
      EXPECT_EQ(rank, 0);
    } else if (bits >= top3_from_bits) {
      EXPECT_LT(rank, 3);
    }
    if (f.compressed()) {
      EXPECT_LT(bytes(f.name()), bytes("f16"));
    }
  }
}

// Token-by-token decode (the quantized kernels, under `mode`) against one batched prefill in
// float32 (SGEMM) over ids, f32 cache: mean KL(prefill || decode) of each position's next-token
// distribution and the share of positions whose top token agrees.
struct DecodeAgreement {
  double mean_kl = 0, top1 = 0;
};
inline DecodeAgreement decode_vs_prefill(const Model& m, const std::vector<int32_t>& ids, QdotMode mode) {
  const int V = m.config().n_vocab, n = static_cast<int>(ids.size());
  std::vector<float> batched(ids.size() * V);
  {
    QdotModeScope f32(QdotMode::F32);
    auto cache = m.make_cache("f32", std::max(256, n + 1));
    m.forward(cache->add_sequence(), ids.data(), n, *cache, batched.data(), true);
  }
  auto log_softmax = [V](const float* z) {
    std::vector<double> p(z, z + V);
    const double mx = *std::max_element(p.begin(), p.end());
    double sum = 0;
    for (double v : p) sum += std::exp(v - mx);
    for (double& v : p) v -= mx + std::log(sum);
    return p;
  };
  QdotModeScope scope(mode);
  auto cache = m.make_cache("f32", std::max(256, n + 1));
  const int64_t seq = cache->add_sequence();
  std::vector<float> step(V);
  DecodeAgreement a;
  for (int t = 0; t < n; ++t) {
    m.forward(seq, &ids[t], 1, *cache, step.data(), false);
    const float* ref = batched.data() + static_cast<size_t>(t) * V;
    const std::vector<double> lp = log_softmax(ref), lq = log_softmax(step.data());
    double kl = 0;
    for (int i = 0; i < V; ++i) kl += std::exp(lp[i]) * (lp[i] - lq[i]);
    a.mean_kl += kl / n;
    a.top1 += (std::max_element(ref, ref + V) - ref == std::max_element(step.begin(), step.end()) - step.begin()) ? 1.0 / n : 0;
  }
  return a;
}

}  // namespace tqkv::engine::testing_util
