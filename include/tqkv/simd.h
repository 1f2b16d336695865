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

// How the SIMD kernels score keys stored as 2-8-bit Mse codes (turboquant_4bit_nc, tq-k4v2,
// turboquant_3bit_nc, the recipes' k5-k8 layers, ...) and sum 2-6-bit Mse or 2-4-bit Uniform values.
// Int8 (the default): the rotated query is rounded once per row to int8 (scale max|q| / 127)
// and the codebook levels to 7-bit integers (scale max|level| / 63), and each score is an
// integer dot product (VNNI vpdpbusd, or vpmaddubsw + vpmaddwd on AVX2) times the two scales
// and the key's norm: about 2x fewer instructions than fp32 products, with a score error below
// norm * (s_q/2 * sum|level| + s_k/2 * s_q * sum|q8|) (docs/journal/RESULTS-journal.md, "Int8 key
// scores"). The values' softmax weights (times the value's scale) are rounded per tile of keys and
// query row to u8 (step max weight / 255), the value levels to 7-bit integers (Mse: max|level| /
// 63; Uniform: 2 * code - (2^bits - 1), exact), and each tile's sums are integer products in int32.
// 6-8-bit keys and 6-bit values take int8 with their levels in two bytes (a 64 times finer grid,
// two products: kernel.h kI8WideBits, kI8MaxKeyBits; AVX2 only up to 6 bits); wider values stay
// fp32. Int8Keys:
// int8 key scores, fp32 value sums. Exact: fp32 products, equal to the scalar reference within
// 1e-5 (the reference tests use it). TQKV_SCORES=int8|int8-keys|exact (read once, at first use)
// or set_key_scores(). Kernels without an int8 path (AVX-512 without VNNI + VBMI, head dims
// that are not a multiple of 64 (AVX-512) or 32 (AVX2)) compute exactly.
enum class KeyScores : int { Int8 = 0, Exact = 1, Int8Keys = 2 };
std::string_view key_scores_name(KeyScores s);
KeyScores parse_key_scores(std::string_view name);  // throws tqkv::Error(InvalidArgument)
KeyScores active_key_scores();
void set_key_scores(KeyScores s);

// Calls with less work than this (key slots x query rows, summed over kv heads) run on the
// calling thread: waking workers costs more than it saves. Default 16384; tests set 0.
long long attention_parallel_threshold();
void set_attention_parallel_threshold(long long slot_rows);  // < 0 restores the default

}  // namespace tqkv
