// Run-time choice of the CPU kernel level (attention kernels, slot encoder and the engine's
// quantized matrix products alike).
//
// The level is detected once (__builtin_cpu_supports) and can be forced with the
// environment variable TQKV_SIMD=scalar|avx2|avx512 (read once, at first use) or with
// set_simd_level() (tests use it to run every level). A level the CPU lacks is refused.
// Threads: tqkv/threads.h (TQKV_THREADS=N or set_num_threads(N)).
#pragma once
#include <string_view>

namespace tqkv {

enum class SimdLevel : int { Scalar = 0, Avx2 = 1, Avx512 = 2 };

std::string_view simd_level_name(SimdLevel level);
SimdLevel parse_simd_level(std::string_view name);  // throws tqkv::Error(InvalidArgument)

// The best level this CPU runs (AVX2 needs AVX2+FMA+F16C; AVX-512 needs F+BW+VL+DQ).
SimdLevel detected_simd_level();
bool simd_level_supported(SimdLevel level);
// The level kernels use now: TQKV_SIMD if set, else the detected one, unless overridden.
SimdLevel active_simd_level();
// Forces a level for the whole process; throws tqkv::Error(InvalidArgument) if unsupported.
void set_simd_level(SimdLevel level);

// Calls with less work than this (key slots x query rows, summed over kv heads) run on the
// calling thread: waking workers costs more than it saves. Default 16384; tests set 0.
long long attention_parallel_threshold();
void set_attention_parallel_threshold(long long slot_rows);  // < 0 restores the default

}  // namespace tqkv
