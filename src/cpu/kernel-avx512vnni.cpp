// AVX-512 + VNNI + VBMI build of the attention kernel (traits: isa-avx512.h): int8 key scores.
#include "isa-avx512.h"

namespace tqkv::cpu {

void run_avx512_vnni(const KernelFormat& f, const SlotRun* runs, int n_runs, const RowBlock& rows,
                     const RowState& st, float* scratch) {
  Kernel<IsaAvx512>::run(f, runs, n_runs, rows, st, scratch);
}

}  // namespace tqkv::cpu
