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
  uint32_t frag[32][6];  // mma operands of each lane
};

struct Thread {
  uint3 thread{}, block{};
  std::barrier<>* block_bar = nullptr;
  Warp* warp = nullptr;
  uint8_t* smem = nullptr;  // the block's dynamic shared memory
};
inline thread_local Thread tl;

// Runs body() as every thread of every block of the grid (blocks in order), with smem_bytes of
// dynamic shared memory a block (filled with a NaN pattern: nothing may read it unwritten).
template <typename F>
void launch(dim3 grid, dim3 block, F&& body, size_t smem_bytes = 0) {
  const unsigned n = block.x * block.y * block.z;
  std::vector<uint8_t> smem(smem_bytes + 16);
  uint8_t* smem16 = smem.data() + (16 - reinterpret_cast<uintptr_t>(smem.data()) % 16) % 16;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::fill(smem.begin(), smem.end(), uint8_t{0xFF});
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
            tl.smem = smem16;
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

// mma.m16n8k16.row.col.f32.f16.f16.f32 of a warp from its lanes' fragments (the PTX ISA's
// layout, written out as device.cuh's mma_f16 states it).
namespace tqkv_vllm {
inline uint8_t* host_dynamic_smem() { return emu::tl.smem; }
inline void host_mma_m16n8k16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                              uint32_t b1) {
  emu::Warp& w = *emu::tl.warp;
  const unsigned lane = emu::tl.thread.x & 31, g = lane / 4, c = lane % 4;
  const uint32_t mine[6] = {a0, a1, a2, a3, b0, b1};
  std::memcpy(w.frag[lane], mine, sizeof(mine));
  w.bar.arrive_and_wait();
  auto half_of = [&](unsigned ln, int reg, int hi) {
    const uint16_t bits = static_cast<uint16_t>(w.frag[ln][reg] >> (16 * hi));
    return __half2float(__ushort_as_half(bits));
  };
  auto A = [&](unsigned r, unsigned k) {  // A[r][k], r < 16, k < 16
    return half_of(4 * (r % 8) + (k % 8) / 2, (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0), k % 2);
  };
  auto B = [&](unsigned k, unsigned n) {  // B[k][n], k < 16, n < 8
    return half_of(4 * n + (k % 8) / 2, 4 + (k >= 8 ? 1 : 0), k % 2);
  };
  const unsigned rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * c, 2 * c + 1, 2 * c, 2 * c + 1};
  float out[4];
  for (int i = 0; i < 4; ++i) {
    float acc = d[i];
    for (unsigned k = 0; k < 16; ++k) acc += A(rows[i], k) * B(k, cols[i]);
    out[i] = acc;
  }
  w.bar.arrive_and_wait();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}
}  // namespace tqkv_vllm

inline void __pipeline_memcpy_async(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
inline void __pipeline_commit() {}
inline void __pipeline_wait_prior(size_t) {}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
using std::max;
using std::min;
