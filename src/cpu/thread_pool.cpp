#include "thread_pool.h"

#include <algorithm>

namespace tqkv::cpu {

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool;
  return pool;
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(m_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::work(int id) {
  for (int i = next_.fetch_add(1); i < job_n_; i = next_.fetch_add(1)) (*job_)(i, id);
}

void ThreadPool::worker_loop(int id) {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lk(m_);
  for (;;) {
    start_cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (id > job_workers_) continue;
    lk.unlock();
    work(id);
    lk.lock();
    if (++finished_ == job_workers_) done_cv_.notify_one();
  }
}

void ThreadPool::parallel_for(int n, int threads, const std::function<void(int, int)>& fn) {
  if (n <= 0) return;
  const int helpers = std::min(threads, n) - 1;
  std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
  if (helpers <= 0 || !busy.owns_lock()) {
    for (int i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(m_);
    while (static_cast<int>(workers_.size()) < helpers) {
      const int id = static_cast<int>(workers_.size()) + 1;
      workers_.emplace_back([this, id] { worker_loop(id); });
    }
    job_ = &fn;
    job_n_ = n;
    job_workers_ = helpers;
    finished_ = 0;
    next_.store(0);
    ++generation_;
  }
  start_cv_.notify_all();
  work(0);
  std::unique_lock<std::mutex> lk(m_);
  done_cv_.wait(lk, [&] { return finished_ == job_workers_; });
  job_ = nullptr;
}

}  // namespace tqkv::cpu
