// The scheduler alone, on fake requests (vLLM's scheduler tests): which requests run, wait
// or are preempted at each step, with no model and no HTTP.
#include "serve/scheduler.h"

#include <gtest/gtest.h>

#include <numeric>

#include "tqkv/error.h"

namespace tqkv::serve {
namespace {

SchedulerRequest req(int64_t id, int n_prompt, int max_tokens, int32_t first = 100) {
  SchedulerRequest r;
  r.id = id;
  r.prompt.resize(n_prompt);
  std::iota(r.prompt.begin(), r.prompt.end(), first);
  r.max_tokens = max_tokens;
  return r;
}

struct Chunk {
  int64_t id;
  int64_t pos0;
  int count;
  bool sample;
  int64_t copy_from = -1;
};
std::vector<Chunk> chunks(const StepPlan& p) {
  std::vector<Chunk> out;
  for (const ScheduledChunk& c : p.chunks) out.push_back({c.request, c.pos0, c.count, c.sample, c.copy_from});
  return out;
}
bool operator==(const Chunk& a, const Chunk& b) {
  return a.id == b.id && a.pos0 == b.pos0 && a.count == b.count && a.sample == b.sample && a.copy_from == b.copy_from;
}
void PrintTo(const Chunk& c, std::ostream* os) {
  *os << "{" << c.id << " @" << c.pos0 << " +" << c.count << (c.sample ? " sample" : "");
  if (c.copy_from >= 0) *os << " copy from " << c.copy_from;
  *os << "}";
}

using Ids = std::vector<int64_t>;

TEST(Scheduler, AdmitsWhilePagesRemainAndDecodesEveryRunningRequest) {
  SchedulerConfig cfg{.block_size = 4, .num_pages = 8, .max_seqs = 4, .max_seq_len = 64, .token_budget = 64};
  Scheduler s(cfg);
  s.add(req(1, 6, 4));  // 2 pages
  s.add(req(2, 9, 4, 200));  // 3 pages
  s.add(req(3, 13, 4, 300));  // 4 pages: does not fit next to the two others
  StepPlan p = s.schedule();
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{1, 0, 6, true}, {2, 0, 9, true}}));
  EXPECT_EQ(s.running(), (Ids{1, 2}));
  EXPECT_EQ(s.waiting(), (Ids{3}));
  EXPECT_EQ(s.pages_used(), 5);
  s.append_token(1, 7);
  s.append_token(2, 7);
  p = s.schedule();  // one decode token each; 3 still waits (needs 4 pages, 3 free)
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{1, 6, 1, true}, {2, 9, 1, true}}));
  EXPECT_EQ(s.waiting(), (Ids{3}));
  s.finish(2);  // finished requests leave at once: their pages come back
  EXPECT_EQ(s.pages_used(), 2);
  s.append_token(1, 7);
  p = s.schedule();
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{1, 7, 1, true}, {3, 0, 13, true}}));
  EXPECT_EQ(s.running(), (Ids{1, 3}));
  EXPECT_TRUE(p.preempted.empty());
}

TEST(Scheduler, ChunkedPrefillUnderTheTokenBudget) {
  SchedulerConfig cfg{.block_size = 4, .num_pages = 64, .max_seqs = 4, .max_seq_len = 64, .token_budget = 8};
  Scheduler s(cfg);
  s.add(req(1, 3, 8));
  s.add(req(2, 12, 8));
  StepPlan p = s.schedule();
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{1, 0, 3, true}, {2, 0, 5, false}}));
  s.append_token(1, 7);
  p = s.schedule();  // the decode first, then the next chunk of 2's prompt
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{1, 3, 1, true}, {2, 5, 7, true}}));
  s.append_token(1, 7);
  s.append_token(2, 7);
  p = s.schedule();
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{1, 4, 1, true}, {2, 12, 1, true}}));
  EXPECT_EQ(p.n_tokens(), 2);
}

TEST(Scheduler, RespectsMaxSeqs) {
  SchedulerConfig cfg{.block_size = 4, .num_pages = 64, .max_seqs = 2, .max_seq_len = 64, .token_budget = 64};
  Scheduler s(cfg);
  for (int i = 1; i <= 3; ++i) s.add(req(i, 4, 2));
  StepPlan p = s.schedule();
  EXPECT_EQ(s.running(), (Ids{1, 2}));
  EXPECT_EQ(s.waiting(), (Ids{3}));
  s.finish(1);
  s.append_token(2, 7);
  p = s.schedule();
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{2, 4, 1, true}, {3, 0, 4, true}}));
}

TEST(Scheduler, PreemptsTheYoungestAndRecomputesItLater) {
  // 4 pages of 4 positions. Two requests of 7 prompt tokens take 2 pages each; the first
  // decode step fits (positions 7 -> 8), the next needs a third page for each.
  SchedulerConfig cfg{.block_size = 4, .num_pages = 4, .max_seqs = 4, .max_seq_len = 64, .token_budget = 64};
  Scheduler s(cfg);
  s.add(req(1, 7, 6));
  s.add(req(2, 7, 6, 500));
  StepPlan p = s.schedule();
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{1, 0, 7, true}, {2, 0, 7, true}}));
  s.append_token(1, 11);
  s.append_token(2, 22);
  p = s.schedule();
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{1, 7, 1, true}, {2, 7, 1, true}}));
  s.append_token(1, 11);
  s.append_token(2, 22);
  p = s.schedule();  // 1 needs page 3: the youngest (2) is preempted, 1 decodes alone
  EXPECT_EQ(p.preempted, (Ids{2}));
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{1, 8, 1, true}}));
  EXPECT_EQ(s.running(), (Ids{1}));
  EXPECT_EQ(s.waiting(), (Ids{2}));
  EXPECT_EQ(s.stats().preemptions, 1);
  EXPECT_EQ(s.pages_of(2), 0);
  // 2 keeps its generated tokens: prompt + 2 samples, recomputed from position 0 later.
  EXPECT_EQ(s.tokens(2).size(), 9u);
  s.append_token(1, 11);
  p = s.schedule();  // 2 needs 3 pages for 9 positions, 1 free: it waits
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{1, 9, 1, true}}));
  s.finish(1);
  p = s.schedule();  // recomputed: prompt + generated in one chunk, then sampling resumes
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{2, 0, 9, true}}));
  EXPECT_EQ(s.n_generated(2), 2);
}

// A preempted request is first in line again, ahead of requests that arrived after it and were
// waiting already; none of them jumps ahead while it cannot be admitted.
TEST(Scheduler, APreemptedRequestIsFirstInLineAgain) {
  SchedulerConfig cfg{.block_size = 4, .num_pages = 4, .max_seqs = 4, .max_seq_len = 64, .token_budget = 64};
  Scheduler s(cfg);
  s.add(req(1, 7, 6));
  s.add(req(2, 7, 6, 500));
  s.add(req(3, 3, 2, 900));  // one page, none free: it waits behind 1 and 2
  s.schedule();
  EXPECT_EQ(s.waiting(), (Ids{3}));
  for (int step = 0; step < 2; ++step) {
    s.append_token(1, 11);
    s.append_token(2, 22);
    s.schedule();
  }
  EXPECT_EQ(s.running(), (Ids{1}));  // 1 needed a third page: 2 was preempted
  EXPECT_EQ(s.waiting(), (Ids{2, 3}));
  s.append_token(1, 11);
  const StepPlan p = s.schedule();  // 2 needs 3 pages, 1 is free: 3 would fit, but waits its turn
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{1, 9, 1, true}}));
  EXPECT_EQ(s.waiting(), (Ids{2, 3}));
}

TEST(Scheduler, PreemptsItselfWhenItIsTheYoungest) {
  SchedulerConfig cfg{.block_size = 2, .num_pages = 4, .max_seqs = 4, .max_seq_len = 64, .token_budget = 64};
  Scheduler s(cfg);
  s.add(req(1, 3, 4));  // 2 pages; position 3 still fits its second page
  s.add(req(2, 4, 4, 200));  // 2 pages, full
  s.schedule();
  s.append_token(1, 7);
  s.append_token(2, 7);
  // 1 decodes without a new page; 2 needs one, none is free, and 2 is the youngest.
  StepPlan p = s.schedule();
  EXPECT_EQ(p.preempted, (Ids{2}));
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{1, 3, 1, true}}));
  EXPECT_EQ(s.waiting(), (Ids{2}));
}

TEST(Scheduler, EveryRequestCompletesUnderATinyPool) {
  // A pool that holds one full request: the load still completes, in order, with every token.
  SchedulerConfig cfg{.block_size = 4, .num_pages = 5, .max_seqs = 8, .max_seq_len = 64, .token_budget = 16};
  Scheduler s(cfg);
  const int n = 12, max_tokens = 6;
  for (int i = 0; i < n; ++i) s.add(req(i, 5 + i % 7, max_tokens, 10 * i));
  std::vector<int> generated(n, 0);
  int steps = 0, finished = 0;
  while (s.has_work()) {
    ASSERT_LT(++steps, 2000);
    StepPlan p = s.schedule();
    ASSERT_FALSE(p.empty()) << "stalled at step " << steps;
    ASSERT_LE(p.n_tokens(), cfg.token_budget);
    ASSERT_LE(s.n_running(), cfg.max_seqs);
    for (const ScheduledChunk& c : p.chunks) {
      if (!c.sample) continue;
      if (s.n_generated(c.request) + 1 == max_tokens) {
        generated[c.request] = max_tokens;
        s.finish(c.request);
        ++finished;
      } else {
        s.append_token(c.request, 1);
      }
    }
  }
  EXPECT_EQ(finished, n);
  for (int g : generated) EXPECT_EQ(g, max_tokens);
  EXPECT_GT(s.stats().preemptions, 0);
  EXPECT_EQ(s.pages_used(), 0);
}

TEST(Scheduler, SharesFullPromptPagesAndCountsHits) {
  SchedulerConfig cfg{.block_size = 4, .num_pages = 16, .max_seqs = 4, .max_seq_len = 64, .token_budget = 64};
  Scheduler s(cfg);
  s.add(req(1, 10, 4));  // pages: [0..3] [4..7] [8, 9]
  s.schedule();
  SchedulerRequest r2 = req(2, 10, 4);
  r2.prompt[9] = 999;  // same first 9 tokens: the two full pages are shared
  s.add(r2);
  SchedulerRequest r3 = req(3, 10, 4);
  r3.prompt[5] = 999;  // differs in page 1: only page 0 is shared
  s.add(r3);
  StepPlan p = s.schedule();
  EXPECT_EQ(s.running(), (Ids{1, 2, 3}));
  EXPECT_EQ(s.pages_of(2), 3);
  EXPECT_EQ(s.pages_used(), 3 + 1 + 2);
  EXPECT_EQ(s.stats().prefix_query_pages, 6);
  EXPECT_EQ(s.stats().prefix_hit_pages, 3);
  // Request 1 computed the shared pages in the step before: the others copy them from it and
  // compute the rest.
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{2, 8, 2, true, 1}, {3, 4, 6, true, 1}}));
  EXPECT_EQ(s.stats().prefix_copy_tokens, 12);
  s.finish(1);
  EXPECT_EQ(s.pages_used(), 1 + 1 + 2 + 1);  // 1's shared pages stay with 2 and 3
  s.finish(2);
  s.finish(3);
  EXPECT_EQ(s.pages_used(), 0);
}

TEST(Scheduler, CopiesOnlyPositionsComputedInEarlierStepsAndNeverTheLastToken) {
  SchedulerConfig cfg{.block_size = 4, .num_pages = 16, .max_seqs = 4, .max_seq_len = 64, .token_budget = 64};
  Scheduler s(cfg);
  s.add(req(1, 8, 4));
  s.add(req(2, 8, 4));  // the same prompt, admitted in the same step: shares pages, computes all
  StepPlan p = s.schedule();
  EXPECT_EQ(chunks(p), (std::vector<Chunk>{{1, 0, 8, true}, {2, 0, 8, true}}));
  EXPECT_EQ(s.stats().prefix_hit_pages, 2);
  s.append_token(1, 7);
  s.append_token(2, 7);
  s.add(req(3, 8, 4));  // later: copies the first page; the last token is computed to sample
  p = s.schedule();
  ASSERT_EQ(p.chunks.size(), 3u);
  EXPECT_EQ(chunks(p)[2], (Chunk{3, 4, 4, true, 1}));
  s.finish(1);
  s.finish(2);
  s.finish(3);
  EXPECT_EQ(s.pages_used(), 0);
}

TEST(Scheduler, AbortFreesWaitingAndRunningRequests) {
  SchedulerConfig cfg{.block_size = 4, .num_pages = 4, .max_seqs = 1, .max_seq_len = 64, .token_budget = 64};
  Scheduler s(cfg);
  s.add(req(1, 4, 2));
  s.add(req(2, 4, 2));
  s.schedule();
  s.abort(2);
  EXPECT_TRUE(s.waiting().empty());
  s.abort(1);
  EXPECT_FALSE(s.has_work());
  EXPECT_EQ(s.pages_used(), 0);
  s.abort(42);  // unknown: ignored
}

TEST(Scheduler, RejectsRequestsThatCanNeverRun) {
  SchedulerConfig cfg{.block_size = 4, .num_pages = 4, .max_seqs = 2, .max_seq_len = 32, .token_budget = 64};
  Scheduler s(cfg);
  EXPECT_THROW(s.add(req(1, 0, 4)), Error);
  EXPECT_THROW(s.add(req(2, 4, 0)), Error);
  EXPECT_THROW(s.add(req(3, 30, 4)), Error);  // 33 positions > 32
  EXPECT_THROW(s.add(req(4, 14, 4)), Error);  // 17 positions: 5 pages > 4
  s.add(req(5, 13, 4));                       // 16 positions: exactly the pool
  EXPECT_THROW(s.add(req(5, 4, 4)), Error);  // duplicate id
  EXPECT_EQ(s.n_waiting(), 1);
  EXPECT_THROW(Scheduler(SchedulerConfig{.block_size = 0}), Error);
}

}  // namespace
}  // namespace tqkv::serve
