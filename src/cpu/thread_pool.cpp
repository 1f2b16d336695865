#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fcntl.h>
#include <unistd.h>
#include <mutex>
#include <thread>
#include <vector>

#include "tqkv/options.h"
#include "tqkv/threads.h"

namespace tqkv {
namespace {

std::atomic<int> g_threads{0};  // 0: the default

}  // namespace

int num_threads() {
  int n = g_threads.load(std::memory_order_relaxed);
  if (n > 0) return n;
  n = static_cast<int>(std::thread::hardware_concurrency());
  n = static_cast<int>(env_count("TQKV_THREADS", n));
  return n > 0 ? n : 1;
}

void set_num_threads(int n) { g_threads.store(n > 0 ? n : 0); }

namespace cpu {
namespace {

// Read on the caller's thread (Pool::run asks before it starts any worker), so a malformed
// value reaches the caller as an Error rather than a worker.
int spin_from_env() {
  return static_cast<int>(env_count("TQKV_POOL_SPIN_US", kDefaultPoolSpinUs));
}

std::atomic<int> g_spin_us{-1};  // -1: not read from the environment yet

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Until this time (now_ns) nobody spins: the cores are oversubscribed, and polling would only
// take CPU time from the threads doing the work (and, under the kernel's fair scheduler, the
// priority a sleeping thread gets when it wakes).
std::atomic<int64_t> g_no_spin_until{0};
constexpr int64_t kPreemptedNs = 30'000;    // a round of 64 pauses that took this long was descheduled
constexpr int64_t kWindowNs = 20'000'000;   // how often a caller samples its run-queue delay
constexpr double kBusyDelay = 0.05;         // waiting for a CPU this share of the window: oversubscribed

void back_off(int64_t now) { g_no_spin_until.store(now + kWindowNs, std::memory_order_relaxed); }

// Called by a caller at each job: every kWindowNs, the time this thread spent runnable but
// waiting for a CPU (Linux schedstat's run_delay); above kBusyDelay of the window, the pool
// stops spinning until the next sample. Where schedstat is missing, only the preemption seen
// while spinning (spin_until) turns spinning off.
bool spin_allowed(int64_t now) {
  struct Sampler {
    int fd = ::open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    int64_t at = 0, delay = 0;
    ~Sampler() {
      if (fd >= 0) ::close(fd);
    }
  };
  thread_local Sampler s;
  if (s.fd >= 0 && now - s.at >= kWindowNs) {
    char buf[96];
    const ssize_t got = ::pread(s.fd, buf, sizeof buf - 1, 0);
    long long run = 0, delay = 0;
    if (got > 0) {
      buf[got] = 0;
      if (std::sscanf(buf, "%lld %lld", &run, &delay) == 2) {
        if (s.at > 0 && static_cast<double>(delay - s.delay) > kBusyDelay * static_cast<double>(now - s.at))
          back_off(now);
        s.at = now;
        s.delay = delay;
      }
    }
  }
  return now >= g_no_spin_until.load(std::memory_order_relaxed);
}

// Polls done() for up to `us` microseconds; true if it held before the time ran out.
template <class Done>
bool spin_until(int us, Done done) {
  if (us <= 0) return done();
  int64_t last = now_ns();
  if (last < g_no_spin_until.load(std::memory_order_relaxed)) return done();
  const int64_t until = last + int64_t{us} * 1000;
  for (;;) {
    for (int k = 0; k < 64; ++k) {
      if (done()) return true;
      cpu_relax();
    }
    const int64_t t = now_ns();
    if (t - last > kPreemptedNs) {
      back_off(t);
      return done();
    }
    if (t >= until) return done();
    last = t;
  }
}

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
      gen_.fetch_add(1, std::memory_order_release);
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

    const int spin = pool_spin_us() > 0 && spin_allowed(now_ns()) ? pool_spin_us() : 0;
    std::unique_lock<std::mutex> lk(m_);
    while (static_cast<int>(workers_.size()) < threads - 1) {
      const int id = static_cast<int>(workers_.size()) + 1;
      workers_.emplace_back([this, id] { worker_loop(id); });
    }
    job_ = &f;
    n_ = n;
    next_ = 1;  // part 0 is the caller's
    pending_.store(n, std::memory_order_relaxed);
    threads_ = threads;
    error_ = nullptr;
    gen_.fetch_add(1, std::memory_order_release);  // wakes spinning workers
    const bool wake = sleepers_ > 0;
    lk.unlock();
    if (wake) start_cv_.notify_all();

    run_part(0, 0, lk);
    // Help with the parts no worker has taken, then wait for the ones they did.
    while (next_ < n_) {
      const int i = next_++;
      run_part(i, 0, lk);
    }
    if (pending_.load(std::memory_order_relaxed) > 0 && spin > 0) {
      // The workers' parts are usually about as long as ours: poll before sleeping, so the
      // last one to finish does not pay a futex wake-up of this thread.
      lk.unlock();
      spin_until(spin, [this] { return pending_.load(std::memory_order_acquire) == 0; });
      lk.lock();
    }
    done_cv_.wait(lk, [this] { return pending_.load(std::memory_order_relaxed) == 0; });
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
    int left = pending_.load(std::memory_order_relaxed) - 1;
    if (error) {
      if (!error_) error_ = std::move(error);
      left -= n_ - next_;  // skip the parts not yet started
      next_ = n_;
    }
    pending_.store(left, std::memory_order_release);
    if (left == 0) done_cv_.notify_one();
  }

  void worker_loop(int id) {
    t_in_job = true;
    std::unique_lock<std::mutex> lk(m_);
    const auto has_part = [&] { return id < threads_ && next_ < n_; };
    for (;;) {
      if (stop_) return;
      if (has_part()) {
        const int i = next_++;
        run_part(i, id, lk);
        continue;
      }
      // Nothing left for us: poll for the next job for a bounded time (a decode step's
      // products follow each other within microseconds), then sleep. The caller never waits
      // for a worker that has not started a part, so a spinning worker that is descheduled
      // delays nobody.
      const int spin = pool_spin_us();
      if (spin > 0) {
        const uint64_t seen = gen_.load(std::memory_order_relaxed);
        lk.unlock();
        const bool news = spin_until(spin, [&] { return gen_.load(std::memory_order_acquire) != seen; });
        lk.lock();
        if (news) continue;
      }
      // Only while a job has parts left: a worker that wakes late finds nothing and sleeps.
      ++sleepers_;
      start_cv_.wait(lk, [&] { return stop_ || has_part(); });
      --sleepers_;
    }
  }

  std::atomic<bool> busy_{false};   // a job is running
  std::atomic<uint64_t> gen_{0};    // bumped (under m_) when a job starts or the pool stops
  std::atomic<int> pending_{0};     // parts not yet finished (or skipped); written under m_
  std::mutex m_;                    // guards everything below
  std::condition_variable start_cv_, done_cv_;
  int sleepers_ = 0;                // workers waiting on start_cv_
  std::vector<std::thread> workers_;  // worker ids 1 .. size
  bool stop_ = false;
  const std::function<void(int, int)>* job_ = nullptr;
  int n_ = 0;        // parts of the current job
  int next_ = 0;     // first part not yet started
  int threads_ = 0;  // threads of the current job: worker ids below it take part
  std::exception_ptr error_;
};

}  // namespace

int pool_threads() { return num_threads(); }

int pool_spin_us() {
  int us = g_spin_us.load(std::memory_order_relaxed);
  if (us < 0) {
    us = spin_from_env();
    g_spin_us.store(us, std::memory_order_relaxed);
  }
  return us;
}

void set_pool_spin_us(int us) { g_spin_us.store(us < 0 ? -1 : us, std::memory_order_relaxed); }

void parallel_for(int parts, const std::function<void(int part)>& f) {
  Pool::instance().run(parts, pool_threads(), [&f](int i, int) { f(i); });
}

void parallel_for(int n, int threads, const std::function<void(int i, int worker)>& f) {
  Pool::instance().run(n, threads, f);
}

}  // namespace cpu
}  // namespace tqkv
