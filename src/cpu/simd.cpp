// Run-time SIMD level detection, the TQKV_SIMD override and kernel choice.
#include "tqkv/simd.h"

#include <atomic>
#include <optional>
#include <string>

#include "kernel.h"
#include "tqkv/error.h"
#include "tqkv/options.h"

namespace tqkv {
namespace {

constexpr int kUnset = -1;
std::atomic<int> g_level{kUnset};
constexpr long long kDefaultParallelThreshold = 16384;
std::atomic<long long> g_parallel_threshold{kDefaultParallelThreshold};
std::atomic<int> g_scores{kUnset};

SimdLevel level_from_env() {
  SimdLevel level = detected_simd_level();
  if (const std::optional<std::string> env = env_choice_if_set("TQKV_SIMD")) {
    const SimdLevel want = parse_simd_level(*env);
    if (!simd_level_supported(want))
      throw Error(ErrorCode::InvalidArgument,
                  "TQKV_SIMD=" + *env + " is not supported by this CPU (best: " +
                      std::string(simd_level_name(level)) + ")");
    level = want;
  }
  return level;
}

}  // namespace

std::string_view simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::Scalar: return "scalar";
    case SimdLevel::Avx2: return "avx2";
    case SimdLevel::Avx512: return "avx512";
  }
  return "?";
}

SimdLevel parse_simd_level(std::string_view name) {
  if (name == "scalar") return SimdLevel::Scalar;
  if (name == "avx2") return SimdLevel::Avx2;
  if (name == "avx512") return SimdLevel::Avx512;
  throw Error(ErrorCode::InvalidArgument,
              "unknown SIMD level '" + std::string(name) + "' (valid: scalar, avx2, avx512)");
}

SimdLevel detected_simd_level() {
#if defined(__x86_64__)
  static const SimdLevel level = [] {
    __builtin_cpu_init();
#if !defined(TQKV_NO_AVX512)  // a build without the AVX-512 kernels (TQKV_AVX512) stops at AVX2
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return SimdLevel::Avx512;
#endif
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return SimdLevel::Avx2;
    return SimdLevel::Scalar;
  }();
  return level;
#else
  return SimdLevel::Scalar;
#endif
}

bool simd_level_supported(SimdLevel level) {
  // AVX-512 CPUs have AVX2 + FMA + F16C as well.
  return static_cast<int>(level) <= static_cast<int>(detected_simd_level());
}

SimdLevel active_simd_level() {
  int v = g_level.load(std::memory_order_relaxed);
  if (v == kUnset) {
    v = static_cast<int>(level_from_env());
    int expected = kUnset;
    g_level.compare_exchange_strong(expected, v);
    v = g_level.load(std::memory_order_relaxed);
  }
  return static_cast<SimdLevel>(v);
}

void set_simd_level(SimdLevel level) {
  if (!simd_level_supported(level))
    throw Error(ErrorCode::InvalidArgument,
                "SIMD level " + std::string(simd_level_name(level)) + " is not supported by this CPU");
  g_level.store(static_cast<int>(level));
}

std::string_view key_scores_name(KeyScores s) {
  return s == KeyScores::Int8 ? "int8" : s == KeyScores::Int8Keys ? "int8-keys" : "exact";
}

KeyScores parse_key_scores(std::string_view name) {
  if (name == "int8") return KeyScores::Int8;
  if (name == "exact") return KeyScores::Exact;
  if (name == "int8-keys") return KeyScores::Int8Keys;
  throw Error(ErrorCode::InvalidArgument,
              "unknown key scoring '" + std::string(name) + "' (valid: int8, int8-keys, exact)");
}

KeyScores active_key_scores() {
  int v = g_scores.load(std::memory_order_relaxed);
  if (v == kUnset) {
    v = static_cast<int>(parse_key_scores(env_choice("TQKV_SCORES")));
    int expected = kUnset;
    g_scores.compare_exchange_strong(expected, v);
    v = g_scores.load(std::memory_order_relaxed);
  }
  return static_cast<KeyScores>(v);
}

void set_key_scores(KeyScores s) { g_scores.store(static_cast<int>(s)); }

long long attention_parallel_threshold() { return g_parallel_threshold.load(std::memory_order_relaxed); }

void set_attention_parallel_threshold(long long slot_rows) {
  g_parallel_threshold.store(slot_rows < 0 ? kDefaultParallelThreshold : slot_rows);
}

namespace cpu {

bool simd_handles(const KernelFormat& f, int width) {
  if (f.dim % width != 0 || f.dim % 8 != 0) return false;
  // Table-decoded (Mse) codes: 2-6 bits from tables in registers, 7-8 bits by a gather from
  // the level table (where the int8 paths do not take them). Uniform codes: 2-4 bits.
  auto table_ok = [](int bits) { return bits >= 2 && bits <= 8; };
  auto uniform_ok = [](int bits) { return bits >= 2 && bits <= 4; };
  if (f.key == KeyCodec::Mse && !table_ok(f.key_bits)) return false;
  if (f.value == ValueCodec::Mse && !table_ok(f.value_bits)) return false;
  if (f.value == ValueCodec::Uniform && !uniform_ok(f.value_bits)) return false;
  return true;
}

RunKernel pick_kernel(const KernelFormat& f, SimdLevel level, SimdLevel* used) {
  SimdLevel got = SimdLevel::Scalar;
  RunKernel k = run_scalar;
#if defined(__x86_64__)
#if !defined(TQKV_NO_AVX512)
  if (level == SimdLevel::Avx512 && simd_handles(f, 16)) {
    got = SimdLevel::Avx512;
    static const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
    k = vnni ? run_avx512_vnni : run_avx512;
  } else
#endif
  if (level >= SimdLevel::Avx2 && simd_handles(f, 8)) {
    got = SimdLevel::Avx2;
    k = run_avx2;
  }
#endif
  if (used) *used = got;
  return k;
}

}  // namespace cpu
}  // namespace tqkv
