// The model runner and the engine loop on the real SmolLM2 model (skipped when models/ is
// absent): greedy answers of requests batched together equal each request run alone through
// generate() with the same model and cache spec (the forward pass is batch-invariant: each
// run gets the matrix products it would get alone). A prompt split into chunks (chunked
// prefill) is not the whole prompt at once (its first chunk attends to itself, the later ones
// read the compressed cache), so the equality is checked with every prompt in one chunk; the
// scheduler tests cover chunking.
#include "serve/model_runner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>

#include "engine/model/generate.h"
#include "engine/real_models.h"  // tests/engine/real_models.h
#include "serve/engine_loop.h"
#include "tqkv/error.h"

namespace tqkv::serve {
namespace {

using engine::testing_util::SmolModelTest;

TEST(TokenLogprobs, LogSoftmaxAndTopN) {
  const float logits[4] = {1.0f, 3.0f, 2.0f, 3.0f};  // a tie: the lower id ranks first
  std::vector<TokenLogprob> top;
  const double z = std::log(std::exp(1.0) + 2 * std::exp(3.0) + std::exp(2.0));
  EXPECT_NEAR(token_logprobs(logits, 4, 2, 3, top), 2.0 - z, 1e-6);
  ASSERT_EQ(top.size(), 3u);
  EXPECT_EQ(top[0].token, 1);
  EXPECT_EQ(top[1].token, 3);
  EXPECT_EQ(top[2].token, 2);
  EXPECT_NEAR(top[0].logprob, 3.0 - z, 1e-6);
  EXPECT_NEAR(token_logprobs(logits, 4, 0, 0, top), 1.0 - z, 1e-6);
  EXPECT_TRUE(top.empty());
  token_logprobs(logits, 4, 0, 99, top);  // more than the vocabulary: all of it
  EXPECT_EQ(top.size(), 4u);
}

constexpr const char* kSpec = "turboquant_k8v4";
constexpr int kCtx = 512;

class ModelRunnerTest : public SmolModelTest {
 protected:
  // Registers a request of n tokens with the runner and the scheduler.
  static void add(ModelRunner& runner, Scheduler& sched, int64_t id, const std::vector<int32_t>& p, int n,
                  bool ignore_eos = false) {
    RequestOptions opt;
    opt.max_tokens = n;
    opt.ignore_eos = ignore_eos;
    runner.add(id, opt, static_cast<int>(p.size()));
    sched.add({id, p, n});
  }
  std::vector<int32_t> chat(const std::string& q) const {
    return tok_->encode(tok_->apply_chat_template({{"user", q}}, true), true, false);
  }
  std::vector<int32_t> alone(const std::vector<int32_t>& prompt, int n) const {
    auto cache = model_->make_cache(kSpec, kCtx);
    engine::GenerateOptions g;
    g.n_predict = n;
    std::vector<int32_t> out;
    engine::generate(*model_, *tok_, *cache, cache->add_sequence(), prompt, g, [&](int32_t id) { out.push_back(id); });
    return out;
  }
};

const std::vector<std::string> kQuestions = {
    "What are the three primary colors?", "Name a large animal.", "What is two plus two?",
    "Write one sentence about the sea."};

TEST_F(ModelRunnerTest, GreedyBatchedEqualsAlone) {
  const int n = 20;
  SchedulerConfig cfg{.block_size = 16, .num_pages = 256, .max_seqs = 4, .max_seq_len = kCtx, .token_budget = 512};
  Scheduler sched(cfg);
  ModelRunner runner(*model_, *tok_, model_->resolve(kSpec), kCtx, cfg.max_seqs);
  std::map<int64_t, std::vector<int32_t>> got;
  for (size_t i = 0; i < kQuestions.size(); ++i) add(runner, sched, static_cast<int64_t>(i), chat(kQuestions[i]), n);
  int steps = 0, batched = 0;
  while (sched.has_work()) {
    ASSERT_LT(++steps, 1000);
    const StepPlan plan = sched.schedule();
    if (plan.chunks.size() > 1) ++batched;
    for (const TokenEvent& ev : runner.step(plan, sched))
      if (ev.token >= 0) got[ev.request].push_back(ev.token);
  }
  EXPECT_GT(batched, n / 2);  // the requests really shared steps
  for (size_t i = 0; i < kQuestions.size(); ++i)
    EXPECT_EQ(got[static_cast<int64_t>(i)], alone(chat(kQuestions[i]), n)) << kQuestions[i];
}

// Prefix sharing copies a common system prompt's positions from the request that computed them
// (KvCache::copy_prefix: slots, sinks and window copies) instead of computing them again, for a
// plain format and for a recipe with sinks and a recent window. The reference is the same split
// prefill without the copy: each question alone, positions [0, c) as one run, then the rest as
// another, then greedy steps. Those are the runs the served requests get (the copy source's prompt
// is exactly the c shared positions, whole pages), so the answers must be equal whatever the
// SGEMM: a position's sums may depend on the length of its run (OpenBLAS's Zen kernels do, as
// OPENBLAS_CORETYPE=Zen shows), which is why a whole prefill is no exact reference here.
TEST_F(ModelRunnerTest, PrefixCopyKeepsGreedyAnswers) {
  const std::string system =
      "You are a helpful assistant. Answer every question in one short sentence, plainly, without lists, "
      "and never repeat the question. If you do not know, say so.";
  std::vector<std::vector<int32_t>> prompts;
  for (const std::string& q : kQuestions)
    prompts.push_back(tok_->encode(tok_->apply_chat_template({{"system", system}, {"user", q}}, true), true, false));
  size_t common = prompts[0].size();
  for (const auto& p : prompts)
    common = std::min<size_t>(common, std::mismatch(p.begin(), p.end(), prompts[0].begin()).first - p.begin());
  const int bs = 16, c = static_cast<int>(common) / bs * bs;
  ASSERT_GE(c, 2 * bs);  // two shared pages at least
  const std::vector<int32_t> shared(prompts[0].begin(), prompts[0].begin() + c);
  const int n = 8;
  for (const char* spec : {"turboquant_k8v4", "tq-4.375"}) {
    SCOPED_TRACE(spec);
    auto split_alone = [&](const std::vector<int32_t>& p) {
      auto cache = model_->make_cache(spec, kCtx);
      const int64_t seq = cache->add_sequence();
      int32_t id = 0;
      model_->forward(seq, p.data(), c, *cache, engine::LogitsOut::greedy(&id), false);
      model_->forward(seq, p.data() + c, static_cast<int>(p.size()) - c, *cache, engine::LogitsOut::greedy(&id), false);
      std::vector<int32_t> out = {id};
      while (static_cast<int>(out.size()) < n) {
        model_->forward(seq, &out.back(), 1, *cache, engine::LogitsOut::greedy(&id), false);
        out.push_back(id);
      }
      return out;
    };
    SchedulerConfig cfg{.block_size = bs, .num_pages = 256, .max_seqs = 5, .max_seq_len = kCtx, .token_budget = 512};
    Scheduler sched(cfg);
    ModelRunner runner(*model_, *tok_, model_->resolve(spec), kCtx, cfg.max_seqs);
    std::map<int64_t, std::vector<int32_t>> got;
    auto step = [&] {
      for (const TokenEvent& ev : runner.step(sched.schedule(), sched))
        if (ev.token >= 0) got[ev.request].push_back(ev.token);
    };
    add(runner, sched, 0, shared, n, true);  // the copy source: the shared positions, one run
    step();
    for (size_t i = 0; i < prompts.size(); ++i) {  // a step each: each copies c positions
      add(runner, sched, static_cast<int64_t>(i) + 1, prompts[i], n, true);
      step();
    }
    while (sched.has_work()) step();
    EXPECT_EQ(runner.copied_tokens(), static_cast<int64_t>(c) * static_cast<int64_t>(prompts.size()));
    for (size_t i = 0; i < prompts.size(); ++i)
      EXPECT_EQ(got[static_cast<int64_t>(i) + 1], split_alone(prompts[i])) << kQuestions[i];
  }
}

TEST_F(ModelRunnerTest, StopStringsEndTheAnswerAndAreNotShown) {
  SchedulerConfig cfg{.block_size = 16, .num_pages = 64, .max_seqs = 1, .max_seq_len = kCtx, .token_budget = 256};
  const std::vector<int32_t> p = chat(kQuestions[0]);
  // The free answer, then the same request stopped at its third word.
  auto run = [&](const std::vector<std::string>& stop) {
    Scheduler sched(cfg);
    ModelRunner runner(*model_, *tok_, model_->resolve(kSpec), kCtx, 1);
    RequestOptions opt;
    opt.max_tokens = 24;
    opt.stop = stop;
    runner.add(0, opt, static_cast<int>(p.size()));
    sched.add({0, p, opt.max_tokens});
    std::string text;
    FinishReason why = FinishReason::None;
    while (sched.has_work())
      for (const TokenEvent& ev : runner.step(sched.schedule(), sched)) {
        text += ev.text;
        why = ev.finish;
      }
    return std::make_pair(text, why);
  };
  const auto [full, why_full] = run({});
  EXPECT_EQ(why_full, FinishReason::Length);
  const size_t sp = full.find(' ', full.find(' ', 1) + 1);
  ASSERT_NE(sp, std::string::npos) << full;
  const std::string stop = full.substr(sp, 3);
  const auto [cut, why_cut] = run({stop});
  EXPECT_EQ(why_cut, FinishReason::Stop);
  EXPECT_EQ(cut, full.substr(0, full.find(stop))) << "stop '" << stop << "'";
}

// OpenAI's logit_bias and presence/frequency penalties (issue 45): greedy answers, so every
// token follows from the adjusted logits.
TEST_F(ModelRunnerTest, LogitBiasAndPenaltiesSteerSampling) {
  SchedulerConfig cfg{.block_size = 16, .num_pages = 64, .max_seqs = 1, .max_seq_len = kCtx, .token_budget = 256};
  const std::vector<int32_t> p = chat(kQuestions[3]);
  auto run = [&](const RequestOptions& opt) {
    Scheduler sched(cfg);
    ModelRunner runner(*model_, *tok_, model_->resolve(kSpec), kCtx, 1);
    runner.add(0, opt, static_cast<int>(p.size()));
    sched.add({0, p, opt.max_tokens});
    std::vector<int32_t> out;
    while (sched.has_work())
      for (const TokenEvent& ev : runner.step(sched.schedule(), sched))
        if (ev.token >= 0) out.push_back(ev.token);
    return out;
  };
  RequestOptions opt;
  opt.max_tokens = 10;
  opt.ignore_eos = true;
  const std::vector<int32_t> free = run(opt);
  ASSERT_EQ(free, alone(p, 10));
  const int32_t x = tok_->token_id("Ġsea");
  ASSERT_GE(x, 0);
  RequestOptions forced = opt;
  forced.logit_bias = {{x, 100.0f}};
  EXPECT_EQ(run(forced), std::vector<int32_t>(10, x));
  RequestOptions banned = opt;
  banned.logit_bias = {{free[0], -100.0f}};
  const std::vector<int32_t> other = run(banned);
  EXPECT_EQ(std::count(other.begin(), other.end(), free[0]), 0);
  // A penalty far beyond the logits' spread: no token is picked twice.
  for (float RequestOptions::*penalty : {&RequestOptions::presence_penalty, &RequestOptions::frequency_penalty}) {
    RequestOptions pen = opt;
    pen.*penalty = 1000.0f;
    std::vector<int32_t> got = run(pen);
    std::sort(got.begin(), got.end());
    EXPECT_EQ(std::adjacent_find(got.begin(), got.end()), got.end());
  }
  // A small frequency penalty only lowers what repeats: the first token is the free one.
  RequestOptions mild = opt;
  mild.frequency_penalty = 0.5f;
  EXPECT_EQ(run(mild)[0], free[0]);
}

TEST_F(ModelRunnerTest, EngineLoopServesConcurrentRequestsAndCancels) {
  // Every prompt in one chunk and computed whole, as alone(): a chunked prompt's later chunks,
  // like the rest of a prompt after a shared prefix, read the compressed cache (the prefix
  // sharing test has its own reference).
  SchedulerConfig cfg{.block_size = 16, .num_pages = 256, .max_seqs = 4, .max_seq_len = kCtx, .token_budget = 512,
                      .prefix_sharing = false};
  EngineLoop loop(*model_, *tok_, model_->resolve(kSpec), cfg);
  std::mutex mu;
  std::condition_variable cv;
  std::map<int64_t, std::vector<int32_t>> got;
  std::map<int64_t, FinishReason> done;
  std::vector<int64_t> ids;
  for (int i = 0; i < 3; ++i) {
    RequestOptions opt;
    opt.max_tokens = i == 2 ? 400 : 12;
    opt.ignore_eos = i == 2;
    ids.push_back(loop.submit(chat(kQuestions[i]), opt, [&](const TokenEvent& ev) {
      std::lock_guard<std::mutex> lock(mu);
      if (ev.token >= 0) got[ev.request].push_back(ev.token);
      if (ev.finish != FinishReason::None) done[ev.request] = ev.finish;
      cv.notify_all();
    }));
  }
  loop.cancel(ids[2]);
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(120), [&] { return done.size() == 3; }));
  EXPECT_EQ(done[ids[2]], FinishReason::Abort);
  EXPECT_LT(got[ids[2]].size(), 400u);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(got[ids[i]], alone(chat(kQuestions[i]), 12));
  lock.unlock();
  const EngineMetrics m = loop.metrics();
  EXPECT_EQ(m.requests_finished, 2);
  EXPECT_EQ(m.requests_aborted, 1);
  EXPECT_EQ(m.pages_used, 0);
  EXPECT_THROW(loop.submit({}, RequestOptions{}, [](const TokenEvent&) {}), tqkv::Error);
  loop.stop();
  try {  // a stopped loop refuses work as Busy (HTTP 503), not as a bad request
    loop.submit(chat(kQuestions[0]), RequestOptions{}, [](const TokenEvent&) {});
    ADD_FAILURE() << "a stopped loop took a request";
  } catch (const tqkv::Error& e) {
    EXPECT_EQ(e.code(), tqkv::ErrorCode::Busy) << e.what();
  }
}

}  // namespace
}  // namespace tqkv::serve
