#include "engine_loop.h"

#include <chrono>

#include "tqkv/error.h"

namespace tqkv::serve {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds.size() && v > bounds[i]) ++i;
  ++counts[i];
  sum += v;
  ++count;
}

EngineLoop::EngineLoop(const engine::Model& model, const engine::Tokenizer& tok, const engine::CacheSpec& spec,
                       const SchedulerConfig& config)
    : cfg_(config), sched_(config), runner_(model, tok, spec, config.max_seq_len, config.max_seqs) {
  metrics_.pages_free = cfg_.num_pages;
  metrics_.block_size = cfg_.block_size;
  thread_ = std::thread([this] { run(); });
}

EngineLoop::~EngineLoop() { stop(); }

int64_t EngineLoop::submit(std::vector<int32_t> prompt, const RequestOptions& opt, Callback on_event) {
  Scheduler::check(cfg_, static_cast<int64_t>(prompt.size()), opt.max_tokens);
  engine::Sampler check_params(opt.sampler);  // throws for bad parameters here, not on the engine thread
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) throw Error(ErrorCode::Busy, "the server is shutting down");
  const int64_t id = next_id_++;
  pending_.push_back({id, std::move(prompt), opt, std::move(on_event)});
  cv_.notify_one();
  return id;
}

void EngineLoop::cancel(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  cancels_.push_back(id);
  cv_.notify_one();
}

void EngineLoop::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.notify_one();
  }
  if (thread_.joinable()) thread_.join();
}

EngineMetrics EngineLoop::metrics() const {
  std::lock_guard<std::mutex> lock(mu_);
  return metrics_;
}

std::string EngineLoop::fatal_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fatal_;
}

// Engine thread: drops a request from the scheduler and the runner and tells its client.
void EngineLoop::abort_locked_out(int64_t id) {
  auto it = live_.find(id);
  if (it == live_.end()) return;
  sched_.abort(id);
  runner_.remove(id);
  TokenEvent ev;
  ev.request = id;
  ev.finish = FinishReason::Abort;
  ev.n_prompt = it->second.n_prompt;
  Callback cb = std::move(it->second.cb);
  live_.erase(it);
  cb(ev);
  std::lock_guard<std::mutex> lock(mu_);
  ++metrics_.requests_aborted;
}

void EngineLoop::publish_gauges() {
  std::lock_guard<std::mutex> lock(mu_);
  metrics_.running = sched_.n_running();
  metrics_.waiting = sched_.n_waiting();
  metrics_.pages_used = sched_.pages_used();
  metrics_.pages_free = sched_.pages_free();
  metrics_.steps = sched_.stats().steps;
  metrics_.preemptions = sched_.stats().preemptions;
  metrics_.prefix_query_pages = sched_.stats().prefix_query_pages;
  metrics_.prefix_hit_pages = sched_.stats().prefix_hit_pages;
  metrics_.prefix_copied_tokens = runner_.copied_tokens();
}

void EngineLoop::run() {
  for (;;) {
    std::vector<Pending> incoming;
    std::vector<int64_t> cancels;
    bool stopping = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !pending_.empty() || !cancels_.empty() || sched_.has_work(); });
      incoming.swap(pending_);
      cancels.swap(cancels_);
      stopping = stopping_;
    }
    const double t_now = now_seconds();
    for (Pending& p : incoming) {
      Live l{std::move(p.cb), t_now, 0, static_cast<int>(p.prompt.size())};
      live_.emplace(p.id, std::move(l));
      runner_.add(p.id, p.opt, static_cast<int>(p.prompt.size()));
      sched_.add({p.id, std::move(p.prompt), p.opt.max_tokens});
      std::lock_guard<std::mutex> lock(mu_);
      metrics_.prompt_tokens += live_[p.id].n_prompt;
    }
    for (int64_t id : cancels) abort_locked_out(id);
    if (!cancels.empty()) publish_gauges();
    if (stopping) {
      std::vector<int64_t> ids;
      for (auto& [id, l] : live_) ids.push_back(id);
      for (int64_t id : ids) abort_locked_out(id);
      return;
    }
    if (!sched_.has_work()) continue;

    std::vector<TokenEvent> events;
    try {
      const StepPlan plan = sched_.schedule();
      events = runner_.step(plan, sched_);
    } catch (const std::exception& e) {
      // A failed step leaves the cache in an unknown state: end every request, stop serving.
      {
        std::lock_guard<std::mutex> lock(mu_);
        fatal_ = e.what();
        stopping_ = true;
      }
      std::vector<int64_t> ids;
      for (auto& [id, l] : live_) ids.push_back(id);
      for (int64_t id : ids) abort_locked_out(id);
      return;
    }
    const double t = now_seconds();
    int64_t generated = 0;
    for (const TokenEvent& ev : events) {
      auto it = live_.find(ev.request);
      if (it == live_.end()) continue;
      Live& l = it->second;
      if (ev.token >= 0) ++generated;
      if (l.first == 0 && (ev.token >= 0 || ev.finish != FinishReason::None)) {
        l.first = t;
        std::lock_guard<std::mutex> lock(mu_);
        metrics_.ttft.observe(t - l.arrival);
      }
      if (ev.finish != FinishReason::None) {
        const double tpot = ev.n_generated > 1 ? (t - l.first) / (ev.n_generated - 1) : -1;
        Callback cb = std::move(l.cb);
        live_.erase(it);
        {  // counted before the client hears of it: a client that sees its answer sees it counted
          std::lock_guard<std::mutex> lock(mu_);
          ++metrics_.requests_finished;
          if (tpot >= 0) metrics_.tpot.observe(tpot);
        }
        cb(ev);
      } else {
        l.cb(ev);
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      metrics_.generated_tokens += generated;
    }
    publish_gauges();
  }
}

}  // namespace tqkv::serve
