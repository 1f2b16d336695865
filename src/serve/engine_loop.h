// The engine thread of `tqkv serve`: owns the scheduler and the model runner and runs the
// step loop (schedule -> forward -> sample) while any request is waiting or running. Other
// threads (the HTTP handlers) submit requests and cancel them; each request's events are
// delivered to its callback on the engine thread, so a callback must only hand them over
// (queue + notify), never block. Cancellation (a client that went away) takes effect at the
// start of the next step: the request's pages and cache sequence are freed there.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "model_runner.h"
#include "scheduler.h"

namespace tqkv::serve {

// Cumulative histogram with Prometheus-style upper bounds (seconds).
struct Histogram {
  std::vector<double> bounds{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
  std::vector<uint64_t> counts = std::vector<uint64_t>(bounds.size() + 1, 0);  // last: +Inf
  double sum = 0;
  uint64_t count = 0;
  void observe(double v);
};

struct EngineMetrics {
  int running = 0, waiting = 0;
  int pages_used = 0, pages_free = 0, block_size = 0;
  int64_t prompt_tokens = 0, generated_tokens = 0;
  int64_t requests_finished = 0, requests_aborted = 0;
  int64_t steps = 0, preemptions = 0;
  int64_t prefix_query_pages = 0, prefix_hit_pages = 0;
  int64_t prefix_copied_tokens = 0;  // prompt positions copied from another request, not computed
  Histogram ttft, tpot;  // seconds: time to first token, time per output token after it
};

class EngineLoop {
 public:
  using Callback = std::function<void(const TokenEvent&)>;

  // Starts the engine thread. The model and tokenizer must outlive the loop.
  EngineLoop(const engine::Model& model, const engine::Tokenizer& tok, const engine::CacheSpec& spec,
             const SchedulerConfig& config);
  ~EngineLoop();  // stop()
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  const SchedulerConfig& config() const { return cfg_; }
  // Queues a request; returns its id. Throws tqkv::Error(InvalidArgument) when it could never
  // run (empty prompt, max_tokens < 1, beyond the context or the pool, bad sampling
  // parameters), tqkv::Error(Busy) after stop(). on_event gets every
  // event, the last one with a finish reason (Abort after cancel() or stop()).
  int64_t submit(std::vector<int32_t> prompt, const RequestOptions& opt, Callback on_event);
  // The request's sequence is freed at the next step; its callback gets an Abort event.
  void cancel(int64_t id);
  // Aborts everything and joins the engine thread. Idempotent.
  void stop();
  EngineMetrics metrics() const;
  // Set when a step threw: the loop stopped and every request was aborted.
  std::string fatal_error() const;

 private:
  struct Pending {
    int64_t id;
    std::vector<int32_t> prompt;
    RequestOptions opt;
    Callback cb;
  };
  struct Live {
    Callback cb;
    double arrival = 0, first = 0;
    int n_prompt = 0;
  };
  void run();
  void abort_locked_out(int64_t id);
  void publish_gauges();  // scheduler gauges -> metrics_

  SchedulerConfig cfg_;
  Scheduler sched_;
  ModelRunner runner_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Pending> pending_;
  std::vector<int64_t> cancels_;
  std::unordered_map<int64_t, Live> live_;  // engine thread only
  bool stopping_ = false;
  int64_t next_id_ = 1;
  EngineMetrics metrics_;  // under mu_
  std::string fatal_;
  std::thread thread_;
};

}  // namespace tqkv::serve
