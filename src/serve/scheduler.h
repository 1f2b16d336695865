// The scheduler of `tqkv serve`: continuous batching over a logical page pool, with no model
// and no HTTP (vLLM's scheduler model). Each step it decides which tokens of which requests
// run: one decode token for every running request, then chunks of prompts (chunked prefill)
// while the step's token budget lasts. Pages of `block_size` positions come from one pool;
// waiting requests are admitted while pages remain; when a running request needs a page and
// none is free, the youngest running request is preempted (its pages freed, its tokens kept,
// recomputed from position 0 when it is admitted again) — never failed or truncated.
//
// Prefix sharing: every full page of a prompt is indexed by a hash of its tokens and of all
// the tokens before it; a request admitted later whose prompt starts with the same pages
// shares them (reference counts) instead of taking new ones. When a running request already
// computed those positions (in an earlier step), the admitted request's first chunk starts
// after them and names that request as its source: the runner copies the source's cache
// positions (KvCache::copy_prefix) instead of computing them again.
//
// Protocol: add() requests; schedule() returns a StepPlan and assumes it runs (the planned
// positions count as computed); the runner then reports each sampled token with
// append_token() or ends the request with finish(); abort() drops a request at any time.
#pragma once
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

namespace tqkv::serve {

struct SchedulerConfig {
  int block_size = 16;     // positions per page
  int num_pages = 1024;    // the pool
  int max_seqs = 8;        // running requests at once (the KvCache's sequences)
  int max_seq_len = 2048;  // positions per sequence (the KvCache's capacity)
  int token_budget = 256;  // tokens per step: decodes plus prefill chunks
  bool prefix_sharing = true;
};

struct SchedulerRequest {
  int64_t id = 0;
  std::vector<int32_t> prompt;  // token ids, not empty
  int max_tokens = 16;          // tokens to generate at most, >= 1
};

// One run of a step: tokens [pos0, pos0 + count) of a request's tokens (prompt, then what it
// generated), appended to its cache sequence at those positions.
struct ScheduledChunk {
  int64_t request = 0;
  int64_t pos0 = 0;     // 0: the runner (re)creates the request's cache sequence first
  int count = 0;
  bool sample = false;  // the chunk ends at the request's last token: sample the next one
  // pos0 > 0 at admission: positions [0, pos0) are a prompt prefix this running request has
  // computed; the runner copies them from its cache sequence (or computes them where it cannot).
  int64_t copy_from = -1;
};

struct StepPlan {
  std::vector<int64_t> preempted;       // requests whose cache sequences are freed before the step
  std::vector<ScheduledChunk> chunks;   // batch order: running requests oldest first, then admitted
  int n_tokens() const;
  bool empty() const { return chunks.empty(); }
};

struct SchedulerStats {
  int64_t steps = 0;
  int64_t scheduled_tokens = 0;
  int64_t preemptions = 0;
  int64_t prefix_query_pages = 0;  // full prompt pages looked up at admission
  int64_t prefix_hit_pages = 0;    // ... found in the pool and shared
  int64_t prefix_copy_tokens = 0;  // positions planned as copies from a running request
  double prefix_hit_rate() const {
    return prefix_query_pages > 0 ? static_cast<double>(prefix_hit_pages) / prefix_query_pages : 0.0;
  }
};

class Scheduler {
 public:
  // Throws tqkv::Error(InvalidArgument) for a size below 1.
  explicit Scheduler(const SchedulerConfig& config);

  const SchedulerConfig& config() const { return cfg_; }

  // The checks of add() that need only the config (so a front end can refuse a request before
  // it reaches the scheduler's thread). Throws tqkv::Error(InvalidArgument).
  static void check(const SchedulerConfig& config, int64_t n_prompt, int64_t max_tokens);

  // Queues a request. Throws tqkv::Error(InvalidArgument) for an empty prompt, max_tokens < 1,
  // a duplicate id, or prompt + max_tokens beyond max_seq_len or beyond what the whole pool
  // holds (such a request could never finish).
  void add(SchedulerRequest r);
  // Drops a waiting or running request and frees its pages; unknown ids are ignored.
  void abort(int64_t id);
  // The next step's plan (empty when nothing can run).
  StepPlan schedule();
  // The token sampled for a request after its chunk with sample = true; it is computed in a
  // later step. Throws tqkv::Error(OutOfRange) for an unknown id.
  void append_token(int64_t id, int32_t token);
  // The request is done (stop, end of generation, max_tokens): its pages are freed now.
  void finish(int64_t id);

  bool contains(int64_t id) const { return seqs_.count(id) != 0; }
  // Prompt then generated tokens of a request.
  const std::vector<int32_t>& tokens(int64_t id) const;
  int n_prompt(int64_t id) const;
  int n_generated(int64_t id) const;
  bool is_running(int64_t id) const;

  bool has_work() const { return !waiting_.empty() || !running_.empty(); }
  int n_running() const { return static_cast<int>(running_.size()); }
  int n_waiting() const { return static_cast<int>(waiting_.size()); }
  const std::vector<int64_t>& running() const { return running_; }
  std::vector<int64_t> waiting() const { return {waiting_.begin(), waiting_.end()}; }
  int pages_free() const { return static_cast<int>(free_.size()); }
  int pages_used() const { return cfg_.num_pages - pages_free(); }
  // Pages a request holds (shared ones included).
  int pages_of(int64_t id) const;
  const SchedulerStats& stats() const { return stats_; }

 private:
  struct Seq {
    SchedulerRequest req;
    std::vector<int32_t> tokens;  // prompt + generated
    int64_t computed = 0;         // positions in the cache (the current step's included)
    int64_t ready = 0;            // positions computed by earlier steps (copyable)
    std::vector<int> pages;
  };
  int pages_for(int64_t positions) const;
  Seq& at(int64_t id);
  const Seq& at(int64_t id) const;
  void release_pages(Seq& s);
  void preempt(int64_t id);
  bool try_admit(int64_t id, int& budget, StepPlan& plan);
  std::vector<uint64_t> prompt_page_hashes(const Seq& s) const;

  SchedulerConfig cfg_;
  std::unordered_map<int64_t, Seq> seqs_;
  std::deque<int64_t> waiting_;
  std::vector<int64_t> running_;  // admission order, oldest first
  std::vector<int> free_;         // free pages (a stack)
  std::vector<int> refs_;         // [num_pages] holders of each page
  std::vector<uint64_t> page_key_;  // [num_pages] its prefix-index key (0: not indexed)
  std::unordered_map<uint64_t, int> prefix_index_;  // key of a full prompt page -> page
  SchedulerStats stats_;
};

}  // namespace tqkv::serve
