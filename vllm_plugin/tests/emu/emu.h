// Runs the plugin's CUDA kernels (vllm_plugin/csrc/*_kernel.cuh) on the CPU, for tests on a
// machine without a GPU: every CUDA thread of a block is a std::thread, __syncthreads and
// __syncwarp are barriers, warp shuffles go through a per-warp exchange buffer, cp.async copies
// synchronously, and blocks run one after another (so `__shared__` is a function-static).
// It checks the kernels' indexing, decomposition and synchronisation against a serial reference;
// it is no substitute for running them on a GPU (timing, memory model, the sm_90 instructions:
// device.cuh's host fallbacks divide in IEEE and cast FP8 in software).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#undef __device__
#undef __host__
#undef __global__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#undef __align__
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

namespace emu {

struct Warp {
  std::barrier<> bar{32};
  uint64_t buf[32];
};

struct Thread {
  uint3 thread{}, block{};
  std::barrier<>* block_bar = nullptr;
  Warp* warp = nullptr;
};
inline thread_local Thread tl;

// Runs body() as every thread of every block of the grid (blocks in order).
template <typename F>
void launch(dim3 grid, dim3 block, F&& body) {
  const unsigned n = block.x * block.y * block.z;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::barrier<> bar(n);
        std::vector<std::unique_ptr<Warp>> warps((n + 31) / 32);
        for (auto& w : warps) w = std::make_unique<Warp>();
        std::vector<std::thread> threads;
        threads.reserve(n);
        for (unsigned t = 0; t < n; ++t)
          threads.emplace_back([&, t] {
            tl.thread = uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            tl.block = uint3{bx, by, bz};
            tl.block_bar = &bar;
            tl.warp = warps[t / 32].get();
            body();
          });
        for (auto& th : threads) th.join();
      }
}

}  // namespace emu

#define threadIdx (::emu::tl.thread)
#define blockIdx (::emu::tl.block)

inline void __syncthreads() { emu::tl.block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::tl.warp->bar.arrive_and_wait(); }

template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  static_assert(sizeof(T) <= 8);
  emu::Warp& w = *emu::tl.warp;
  const unsigned lane = emu::tl.thread.x & 31;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  w.buf[lane] = bits;
  w.bar.arrive_and_wait();
  const uint64_t other = w.buf[lane ^ static_cast<unsigned>(lane_mask)];
  w.bar.arrive_and_wait();
  T r;
  std::memcpy(&r, &other, sizeof(T));
  return r;
}

inline void __pipeline_memcpy_async(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
inline void __pipeline_commit() {}
inline void __pipeline_wait_prior(size_t) {}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
using std::max;
using std::min;
