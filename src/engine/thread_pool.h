// A small fork-join pool for the engine's matrix products. Workers block on a condition
// variable between jobs instead of spin-waiting: on a 2-core machine shared with other work,
// spinning OpenMP or OpenBLAS workers that get descheduled stall every barrier (we measured
// decode dropping from 19 to 0.7 tokens/s under load), while blocking costs a few
// microseconds per job.
#pragma once
#include <functional>

namespace tqkv::engine {

// Threads used by parallel_for (the caller included); n <= 0 means all hardware threads.
void set_pool_threads(int n);
int pool_threads();

// Runs f(0) .. f(parts - 1), spread over the pool, and returns when all are done. The
// calling thread takes part 0. Exceptions from f are rethrown (the first one).
void parallel_for(int parts, const std::function<void(int)>& f);

}  // namespace tqkv::engine
