// A small fork-join pool for the attention kernels (internal). Plain std::thread, mutex and
// condition variable (so ThreadSanitizer understands every synchronisation, which it does not
// for libgomp). The caller takes part as worker 0. If another thread is already running a job
// on the pool, the call runs its job serially on the calling thread instead of waiting.
#pragma once
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tqkv::cpu {

class ThreadPool {
 public:
  static ThreadPool& instance();
  ~ThreadPool();

  // Calls fn(i, worker) for every i in [0, n), on at most `threads` workers; worker ids are in
  // [0, threads). Returns when all calls are done.
  void parallel_for(int n, int threads, const std::function<void(int, int)>& fn);

 private:
  ThreadPool() = default;
  void worker_loop(int id);
  void work(int id);

  std::mutex busy_;  // held by the caller that owns the current job
  std::mutex m_;
  std::condition_variable start_cv_, done_cv_;
  std::vector<std::thread> workers_;  // worker ids 1 .. size
  uint64_t generation_ = 0;
  bool stop_ = false;
  const std::function<void(int, int)>* job_ = nullptr;
  int job_n_ = 0;
  int job_workers_ = 0;  // helper workers that take part (ids 1 .. job_workers_)
  int finished_ = 0;
  std::atomic<int> next_{0};
};

}  // namespace tqkv::cpu
