// The one fork-join pool (internal): attention kernels, the engine's matrix products and
// weight loading. Sized by tqkv::set_num_threads / TQKV_THREADS (include/tqkv/threads.h).
//
// Workers block on a condition variable between jobs instead of spin-waiting without bound: on
// a 2-core machine shared with other work, spinning OpenMP or OpenBLAS workers that get
// descheduled stall every barrier (we measured decode dropping from 19 to 0.7 tokens/s under
// load). The caller only waits for parts that were started, never for a sleeping (or
// descheduled) worker to wake up. Before sleeping, a worker polls for the next job for a
// bounded time (pool_spin_us(), 0 = block at once), and the caller polls for the workers'
// last parts before it sleeps: a decode step is ~200 products of tens of microseconds each,
// and a futex wake-up per hand-off cost what the second core saved
// (docs/journal/RESULTS-journal.md, "CPU decode on K-quant models"). Plain std::thread, mutex,
// condition variable and atomics, so ThreadSanitizer understands every synchronisation (it does not
// for libgomp).
//
// A call made while the pool runs a job (from inside a part, or from another thread) runs its
// parts serially on the calling thread instead of waiting or deadlocking.
#pragma once
#include <functional>

namespace tqkv::cpu {

// Threads parallel_for(parts, f) spreads over, the caller included: tqkv::num_threads().
int pool_threads();

// How long (microseconds) an idle worker polls for a new job, and the caller for the workers'
// parts, before blocking: set_pool_spin_us, else TQKV_POOL_SPIN_US (read once), else the
// default. 0 restores the purely blocking pool.
inline constexpr int kDefaultPoolSpinUs = 50;
int pool_spin_us();
// us < 0 restores the default (TQKV_POOL_SPIN_US, else kDefaultPoolSpinUs).
void set_pool_spin_us(int us);

// Runs f(0) .. f(parts - 1) on up to pool_threads() threads and returns when all are done.
// The calling thread takes part 0. If a part throws, parts not yet started are skipped and
// the first exception is rethrown.
void parallel_for(int parts, const std::function<void(int part)>& f);

// The same with worker ids, for per-thread scratch: f(i, worker) for i in [0, n) on at most
// `threads` threads; worker ids are in [0, min(threads, n)) and no two parts run at once with
// the same id. The caller is worker 0; a serial run (see above) uses worker 0 only.
void parallel_for(int n, int threads, const std::function<void(int i, int worker)>& f);

}  // namespace tqkv::cpu
