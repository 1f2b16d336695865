#include "scheduler.h"

#include <algorithm>
#include <string>

#include "tqkv/error.h"

namespace tqkv::serve {
namespace {

uint64_t mix(uint64_t h, uint64_t v) {
  // splitmix64 finaliser over the running hash: order-sensitive, well spread.
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebULL;
  h ^= h >> 31;
  return h;
}

}  // namespace

int StepPlan::n_tokens() const {
  int n = 0;
  for (const ScheduledChunk& c : chunks) n += c.count;
  return n;
}

Scheduler::Scheduler(const SchedulerConfig& config) : cfg_(config) {
  if (cfg_.block_size < 1 || cfg_.num_pages < 1 || cfg_.max_seqs < 1 || cfg_.max_seq_len < 1 || cfg_.token_budget < 1)
    throw Error(ErrorCode::InvalidArgument, "scheduler: block size, pages, sequences, length and budget must be >= 1");
  refs_.assign(cfg_.num_pages, 0);
  page_key_.assign(cfg_.num_pages, 0);
  free_.reserve(cfg_.num_pages);
  for (int p = cfg_.num_pages - 1; p >= 0; --p) free_.push_back(p);  // page 0 is handed out first
}

int Scheduler::pages_for(int64_t positions) const {
  return static_cast<int>((positions + cfg_.block_size - 1) / cfg_.block_size);
}

Scheduler::Seq& Scheduler::at(int64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) throw Error(ErrorCode::OutOfRange, "scheduler: unknown request " + std::to_string(id));
  return it->second;
}
const Scheduler::Seq& Scheduler::at(int64_t id) const { return const_cast<Scheduler*>(this)->at(id); }

const std::vector<int32_t>& Scheduler::tokens(int64_t id) const { return at(id).tokens; }
int Scheduler::n_prompt(int64_t id) const { return static_cast<int>(at(id).req.prompt.size()); }
int Scheduler::n_generated(int64_t id) const {
  const Seq& s = at(id);
  return static_cast<int>(s.tokens.size() - s.req.prompt.size());
}
bool Scheduler::is_running(int64_t id) const {
  return std::find(running_.begin(), running_.end(), id) != running_.end();
}
int Scheduler::pages_of(int64_t id) const { return static_cast<int>(at(id).pages.size()); }

void Scheduler::check(const SchedulerConfig& cfg, int64_t n, int64_t max_tokens) {
  if (n <= 0) throw Error(ErrorCode::InvalidArgument, "the prompt is empty");
  if (max_tokens < 1) throw Error(ErrorCode::InvalidArgument, "max_tokens must be at least 1");
  // The last generated token is never computed, so a request holds at most n + max_tokens - 1
  // positions.
  const int64_t most = n + max_tokens - 1;
  if (n >= cfg.max_seq_len)
    throw Error(ErrorCode::InvalidArgument, "the prompt has " + std::to_string(n) +
                                                " tokens but the context holds " + std::to_string(cfg.max_seq_len));
  if (most > cfg.max_seq_len)
    throw Error(ErrorCode::InvalidArgument, "the prompt (" + std::to_string(n) + " tokens) plus max_tokens (" +
                                                std::to_string(max_tokens) + ") exceeds the context of " +
                                                std::to_string(cfg.max_seq_len) + " tokens");
  const int64_t pages = (most + cfg.block_size - 1) / cfg.block_size;
  if (pages > cfg.num_pages)
    throw Error(ErrorCode::InvalidArgument, "the prompt plus max_tokens needs " + std::to_string(pages) +
                                                " pages but the cache holds " + std::to_string(cfg.num_pages));
}

void Scheduler::add(SchedulerRequest r) {
  check(cfg_, static_cast<int64_t>(r.prompt.size()), r.max_tokens);
  if (seqs_.count(r.id)) throw Error(ErrorCode::InvalidArgument, "scheduler: duplicate request " + std::to_string(r.id));
  Seq s;
  s.tokens = r.prompt;
  s.req = std::move(r);
  const int64_t id = s.req.id;
  seqs_.emplace(id, std::move(s));
  waiting_.push_back(id);
}

void Scheduler::release_pages(Seq& s) {
  for (int p : s.pages) {
    if (--refs_[p] > 0) continue;
    if (page_key_[p] != 0) {
      prefix_index_.erase(page_key_[p]);
      page_key_[p] = 0;
    }
    free_.push_back(p);
  }
  s.pages.clear();
}

void Scheduler::abort(int64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  release_pages(it->second);
  running_.erase(std::remove(running_.begin(), running_.end(), id), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), id), waiting_.end());
  seqs_.erase(it);
}

void Scheduler::finish(int64_t id) { abort(id); }

void Scheduler::append_token(int64_t id, int32_t token) { at(id).tokens.push_back(token); }

void Scheduler::preempt(int64_t id) {
  Seq& s = at(id);
  release_pages(s);
  s.computed = s.ready = 0;
  running_.erase(std::remove(running_.begin(), running_.end(), id), running_.end());
  waiting_.push_front(id);  // first in line again: it is older than anything still waiting
  ++stats_.preemptions;
}

std::vector<uint64_t> Scheduler::prompt_page_hashes(const Seq& s) const {
  std::vector<uint64_t> keys;
  const size_t bs = static_cast<size_t>(cfg_.block_size);
  uint64_t h = 0x51ed27e3u;
  for (size_t p = 0; (p + 1) * bs <= s.req.prompt.size(); ++p) {
    for (size_t t = p * bs; t < (p + 1) * bs; ++t) h = mix(h, static_cast<uint32_t>(s.req.prompt[t]));
    keys.push_back(h == 0 ? 1 : h);
  }
  return keys;
}

bool Scheduler::try_admit(int64_t id, int& budget, StepPlan& plan) {
  Seq& s = at(id);
  const std::vector<uint64_t> keys = cfg_.prefix_sharing ? prompt_page_hashes(s) : std::vector<uint64_t>{};
  std::vector<int> shared;
  for (uint64_t k : keys) {
    auto it = prefix_index_.find(k);
    if (it == prefix_index_.end()) break;
    shared.push_back(it->second);
  }
  // The running request that computed the longest run of the shared pages in earlier steps:
  // those positions are copied, not computed (at least the last token is computed, to sample).
  const int bs = cfg_.block_size;
  const int max_copy = std::min(static_cast<int>(shared.size()), static_cast<int>((s.tokens.size() - 1) / bs));
  int64_t source = -1;
  int copy_pages = 0;
  for (int64_t r : running_) {
    const Seq& o = at(r);
    int m = 0;
    while (m < max_copy && m < static_cast<int>(o.pages.size()) && o.pages[m] == shared[m] &&
           static_cast<int64_t>(m + 1) * bs <= o.ready)
      ++m;
    if (m > copy_pages) {
      copy_pages = m;
      source = r;
    }
  }
  const int64_t pos0 = static_cast<int64_t>(copy_pages) * bs;
  const int count = static_cast<int>(std::min<int64_t>(static_cast<int64_t>(s.tokens.size()) - pos0, budget));
  const int need = std::max(0, pages_for(pos0 + count) - static_cast<int>(shared.size()));
  if (need > pages_free()) return false;
  stats_.prefix_query_pages += static_cast<int64_t>(keys.size());
  stats_.prefix_hit_pages += static_cast<int64_t>(shared.size());
  for (int p : shared) {
    ++refs_[p];
    s.pages.push_back(p);
  }
  for (int i = 0; i < need; ++i) {
    const int p = free_.back();
    free_.pop_back();
    refs_[p] = 1;
    s.pages.push_back(p);
  }
  // Index this prompt's own full pages so that later requests can share them.
  for (size_t i = shared.size(); i < keys.size() && i < s.pages.size(); ++i) {
    const int p = s.pages[i];
    if (prefix_index_.emplace(keys[i], p).second) page_key_[p] = keys[i];
  }
  waiting_.pop_front();
  running_.push_back(id);
  plan.chunks.push_back({id, pos0, count, pos0 + count == static_cast<int64_t>(s.tokens.size()), source});
  s.computed = pos0 + count;
  s.ready = 0;
  stats_.prefix_copy_tokens += pos0;
  budget -= count;
  return true;
}

StepPlan Scheduler::schedule() {
  StepPlan plan;
  int budget = cfg_.token_budget;
  for (int64_t id : running_) {
    Seq& s = at(id);
    s.ready = s.computed;
  }
  // Running requests, oldest first: a decode token each, or their prompt's next chunk.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    const int64_t id = running_[i];
    Seq& s = at(id);
    const int count = static_cast<int>(std::min<int64_t>(static_cast<int64_t>(s.tokens.size()) - s.computed, budget));
    if (count <= 0) continue;
    // Late pages of a request are its own (only full prompt pages are shared), so what it
    // needs is the difference.
    const int need = std::max(0, pages_for(s.computed + count) - static_cast<int>(s.pages.size()));
    bool self_preempted = false;
    while (need > pages_free()) {
      const int64_t victim = running_.back();  // the youngest; never one already planned
      preempt(victim);
      plan.preempted.push_back(victim);
      if (victim == id) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;
    for (int k = 0; k < need; ++k) {
      const int p = free_.back();
      free_.pop_back();
      refs_[p] = 1;
      s.pages.push_back(p);
    }
    plan.chunks.push_back({id, s.computed, count, s.computed + count == static_cast<int64_t>(s.tokens.size())});
    s.computed += count;
    budget -= count;
  }
  // Admission, oldest waiting first, while sequences, budget and pages remain; none in a step
  // that had to preempt (the pool is short).
  if (plan.preempted.empty())
    while (!waiting_.empty() && n_running() < cfg_.max_seqs && budget > 0)
      if (!try_admit(waiting_.front(), budget, plan)) break;
  if (!plan.empty()) {
    ++stats_.steps;
    stats_.scheduled_tokens += plan.n_tokens();
  }
  return plan;
}

}  // namespace tqkv::serve
