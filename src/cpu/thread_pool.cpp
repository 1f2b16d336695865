#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "tqkv/threads.h"

namespace tqkv {
namespace {

std::atomic<int> g_threads{0};  // 0: the default

}  // namespace

int num_threads() {
  int n = g_threads.load(std::memory_order_relaxed);
  if (n > 0) return n;
  n = static_cast<int>(std::thread::hardware_concurrency());
  if (const char* env = std::getenv("TQKV_THREADS"); env && *env) n = std::atoi(env);
  return n > 0 ? n : 1;
}

void set_num_threads(int n) { g_threads.store(n > 0 ? n : 0); }

namespace cpu {
namespace {

// Set on the pool's workers for their lifetime and on a caller while it runs a job: a
// parallel_for from such a thread runs serially.
thread_local bool t_in_job = false;

class Pool {
 public:
  static Pool& instance() {
    static Pool pool;
    return pool;
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
    }
    start_cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  void run(int n, int threads, const std::function<void(int, int)>& f) {
    if (n <= 0) return;
    threads = std::min(threads, n);
    if (threads <= 1 || t_in_job || busy_.exchange(true, std::memory_order_acquire)) {
      for (int i = 0; i < n; ++i) f(i, 0);
      return;
    }
    struct Release {
      std::atomic<bool>& busy;
      ~Release() {
        t_in_job = false;
        busy.store(false, std::memory_order_release);
      }
    } release{busy_};
    t_in_job = true;

    std::unique_lock<std::mutex> lk(m_);
    while (static_cast<int>(workers_.size()) < threads - 1) {
      const int id = static_cast<int>(workers_.size()) + 1;
      workers_.emplace_back([this, id] { worker_loop(id); });
    }
    job_ = &f;
    n_ = n;
    next_ = 1;  // part 0 is the caller's
    pending_ = n;
    threads_ = threads;
    error_ = nullptr;
    lk.unlock();
    start_cv_.notify_all();

    run_part(0, 0, lk);
    // Help with the parts no worker has taken, then wait for the ones they did.
    while (next_ < n_) {
      const int i = next_++;
      run_part(i, 0, lk);
    }
    done_cv_.wait(lk, [this] { return pending_ == 0; });
    job_ = nullptr;
    n_ = next_ = 0;
    std::exception_ptr error = std::move(error_);
    error_ = nullptr;
    lk.unlock();
    if (error) std::rethrow_exception(error);
  }

 private:
  Pool() = default;

  // Runs part i with m_ unlocked; returns with m_ locked and the part counted as done.
  void run_part(int i, int worker, std::unique_lock<std::mutex>& lk) {
    if (lk.owns_lock()) lk.unlock();
    std::exception_ptr error;
    try {
      (*job_)(i, worker);
    } catch (...) {
      error = std::current_exception();
    }
    lk.lock();
    --pending_;
    if (error) {
      if (!error_) error_ = std::move(error);
      pending_ -= n_ - next_;  // skip the parts not yet started
      next_ = n_;
    }
    if (pending_ == 0) done_cv_.notify_one();
  }

  void worker_loop(int id) {
    t_in_job = true;
    std::unique_lock<std::mutex> lk(m_);
    for (;;) {
      // Only while a job has parts left: a worker that wakes late finds nothing and sleeps.
      start_cv_.wait(lk, [&] { return stop_ || (id < threads_ && next_ < n_); });
      if (stop_) return;
      const int i = next_++;
      run_part(i, id, lk);
    }
  }

  std::atomic<bool> busy_{false};  // a job is running
  std::mutex m_;                   // guards everything below
  std::condition_variable start_cv_, done_cv_;
  std::vector<std::thread> workers_;  // worker ids 1 .. size
  bool stop_ = false;
  const std::function<void(int, int)>* job_ = nullptr;
  int n_ = 0;        // parts of the current job
  int next_ = 0;     // first part not yet started
  int pending_ = 0;  // parts not yet finished (or skipped)
  int threads_ = 0;  // threads of the current job: worker ids below it take part
  std::exception_ptr error_;
};

}  // namespace

int pool_threads() { return num_threads(); }

void parallel_for(int parts, const std::function<void(int part)>& f) {
  Pool::instance().run(parts, pool_threads(), [&f](int i, int) { f(i); });
}

void parallel_for(int n, int threads, const std::function<void(int i, int worker)>& f) {
  Pool::instance().run(n, threads, f);
}

}  // namespace cpu
}  // namespace tqkv
