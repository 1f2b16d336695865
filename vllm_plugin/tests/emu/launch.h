// The plugin's launchers (store.cu, decode_launch.cuh, decode.cu, dequant.cu) on the emulator,
// shared by emu_test.cpp and emu_capi.cpp.
#pragma once
#include "emu.h"
// clang-format off
#include "store_kernel.cuh"
#include "decode_kernel.cuh"
#include "decode_mma_kernel.cuh"
#include "dequant_kernel.cuh"
// clang-format on

namespace tqkv_vllm {

// A kernel of one warp per (token, head) row, `warps` warps a block: kernel(KB, VB, D) as
// integral constants, run for the preset (key bits kb, value bits vb) at head dim d.
template <typename K>
void launch_rows(int kb, int vb, int d, int rows, int warps, K kernel) {
  dispatch_preset(Preset{kb, vb, d, true}, [&](auto KB, auto VB, auto D) {
    emu::launch(dim3((rows + warps - 1) / warps), dim3(32 * warps), [&] { kernel(KB, VB, D); });
  });
}

// decode_launch.cuh's choice of kernel, on the emulator.
template <int KB, int VB, int D>
void launch_decode_emu(const DecodeParams& p, int group) {
  const dim3 grid(p.num_splits, p.cache.n_kv_heads, p.batch);
  auto run = [&](auto gc) {
    emu::launch(grid, dim3(kThreads), [&] { decode_kernel<KB, VB, D, decltype(gc)::value>(p); });
  };
  if (p.kernel == DecodeKernel::Mma || (p.kernel == DecodeKernel::Auto && group <= 8))
    emu::launch(grid, dim3(32 * kMmaWarps), [&] { decode_mma_kernel<KB, VB, D>(p); }, MmaShape<KB, VB, D>::kSmem);
  else if (group <= 1) run(std::integral_constant<int, 1>{});
  else if (group <= 2) run(std::integral_constant<int, 2>{});
  else if (group <= 4) run(std::integral_constant<int, 4>{});
  else if (group <= 8) run(std::integral_constant<int, 8>{});
  else run(std::integral_constant<int, 16>{});
  if (p.num_splits > 1)
    emu::launch(dim3(p.n_q_heads, p.batch), dim3(kMergeThreads), [&] { merge_kernel<D>(p); });
}

}  // namespace tqkv_vllm
