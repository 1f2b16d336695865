#include "thread_pool.h"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace tqkv::engine {
namespace {

class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 1; i < n; ++i) workers_.emplace_back([this, i] { loop(i); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void run(int parts, const std::function<void(int)>& f) {
    std::unique_lock<std::mutex> l(job_m_);  // one job at a time
    {
      std::lock_guard<std::mutex> g(m_);
      f_ = &f;
      parts_ = parts;
      next_ = 1;  // part 0 is the caller's
      pending_ = parts - 1;
      error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    run_part(0);
    // Help with the remaining parts, then wait for the ones the workers took.
    for (;;) {
      int p;
      {
        std::lock_guard<std::mutex> g(m_);
        if (next_ >= parts_) break;
        p = next_++;
      }
      run_part(p);
      finish_one();
    }
    std::unique_lock<std::mutex> g(m_);
    done_cv_.wait(g, [this] { return pending_ == 0; });
    f_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void run_part(int p) {
    try {
      (*f_)(p);
    } catch (...) {
      std::lock_guard<std::mutex> g(m_);
      if (!error_) error_ = std::current_exception();
    }
  }
  void finish_one() {
    std::lock_guard<std::mutex> g(m_);
    if (--pending_ == 0) done_cv_.notify_one();
  }
  void loop(int) {
    unsigned long seen = 0;
    for (;;) {
      int p;
      {
        std::unique_lock<std::mutex> g(m_);
        cv_.wait(g, [&] { return stop_ || (generation_ != seen && f_ && next_ < parts_); });
        if (stop_) return;
        p = next_++;
        if (next_ >= parts_) seen = generation_;
      }
      run_part(p);
      finish_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex m_, job_m_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* f_ = nullptr;
  int parts_ = 0, next_ = 0, pending_ = 0;
  unsigned long generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

int g_threads = 0;
std::unique_ptr<Pool> g_pool;
std::mutex g_pool_m;

Pool& pool() {
  std::lock_guard<std::mutex> l(g_pool_m);
  if (!g_pool) {
    const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    g_pool = std::make_unique<Pool>(g_threads > 0 ? g_threads : hw);
  }
  return *g_pool;
}

}  // namespace

void set_pool_threads(int n) {
  std::lock_guard<std::mutex> l(g_pool_m);
  g_threads = n;
  g_pool.reset();  // rebuilt with the new size on next use
}

int pool_threads() { return pool().size(); }

void parallel_for(int parts, const std::function<void(int)>& f) {
  if (parts <= 0) return;
  if (parts == 1) {
    f(0);
    return;
  }
  pool().run(parts, f);
}

}  // namespace tqkv::engine
