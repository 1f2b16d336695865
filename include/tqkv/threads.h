// The process-wide thread count: one pool (src/cpu/thread_pool.h) runs both the attention
// kernels and the inference engine's matrix products and weight loading.
//
// Default: the environment variable TQKV_THREADS=N if set (read at each call that needs the
// default), else the hardware threads. set_num_threads(N) overrides it for the whole process;
// the tools' -t/--threads call it.
#pragma once

namespace tqkv {

// Threads a parallel call uses, the calling thread included (>= 1).
int num_threads();
// n <= 0 restores the default (TQKV_THREADS, else the hardware threads).
void set_num_threads(int n);

}  // namespace tqkv
