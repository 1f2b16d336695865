// The one fork-join pool (src/cpu/thread_pool.h): every part exactly once, the thread count
// honoured, the first exception rethrown, nested and concurrent calls run serially instead of
// deadlocking, both with workers that block at once and with workers that poll for the next
// job first (pool_spin_us). Run under TSan in CI (.ci/run).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "thread_pool.h"
#include "tqkv/threads.h"

namespace tqkv::cpu {
namespace {

struct ThreadsGuard {
  ~ThreadsGuard() { set_num_threads(0); }
};

// Every test runs with the purely blocking pool (0) and with polling workers: a short spin
// that mostly times out between tests' jobs, and a long one that catches every next job.
class ThreadPool : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { set_pool_spin_us(GetParam()); }
  void TearDown() override { set_pool_spin_us(-1); }
};

INSTANTIATE_TEST_SUITE_P(Spin, ThreadPool, ::testing::Values(0, 5, 2000),
                         [](const ::testing::TestParamInfo<int>& info) { return "us" + std::to_string(info.param); });

TEST_P(ThreadPool, EveryPartRunsExactlyOnce) {
  ThreadsGuard guard;
  for (int threads : {1, 2, 3, 4, 8}) {
    set_num_threads(threads);
    EXPECT_EQ(pool_threads(), threads);
    for (int parts : {0, 1, 2, 3, 7, 64, 1000}) {
      std::vector<std::atomic<int>> runs(parts);
      parallel_for(parts, [&](int p) { runs[p].fetch_add(1); });
      for (int p = 0; p < parts; ++p) EXPECT_EQ(runs[p].load(), 1) << "threads " << threads << " parts " << parts;
    }
  }
}

TEST_P(ThreadPool, CallerTakesPartZero) {
  ThreadsGuard guard;
  set_num_threads(4);
  const std::thread::id caller = std::this_thread::get_id();
  for (int rep = 0; rep < 20; ++rep) {
    std::thread::id ran_zero;
    parallel_for(8, [&](int p) {
      if (p == 0) ran_zero = std::this_thread::get_id();
    });
    EXPECT_EQ(ran_zero, caller);
  }
}

// Worker ids stay below the thread count and no two parts run at once with the same id;
// with a barrier-like wait, all requested threads take part.
TEST_P(ThreadPool, ThreadCountHonoured) {
  ThreadsGuard guard;
  for (int threads : {1, 2, 3, 4}) {
    set_num_threads(threads);
    std::mutex m;
    std::set<std::thread::id> ids;
    std::atomic<int> active{0}, peak{0};
    std::vector<std::atomic<int>> busy(threads);
    parallel_for(64, pool_threads(), [&](int, int worker) {
      ASSERT_GE(worker, 0);
      ASSERT_LT(worker, threads);
      EXPECT_EQ(busy[worker].fetch_add(1), 0) << "worker id " << worker << " used twice at once";
      const int now = active.fetch_add(1) + 1;
      int p = peak.load();
      while (now > p && !peak.compare_exchange_weak(p, now)) {
      }
      {
        std::lock_guard<std::mutex> lk(m);
        ids.insert(std::this_thread::get_id());
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      active.fetch_sub(1);
      busy[worker].fetch_sub(1);
    });
    EXPECT_LE(peak.load(), threads);
    EXPECT_LE(static_cast<int>(ids.size()), threads);
    if (threads == 1) {
      EXPECT_EQ(ids.size(), 1u);
    }
  }
  // All threads join a job whose parts wait for each other (this would hang if fewer ran).
  set_num_threads(3);
  std::atomic<int> arrived{0};
  parallel_for(3, [&](int) {
    arrived.fetch_add(1);
    while (arrived.load() < 3) std::this_thread::yield();
  });
  EXPECT_EQ(arrived.load(), 3);
}

TEST_P(ThreadPool, FirstExceptionRethrown) {
  ThreadsGuard guard;
  for (int threads : {1, 4}) {
    set_num_threads(threads);
    for (int thrower : {0, 5}) {
      std::atomic<int> runs{0};
      try {
        parallel_for(16, [&](int p) {
          runs.fetch_add(1);
          if (p == thrower) throw std::runtime_error("part " + std::to_string(p));
        });
        ADD_FAILURE() << "no exception";
      } catch (const std::runtime_error& e) {
        EXPECT_EQ(std::string(e.what()), "part " + std::to_string(thrower));
      }
      EXPECT_GE(runs.load(), 1);
      EXPECT_LE(runs.load(), 16);
    }
    // Every part throws: exactly one exception comes out, and the pool still works after.
    EXPECT_THROW(parallel_for(32, [](int) { throw std::logic_error("x"); }), std::logic_error);
    std::atomic<int> sum{0};
    parallel_for(10, [&](int p) { sum.fetch_add(p); });
    EXPECT_EQ(sum.load(), 45);
  }
}

TEST_P(ThreadPool, NestedCallRunsSerially) {
  ThreadsGuard guard;
  set_num_threads(4);
  std::vector<std::atomic<int>> runs(8 * 8);
  parallel_for(8, [&](int outer) {
    const std::thread::id self = std::this_thread::get_id();
    parallel_for(8, [&](int inner) {
      EXPECT_EQ(std::this_thread::get_id(), self);  // serially, on the part's own thread
      runs[outer * 8 + inner].fetch_add(1);
    });
    parallel_for(4, 4, [&](int, int worker) { EXPECT_EQ(worker, 0); });
  });
  for (auto& r : runs) EXPECT_EQ(r.load(), 1);
}

TEST_P(ThreadPool, ConcurrentCallersComplete) {
  ThreadsGuard guard;
  set_num_threads(3);
  constexpr int kCallers = 4, kReps = 50, kParts = 17;
  std::vector<std::atomic<long>> totals(kCallers);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c)
    callers.emplace_back([&, c] {
      for (int rep = 0; rep < kReps; ++rep) parallel_for(kParts, [&](int p) { totals[c].fetch_add(p + 1); });
    });
  for (auto& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) EXPECT_EQ(totals[c].load(), kReps * kParts * (kParts + 1) / 2);
}

TEST(ThreadPoolThreads, DefaultFromEnvironmentOrHardware) {
  ThreadsGuard guard;
  set_num_threads(0);
  EXPECT_GE(num_threads(), 1);
  set_num_threads(-3);
  EXPECT_GE(num_threads(), 1);
  set_num_threads(2);
  EXPECT_EQ(num_threads(), 2);
}

// Many back-to-back small jobs, as a decode step's products: none lost, none run twice, with
// workers picking jobs up while polling and while asleep.
TEST_P(ThreadPool, BackToBackJobs) {
  ThreadsGuard guard;
  set_num_threads(2);
  std::vector<std::atomic<int>> runs(4);
  constexpr int kJobs = 5000;
  for (int j = 0; j < kJobs; ++j) {
    parallel_for(4, [&](int p) { runs[p].fetch_add(1, std::memory_order_relaxed); });
    if (j % 1000 == 999) std::this_thread::sleep_for(std::chrono::milliseconds(3));  // let workers sleep
  }
  for (auto& r : runs) EXPECT_EQ(r.load(), kJobs);
}

// A throwing part among back-to-back jobs leaves nothing pending for the next job.
TEST_P(ThreadPool, ExceptionThenNextJob) {
  ThreadsGuard guard;
  set_num_threads(2);
  for (int j = 0; j < 200; ++j) {
    EXPECT_THROW(parallel_for(2, [&](int p) {
                   if (p == j % 2) throw std::runtime_error("x");
                 }),
                 std::runtime_error);
    std::atomic<int> sum{0};
    parallel_for(6, [&](int p) { sum.fetch_add(p + 1); });
    EXPECT_EQ(sum.load(), 21);
  }
}

TEST(ThreadPoolSpin, SetAndRestoreDefault) {
  set_pool_spin_us(7);
  EXPECT_EQ(pool_spin_us(), 7);
  set_pool_spin_us(0);
  EXPECT_EQ(pool_spin_us(), 0);
  set_pool_spin_us(-1);  // the default: TQKV_POOL_SPIN_US, else kDefaultPoolSpinUs
  EXPECT_GE(pool_spin_us(), 0);
  if (!std::getenv("TQKV_POOL_SPIN_US")) {
    EXPECT_EQ(pool_spin_us(), kDefaultPoolSpinUs);
  }
}

}  // namespace
}  // namespace tqkv::cpu
