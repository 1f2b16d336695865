// The CUDA device against the CPU device on the real model (SmolLM2-135M-Instruct): logits of a
// chat prompt (prefill and decode steps) with f32, f16 and compressed caches, greedy tokens,
// a varlen batch vs separate runs, bad input. Weights are bf16 on the GPU (float32 on the CPU),
// so logits are compared by mean KL divergence and top-1 agreement, not exactly. Every test
// skips without a CUDA device (fails under TQKV_REQUIRE_CUDA=1) or without the model;
// make_device's answers are checked anywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/model/architecture.h"
#include "engine/cache/cache_spec.h"
#include "engine/device/cuda_device.h"
#include "engine/device/cuda_kv_cache.h"
#include "engine/model/generate.h"
#include "engine/core/sampler.h"
#include "engine/gguf/gguf.h"
#include "engine/model/model.h"
#include "engine/cache/model_recipes.h"
#include "engine/weights/qgemv.h"
#include "engine/cache/recipe.h"
#include "engine/gguf/tokenizer.h"
#include "../common/require_cuda.h"
#include "../common/scoped_env.h"
#include "../common/test_data.h"
#include "gguf_builder.h"
#include "tqkv/cuda_ops.h"
#include "tqkv/error.h"
#include "tqkv/half.h"

namespace tqkv::engine {
namespace {

const std::string kModel = std::string(TQKV_REPO_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";

TEST(CudaDeviceSelection, MakeDevice) {
  if (cuda_device_present()) {
    EXPECT_EQ(make_device("cuda")->name(), "cuda");
    EXPECT_EQ(make_device("auto")->name(), "cuda");
  } else {
    EXPECT_THROW(make_device("cuda"), Error);
    EXPECT_EQ(make_device("auto")->name(), "cpu");
  }
  EXPECT_EQ(make_device("cpu")->name(), "cpu");
  EXPECT_THROW(make_device("tpu"), Error);
}

// Mean over rows of KL(p_cpu || p_gpu) and the fraction of rows whose argmax agrees.
struct Agreement {
  double mean_kl = 0, top1 = 0, max_abs = 0;
};
Agreement compare(const std::vector<float>& cpu, const std::vector<float>& gpu, int V) {
  Agreement a;
  const size_t rows = cpu.size() / V;
  for (size_t r = 0; r < rows; ++r) {
    const float* x = cpu.data() + r * V;
    const float* y = gpu.data() + r * V;
    const double mx = *std::max_element(x, x + V), my = *std::max_element(y, y + V);
    double zx = 0, zy = 0;
    for (int i = 0; i < V; ++i) zx += std::exp(x[i] - mx), zy += std::exp(y[i] - my);
    double kl = 0;
    for (int i = 0; i < V; ++i) {
      const double lp = x[i] - mx - std::log(zx), lq = y[i] - my - std::log(zy);
      kl += std::exp(lp) * (lp - lq);
      a.max_abs = std::max(a.max_abs, std::fabs(static_cast<double>(x[i]) - y[i]));
    }
    a.mean_kl += kl / rows;
    a.top1 += (std::max_element(x, x + V) - x == std::max_element(y, y + V) - y) ? 1.0 / rows : 0.0;
  }
  return a;
}

class CudaSmol : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(kModel) || !cuda_device_present()) return;
    // The CPU side of these comparisons is the float path: the int8 activations of CPU decode
    // (qgemv, TQKV_QDOT) are a CPU speed choice held to the float path by their own tests
    // (Smol.Int8DecodeAgreesWithBatchedPrefill); against the GPU they flip a near tie at token 5.
    saved_qdot_ = qdot_mode();
    set_qdot_mode(QdotMode::F32);
    file_ = new GgufFile(GgufFile::open(kModel));
    tok_ = new Tokenizer(Tokenizer::from_gguf(*file_));
    cpu_ = new Model(Model::load(*file_, make_device("cpu")));
    gpu_ = new Model(Model::load(*file_, make_device("cuda")));
    cpu_->set_spec_sources(model_spec_sources(*file_, cpu_->config()));
    gpu_->set_spec_sources(cpu_->spec_sources());
  }
  static void TearDownTestSuite() {
    set_qdot_mode(saved_qdot_);
    delete gpu_;
    delete cpu_;
    delete tok_;
    delete file_;
    gpu_ = cpu_ = nullptr;
    tok_ = nullptr;
    file_ = nullptr;
  }
  void SetUp() override {
    TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
    if (!gpu_) GTEST_SKIP() << "model not found at " << kModel << " (run scripts/fetch_model.sh)";
  }
  std::vector<int32_t> chat(const std::string& q) const {
    return tok_->encode(tok_->apply_chat_template({{"user", q}}, true));
  }
  // Logits of every position: the prompt's first n - decode tokens as one prefill, then the
  // last `decode` tokens one step each (the decode path).
  static std::vector<float> run(const Model& m, const std::vector<int32_t>& ids, const std::string& spec, int decode) {
    const int V = m.config().n_vocab, n = static_cast<int>(ids.size()), pre = n - decode;
    auto cache = m.make_cache(spec, 256);
    const int64_t seq = cache->add_sequence();
    std::vector<float> logits(static_cast<size_t>(n) * V);
    m.forward(seq, ids.data(), pre, *cache, logits.data(), true);
    for (int t = pre; t < n; ++t) m.forward(seq, &ids[t], 1, *cache, logits.data() + static_cast<size_t>(t) * V, false);
    return logits;
  }
  static std::vector<int32_t> greedy(const Model& m, const std::vector<int32_t>& prompt, const std::string& spec, int n) {
    auto cache = m.make_cache(spec, 512);
    GenerateOptions g;
    g.n_predict = n;
    g.stop_at_end_of_generation = false;
    std::vector<int32_t> out;
    generate(m, *tok_, *cache, cache->add_sequence(), prompt, g, [&](int32_t id) { out.push_back(id); });
    return out;
  }
  inline static GgufFile* file_ = nullptr;
  inline static Tokenizer* tok_ = nullptr;
  inline static Model* cpu_ = nullptr;
  inline static Model* gpu_ = nullptr;
  inline static QdotMode saved_qdot_ = QdotMode::Int8;
};

// Uncompressed caches: the GPU's logits are the CPU's up to the bf16 weights (KL <= 1e-3).
// Compressed caches: the two devices store the same codes for the same inputs
// (CudaCacheLayer.SameInputsSameCodesAsCpu), but the bf16 weights move some inputs across a
// code threshold, and a flipped code's error then propagates through every later layer (measured:
// read-back keys differ by ~2% at the first compressed layer, ~10% by layer 9, against 0.3% with
// f16). So compressed caches are held to the same quality on both devices instead: each device's
// KL against its own f32-cache logits, and the cross-device KL no larger than that noise.
TEST_F(CudaSmol, LogitsMatchCpu) {
  const std::vector<int32_t> ids = chat("Tell me a short story about a robot who learns to paint.");
  const int V = cpu_->config().n_vocab;
  const std::vector<float> c32 = run(*cpu_, ids, "f32", 8), g32 = run(*gpu_, ids, "f32", 8);
  for (const std::string spec : {"f32", "f16", "turboquant_4bit_nc", "tq-k4v4", "k4v4+c", "turboquant_k8v4", "k6v6"}) {
    SCOPED_TRACE(spec);
    // Every spec listed is on the GPU: one that cannot be made is a failure, never a skip.
    ASSERT_NO_THROW(gpu_->make_cache(spec, 16)) << spec << " cannot be made on the GPU";
    const std::vector<float> c = run(*cpu_, ids, spec, 8), g = run(*gpu_, ids, spec, 8);
    const Agreement a = compare(c, g, V);
    std::printf("[ cuda vs cpu ] %-20s mean KL %.3g  top-1 %.3f  max |dlogit| %.3g over %zu positions\n", spec.c_str(),
                a.mean_kl, a.top1, a.max_abs, ids.size());
    const bool plain = !gpu_->resolve(spec).layers[gpu_->config().n_layers / 2].compressed();
    if (plain) {
      EXPECT_LE(a.mean_kl, 1e-3);
      EXPECT_GE(a.top1, 0.9);
      const size_t tail = static_cast<size_t>(8) * V;  // the decode steps alone
      EXPECT_LE(compare(std::vector<float>(c.end() - tail, c.end()), std::vector<float>(g.end() - tail, g.end()), V).mean_kl,
                1e-3);
      continue;
    }
    const double kl_cpu = compare(c32, c, V).mean_kl, kl_gpu = compare(g32, g, V).mean_kl;
    std::printf("[ quality ] %-20s KL vs own f32: cpu %.3g  gpu %.3g\n", spec.c_str(), kl_cpu, kl_gpu);
    EXPECT_LE(kl_gpu, 1.5 * kl_cpu + 0.01) << "the GPU's compressed cache is worse than the CPU's";
    EXPECT_LE(a.mean_kl, 2.0 * (kl_cpu + kl_gpu) + 0.01);
  }
}

// TQKV_CUDA_WEIGHTS=quantized: the layers' matrices stay in their GGUF blocks (SmolLM2's Q4_1).
// A prefill's products expand them to the very bf16 the default holds, so its logits are the
// default's bit for bit; decode steps (up to 8 rows) multiply on the blocks (cuda::qgemv: the
// weights unrounded, float32 sums), held to the uncompressed cross-device rule against the
// default (KL <= 1e-3, top-1 >= 0.9), op by op and in replayed graphs — in less memory.
TEST_F(CudaSmol, QuantizedWeightsGiveTheBf16Logits) {
  std::unique_ptr<Model> q;
  {
    testing_util::ScopedEnv env("TQKV_CUDA_WEIGHTS", "quantized");
    q = std::make_unique<Model>(Model::load(*file_, make_device("cuda")));
  }
  q->set_spec_sources(cpu_->spec_sources());
  std::printf("[ weights ] bf16 %.1f MiB, quantized %.1f MiB\n", gpu_->weight_bytes() / 1048576.0,
              q->weight_bytes() / 1048576.0);
  EXPECT_LT(static_cast<double>(q->weight_bytes()), 0.6 * static_cast<double>(gpu_->weight_bytes()));
  const std::vector<int32_t> ids = chat("Tell me a short story about a robot who learns to paint.");
  const int V = gpu_->config().n_vocab;
  const size_t tail = static_cast<size_t>(8) * V;
  for (const std::string spec : {"f16", "tq-4.375"}) {
    SCOPED_TRACE(spec);
    const std::vector<float> a = run(*q, ids, spec, 8), b = run(*gpu_, ids, spec, 8);
    EXPECT_TRUE(std::equal(a.begin(), a.end() - tail, b.begin())) << "the prefill's logits";
    const Agreement d = compare(std::vector<float>(a.end() - tail, a.end()), std::vector<float>(b.end() - tail, b.end()), V);
    std::printf("[ weights ] %-10s decode on the blocks vs bf16: mean KL %.3g  top-1 %.3f\n", spec.c_str(), d.mean_kl, d.top1);
    EXPECT_LE(d.mean_kl, 1e-3);
    EXPECT_GE(d.top1, 0.9);
    const std::vector<int32_t> ga = greedy(*q, ids, spec, 24), gb = greedy(*gpu_, ids, spec, 24);
    EXPECT_EQ(std::vector<int32_t>(ga.begin(), ga.begin() + 4), std::vector<int32_t>(gb.begin(), gb.begin() + 4));
  }
  testing_util::ScopedEnv bad("TQKV_CUDA_WEIGHTS", "int4");
  EXPECT_THROW(make_device("cuda"), Error);
}

// A fresh prompt attends to its own keys and values (f16 on the GPU, f32 on the CPU), whatever
// the spec stores, in one step at any length — 600 positions here, past the copies' 512 a
// step — and the decode steps after it read the cache: the prompt's logits are the f16 cache's
// bit for bit on the GPU (same kernel, same rounding) and the CPU's up to the uncompressed
// cross-device rule; the decode steps are held to LogitsMatchCpu's rule for compressed caches.
TEST_F(CudaSmol, FreshPromptOfAnyLengthMatchesCpu) {
  const std::vector<int32_t> q = chat("Tell me a short story about a robot who learns to paint.");
  std::vector<int32_t> ids;
  while (ids.size() < 604) ids.insert(ids.end(), q.begin(), q.end());
  ids.resize(604);
  const int V = cpu_->config().n_vocab, n = 600, decode = 4;
  auto run_long = [&](const Model& m, const std::string& spec) {
    auto cache = m.make_cache(spec, 1024);
    const int64_t seq = cache->add_sequence();
    std::vector<float> logits(static_cast<size_t>(n + decode) * V);
    m.forward(seq, ids.data(), n, *cache, logits.data(), true);
    for (int t = n; t < n + decode; ++t)
      m.forward(seq, &ids[t], 1, *cache, logits.data() + static_cast<size_t>(t) * V, false);
    return logits;
  };
  const size_t tail = static_cast<size_t>(decode) * V;
  auto prompt_part = [&](const std::vector<float>& x) { return std::vector<float>(x.begin(), x.end() - tail); };
  auto decode_part = [&](const std::vector<float>& x) { return std::vector<float>(x.end() - tail, x.end()); };
  const std::vector<float> g16 = run_long(*gpu_, "f16"), c32 = run_long(*cpu_, "f32"), g32 = run_long(*gpu_, "f32");
  for (const std::string spec : {"turboquant_4bit_nc", "tq-4.375"}) {
    SCOPED_TRACE(spec);
    const std::vector<float> c = run_long(*cpu_, spec), g = run_long(*gpu_, spec);
    if (spec == "turboquant_4bit_nc") {
      EXPECT_EQ(prompt_part(g), prompt_part(g16));  // no centring: the same keys
    }
    const Agreement p = compare(prompt_part(c), prompt_part(g), V);
    std::printf("[ fresh prompt ] %-20s cpu vs gpu over %d positions: mean KL %.3g  top-1 %.3f\n", spec.c_str(), n,
                p.mean_kl, p.top1);
    EXPECT_LE(p.mean_kl, 1e-3);
    EXPECT_GE(p.top1, 0.9);
    const double kl_cpu = compare(decode_part(c32), decode_part(c), V).mean_kl;
    const double kl_gpu = compare(decode_part(g32), decode_part(g), V).mean_kl;
    std::printf("[ fresh prompt ] %-20s decode KL vs own f32: cpu %.3g  gpu %.3g\n", spec.c_str(), kl_cpu, kl_gpu);
    EXPECT_LE(kl_gpu, 1.5 * kl_cpu + 0.01);
    EXPECT_LE(compare(decode_part(c), decode_part(g), V).mean_kl, 2.0 * (kl_cpu + kl_gpu) + 0.01);
  }
}

// The grouped products (Q, K, V; gate, up) convert their input to bf16 once and run the same
// cuBLAS GEMMs on it: the logits equal one product at a time bit for bit, prefill and decode.
TEST_F(CudaSmol, GroupedProductsLeaveLogitsUnchanged) {
  struct Restore {
    ~Restore() { set_group_products(true); }
  } restore;
  const std::vector<int32_t> ids = chat("Name three rivers.");
  std::vector<float> logits[2];
  for (int grouped = 0; grouped < 2; ++grouped) {
    set_group_products(grouped != 0);
    logits[grouped] = run(*gpu_, ids, "tq-k4v4", 3);
  }
  ASSERT_EQ(logits[0].size(), logits[1].size());
  EXPECT_EQ(std::memcmp(logits[0].data(), logits[1].data(), logits[0].size() * sizeof(float)), 0);
}

// The fused operations (Device::add_rmsnorm, glu, rope_qk, their products' inputs written by the
// same kernels) give the logits of the plain operations bit for bit, prefill and decode (decode
// steps recorded as graphs and replayed), compressed and f16 caches. FusedOps sets them on a
// device for its scope.
class FusedOps {
 public:
  FusedOps(Device& d, bool on) : d_(d), was_(d.fused_ops()) { d.set_fused_ops(on); }
  ~FusedOps() { d_.set_fused_ops(was_); }

 private:
  Device& d_;
  bool was_;
};

TEST_F(CudaSmol, FusedOpsLeaveLogitsUnchanged) {
  const std::vector<int32_t> ids = chat("Name three rivers.");
  for (const std::string spec : {"tq-k4v4", "f16"}) {
    SCOPED_TRACE(spec);
    std::vector<float> logits[2];
    for (int fused = 0; fused < 2; ++fused) {
      FusedOps scope(gpu_->device(), fused != 0);
      ASSERT_EQ(gpu_->device().fused_ops(), fused != 0);
      logits[fused] = run(*gpu_, ids, spec, 4);
    }
    ASSERT_EQ(logits[0].size(), logits[1].size());
    EXPECT_EQ(std::memcmp(logits[0].data(), logits[1].data(), logits[0].size() * sizeof(float)), 0);
  }
}

TEST_F(CudaSmol, GreedyMatchesCpuWithF16Cache) {
  const std::vector<int32_t> prompt = chat("Tell me a short story about a robot who learns to paint.");
  const auto c = greedy(*cpu_, prompt, "f16", 32), g = greedy(*gpu_, prompt, "f16", 32);
  ASSERT_EQ(c.size(), 32u);
  ASSERT_EQ(g.size(), 32u);
  size_t first = 0;
  while (first < c.size() && c[first] == g[first]) ++first;
  std::printf("[ cuda vs cpu ] greedy f16: %zu of 32 tokens identical before the first divergence\n", first);
  std::printf("  cpu: %s\n  gpu: %s\n", tok_->decode(c).c_str(), tok_->decode(g).c_str());
  // bf16 weights may flip a near tie late in the answer; the beginning must agree.
  EXPECT_GE(first, 16u) << "first divergence at token " << first;
}

TEST_F(CudaSmol, VarlenBatchEqualsSeparateRuns) {
  const std::vector<int32_t> a = chat("Name three rivers."), b = chat("What is two plus two?");
  const int V = gpu_->config().n_vocab, na = static_cast<int>(a.size()), nb = static_cast<int>(b.size());
  auto* cd = dynamic_cast<CudaDevice*>(&gpu_->device());
  ASSERT_NE(cd, nullptr);
  struct Restore {  // the device's skinny-product limit, whatever happens
    CudaDevice* d;
    int was;
    ~Restore() { d->set_skinny_max(was); }
  } restore{cd, cd->skinny_max()};
  // cuBLAS for every product first (a tight check), then the device's default limit (skinny
  // products for runs of at most that many rows, cuBLAS for the 68-row batch).
  for (const int skinny : {0, restore.was}) {
    for (const std::string spec : {"f32", "f16", "turboquant_4bit_nc"}) {
      SCOPED_TRACE(spec + ", skinny products up to " + std::to_string(skinny) + " rows");
      cd->set_skinny_max(skinny);
      const Model& m = *gpu_;
      auto alone = m.make_cache(spec, 128);
      const int64_t sa = alone->add_sequence();
      std::vector<float> la(static_cast<size_t>(V)), lb(static_cast<size_t>(nb) * V);
      m.forward(sa, a.data(), na - 1, *alone, la.data(), false);
      m.forward(sa, &a[na - 1], 1, *alone, la.data(), false);
      auto alone_b = m.make_cache(spec, 128);
      m.forward(alone_b->add_sequence(), b.data(), nb, *alone_b, lb.data(), true);

      auto shared = m.make_cache(spec, 128, 3);
      const int64_t s0 = shared->add_sequence(), s1 = shared->add_sequence(), s2 = shared->add_sequence();
      std::vector<float> pre(static_cast<size_t>(V));
      m.forward(s0, a.data(), na - 1, *shared, pre.data(), false);
      m.forward(s2, b.data(), 5, *shared, pre.data(), false);
      Batch step;  // decode of s0, prefill of s1, a continuation chunk of s2 (over its cached 5)
      step.add(s0, &a[na - 1], 1, na - 1, false);
      step.add(s1, b.data(), nb, 0, true);
      step.add(s2, b.data() + 5, nb - 5, 5, true);
      std::vector<float> out(static_cast<size_t>(step.n_logits()) * V);
      m.forward(step, *shared, out.data());
      EXPECT_EQ(shared->seq_len(s0), na);
      EXPECT_EQ(shared->seq_len(s1), nb);
      EXPECT_EQ(shared->seq_len(s2), nb);
      // Different batch shapes take different cuBLAS paths: close, not bit-equal.
      auto close = [&](const float* x, const float* y) {
        double err = 0, mag = 0;
        for (int i = 0; i < V; ++i) {
          err = std::max(err, std::fabs(static_cast<double>(x[i]) - y[i]));
          mag = std::max(mag, std::fabs(static_cast<double>(y[i])));
        }
        return err <= 2e-3 * mag;
      };
      if (skinny == 0) {
        EXPECT_TRUE(close(out.data(), la.data())) << "decode row";
        for (int t = 0; t < nb; ++t)
          EXPECT_TRUE(close(out.data() + static_cast<size_t>(1 + t) * V, lb.data() + static_cast<size_t>(t) * V))
              << "prefill row " << t;
        for (int t = 5; t < nb; ++t)
          EXPECT_TRUE(close(out.data() + static_cast<size_t>(1 + nb + t - 5) * V, lb.data() + static_cast<size_t>(t) * V))
              << "continuation row " << t;
      }
      // With skinny products the separate runs and the batch (68 rows, cuBLAS) take different product
      // kernels where a run is short enough: a float32 difference in a sum can round a later
      // product's bf16 input the other way, so the logits agree as the GPU's and the CPU's do
      // (LogitsMatchCpu), not to the tolerance above; a row mixed up with another sequence's would be
      // far off. A compressed cache turns such differences into other codes (on the H200 with every
      // run skinny: mean KL 0.11 for turboquant_4bit_nc, as between the devices), so it is held to
      // the tight check with cuBLAS alone above.
      std::vector<float> batched, separate;
      auto take = [&](const float* x, std::vector<float>& to) { to.insert(to.end(), x, x + V); };
      take(out.data(), batched);
      take(la.data(), separate);
      for (int t = 0; t < nb; ++t) {
        take(out.data() + static_cast<size_t>(1 + t) * V, batched);  // s1's prefill
        take(lb.data() + static_cast<size_t>(t) * V, separate);
      }
      for (int t = 5; t < nb; ++t) {
        take(out.data() + static_cast<size_t>(1 + nb + t - 5) * V, batched);  // s2's continuation
        take(lb.data() + static_cast<size_t>(t) * V, separate);
      }
      const Agreement ag = compare(separate, batched, V);
      std::printf("[ varlen ] %-20s skinny <= %2d rows: batched vs separate: mean KL %.3g  top-1 %.3f  max |dlogit| %.3g over %zu rows\n",
                  spec.c_str(), skinny, ag.mean_kl, ag.top1, ag.max_abs, separate.size() / V);
      if (skinny == 0 || spec == "f32" || spec == "f16") {
        EXPECT_LE(ag.mean_kl, 1e-3);
        EXPECT_GE(ag.top1, 0.9);
      }
      shared->free_sequence(s0);
      EXPECT_THROW(shared->seq_len(s0), Error);
      EXPECT_GT(shared->add_sequence(), s2);
    }
  }
}

// CUDA graphs (cuda_graphs.h): decode steps replayed from a recorded graph give the tokens of
// the same steps run op by op. Graphs are switched per device; the fixture's model shares one.
class GraphsOff {
 public:
  explicit GraphsOff(Device& d) : d_(d), was_(d.step_graphs()) { d.set_step_graphs(false); }
  ~GraphsOff() { d_.set_step_graphs(was_); }

 private:
  Device& d_;
  bool was_;
};

int recorded(const KvCache& c) {
  const auto* cc = dynamic_cast<const CudaKvCache*>(&c);
  return cc ? cc->graphs_recorded() : -1;
}

// 64 greedy tokens of generate's default prompt: a batch of one (bucket 1), every step after
// the second one replayed.
TEST_F(CudaSmol, GraphsGiveTheSameGreedyTokens) {
  const std::vector<int32_t> prompt = chat("What are the three primary colors? Answer briefly.");
  ASSERT_TRUE(gpu_->device().step_graphs()) << "graphs are on by default (unset TQKV_CUDA_GRAPHS)";
  for (const std::string spec : {"f16", "turboquant_4bit_nc", "tq-4.375"}) {
    SCOPED_TRACE(spec);
    auto cache = gpu_->make_cache(spec, 512);
    const auto* cc = dynamic_cast<const CudaKvCache*>(cache.get());
    ASSERT_NE(cc, nullptr);
    ASSERT_TRUE(cc->graphs_supported());
    GenerateOptions g;
    g.n_predict = 64;
    g.stop_at_end_of_generation = false;
    std::vector<int32_t> with, without;
    generate(*gpu_, *tok_, *cache, cache->add_sequence(), prompt, g, [&](int32_t id) { with.push_back(id); });
    EXPECT_EQ(recorded(*cache), 1);
    {
      GraphsOff off(gpu_->device());
      without = greedy(*gpu_, prompt, spec, 64);
    }
    ASSERT_EQ(with.size(), 64u);
    EXPECT_EQ(with, without) << "graphs: " << tok_->decode(with) << "\nop by op: " << tok_->decode(without);
    std::printf("[ graphs ] %-20s 64 greedy tokens identical: %s\n", spec.c_str(), with == without ? "yes" : "no");
  }
}

// Greedy decode of B sequences of different lengths in one batch per step: a batch that fills
// its bucket (4) and one that is padded (3 -> 4, 5 -> 8), each against the same steps op by op.
// toggle_every > 0: graphs switched on or off every that many steps (replays and op-by-op steps
// on one cache, as bench decode times them).
std::vector<std::vector<int32_t>> batched_greedy(const Model& m, const std::vector<std::vector<int32_t>>& prompts,
                                                 const std::string& spec, int steps, int* graphs,
                                                 int toggle_every = 0) {
  const int V = m.config().n_vocab, B = static_cast<int>(prompts.size());
  auto cache = m.make_cache(spec, 256, B);
  std::vector<int64_t> seqs;
  std::vector<std::vector<int32_t>> out(B);
  std::vector<float> logits(static_cast<size_t>(B) * V);
  for (int b = 0; b < B; ++b) {
    seqs.push_back(cache->add_sequence());
    m.forward(seqs[b], prompts[b].data(), static_cast<int>(prompts[b].size()), *cache, logits.data() + b * V, false);
  }
  Device& dev = m.device();
  const bool graphs_at_start = dev.step_graphs();
  for (int s = 0; s < steps; ++s) {
    if (toggle_every > 0 && s > 0 && s % toggle_every == 0) dev.set_step_graphs(!dev.step_graphs());
    Batch step;
    for (int b = 0; b < B; ++b) {
      const float* row = logits.data() + static_cast<size_t>(b) * V;
      const int32_t id = static_cast<int32_t>(std::max_element(row, row + V) - row);
      out[b].push_back(id);
      step.add(seqs[b], &id, 1, cache->seq_len(seqs[b]), false);
    }
    m.forward(step, *cache, logits.data());
  }
  dev.set_step_graphs(graphs_at_start);
  for (int b = 0; b < B; ++b) EXPECT_EQ(cache->seq_len(seqs[b]), static_cast<int64_t>(prompts[b].size()) + steps);
  *graphs = recorded(*cache);
  return out;
}

// A step that asks for argmax ids (LogitsOut::greedy, picked on the GPU) gives each row's argmax
// of the logits the same step gives, replayed from graphs (bucket 8, 5 rows of it) and op by op.
TEST_F(CudaSmol, GreedyIdsAreTheArgmaxOfTheStepsLogits) {
  const std::vector<std::string> qs = {"Name three rivers.", "What is two plus two?", "Say hello.", "Count to five.",
                                       "Why is the sky blue?"};
  const int V = gpu_->config().n_vocab, B = static_cast<int>(qs.size());
  Device& dev = gpu_->device();
  const bool graphs_at_start = dev.step_graphs();
  for (const bool graphs : {true, false}) {
    SCOPED_TRACE(graphs ? "graphs" : "op by op");
    dev.set_step_graphs(graphs);
    auto with_logits = gpu_->make_cache("turboquant_4bit_nc", 256, B), with_ids = gpu_->make_cache("turboquant_4bit_nc", 256, B);
    std::vector<int64_t> a, b;
    std::vector<int32_t> next(B), ids(B, -1);
    std::vector<float> logits(static_cast<size_t>(B) * V);
    for (int i = 0; i < B; ++i) {
      const std::vector<int32_t> p = chat(qs[i]);
      a.push_back(with_logits->add_sequence());
      b.push_back(with_ids->add_sequence());
      gpu_->forward(a[i], p.data(), static_cast<int>(p.size()), *with_logits, logits.data(), false);
      gpu_->forward(b[i], p.data(), static_cast<int>(p.size()), *with_ids, LogitsOut::greedy(&ids[i]), false);
      next[i] = argmax(logits.data(), V);
      ASSERT_EQ(ids[i], next[i]) << "prefill of sequence " << i;
    }
    for (int s = 0; s < 6; ++s) {
      Batch sa, sb;
      for (int i = 0; i < B; ++i) {
        sa.add(a[i], &next[i], 1, with_logits->seq_len(a[i]), false);
        sb.add(b[i], &next[i], 1, with_ids->seq_len(b[i]), false);
      }
      std::fill(ids.begin(), ids.end(), -1);
      gpu_->forward(sa, *with_logits, logits.data());
      gpu_->forward(sb, *with_ids, LogitsOut::greedy(ids.data()));
      for (int i = 0; i < B; ++i) {
        next[i] = argmax(logits.data() + static_cast<size_t>(i) * V, V);
        ASSERT_EQ(ids[i], next[i]) << "step " << s << " sequence " << i;
      }
    }
    if (graphs) {
      EXPECT_GE(recorded(*with_ids), 1);
    }
  }
  dev.set_step_graphs(graphs_at_start);
}

TEST_F(CudaSmol, GraphsGiveTheSameTokensForBatchesOfDifferentLengths) {
  const std::vector<std::vector<int32_t>> prompts = {
      chat("Name three rivers."), chat("What is two plus two?"),
      chat("Tell me a short story about a robot who learns to paint."), tok_->encode("Once upon a time", false),
      chat("Why is the sky blue? Explain in detail.")};
  for (const std::string spec : {"f16", "tq-4.375"}) {
    for (const int B : {4, 3, 5}) {
      SCOPED_TRACE(spec + " batch " + std::to_string(B));
      const std::vector<std::vector<int32_t>> p(prompts.begin(), prompts.begin() + B);
      int with_graphs = 0, without_graphs = 0;
      const auto with = batched_greedy(*gpu_, p, spec, 24, &with_graphs);
      std::vector<std::vector<int32_t>> without;
      {
        GraphsOff off(gpu_->device());
        without = batched_greedy(*gpu_, p, spec, 24, &without_graphs);
      }
      EXPECT_EQ(with_graphs, 1);
      EXPECT_EQ(without_graphs, 0);
      for (int b = 0; b < B; ++b) EXPECT_EQ(with[b], without[b]) << "sequence " << b;
      // Replays and op-by-op steps taking turns on one cache (each picks up where the other left).
      int mixed_graphs = 0;
      const auto mixed = batched_greedy(*gpu_, p, spec, 24, &mixed_graphs, 5);
      EXPECT_EQ(mixed_graphs, 1);
      for (int b = 0; b < B; ++b) EXPECT_EQ(mixed[b], without[b]) << "sequence " << b << ", graphs on and off in turn";
    }
  }
}

// The same along 24 greedy tokens of a batch of sequences of different lengths (a padded bucket,
// graphs replayed).
TEST_F(CudaSmol, FusedOpsGiveTheSameBatchedTokens) {
  const std::vector<std::vector<int32_t>> prompts = {chat("Name three rivers."), chat("What is 2 + 2?"),
                                                     chat("Write a haiku about the sea.")};
  std::vector<std::vector<int32_t>> tokens[2];
  for (int fused = 0; fused < 2; ++fused) {
    FusedOps scope(gpu_->device(), fused != 0);
    int graphs = 0;
    tokens[fused] = batched_greedy(*gpu_, prompts, "tq-4.375", 24, &graphs);
    EXPECT_EQ(graphs, 1);
  }
  EXPECT_EQ(tokens[0], tokens[1]);
}

// The GPU cache reads back what the CPU cache reads back for the same keys (both decode the
// same slot bytes; centring undone with the same statistics). The keys themselves differ by the
// bf16 weights, so the comparison is relative.
TEST_F(CudaSmol, ReadMatchesCpu) {
  const std::vector<int32_t> ids = tok_->encode("And God said, Let there be light: and there was light.", false);
  const int n = static_cast<int>(ids.size()), H = cpu_->config().n_kv_heads, d = cpu_->config().head_dim;
  for (const std::string spec : {"f16", "fp8", "turboquant_4bit_nc", "tq-k4v4", "k4v4+c"}) {
    SCOPED_TRACE(spec);
    std::vector<float> lc(static_cast<size_t>(cpu_->config().n_vocab)), kc(static_cast<size_t>(n) * H * d), kg(kc.size());
    auto c = cpu_->make_cache(spec, 64);
    auto g = gpu_->make_cache(spec, 64);
    const int64_t sc = c->add_sequence(), sg = g->add_sequence();
    cpu_->forward(sc, ids.data(), n, *c, lc.data(), false);
    gpu_->forward(sg, ids.data(), n, *g, lc.data(), false);
    for (int layer : {2, 9}) {
      for (bool keys : {true, false}) {
        c->read(layer, sc, 0, n, keys, kc.data());
        g->read(layer, sg, 0, n, keys, kg.data());
        double err = 0, mag = 0;
        for (size_t i = 0; i < kc.size(); ++i) {
          err += std::fabs(static_cast<double>(kc[i]) - kg[i]);
          mag += std::fabs(static_cast<double>(kc[i]));
        }
        std::printf("[ read ] %-20s layer %d %s: mean |cpu - gpu| / mean |cpu| = %.4f\n", spec.c_str(), layer,
                    keys ? "keys" : "values", err / mag);
        // Past the first compressed layer the devices' inputs have drifted apart (see LogitsMatchCpu).
        if (layer == 2) {
          EXPECT_LT(err, 0.05 * mag) << (keys ? "keys" : "values") << " layer " << layer;
        }
      }
    }
    EXPECT_THROW(g->read(9, sg, 0, n + 1, true, kg.data()), Error);
  }
}

// The cache layer alone, the same inputs on both devices: the GPU stores the bytes the CPU
// stores (so reads agree exactly), and attention agrees closely, layer by layer.
// steps: the tokens of each step (a prefill chunk, then single tokens).
// read_layer's positions [read_from, end) are read back (a ring layer holds only its last ones).
void compare_cache_layers(const ModelConfig& m, const std::string& name, int capacity, const std::vector<int>& steps,
                          int read_layer, int read_from = 0) {
  SCOPED_TRACE(name);
  // The CPU in fp32 throughout: its default int8 key scores and value sums (tqkv/simd.h) carry
  // their own error (up to 0.019 here), which would hide the GPU's.
  const testing_util::ScoresGuard exact(KeyScores::Exact);
  std::shared_ptr<Device> gpu = make_device("cuda");
  std::shared_ptr<Device> cpu = make_device("cpu");
  int n = 0;
  for (int c : steps) n += c;
  const int qd = m.n_heads * m.head_dim, kd = m.n_kv_heads * m.head_dim;
  std::vector<float> q(static_cast<size_t>(n) * qd), k(static_cast<size_t>(n) * kd), v(k.size());
  uint64_t x = 12345;
  auto rnd = [&] {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<int64_t>(x >> 11) % 2000001 - 1000000) / 1e6f;
  };
  for (float& e : q) e = rnd();
  for (float& e : k) e = 2.0f * rnd() + 0.3f;
  for (float& e : v) e = rnd();
  const CacheSpec spec = resolve_cache_spec(name, m);
  auto cc = cpu->make_cache(spec, CacheShape{capacity, 1});
  auto gc = gpu->make_cache(spec, CacheShape{capacity, 1});
  std::vector<float> oc(q.size()), og(q.size());
  const int64_t sc = cc->add_sequence();
  gc->add_sequence();
  DeviceBuffer qg = gpu->load_vector(q.data(), q.size()), kg = gpu->load_vector(k.data(), k.size()),
               vg = gpu->load_vector(v.data(), v.size()), out = gpu->alloc(q.size());
  std::vector<float> qc = q, kc = k;
  std::vector<int32_t> ids(n, 1);
  int t0 = 0;
  double worst = 0;  // attention, over every layer and token
  for (int cnt : steps) {
    Batch b;
    b.add(sc, ids.data(), cnt, t0, true);
    const size_t qo = static_cast<size_t>(t0) * qd, ko = static_cast<size_t>(t0) * kd;
    for (int layer = 0; layer < m.n_layers; ++layer) {
      cc->attend(layer, b, qc.data() + qo, kc.data() + ko, v.data() + ko, oc.data() + qo);
      gc->attend(layer, b, qg.data() + qo, kg.data() + ko, vg.data() + ko, out.data() + qo);
      gpu->to_host(out.data(), og.size(), og.data());
      for (size_t i = qo; i < qo + static_cast<size_t>(cnt) * qd; ++i)
        worst = std::max(worst, std::fabs(static_cast<double>(oc[i]) - og[i]));
    }
    t0 += cnt;
  }
  std::vector<float> rc(static_cast<size_t>(n - read_from) * kd), rg(rc.size());
  for (bool keys : {true, false}) {
    cc->read(read_layer, 0, read_from, n - read_from, keys, rc.data());
    gc->read(read_layer, 0, read_from, n - read_from, keys, rg.data());
    double worst = 0;
    for (size_t i = 0; i < rc.size(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(rc[i]) - rg[i]));
    std::printf("[ cache ] %-20s %s: max |cpu - gpu| read %.3g\n", name.c_str(), keys ? "keys" : "values", worst);
    // The same bytes decoded by the same arithmetic: 0 in every logged run (docs/gpu_*).
    EXPECT_EQ(worst, 0.0) << (keys ? "keys" : "values");
  }
  std::printf("[ cache ] %-20s attention: max |cpu - gpu| %.3g\n", name.c_str(), worst);
  // The GPU rounds Q, K, V and P to fp16 (2^-11) for its tensor cores; against an fp32 CPU the
  // logged worst is 3.8e-4 (f16, fp8, k5v5: specs the CPU already ran in fp32). 5x that.
  EXPECT_LT(worst, 2e-3);
}

ModelConfig cache_test_model(int n_layers, int n_heads, int n_kv_heads, int head_dim = 64) {
  ModelConfig m;
  m.arch = "llama";
  m.n_layers = n_layers;
  m.n_heads = n_heads;
  m.n_kv_heads = n_kv_heads;
  m.head_dim = head_dim;
  m.rope.n_rot = head_dim;
  m.layer_window.assign(n_layers, 0);
  return m;
}

// The last five keep copies: attention sinks and a recent window (f16 or wq6) as the recipes
// tq-4.375 / tq-3.375 do, on 5- and 6-bit keys and 2-bit values. Each runs a prefill of 34
// tokens (every query its own key ranges) and then 3 decode steps.
TEST(CudaCacheLayer, SameInputsSameCodesAsCpu) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  const ModelConfig m = cache_test_model(2, 6, 2);
  for (const std::string name : {"f16", "fp8", "turboquant_4bit_nc", "tq-k4v4", "tq-k3v2", "k5v3", "k2v2+sink1+wq6+w7",
                                 "k5v3+sink1+w5", "k6v3+sink2+wq6+w11", "tq-k4v2+sink1", "tq-k3v2+w9"}) {
    compare_cache_layers(m, name + "+skip0", 64, {34, 1, 1, 1}, 1);  // 2 layers: no f16 boundary
    if (HasFatalFailure()) return;
  }
}

// Copies with sliding-window layers (Gemma 3's local layers: here a window of 64): every part
// cut by the layer's window, the sink read only while it is inside it. Both devices keep rings
// of 64 + 255 positions; 402 positions run past the window and wrap the rings. d = 64 with a fused kernel (k5v3 + wq6), d = 256 by three launches; read back from the
// full-attention layer.
TEST(CudaCacheLayer, CopiesWithSlidingWindowLayersMatchCpu) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  for (int d : {64, 256}) {
    ModelConfig m = cache_test_model(4, 4, 1, d);
    m.layer_window = {64, 64, 0, 64};
    for (const std::string name : {"k5v3+sink1+wq6+w16+skip0", "k3v2+sink1+w8+skip0", "k4v4+wq6+w64+skip0"}) {
      const CacheSpec spec = resolve_cache_spec(name, m);
      ASSERT_GT(spec.ring_positions(0, 1024), 0) << name;  // the CPU keeps its rings
      compare_cache_layers(m, name, 1024, {200, 200, 1, 1}, 2);
      if (HasFatalFailure()) return;
    }
  }
}

// Sliding-window layers keep rings on the GPU as on the CPU (CacheSpec::ring_positions: the
// window + 255 positions): their pools hold a ring per sequence instead of the capacity, steps
// take at most 256 tokens, and over 803 positions (the rings wrap twice) attention agrees with the
// CPU's and a ring layer's last positions read back the same — without copies (decode rows cut
// by the window; and by the tiled path, which dequantizes only the window), with copies (rows
// cut by the window in every part), and for a pair without a compiled kernel (its ring
// converted to f16). Positions that left a ring are refused.
TEST(CudaCacheLayer, SlidingWindowLayersKeepRingsAsCpu) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  auto dev = std::make_shared<CudaDevice>();
  ModelConfig m = cache_test_model(4, 4, 1, 64);
  m.layer_window = {64, 64, 0, 64};
  const int capacity = 2048, ring = 64 + CacheSpec::kWindowStepTokens - 1;
  const std::vector<int> steps = {256, 200, 144, 201, 1, 1};
  const int n = 803;
  for (const std::string name : {"f16", "tq-k4v4+skip0", "k5v3+sink1+wq6+w16+skip0", "k7v3+sink1+wq7+w5+skip0"}) {
    SCOPED_TRACE(name);
    const CacheSpec spec = resolve_cache_spec(name, m);
    ASSERT_EQ(spec.ring_positions(0, capacity), ring);
    {
      auto cache = dev->make_cache(spec, CacheShape{capacity, 1});
      auto* cc = dynamic_cast<CudaKvCache*>(cache.get());
      ASSERT_TRUE(cc);
      EXPECT_EQ(cc->max_step_tokens(), CacheSpec::kWindowStepTokens);
      // Three ring layers of ceil(319 / 16) + 1 = 21 blocks and one of 128, against 4 x 128.
      const CacheSpec flat = resolve_cache_spec(name, cache_test_model(4, 4, 1, 64));
      auto whole = dev->make_cache(flat, CacheShape{capacity, 1});
      const size_t full = dynamic_cast<CudaKvCache*>(whole.get())->pool_bytes();
      // The copies' own rings (N + 512 positions in every layer) are the same in both.
      EXPECT_LT(cc->pool_bytes(), spec.sinks > 0 ? full : full / 2);
      // Filled past the ring, a read of what left it is refused.
      std::vector<float> x(static_cast<size_t>(n) * 64 * 4, 0.5f), o(x.size());
      const int64_t seq = cc->add_sequence();
      DeviceBuffer xg = dev->load_vector(x.data(), x.size()), og = dev->alloc(x.size());
      std::vector<int32_t> ids(n, 1);
      int t0 = 0;
      for (int c : steps) {
        Batch b;
        b.add(seq, ids.data(), c, t0, true);
        for (int l = 0; l < 4; ++l) {
          const size_t qo = static_cast<size_t>(t0) * 4 * 64, ko = static_cast<size_t>(t0) * 64;
          cc->attend(l, b, xg.data() + qo, xg.data() + ko, xg.data() + ko, og.data() + qo);
        }
        t0 += c;
      }
      std::vector<float> r(static_cast<size_t>(ring) * 64);
      EXPECT_NO_THROW(cc->read(0, seq, n - ring, ring, true, r.data()));
      EXPECT_THROW(cc->read(0, seq, n - ring - 1, ring, true, r.data()), Error);
      EXPECT_NO_THROW(cc->read(2, seq, 0, ring, true, r.data()));  // the full-attention layer keeps all
      Batch big;
      big.add(seq, ids.data(), CacheSpec::kWindowStepTokens + 1, n, true);
      EXPECT_THROW(cc->attend(0, big, xg.data(), xg.data(), xg.data(), og.data()), Error);
    }
    compare_cache_layers(m, name, capacity, steps, 0, n - ring);  // a ring layer
    if (HasFatalFailure()) return;
    compare_cache_layers(m, name, capacity, steps, 2);  // the full-attention layer
    if (HasFatalFailure()) return;
    if (spec.sinks > 0) continue;
    {  // prefill chunks by the tiled kernel over the window's dequantized positions
      testing_util::ScopedEnv env("TQKV_PREFILL_PATH", "tiled");
      compare_cache_layers(m, name, capacity, steps, 0, n - ring);
    }
    if (HasFatalFailure()) return;
  }
}

// The recipes' layers and copies on SmolLM2's shape (30 layers, 9:3 heads, d = 64) without the
// key centring (no key statistics here): tq-4.375's 5/6-bit keys, tq-3.375's and tq-2.5's 2-bit
// codes, the sink and the wq6 window of fill<B> at capacity 512 (7, 18 and 8 positions); then a
// window ring that wraps (two 300-token chunks into a ring of 544 positions).
TEST(CudaCacheLayer, RecipesWithSinksAndWindowMatchCpu) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  const ModelConfig m = cache_test_model(30, 9, 3);
  for (const std::string name :
       {"k5v3+L4.5.6.7.8.24.25=k4v3+L3.10.11=k4v4+L2.12.13.16.19.23=k5v4+L17=k6v3+sink1+wq6+fill4.375",
        "k3v2+L11=k2v2+L5.7.8.9.16.18.20.26=k4v2+L14.15.17.21.23.24=k4v3+sink1+wq6+fill3.375",
        "k2v2+L5.8.9.14.20.23=k3v2+sink1+wq6+fill2.5"}) {
    compare_cache_layers(m, name, 512, {40, 1, 1, 1}, 17);
    if (HasFatalFailure()) return;
  }
  compare_cache_layers(cache_test_model(2, 6, 2), "k5v3+sink1+w5+skip0", 1024, {300, 300, 1, 1}, 1);
}

// A plain and a graphed cache of one spec with fixed device inputs per layer (a replay reads
// them where the recording did): q, k, v and each cache's output, `rows` rows. Attention writes
// q and k in place only with centring, which the specs here lack: both caches see the same inputs.
struct RecordedTwins {
  const ModelConfig& m;
  std::shared_ptr<CudaDevice> dev;
  std::unique_ptr<KvCache> plain, graphed;
  CudaKvCache* g = nullptr;
  std::vector<DeviceBuffer> q, k, v, out_plain, out_graphed;
  uint64_t x;
  int64_t a = 0, b = 0;
  cudaGraphExec_t exec = nullptr;

  RecordedTwins(const ModelConfig& model, const std::shared_ptr<CudaDevice>& d, const std::string& name, int capacity,
                int rows, uint64_t seed)
      : m(model), dev(d), x(seed) {
    const CacheSpec spec = resolve_cache_spec(name, m);
    plain = dev->make_cache(spec, CacheShape{capacity, 2});
    graphed = dev->make_cache(spec, CacheShape{capacity, 2});
    g = dynamic_cast<CudaKvCache*>(graphed.get());
    a = plain->add_sequence();
    b = plain->add_sequence();
    graphed->add_sequence();
    graphed->add_sequence();
    const int qd = m.n_heads * m.head_dim, kd = m.n_kv_heads * m.head_dim;
    for (int l = 0; l < m.n_layers; ++l) {
      q.push_back(dev->alloc(static_cast<size_t>(rows) * qd));
      k.push_back(dev->alloc(static_cast<size_t>(rows) * kd));
      v.push_back(dev->alloc(static_cast<size_t>(rows) * kd));
      out_plain.push_back(dev->alloc(static_cast<size_t>(rows) * qd));
      out_graphed.push_back(dev->alloc(static_cast<size_t>(rows) * qd));
    }
  }
  ~RecordedTwins() {
    if (exec) cudaGraphExecDestroy(exec);
  }
  float rnd() {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<int64_t>(x >> 11) % 2000001 - 1000000) / 1e6f;
  }
  void fill(int n) {  // new random inputs (k positive-shifted as in compare_cache_layers)
    const int qd = m.n_heads * m.head_dim, kd = m.n_kv_heads * m.head_dim;
    for (int l = 0; l < m.n_layers; ++l) {
      std::vector<float> hq(static_cast<size_t>(n) * qd), hk(static_cast<size_t>(n) * kd), hv(hk.size());
      for (float& e : hq) e = rnd();
      for (float& e : hk) e = 2.0f * rnd() + 0.3f;
      for (float& e : hv) e = rnd();
      dev->to_device(hq.data(), hq.size(), q[l].data());
      dev->to_device(hk.data(), hk.size(), k[l].data());
      dev->to_device(hv.data(), hv.size(), v[l].data());
    }
  }
  void run_layers(KvCache& c, const Batch& batch, std::vector<DeviceBuffer>& out) {
    for (int l = 0; l < m.n_layers; ++l) c.attend(l, batch, q[l].data(), k[l].data(), v[l].data(), out[l].data());
  }
  // `batch` (new random inputs) op by op in both caches.
  void both(const Batch& batch) {
    fill(batch.size());
    run_layers(*plain, batch, out_plain);
    run_layers(*graphed, batch, out_graphed);
  }
  // Decode step number s of both sequences at positions pa and pb: op by op in the plain cache;
  // in the graphed one step 0 warms up (plans and workspaces), step 1 is recorded, later steps
  // replay it. Returns the largest |difference| of the two caches' outputs and raises scale to
  // the largest output.
  double step(int s, int64_t pa, int64_t pb, double& scale) {
    static const int32_t id = 1;
    Batch st;
    st.add(a, &id, 1, pa, true);
    st.add(b, &id, 1, pb, true);
    fill(2);
    run_layers(*plain, st, out_plain);
    g->prepare_bucket(st, 2);
    if (s == 0) {
      run_layers(*graphed, st, out_graphed);
    } else if (s == 1) {
      EXPECT_EQ(cudaStreamBeginCapture(dev->stream(), cudaStreamCaptureModeRelaxed), cudaSuccess);
      run_layers(*graphed, st, out_graphed);
      cudaGraph_t graph = nullptr;
      EXPECT_EQ(cudaStreamEndCapture(dev->stream(), &graph), cudaSuccess);
      EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      cudaGraphDestroy(graph);
    } else {
      g->cancel_bucket();
    }
    if (exec) {
      EXPECT_EQ(cudaGraphLaunch(exec, dev->stream()), cudaSuccess);
    }
    const int qd = m.n_heads * m.head_dim;
    double worst = 0;
    for (int l = 0; l < m.n_layers; ++l) {
      std::vector<float> op(static_cast<size_t>(2) * qd), gr(op.size());
      dev->to_host(out_plain[l].data(), op.size(), op.data());
      dev->to_host(out_graphed[l].data(), gr.size(), gr.data());
      for (size_t i = 0; i < op.size(); ++i) {
        worst = std::max(worst, std::fabs(static_cast<double>(op[i]) - gr[i]));
        scale = std::max(scale, std::fabs(static_cast<double>(op[i])));
      }
    }
    return worst;
  }
};

// Qwen2.5-Coder-1.5B's recipes, as shipped (recipes/qwen2.5-coder-1.5b-instruct.json) but without
// the key centring (no key statistics here), on its shape (28 layers, 12:2 heads, d = 128): first
// a k5v5 layer with a sink and a wq6 window (refused before the kernels came from the recipes),
// then tq-4.375, tq-3.375 and tq-2.5 on every layer, their fill<B> window at capacity 512.
const char* const kQwen15bRecipes[] = {
    "k4v3+skip0+L1=k3v2+L0.3=k3v3+L10.12.14=k4v4+L5.13.25.27=k5v3+L16.23.26=k5v4+L11.15.20.21=k5v5+L19=k6v4+sink1+wq6+"
    "fill4.1875",
    "k3v2+skip0+L0.1.3.7=k2v2+L10=k3v3+L5.12.13.25.27=k4v2+L16.23.26=k4v3+L11.15.21=k4v4+L19=k5v3+L20=k5v4+sink1+wq6+"
    "fill3.1875",
    "k2v2+skip0+L19=k3v2+L20=k3v3+sink1+wq6+fill2.3125"};

TEST(CudaCacheLayer, Qwen15bRecipesMatchCpu) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  compare_cache_layers(cache_test_model(2, 12, 2, 128), "k5v5+sink1+wq6+w8+skip0", 64, {34, 1, 1, 1}, 1);
  if (HasFatalFailure()) return;
  for (const char* name : kQwen15bRecipes) {
    compare_cache_layers(cache_test_model(28, 12, 2, 128), name, 512, {40, 1, 1, 1}, 11);
    if (HasFatalFailure()) return;
  }
}

// Copies beside pairs without a compiled kernel (values of 6-8 bits but k6v6: tqkv/format.h): the generic path
// (the pool converted to f16 each step, read by the f16 kernel, merged by log-sum-exp) against the
// CPU, for the compressed middle, the window's wq<B> ring and both, at every head dim, uniform
// values, and a window ring that wraps (two 300-token chunks into a ring of 544 positions).
TEST(CudaCacheLayer, PairsWithoutKernelsWithCopiesMatchCpu) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  auto dev = std::make_shared<CudaDevice>();
  struct Case {
    int d;
    std::string spec;
    int capacity;
    std::vector<int> steps;
  };
  const std::vector<Case> cases = {
      {128, "k3v7+sink1+wq6+w8+skip0", 64, {34, 1, 1, 1}},       // the middle
      {128, "k4v4+sink1+wq7+w8+skip0", 64, {34, 1, 1, 1}},       // the window
      {64, "k2v7+vu+sink2+wq8+w6+skip0", 64, {34, 1, 1, 1}},     // both, uniform values
      {256, "k3v6+sink1+w7+skip0", 64, {34, 1, 1, 1}},           // d = 256, an f16 window
      {64, "k2v8+w16+skip0", 64, {34, 1, 1, 1}},                 // a window alone
      {64, "k3v7+sink1+wq7+w5+skip0", 1024, {300, 300, 1, 1}},  // the ring wraps
  };
  for (const Case& c : cases) {
    const ModelConfig m = cache_test_model(2, 6, 2, c.d);
    {
      auto cache = dev->make_cache(resolve_cache_spec(c.spec, m), CacheShape{c.capacity, 1});
      const auto* cc = dynamic_cast<const CudaKvCache*>(cache.get());
      ASSERT_TRUE(cc);
      EXPECT_EQ(cc->generic_layers(), 2) << c.spec;
      EXPECT_EQ(cc->fused_layers(), 0) << c.spec;
    }
    compare_cache_layers(m, c.spec, c.capacity, c.steps, 1);
    if (HasFatalFailure()) return;
  }
}

// A prefill of 20 and 13 tokens into both caches of `t`, then `steps` decode steps of both
// sequences, recorded and replayed in t.graphed, op by op in t.plain: worst is the largest
// difference of their outputs.
void replay_steps(RecordedTwins& t, int steps, double& worst) {
  ASSERT_NE(t.g, nullptr);
  ASSERT_TRUE(t.g->graphs_supported());
  std::vector<int32_t> ids(20, 1);
  Batch prefill;
  prefill.add(t.a, ids.data(), 20, 0, true);
  prefill.add(t.b, ids.data(), 13, 0, true);
  t.both(prefill);
  double scale = 0;
  for (int s = 0; s < steps; ++s) {
    worst = std::max(worst, t.step(s, 20 + s, 13 + s, scale));
    if (::testing::Test::HasFailure()) return;
  }
}

// The cache layer's part of a CUDA graph (CudaDevice::run_step records the rest): decode steps of
// two sequences of different lengths prepared into a bucket, recorded once and replayed, give
// the outputs of the same steps run op by op on a twin cache, bit for bit, with sinks and a
// window (their decodes forked onto side streams while recorded: parallel branches of the
// graph; on one stream op by op) over steps that move the ring past the window.
TEST(CudaCacheLayer, RecordedDecodeStepsMatchOpByOp) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  const ModelConfig m = cache_test_model(2, 6, 2);
  auto dev = std::make_shared<CudaDevice>();
  const int steps = 12;
  for (const std::string name : {"f16+skip0", "k5v3+sink1+w5+skip0", "k6v3+sink2+wq6+w11+skip0"}) {
    SCOPED_TRACE(name);
    RecordedTwins t(m, dev, name, 64, 20 + 13, 777);  // the prefill's rows; decode steps use the first 2
    double worst = 0;
    replay_steps(t, steps, worst);
    if (HasFailure()) return;
    EXPECT_EQ(t.plain->seq_len(t.a), 20 + steps);
    EXPECT_EQ(t.graphed->seq_len(t.b), 13 + steps);
    std::printf("[ graphs ] %-28s replayed vs op by op: max |diff| %.3g over %d steps\n", name.c_str(), worst, steps);
    EXPECT_EQ(worst, 0.0);
  }
}

// The same with a sliding-window layer (a window of 16 that every step's rows cut; at capacity
// 512 its ring of 271 positions is shorter than the sequence's pages): its rows replay as
// recorded, with and without copies.
TEST(CudaCacheLayer, RecordedDecodeStepsWithSlidingWindowMatchOpByOp) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  ModelConfig m = cache_test_model(2, 6, 2);
  m.layer_window = {16, 0};
  auto dev = std::make_shared<CudaDevice>();
  const int steps = 12;
  for (const std::string name : {"f16+skip0", "tq-k4v4+skip0", "k5v3+sink1+wq6+w5+skip0"}) {
    SCOPED_TRACE(name);
    RecordedTwins t(m, dev, name, 512, 20 + 13, 778);
    double worst = 0;
    replay_steps(t, steps, worst);
    if (HasFailure()) return;
    std::printf("[ graphs ] %-28s sliding window: max |diff| %.3g over %d steps\n", name.c_str(), worst, steps);
    EXPECT_EQ(worst, 0.0);
  }
}

using tqkv::testing_util::ScopedEnv;

// A cache made while the environment variable `name` is `value` (a cache reads its knobs once).
std::unique_ptr<KvCache> make_cache_with(Device& dev, const CacheSpec& spec, CacheShape shape, const char* name,
                                         const char* value) {
  ScopedEnv env(name, value);
  return dev.make_cache(spec, shape);
}

// Two caches of one model shape attend the same random inputs, layer by layer: the largest
// difference of their outputs (worst) and the largest output of the second (scale).
struct TwinCaches {
  CudaDevice& dev;
  const ModelConfig& m;
  KvCache& first;
  KvCache& second;
  uint64_t x = 4242;
  double worst = 0, scale = 0;

  float rnd() {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<int64_t>(x >> 11) % 2000001 - 1000000) / 1e6f;
  }
  // Every layer of `batch` in both caches.
  void run(const Batch& batch) {
    const int n = batch.size(), qd = m.n_heads * m.head_dim, kd = m.n_kv_heads * m.head_dim;
    std::vector<float> hq(static_cast<size_t>(n) * qd), hk(static_cast<size_t>(n) * kd), hv(hk.size());
    for (int l = 0; l < m.n_layers; ++l) {
      for (float& e : hq) e = rnd();
      for (float& e : hk) e = 2.0f * rnd() + 0.3f;
      for (float& e : hv) e = rnd();
      std::vector<float> o1(hq.size()), o2(hq.size());
      for (KvCache* cache : {&first, &second}) {
        // Centring rewrites q and k in place: each cache gets fresh copies of the inputs.
        DeviceBuffer q = dev.load_vector(hq.data(), hq.size()), k = dev.load_vector(hk.data(), hk.size()),
                     v = dev.load_vector(hv.data(), hv.size()), o = dev.alloc(hq.size());
        cache->attend(l, batch, q.data(), k.data(), v.data(), o.data());
        dev.to_host(o.data(), o1.size(), cache == &first ? o1.data() : o2.data());
      }
      for (size_t i = 0; i < o1.size(); ++i) {
        worst = std::max(worst, std::fabs(static_cast<double>(o1[i]) - o2[i]));
        scale = std::max(scale, std::fabs(static_cast<double>(o2[i])));
      }
    }
  }
};

// Both caches of `twin` take two new sequences, a prefill of 40 and 23 tokens (every query its own
// key ranges), then 8 decode steps of both.
void prefill_then_decode(TwinCaches& twin) {
  const int64_t a = twin.first.add_sequence(), b = twin.first.add_sequence();
  ASSERT_EQ(twin.second.add_sequence(), a);
  ASSERT_EQ(twin.second.add_sequence(), b);
  std::vector<int32_t> ids(70, 1);
  Batch prefill;
  prefill.add(a, ids.data(), 40, 0, true);
  prefill.add(b, ids.data(), 23, 0, true);
  twin.run(prefill);
  for (int s = 0; s < 8; ++s) {
    Batch step;
    step.add(a, ids.data(), 1, 40 + s, true);
    step.add(b, ids.data(), 1, 23 + s, true);
    twin.run(step);
  }
}

// The fused decode of the copies (sinks, compressed middle, window in one launch) against the
// three launches and two merges (TQKV_FUSED_MAX_ROWS=0), on the same inputs: the recipes' layers on
// SmolLM2's shape, f16 and wq6 windows, sinks alone, a window alone.
TEST(CudaCacheLayer, FusedDecodeMatchesThreeLaunches) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  auto dev = std::make_shared<CudaDevice>();
  struct Case {
    ModelConfig m;
    std::string spec;
    int capacity;
  };
  const std::vector<Case> cases = {
      {cache_test_model(30, 9, 3),
       "k5v4+skip0+L11.29=k3v2+L0.1=k3v4+L27=k4v2+L2.7.10.28=k4v3+L3.4=k4v4+L9.13.16.19.22.25.26=k5v3+L23=k6v5+sink1+wq6+fill4.375",
       512},
      {cache_test_model(30, 9, 3),
       "k4v2+skip0+L11.29=k2v2+L0.1=k2v3+L2.12.19.25.27.28=k3v2+L4.8.14.15.17.18.20.21.24=k4v3+L23=k5v4+sink1+wq6+fill3.375",
       512},
      {cache_test_model(2, 6, 2), "k5v3+sink1+w5+skip0", 128},
      {cache_test_model(2, 6, 2), "k6v3+sink2+wq6+w11+skip0", 128},
      {cache_test_model(2, 6, 2), "k5v3+sink1+skip0", 128},
      {cache_test_model(2, 6, 2), "k5v3+w9+skip0", 128},
      // Qwen2.5-Coder-1.5B's recipes (d = 128, 12:2 heads): every layer fused.
      {cache_test_model(28, 12, 2, 128), kQwen15bRecipes[0], 512},
      {cache_test_model(28, 12, 2, 128), kQwen15bRecipes[1], 512},
      {cache_test_model(28, 12, 2, 128), kQwen15bRecipes[2], 512},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.spec);
    const CacheSpec spec = resolve_cache_spec(c.spec, c.m);
    auto fused = dev->make_cache(spec, CacheShape{c.capacity, 2});
    std::unique_ptr<KvCache> three;
    {
      ScopedEnv off("TQKV_FUSED_MAX_ROWS", "0");
      three = dev->make_cache(spec, CacheShape{c.capacity, 2});
    }
    const auto* fc = dynamic_cast<const CudaKvCache*>(fused.get());
    const auto* tc = dynamic_cast<const CudaKvCache*>(three.get());
    ASSERT_TRUE(fc && tc);
    EXPECT_EQ(fc->fused_layers(), c.m.n_layers);
    TwinCaches twin{*dev, c.m, *fused, *three};
    prefill_then_decode(twin);
    std::printf("[ fused ] %-24.24s fused vs three launches: max |diff| %.3g (outputs up to %.3g)\n", c.spec.c_str(),
                twin.worst, twin.scale);
    EXPECT_LT(twin.worst, 5e-3);
    EXPECT_GT(twin.scale, 0.0);
  }
}

// Each decode row's own position is folded in from the layer's k and v (cuda::NewestKv), fused
// and in three launches: a sequence's first token attends to itself alone, so its output is its
// value bit for bit; later rows differ from reading the position's copy back (TQKV_FOLD_NEWEST=0).
// (That the fold agrees with the CPU's is compare_cache_layers'; that a recorded step, whose store
// runs beside the decode, replays the op-by-op outputs is RecordedDecodeStepsMatchOpByOp's.)
TEST(CudaCacheLayer, OwnPositionFoldedInExactly) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  auto dev = std::make_shared<CudaDevice>();
  const ModelConfig m = cache_test_model(2, 6, 2);
  const int qd = m.n_heads * m.head_dim, kd = m.n_kv_heads * m.head_dim, group = m.n_heads / m.n_kv_heads;
  for (const char* fused_max_rows : {"256", "0"}) {  // fused; the three launches
    for (const std::string name : {"k2v2+sink1+w4+skip0", "k3v2+sink2+skip0", "k3v2+w3+skip0"}) {
      SCOPED_TRACE(name + " fused max rows " + fused_max_rows);
      ScopedEnv mode("TQKV_FUSED_MAX_ROWS", fused_max_rows);
      const CacheSpec spec = resolve_cache_spec(name, m);
      auto cache = dev->make_cache(spec, CacheShape{64, 2});
      const int64_t seq = cache->add_sequence();
      std::vector<float> hq(qd), hk(kd), hv(kd);
      for (size_t i = 0; i < hq.size(); ++i) hq[i] = std::sin(0.37f * static_cast<float>(i));
      for (size_t i = 0; i < hk.size(); ++i) hk[i] = std::cos(0.11f * static_cast<float>(i)) + 0.3f;
      for (size_t i = 0; i < hv.size(); ++i) hv[i] = std::sin(0.23f * static_cast<float>(i) + 1.0f);
      const int32_t id = 1;
      Batch first;
      first.add(seq, &id, 1, 0, true);
      for (int layer = 0; layer < m.n_layers; ++layer) {
        DeviceBuffer q = dev->load_vector(hq.data(), hq.size()), k = dev->load_vector(hk.data(), hk.size()),
                     v = dev->load_vector(hv.data(), hv.size()), o = dev->alloc(hq.size());
        cache->attend(layer, first, q.data(), k.data(), v.data(), o.data());
        std::vector<float> out(hq.size());
        dev->to_host(o.data(), out.size(), out.data());
        if (layer == 0) continue;  // skip0: an f16 layer without copies reads p back from its pool
        for (int h = 0; h < m.n_heads; ++h)
          for (int i = 0; i < m.head_dim; ++i)
            ASSERT_EQ(out[static_cast<size_t>(h) * m.head_dim + i], hv[static_cast<size_t>(h / group) * m.head_dim + i])
                << "layer " << layer << " head " << h << " dim " << i;
      }
      // Later rows: the fold against reading p back from its copy or code.
      auto folded = dev->make_cache(spec, CacheShape{64, 2});
      auto read_back = make_cache_with(*dev, spec, CacheShape{64, 2}, "TQKV_FOLD_NEWEST", "0");
      TwinCaches twin{*dev, m, *folded, *read_back};
      prefill_then_decode(twin);
      std::printf("[ fold ] %-22s fused max rows %s: folded vs read back max |diff| %.3g (outputs up to %.3g)\n",
                  name.c_str(), fused_max_rows, twin.worst, twin.scale);
      EXPECT_GT(twin.worst, 1e-4);
      EXPECT_LT(twin.worst, 0.5 * twin.scale);
    }
  }
}

// Without the cluster merge (many rows), the fused grid runs in either dispatch order: every
// window and sink CTA first (TQKV_FUSED_SHORT_FIRST=1; the default where the grid takes more
// than one wave) or (sequence, kv head) by (sequence, kv head); both against the three launches.
TEST(CudaCacheLayer, FusedDecodeInEitherDispatchOrderMatchesThreeLaunches) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  auto dev = std::make_shared<CudaDevice>();
  const std::vector<std::pair<ModelConfig, std::string>> cases = {
      {cache_test_model(30, 9, 3),
       "k5v4+skip0+L11.29=k3v2+L0.1=k3v4+L27=k4v2+L2.7.10.28=k4v3+L3.4=k4v4+L9.13.16.19.22.25.26=k5v3+L23=k6v5+sink1+wq6+fill4.375"},
      {cache_test_model(28, 12, 2, 128), kQwen15bRecipes[0]},
      {cache_test_model(2, 6, 2), "k5v3+sink2+w9+skip0"},
  };
  for (const auto& [m, name] : cases)
    for (const char* order : {"1", "0"}) {
      SCOPED_TRACE(name + " short-first " + order);
      const CacheSpec spec = resolve_cache_spec(name, m);
      std::unique_ptr<KvCache> fused, three;
      {
        ScopedEnv no_cluster("TQKV_FUSED_CLUSTER", "0");
        ScopedEnv first("TQKV_FUSED_SHORT_FIRST", order);
        fused = dev->make_cache(spec, CacheShape{512, 2});
      }
      {
        ScopedEnv off("TQKV_FUSED_MAX_ROWS", "0");
        three = dev->make_cache(spec, CacheShape{512, 2});
      }
      const auto* fc = dynamic_cast<const CudaKvCache*>(fused.get());
      ASSERT_TRUE(fc);
      EXPECT_EQ(fc->fused_layers(), m.n_layers);
      TwinCaches twin{*dev, m, *fused, *three};
      prefill_then_decode(twin);
      EXPECT_LT(twin.worst, 5e-3);
      EXPECT_GT(twin.scale, 0.0);
    }
}

// Every fused kernel (src/cuda/decode_pairs.cmake: the fixed set of tqkv/format.h, each spec pair
// with a wq6 window, at every head dim) against the three launches, one layer each: every Mse pair
// of 2..8 bits with a wq6 window at d = 64, 128 and 256; exactly the set has a fused kernel.
TEST(CudaCacheLayer, EveryFusedKernelMatchesThreeLaunches) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  auto dev = std::make_shared<CudaDevice>();
  auto in_set = [](int k, int v) {
    return k >= kKernelMinBits && k <= kKernelMaxKeyBits && v >= kKernelMinBits && v <= kKernelMaxValueBits;
  };
  int in_set_count = 0;
  int fused_count = 0;
  double worst = 0;
  for (int d : {64, 128, 256})
    for (int k = 2; k <= 8; ++k)
      for (int v = 2; v <= 8; ++v) {
        const std::string pair = std::string("k") + std::to_string(k) + "v" + std::to_string(v);
        const std::string name = pair + "+sink1+wq6+w9+skip0";
        SCOPED_TRACE(name + " d=" + std::to_string(d));
        const ModelConfig m = cache_test_model(1, 6, 2, d);
        const CacheSpec spec = resolve_cache_spec(name, m);
        auto fused = dev->make_cache(spec, CacheShape{96, 2});
        const auto* fc = dynamic_cast<const CudaKvCache*>(fused.get());
        ASSERT_TRUE(fc);
        EXPECT_EQ(fc->fused_layers(), in_set(k, v) ? 1 : 0);
        in_set_count += in_set(k, v);
        if (fc->fused_layers() == 0) continue;
        ++fused_count;
        std::unique_ptr<KvCache> three;
        {
          ScopedEnv off("TQKV_FUSED_MAX_ROWS", "0");
          three = dev->make_cache(spec, CacheShape{96, 2});
        }
        TwinCaches twin{*dev, m, *fused, *three};
        prefill_then_decode(twin);
        if (HasFatalFailure()) return;
        EXPECT_LT(twin.worst, 5e-3);
        EXPECT_GT(twin.scale, 0.0);
        worst = std::max(worst, twin.worst);
      }
  std::printf("[ fused ] %d fused kernels vs three launches: max |diff| %.3g\n", fused_count, worst);
  EXPECT_EQ(fused_count, in_set_count);
}

// The fused decode's cluster merge gives the same attention as the workspace merge
// (TQKV_FUSED_CLUSTER=0): batch 1, a cache far longer than the sequence (the splits share the
// sequence's own range), f16 and wq6 windows. At capacity 512 the default plan merges as a
// cluster.
TEST(CudaCacheLayer, FusedClusterMergeMatchesWorkspaceMerge) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  auto dev = std::make_shared<CudaDevice>();
  const ModelConfig m = cache_test_model(2, 9, 3);
  for (const std::string name : {"k5v4+sink1+wq6+w40+skip0", "k5v3+sink1+w24+skip0"})
    for (int capacity : {512, 4096}) {
      SCOPED_TRACE(name + " capacity " + std::to_string(capacity));
      const CacheSpec spec = resolve_cache_spec(name, m);
      std::unique_ptr<KvCache> old_plan, now;
      {
        ScopedEnv b("TQKV_FUSED_CLUSTER", "0");
        old_plan = dev->make_cache(spec, CacheShape{capacity, 1});
      }
      now = dev->make_cache(spec, CacheShape{capacity, 1});
      TwinCaches twin{*dev, m, *now, *old_plan};
      const int64_t a = now->add_sequence();
      ASSERT_EQ(old_plan->add_sequence(), a);
      std::vector<int32_t> ids(512, 1);
      Batch prefill;
      prefill.add(a, ids.data(), 300, 0, true);
      twin.run(prefill);
      for (int s = 0; s < 8; ++s) {
        Batch step;
        step.add(a, ids.data(), 1, 300 + s, true);
        twin.run(step);
      }
      const auto* nc = dynamic_cast<const CudaKvCache*>(now.get());
      const auto* oc = dynamic_cast<const CudaKvCache*>(old_plan.get());
      ASSERT_TRUE(nc && oc);
      EXPECT_EQ(nc->fused_layers(), m.n_layers);
      std::printf("[ fused ] %-26s cap %4d: default plan vs workspace merge: max |diff| %.3g (outputs up to %.3g), "
                  "cluster plans %d\n",
                  name.c_str(), capacity, twin.worst, twin.scale, nc->fused_cluster_plans());
      EXPECT_LT(twin.worst, 5e-3);
      EXPECT_GT(twin.scale, 0.0);
      EXPECT_EQ(oc->fused_cluster_plans(), 0);
      if (capacity == 512) {
        EXPECT_GT(nc->fused_cluster_plans(), 0) << "batch 1 at capacity 512 fits one cluster";
      }
    }
}

// Prefill chunks with copies as one fused launch (TQKV_FUSED_MAX_ROWS above the step's rows)
// against the three launches and two merges, on the same inputs: steps of 812 rows (two prompts
// of 512 and 300), then 513 (a second chunk of 512 over its history and a decode), then decodes,
// SmolLM2's shape (9 query : 3 kv heads), f16 and wq6 windows. A bad TQKV_FUSED_MAX_ROWS is an
// error at construction.
TEST(CudaCacheLayer, FusedPrefillOfManyRowsMatchesThreeLaunches) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  auto dev = std::make_shared<CudaDevice>();
  const ModelConfig m = cache_test_model(2, 9, 3);
  for (const std::string name : {"k6v5+sink1+wq6+w100+skip0", "k5v4+sink1+w40+skip0"}) {
    SCOPED_TRACE(name);
    const CacheSpec spec = resolve_cache_spec(name, m);
    std::unique_ptr<KvCache> fused, three;
    {
      ScopedEnv many("TQKV_FUSED_MAX_ROWS", "100000");
      fused = dev->make_cache(spec, CacheShape{2048, 2});
    }
    {
      ScopedEnv off("TQKV_FUSED_MAX_ROWS", "0");
      three = dev->make_cache(spec, CacheShape{2048, 2});
    }
    for (const char* bad : {"-1", "lots", "99999999999999999999"}) {
      ScopedEnv env("TQKV_FUSED_MAX_ROWS", bad);
      EXPECT_THROW(dev->make_cache(spec, CacheShape{2048, 2}), Error) << bad;
    }
    TwinCaches twin{*dev, m, *fused, *three};
    const int64_t a = fused->add_sequence(), b = fused->add_sequence();
    ASSERT_EQ(three->add_sequence(), a);
    ASSERT_EQ(three->add_sequence(), b);
    std::vector<int32_t> ids(1024, 1);
    Batch first;
    first.add(a, ids.data(), 512, 0, true);
    first.add(b, ids.data(), 300, 0, true);
    twin.run(first);
    Batch second;
    second.add(a, ids.data(), 512, 512, true);
    second.add(b, ids.data(), 1, 300, true);
    twin.run(second);
    for (int s = 0; s < 4; ++s) {
      Batch step;
      step.add(a, ids.data(), 1, 1024 + s, true);
      step.add(b, ids.data(), 1, 301 + s, true);
      twin.run(step);
    }
    std::printf("[ fused ] %-28s 812/513-row prefill, fused vs three launches: max |diff| %.3g (outputs up to %.3g)\n",
                name.c_str(), twin.worst, twin.scale);
    EXPECT_LT(twin.worst, 5e-3);
    EXPECT_GT(twin.scale, 0.0);
  }
}

// Decode plans are sized by the step's longest sequence (CudaKvCache::plan_len): its power-of-two
// class from kMinPlanLen, at most the capacity.
TEST(CudaCacheLayer, PlansBySequenceLength) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  auto dev = std::make_shared<CudaDevice>();
  const ModelConfig m = cache_test_model(2, 9, 3);
  auto cache = dev->make_cache(resolve_cache_spec("k5v4+sink1+wq6+w40+skip0", m), CacheShape{8192, 2});
  const auto* cc = dynamic_cast<const CudaKvCache*>(cache.get());
  ASSERT_TRUE(cc);
  EXPECT_EQ(cc->plan_len(300), 512);
  EXPECT_EQ(cc->plan_len(1), CudaKvCache::kMinPlanLen);
  EXPECT_EQ(cc->plan_len(100000), 8192);
}

// A decode step recorded while the sequences are short (planned for kMinPlanLen positions) and
// replayed after they grew to ~2K positions (op-by-op prefill chunks in between) gives the
// attention of the same steps run op by op, which plan for their own length: a plan stays
// correct past its length (the engine records one graph per plan length, so it never replays
// one there; this holds the kernels to it anyway). Plain split-KV and the fused decode.
TEST(CudaCacheLayer, StepRecordedShortReplaysLong) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  const ModelConfig m = cache_test_model(2, 6, 2);
  auto dev = std::make_shared<CudaDevice>();
  for (const std::string name : {"f16+skip0", "k5v3+skip0", "k5v3+sink1+w5+skip0", "k6v3+sink2+wq6+w11+skip0"}) {
    SCOPED_TRACE(name);
    RecordedTwins t(m, dev, name, 4096, 1024, 991);
    ASSERT_NE(t.g, nullptr);
    ASSERT_TRUE(t.g->graphs_supported());
    std::vector<int32_t> ids(512, 1);
    int64_t la = 20, lb = 13;
    Batch prefill;
    prefill.add(t.a, ids.data(), 20, 0, true);
    prefill.add(t.b, ids.data(), 13, 0, true);
    t.both(prefill);
    EXPECT_EQ(t.g->plan_len(la + 2), CudaKvCache::kMinPlanLen);
    double worst = 0, scale = 0;
    for (int s = 0; s < 8; ++s) {
      if (s == 2) {  // both sequences grow by 2K positions op by op, past the recorded plan's length
        for (int c = 0; c < 4; ++c, la += 512, lb += 512) {
          Batch chunk;
          chunk.add(t.a, ids.data(), 512, la, true);
          chunk.add(t.b, ids.data(), 512, lb, true);
          t.both(chunk);
        }
        EXPECT_EQ(t.g->plan_len(la + 1), 4096);
      }
      worst = std::max(worst, t.step(s, la++, lb++, scale));
      if (HasFailure()) return;
    }
    EXPECT_EQ(t.graphed->seq_len(t.a), la);
    std::printf("[ graphs ] %-28s recorded at ~20 positions, replayed at ~2K vs op by op: max |diff| %.3g "
                "(outputs up to %.3g)\n",
                name.c_str(), worst, scale);
    EXPECT_LT(worst, 1e-3);
    EXPECT_GT(scale, 0.0);
  }
}

// A llama-architecture model of the given shape with Q4_0 weights of made-up codes (no model
// file needed): what CUDA graphs allocate depends on the shape alone.
struct ShapeModel {
  std::vector<uint8_t> bytes;
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Model> model;
};

// `extra` adds metadata or tensors (RoPE scaling, ...); `device` is where the model loads.
std::unique_ptr<ShapeModel> shape_model(int layers, int d, int heads, int kv_heads, int ff, int vocab,
                                        const std::function<void(test::GgufBuilder&)>& extra = {},
                                        const std::string& device = "cuda") {
  uint64_t x = 99;
  auto q4_0 = [&](int rows, int cols, float scale) {  // blocks of a half scale and 32 nibbles
    std::vector<uint8_t> t(static_cast<size_t>(rows) * cols / 32 * 18);
    const uint16_t h = float_to_half(scale);
    for (size_t i = 0; i < t.size(); i += 18) {
      t[i] = static_cast<uint8_t>(h & 0xff);
      t[i + 1] = static_cast<uint8_t>(h >> 8);
      for (size_t j = 2; j < 18; ++j) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        t[i + j] = static_cast<uint8_t>(x >> 56);
      }
    }
    return t;
  };
  auto ones = [](int n) {
    std::vector<uint8_t> t(static_cast<size_t>(n) * 4);
    const float one = 1.0f;
    for (int i = 0; i < n; ++i) std::memcpy(t.data() + 4 * static_cast<size_t>(i), &one, 4);
    return t;
  };
  const uint32_t kQ4_0 = 2, kF32 = 0;
  const auto u = [](int v) { return static_cast<uint64_t>(v); };
  const int kvd = kv_heads * (d / heads);
  const float w = 1.0f / (4.6f * std::sqrt(static_cast<float>(d)));  // |q - 8| has a std of ~4.6
  test::GgufBuilder g;
  g.str("general.architecture", "llama")
      .u32("llama.block_count", static_cast<uint32_t>(layers))
      .u32("llama.embedding_length", static_cast<uint32_t>(d))
      .u32("llama.attention.head_count", static_cast<uint32_t>(heads))
      .u32("llama.attention.head_count_kv", static_cast<uint32_t>(kv_heads))
      .u32("llama.feed_forward_length", static_cast<uint32_t>(ff))
      .u32("llama.context_length", 32768)
      .f32("llama.attention.layer_norm_rms_epsilon", 1e-5f)
      .tensor("token_embd.weight", {u(d), u(vocab)}, kQ4_0, q4_0(vocab, d, 0.2f))
      .tensor("output_norm.weight", {u(d)}, kF32, ones(d));
  for (int l = 0; l < layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    g.tensor(p + "attn_norm.weight", {u(d)}, kF32, ones(d))
        .tensor(p + "ffn_norm.weight", {u(d)}, kF32, ones(d))
        .tensor(p + "attn_q.weight", {u(d), u(d)}, kQ4_0, q4_0(d, d, w))
        .tensor(p + "attn_k.weight", {u(d), u(kvd)}, kQ4_0, q4_0(kvd, d, w))
        .tensor(p + "attn_v.weight", {u(d), u(kvd)}, kQ4_0, q4_0(kvd, d, w))
        .tensor(p + "attn_output.weight", {u(d), u(d)}, kQ4_0, q4_0(d, d, w))
        .tensor(p + "ffn_gate.weight", {u(d), u(ff)}, kQ4_0, q4_0(ff, d, w))
        .tensor(p + "ffn_up.weight", {u(d), u(ff)}, kQ4_0, q4_0(ff, d, w))
        .tensor(p + "ffn_down.weight", {u(ff), u(d)}, kQ4_0, q4_0(d, ff, 1.0f / (4.6f * std::sqrt(float(ff)))));
  }
  if (extra) extra(g);
  auto m = std::make_unique<ShapeModel>();
  m->bytes = g.build();
  m->file = std::make_unique<GgufFile>(GgufFile::parse(m->bytes));
  m->model = std::make_unique<Model>(Model::load(*m->file, make_device(device)));
  return m;
}

// RoPE scaling (Llama 3's rope_freqs, YaRN with its attention factor, linear) turns q and k on
// the GPU as on the CPU, in prefill and decode, with the fused and the plain RoPE: logits within
// the bf16 weights' noise (as for SmolLM2's f32 cache: KL <= 1e-3), while each scaling moves the
// logits well beyond that noise from the unscaled model's (so the GPU cannot pass by ignoring it).
// The CPU is held to transformers by tests/python/test_architectures.py.
TEST(CudaRopeScaling, LogitsMatchCpu) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  // The CPU's float path (as CudaSmol): its int8 activations for decode are a CPU speed choice.
  const QdotMode saved_qdot = qdot_mode();
  set_qdot_mode(QdotMode::F32);
  const std::shared_ptr<void> restore(nullptr, [&](void*) { set_qdot_mode(saved_qdot); });
  const int layers = 2, d = 256, heads = 4, kv_heads = 2, ff = 512, vocab = 512, n = 160, decode = 16;
  const auto f32 = [](const std::vector<float>& v) {
    std::vector<uint8_t> t(v.size() * 4);
    std::memcpy(t.data(), v.data(), t.size());
    return t;
  };
  std::vector<float> llama3(d / heads / 2);
  for (size_t i = 0; i < llama3.size(); ++i) llama3[i] = i < 8 ? 1.0f : i < 20 ? 1.0f + 0.5f * (i - 8) : 8.0f;
  const std::vector<std::pair<std::string, std::function<void(test::GgufBuilder&)>>> cases = {
      {"llama3",
       [&](test::GgufBuilder& g) {
         g.tensor("rope_freqs.weight", {static_cast<uint64_t>(llama3.size())}, 0, f32(llama3));
       }},
      {"yarn",
       [](test::GgufBuilder& g) {
         g.str("llama.rope.scaling.type", "yarn")
             .f32("llama.rope.scaling.factor", 4.0f)
             .u32("llama.rope.scaling.original_context_length", 64);
       }},
      {"linear",
       [](test::GgufBuilder& g) {
         g.str("llama.rope.scaling.type", "linear").f32("llama.rope.scaling.factor", 4.0f);
       }},
  };
  std::vector<int32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = (i * 131 + 7) % vocab;
  const auto run = [&](const Model& m) {
    auto cache = m.make_cache("f32", n);
    const int64_t seq = cache->add_sequence();
    std::vector<float> logits(static_cast<size_t>(n) * vocab);
    m.forward(seq, ids.data(), n - decode, *cache, logits.data(), true);
    for (int t = n - decode; t < n; ++t)
      m.forward(seq, &ids[t], 1, *cache, logits.data() + static_cast<size_t>(t) * vocab, false);
    return logits;
  };
  const std::vector<float> plain = run(*shape_model(layers, d, heads, kv_heads, ff, vocab)->model);
  for (const auto& [name, extra] : cases) {
    SCOPED_TRACE(name);
    auto cpu = shape_model(layers, d, heads, kv_heads, ff, vocab, extra, "cpu");
    auto gpu = shape_model(layers, d, heads, kv_heads, ff, vocab, extra, "cuda");
    const std::vector<float> c = run(*cpu->model);
    for (const bool fused : {true, false}) {
      auto* dev = dynamic_cast<CudaDevice*>(&gpu->model->device());
      ASSERT_NE(dev, nullptr);
      dev->set_fused_ops(fused);
      const std::vector<float> g = run(*gpu->model);
      const Agreement a = compare(c, g, vocab), off = compare(plain, g, vocab);
      std::printf("[ rope scaling ] %-7s fused %d: KL vs cpu %.3g (top-1 %.3f), vs the unscaled model %.3g\n",
                  name.c_str(), fused, a.mean_kl, a.top1, off.mean_kl);
      EXPECT_LE(a.mean_kl, 1e-3);
      EXPECT_GE(a.top1, 0.9);
      EXPECT_GT(off.mean_kl, 20 * std::max(a.mean_kl, 1e-4));
    }
  }
}

// Every length class's graph of one bucket runs over the bucket's one set of activations
// (StepActivations). For each bucket of the server's default --max-seqs 8 (1, 2, 4, 8), decode
// steps of groups of sequences of ~150, ~300, ~600 and ~1200 tokens in a 2K cache record a
// graph for each of the classes 256, 512, 1024 and 2048: the bucket's activation bytes stay
// those of its first class (printed, with the device memory the later classes took: their
// graphs and plans, cudaMemGetInfo). A second round replays every class after the others wrote
// the shared buffers; the greedy tokens of every step are those of the same steps op by op.
// SmolLM2's shape (30 layers), and Qwen2.5-1.5B's with 1 and 2 of its 28 layers (the step reuses
// its buffers layer after layer, so the set does not depend on the depth: measured the same).
TEST(CudaGraphs, LengthClassesShareTheBucketsActivations) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  struct Shape {
    const char* name;
    int layers, d, heads, kv_heads, ff, vocab;
  };
  const Shape shapes[] = {{"SmolLM2-135M", 30, 576, 9, 3, 1536, 49152},
                          {"Qwen2.5-1.5B, 1 layer", 1, 1536, 12, 2, 8960, 151936},
                          {"Qwen2.5-1.5B, 2 layers", 2, 1536, 12, 2, 8960, 151936}};
  const int buckets[] = {1, 2, 4, 8}, lens[] = {150, 300, 600, 1200}, G = 8;
  for (const Shape& sh : shapes) {
    const auto sm = shape_model(sh.layers, sh.d, sh.heads, sh.kv_heads, sh.ff, sh.vocab);
    const Model& m = *sm->model;
    const int V = m.config().n_vocab;
    // k5v3 with a wq6 window: compiled and fused at d = 64 and 128 (src/cuda/decode_pairs.cmake
    // compiles the recipes' pairs; k6v3 is none of Qwen2.5-1.5B's, so at d = 128 it takes the
    // generic path, without graphs).
    for (const std::string spec : {"f16", "k5v3+sink2+wq6+w11+skip0"}) {
      SCOPED_TRACE(std::string(sh.name) + " " + spec);
      std::vector<int32_t> tokens[2];  // [graphs off, on]: every step's greedy tokens in order
      for (int on = 0; on < 2; ++on) {
        std::unique_ptr<GraphsOff> off;
        if (!on) off = std::make_unique<GraphsOff>(m.device());
        auto cache = m.make_cache(spec, 2048, 4 * G);
        const auto* cc = dynamic_cast<const CudaKvCache*>(cache.get());
        ASSERT_NE(cc, nullptr);
        ASSERT_TRUE(cc->graphs_supported());
        std::vector<int64_t> seqs;  // group c (class c) holds seqs[c * G, c * G + G)
        std::vector<int32_t> next;
        std::vector<float> logits(static_cast<size_t>(G) * V);
        for (int c = 0; c < 4; ++c)
          for (int i = 0; i < G; ++i) {
            const int n = lens[c] + 7 * i;
            std::vector<int32_t> ids(n);
            for (int t = 0; t < n; ++t) ids[t] = (t * 7919 + i * 131 + c * 17) % V;
            seqs.push_back(cache->add_sequence());
            m.forward(seqs.back(), ids.data(), n, *cache, logits.data(), false);
            next.push_back(static_cast<int32_t>(std::max_element(logits.begin(), logits.begin() + V) - logits.begin()));
          }
        for (const int B : buckets) {
          size_t first_bytes = 0, free_first = 0, free_last = 0, total = 0;
          for (int round = 0; round < 2; ++round)
            for (int c = 0; c < 4; ++c) {
              for (int s = 0; s < (round == 0 ? 3 : 2); ++s) {  // warm-up, recording, replay; replays
                Batch step;
                for (int i = 0; i < B; ++i) {
                  const int k = c * G + i;
                  tokens[on].push_back(next[k]);
                  step.add(seqs[k], &next[k], 1, cache->seq_len(seqs[k]), false);
                }
                m.forward(step, *cache, logits.data());
                for (int i = 0; i < B; ++i) {
                  const float* row = logits.data() + static_cast<size_t>(i) * V;
                  next[c * G + i] = static_cast<int32_t>(std::max_element(row, row + V) - row);
                }
              }
              if (on && round == 0 && (c == 0 || c == 3)) {
                ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
                ASSERT_EQ(cudaMemGetInfo(c == 0 ? &free_first : &free_last, &total), cudaSuccess);
                if (c == 0) first_bytes = cc->step_activations(B) ? cc->step_activations(B)->bytes : 0;
              }
            }
          if (!on) continue;
          const StepActivations* acts = cc->step_activations(B);
          ASSERT_NE(acts, nullptr);
          EXPECT_GT(first_bytes, 0u);
          EXPECT_EQ(acts->bytes, first_bytes) << "bucket " << B << ": a new length class added activations";
          std::map<size_t, int> sizes;  // floats -> buffers
          for (const DeviceBuffer& b : acts->held) ++sizes[b.size()];
          std::string list;
          for (const auto& [n, count] : sizes) list += std::string(" ") + std::to_string(count) + "x" + std::to_string(n);
          std::printf("[ graphs ] %-23s %-24s bucket %d: activations %.2f MB after class 256, %.2f MB after "
                      "all 4 classes (one set a class: %.2f MB); classes 512-2048 took %.2f MB more (graphs, "
                      "plans); %zu buffers (floats:%s)\n",
                      sh.name, spec.c_str(), B, first_bytes / 1e6, acts->bytes / 1e6, 4 * first_bytes / 1e6,
                      (static_cast<double>(free_first) - static_cast<double>(free_last)) / 1e6, acts->held.size(),
                      list.c_str());
        }
        if (on) {
          EXPECT_EQ(recorded(*cache), 16);
          size_t sum = 0;
          for (const int B : buckets) sum += cc->step_activations(B)->bytes;
          EXPECT_EQ(cc->graph_activation_bytes(), sum);
        }
      }
      ASSERT_EQ(tokens[1].size(), tokens[0].size());
      EXPECT_EQ(tokens[1], tokens[0]);
    }
  }
}

// The cross-device rule for two paths along the same teacher-forced tokens (logits of every
// position): `path` no worse than `ref` against the f32 cache, the two no further apart than
// their distance from it allows, top-1 agreement >= min_top1. Returns path's and ref's KL to f32.
std::pair<double, double> expect_same_quality(const std::string& what, const std::vector<float>& f32,
                                              const std::vector<float>& ref, const std::vector<float>& path, int V,
                                              double min_top1 = 0.9) {
  const double kl_ref = compare(f32, ref, V).mean_kl, kl_path = compare(f32, path, V).mean_kl;
  const Agreement a = compare(ref, path, V);
  std::printf("[ paths ] %-40s: mean KL %.3g, top-1 %.3f, max |dlogit| %.3g; KL vs f32: %.3g / %.3g\n", what.c_str(),
              a.mean_kl, a.top1, a.max_abs, kl_path, kl_ref);
  EXPECT_LE(kl_path, 1.5 * kl_ref + 0.01) << what << ": worse against the f32 cache";
  EXPECT_LE(a.mean_kl, 2.0 * (kl_ref + kl_path) + 0.01) << what;
  EXPECT_GE(a.top1, min_top1) << what;
  return {kl_path, kl_ref};
}

// 64 greedy tokens of the recipes with copies: the fused decode gives the three launches' tokens.
// The fused launch sums the three parts' partials in another order than the three launches and
// their merges (1.8e-7 apart at the cache layer, CudaCacheLayer.FusedDecodeMatchesThreeLaunches).
// On the real model a code flip in a later layer amplifies that, as between two devices
// (LogitsMatchCpu) or the CPU's AVX2 and AVX-512 paths: H200, 2026-12-01, tq-4.375's greedy answers
// parted at token 17, and along the same teacher-forced tokens the two paths' logits were
// KL 0.005 (tq-4.375) and 0.014 (tq-3.375) apart over the 64 decode steps, top-1 0.97. So they are
// held to the cross-device test's rule: the fused path no worse against the f32 cache, and the two
// no further apart than their own distance from it allows. A broken merge is far outside that.
TEST_F(CudaSmol, FusedDecodeGivesTheSameQualityAlongTheSameTokens) {
  const std::vector<int32_t> prompt = chat("What are the three primary colors? Answer briefly.");
  const int V = gpu_->config().n_vocab;
  for (const std::string spec : {"tq-4.375", "tq-3.375"}) {
    SCOPED_TRACE(spec);
    {
      auto cache = gpu_->make_cache(spec, 256);
      const auto* cc = dynamic_cast<const CudaKvCache*>(cache.get());
      ASSERT_NE(cc, nullptr);
      EXPECT_GT(cc->fused_layers(), 0);
    }
    std::vector<int32_t> ids = prompt;
    std::vector<float> three;
    {
      ScopedEnv off("TQKV_FUSED_MAX_ROWS", "0");
      const std::vector<int32_t> answer = greedy(*gpu_, prompt, spec, 64);
      ASSERT_EQ(answer.size(), 64u);
      ids.insert(ids.end(), answer.begin(), answer.end());
      three = run(*gpu_, ids, spec, 64);
    }
    const std::vector<float> fused = run(*gpu_, ids, spec, 64), f32 = run(*gpu_, ids, "f32", 64);
    expect_same_quality(spec + " fused vs three launches", f32, three, fused, V);
  }
}


// A cache made with TQKV_PREFILL_PATH=path.
std::unique_ptr<KvCache> cache_with_path(const std::function<std::unique_ptr<KvCache>()>& make, const char* path) {
  ScopedEnv env("TQKV_PREFILL_PATH", path);
  return make();
}

// Prefill chunks as decode rows against dequantize + the tiled kernel, on the same inputs, layer
// by layer: two sequences prefilled in chunks (the later ones over their history, a chunk of
// 100 over two of the tiled kernel's 64-query CTAs, a chunk of 64 over 659 positions, whose
// CTAs split their keys: cuda::prefill_attention's splits), then decode steps. f16 dequantizes to
// itself, so the two differ by the kernels' arithmetic (the tensor cores round the scaled query
// and the weights to f16: bound 1e-3); compressed formats to f16 (the tiled path's workspace),
// held to the cross-device tolerance of SameInputsSameCodesAsCpu. With copies the tiled path
// attends the parts one by one (middle, window, sinks, the own position folded in after) where
// the rows decode them in one launch: the same tolerance.
TEST(CudaCacheLayer, PrefillPathsMatch) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  auto dev = std::make_shared<CudaDevice>();
  const ModelConfig m = cache_test_model(2, 6, 2);
  for (const std::string name : {"f16", "turboquant_4bit_nc", "tq-k3v2", "k6v4", "k5v3+sink1+w5"}) {
    SCOPED_TRACE(name);
    const CacheSpec spec = resolve_cache_spec(name + "+skip0", m);
    auto make = [&] { return dev->make_cache(spec, CacheShape{1024, 2}); };
    auto rows = cache_with_path(make, "rows"), tiled = cache_with_path(make, "tiled");
    {
      ScopedEnv env("TQKV_PREFILL_PATH", "sideways");
      EXPECT_THROW(make(), Error);
    }
    {
      ScopedEnv env("TQKV_PREFILL_WORKSPACE", "f8");
      EXPECT_THROW(make(), Error);
    }
    const auto* rc = dynamic_cast<const CudaKvCache*>(rows.get());
    const auto* tc = dynamic_cast<const CudaKvCache*>(tiled.get());
    ASSERT_TRUE(rc && tc);
    EXPECT_TRUE(rc->prefill_rows(40));
    EXPECT_FALSE(tc->prefill_rows(40));
    EXPECT_TRUE(tc->prefill_rows(1));
    const int64_t a = rows->add_sequence(), b = rows->add_sequence();
    ASSERT_EQ(tiled->add_sequence(), a);
    ASSERT_EQ(tiled->add_sequence(), b);
    std::vector<int32_t> ids(500, 1);
    TwinCaches twin{*dev, m, *rows, *tiled, 777};
    int la = 0, lb = 0;
    for (const auto& [na, nb] : {std::pair{40, 23}, std::pair{17, 1}, std::pair{1, 30}, std::pair{100, 1}, std::pair{1, 1},
                                 std::pair{500, 1}, std::pair{64, 64}, std::pair{1, 1}}) {
      Batch step;  // a varlen batch: chunks and single tokens of both sequences
      step.add(a, ids.data(), na, la, true);
      step.add(b, ids.data(), nb, lb, true);
      la += na;
      lb += nb;
      twin.run(step);
    }
    std::printf("[ prefill ] %-20s rows vs tiled: max |diff| %.3g (outputs up to %.3g)\n", name.c_str(), twin.worst,
                twin.scale);
    EXPECT_LT(twin.worst, name == "f16" ? 1e-3 : 2e-2);
    EXPECT_GT(twin.scale, 0.0);
  }
}

// The same on the real model, along the same teacher-forced tokens: a chat prompt and a
// 64-token greedy answer prefilled in chunks of 24 (each later chunk over its history), every
// position's logits, with the chunks as decode rows and with the tiled path. Held to the
// cross-device rule of LogitsMatchCpu: f16 to KL <= 1e-3 and top-1 >= 0.9; compressed caches
// to neither path worse against the f32 cache and the two no further apart than their distance
// from it allows. Their top-1 is not held: the tiled path's workspace rounding (bf16 then)
// moved a layer's outputs by ~1e-3, later layers' inputs cross code thresholds, and the flips
// compound as between the two devices (H200, 2026-12-01: rows vs tiled KL 0.0725 / 0.0463, top-1 0.861 /
// 0.833 for turboquant_4bit_nc / tq-k4v4, while each path's KL to f32 was 0.085 / 0.064 and
// within 10% of the other's; f16 KL 0.0002, top-1 0.991).
TEST_F(CudaSmol, PrefillPathsGiveTheSameQualityAlongTheSameTokens) {
  std::vector<int32_t> ids = chat("Name three animals that live in the sea, with one fact each.");
  const std::vector<int32_t> answer = greedy(*gpu_, ids, "f16", 64);
  ids.insert(ids.end(), answer.begin(), answer.end());
  const int V = gpu_->config().n_vocab, n = static_cast<int>(ids.size()), chunk = 24;
  auto logits = [&](const std::string& spec, const char* path) {
    ScopedEnv env("TQKV_PREFILL_PATH", path);
    auto cache = gpu_->make_cache(spec, 256);
    const int64_t seq = cache->add_sequence();
    std::vector<float> out(static_cast<size_t>(n) * V);
    for (int t = 0; t < n; t += chunk)
      gpu_->forward(seq, &ids[t], std::min(chunk, n - t), *cache, out.data() + static_cast<size_t>(t) * V, true);
    return out;
  };
  const std::vector<float> f32 = logits("f32", "auto");
  // tq-4.375: sinks and a window, so its tiled path attends part by part (prefill_parts).
  for (const std::string spec : {"f16", "turboquant_4bit_nc", "tq-k4v4", "tq-4.375"}) {
    SCOPED_TRACE(spec);
    const std::vector<float> rows = logits(spec, "rows"), tiled = logits(spec, "tiled");
    const bool plain = spec == "f16";
    const auto [kl_rows, kl_tiled] =
        expect_same_quality(spec + " prefill rows vs tiled", f32, tiled, rows, V, plain ? 0.9 : 0.0);
    EXPECT_LE(kl_tiled, 1.5 * kl_rows + 0.01) << "the tiled path is worse than the rows one";
    if (plain) {
      EXPECT_LE(compare(tiled, rows, V).mean_kl, 1e-3);
    }
  }
}

TEST_F(CudaSmol, BadInputThrowsAndChangesNothing) {
  const Model& m = *gpu_;
  auto c = m.make_cache("f16", 32, 2);
  auto* cc = dynamic_cast<CudaKvCache*>(c.get());
  ASSERT_NE(cc, nullptr);
  const int free0 = cc->free_blocks();
  const int64_t seq = c->add_sequence();
  std::vector<float> logits(static_cast<size_t>(m.config().n_vocab));
  const int32_t ok = 5, bad = 1 << 20;
  EXPECT_THROW(m.forward(seq, &bad, 1, *c, logits.data(), false), Error);
  Batch unknown;
  unknown.add(seq + 7, &ok, 1, 0, false);
  EXPECT_THROW(m.forward(unknown, *c, logits.data()), Error);
  const std::vector<int32_t> long_ids(40, ok);
  try {
    m.forward(seq, long_ids.data(), 40, *c, logits.data(), false);
    FAIL() << "40 tokens went into a 32-position cache";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Capacity);
  }
  EXPECT_EQ(c->seq_len(seq), 0);
  EXPECT_EQ(cc->free_blocks(), free0);
  m.forward(seq, long_ids.data(), 30, *c, logits.data(), false);
  EXPECT_THROW(m.forward(seq, long_ids.data(), 3, *c, logits.data(), false), Error) << "past capacity";
  EXPECT_EQ(c->seq_len(seq), 30);
  c->add_sequence();
  EXPECT_THROW(c->add_sequence(), Error) << "a two-sequence cache took a third";
  c->free_sequence(seq);
  EXPECT_EQ(cc->free_blocks(), free0);
  // What the GPU cache does not implement yet is refused by name, never run wrong: copies
  // (sinks, window) beside 1-bit codes (no decode kernel takes them).
  for (const std::string spec : {"k1v4+sink1+w8", "k4v1+w16"}) {
    try {
      m.make_cache(spec, 64);
      ADD_FAILURE() << spec << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find("not on the GPU yet"), std::string::npos) << e.what();
    }
  }
}

// The fused operations against the plain ones on one CUDA device, bit for bit: a residual add
// with its RMSNorm (and the norm alone) and a gated activation, each feeding a product through
// the bf16 copy its kernel writes; a group's biases in one launch; RoPE of queries and keys in one launch in both layouts, over
// part of a head (n_rot < head_dim) and at positions in the thousands.
TEST(CudaFusedOps, MatchPlainOpsBitForBit) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  CudaDevice cuda_dev;
  Device& dev = cuda_dev;  // the interface's default arguments
  const int n = 5, d = 192, out = 72, hd = 64, qh = 6, kh = 2;
  uint32_t state = 12345;
  auto rnd = [&](size_t count, float scale) {
    std::vector<float> v(count);
    for (float& f : v) {
      state = state * 1664525u + 1013904223u;
      f = scale * (static_cast<float>(state >> 8) / 16777216.0f - 0.5f);
    }
    return v;
  };
  const std::vector<float> hx = rnd(n * d, 4), hdelta = rnd(n * d, 2), hw = rnd(d, 2), hm = rnd(out * d, 1),
                           hup = rnd(n * d, 3), hq = rnd(n * qh * hd, 2), hk = rnd(n * kh * hd, 2),
                           hb1 = rnd(out, 1), hb2 = rnd(out, 3);
  const CudaMatrix W(out, d, hm.data());
  const int64_t pos[n] = {0, 1, 17, 4095, 123456};
  struct Outputs {
    std::vector<float> x, y, p1, p2, g1, g2, p3, q, k;
  };
  auto run_ops = [&](bool fused) {
    dev.set_fused_ops(fused);
    EXPECT_EQ(dev.fused_ops(), fused);
    auto up = [&](const std::vector<float>& h) {
      DeviceBuffer b = dev.alloc(h.size());
      dev.to_device(h.data(), h.size(), b.data());
      return b;
    };
    DeviceBuffer x = up(hx), delta = up(hdelta), w = up(hw), gate = up(hx), upb = up(hup), gate2 = up(hdelta),
                 b1 = up(hb1), b2 = up(hb2);
    DeviceBuffer y = dev.alloc(n * d), p1 = dev.alloc(n * out), p2 = dev.alloc(n * out), g1 = dev.alloc(n * out),
                 g2 = dev.alloc(n * out), p3 = dev.alloc(n * out);
    dev.add_rmsnorm(x.data(), delta.data(), w.data(), n, d, 1e-5f, delta.data(), true);  // y = delta, as the models do
    dev.matmul(delta.data(), n, W, p1.data());
    dev.add_rmsnorm(x.data(), nullptr, w.data(), n, d, 1e-5f, y.data(), true);
    // Biases (Qwen2's Q, K, V): one launch for the group when fused.
    const GroupProduct group[3] = {{&W, p2.data()}, {&W, g2.data(), b1.data()}, {&W, p3.data(), b2.data()}};
    dev.matmul_group(y.data(), n, group, 3);
    dev.glu(Device::Glu::Silu, gate.data(), upb.data(), n * d, true);
    dev.matmul(gate.data(), n, W, g1.data());
    dev.glu(Device::Glu::Gelu, gate2.data(), upb.data(), n * d, false);
    Outputs o;
    auto down = [&](const DeviceBuffer& b) {
      std::vector<float> h(b.size());
      dev.to_host(b.data(), b.size(), h.data());
      return h;
    };
    o.x = down(x);
    o.y = down(delta);
    o.y.resize(n * d);
    o.p1 = down(p1);
    o.p2 = down(p2);
    o.g1 = down(g1);
    o.g2 = down(g2);
    o.p3 = down(p3);
    std::vector<float> gg = down(gate2);
    o.y.insert(o.y.end(), gg.begin(), gg.begin() + n * d);
    std::vector<float> yy = down(y);
    o.y.insert(o.y.end(), yy.begin(), yy.begin() + n * d);
    for (const RopeLayout layout : {RopeLayout::Adjacent, RopeLayout::Halves})
      for (const int n_rot : {hd, hd / 2}) {
        DeviceBuffer q = up(hq), k = up(hk);
        RopeParams rp;
        rp.n_rot = n_rot;
        rp.base = layout == RopeLayout::Halves ? 1e6f : 1e4f;
        rp.layout = layout;
        dev.rope_qk(q.data(), qh, k.data(), kh, n, hd, pos, rp);
        std::vector<float> a = down(q), b = down(k);
        o.q.insert(o.q.end(), a.begin(), a.begin() + n * qh * hd);
        o.k.insert(o.k.end(), b.begin(), b.begin() + n * kh * hd);
      }
    o.x.resize(n * d);
    o.p1.resize(n * out);
    o.p2.resize(n * out);
    o.g1.resize(n * out);
    o.g2.resize(n * out);
    o.p3.resize(n * out);
    return o;
  };
  const Outputs plain = run_ops(false), fused = run_ops(true);
  EXPECT_EQ(plain.x, fused.x);
  EXPECT_EQ(plain.y, fused.y);
  EXPECT_EQ(plain.p1, fused.p1);
  EXPECT_EQ(plain.p2, fused.p2);
  EXPECT_EQ(plain.g1, fused.g1);
  EXPECT_EQ(plain.g2, fused.g2);
  EXPECT_EQ(plain.p3, fused.p3);
  EXPECT_NE(plain.p2, plain.g2);  // the bias was added
  EXPECT_EQ(plain.q, fused.q);
  EXPECT_EQ(plain.k, fused.k);
  EXPECT_EQ(plain.p1, plain.p2);  // the two norms saw the same x + delta
}

TEST(CudaFusedOps, BadArgumentsThrow) {
  TQKV_SKIP_WITHOUT_CUDA(cuda_device_present());
  CudaDevice dev;
  DeviceBuffer x = dev.alloc(64), w = dev.alloc(64);
  EXPECT_THROW(cuda::add_rmsnorm(x.data(), nullptr, w.data(), 1, 64, 1e-5f, x.data(), nullptr, dev.stream()), Error);
  EXPECT_THROW(cuda::add_rmsnorm(nullptr, nullptr, w.data(), 1, 64, 1e-5f, x.data(), nullptr, dev.stream()), Error);
  EXPECT_THROW(cuda::glu(false, nullptr, x.data(), 64, nullptr, dev.stream()), Error);
  float* ys[1] = {x.data()};
  const float* no_bias[1] = {nullptr};
  const int cols[1] = {64};
  EXPECT_THROW(cuda::add_biases(ys, no_bias, cols, 1, 1, dev.stream()), Error);
  EXPECT_THROW(cuda::add_biases(ys, no_bias, cols, cuda::kMaxBiases + 1, 1, dev.stream()), Error);
  int64_t* pos = nullptr;
  EXPECT_THROW(cuda::rope_qk(x.data(), 1, x.data(), 1, 1, 64, pos, 64, w.data(), 1.0f, false, dev.stream()), Error);
  EXPECT_THROW(cuda::rope_qk(x.data(), 1, x.data(), 1, 1, 64, reinterpret_cast<const int64_t*>(w.data()), 66, w.data(),
                             1.0f, false, dev.stream()),
               Error);
}

}  // namespace
}  // namespace tqkv::engine
