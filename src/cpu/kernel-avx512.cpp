// AVX-512 (F, BW, VL, DQ) build of the attention kernel (traits: isa-avx512.h); CPUs with
// VNNI + VBMI run kernel-avx512vnni.cpp instead.
#include "isa-avx512.h"

namespace tqkv::cpu {

void run_avx512(const KernelFormat& f, const SlotRun* runs, int n_runs, const RowBlock& rows, const RowState& st,
                float* scratch) {
  Kernel<IsaAvx512>::run(f, runs, n_runs, rows, st, scratch);
}

}  // namespace tqkv::cpu
