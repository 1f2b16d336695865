// Every SIMD level and thread count against the scalar reference on the same codes.
#include <gtest/gtest.h>

#include "../common/test_data.h"

#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "kernel.h"
#include "tqkv/attention.h"
#include "tqkv/error.h"
#include "tqkv/simd.h"
#include "tqkv/threads.h"

namespace tqkv {
namespace {

using testing_util::gaussian;
using testing_util::LevelGuard;
using testing_util::rel_error;


std::vector<Format> test_formats() {
  std::vector<Format> out;
  for (const NamedFormat& f : named_formats()) out.push_back(f.format);
  for (const char* extra : {"tq-k2v2", "tq-k3v3", "tq-k2v4"}) out.push_back(find_format(extra));
  // 5-8 bit Mse codes (the engine's per-layer key widths) take the SIMD builds' gather path.
  static const Format wide[] = {
      {KeyCodec::Mse, 5, ValueCodec::Mse, 3, true, Law::Sphere, RotationKind::Srht},
      {KeyCodec::Mse, 6, ValueCodec::Mse, 2, true, Law::Sphere, RotationKind::Srht},
      {KeyCodec::Mse, 7, ValueCodec::Mse, 5, true, Law::Gauss, RotationKind::Hadamard},
      {KeyCodec::Mse, 8, ValueCodec::Mse, 6, false, Law::Sphere, RotationKind::Srht},
      {KeyCodec::Mse, 6, ValueCodec::Mse, 8, true, Law::Sphere, RotationKind::Srht},  // 8-bit values
  };
  for (const Format& f : wide) out.push_back(f);
  return out;
}

struct Case {
  int d, H, Hq, capacity, written, n_q, window;
};

// Checks decode or prefill of the last n_q positions at every level and thread count.
void check_case(const Format& f, const Case& c) {
  ContiguousCacheConfig cfg;
  cfg.n_kv_heads = c.H;
  cfg.head_dim = c.d;
  cfg.capacity = c.capacity;
  cfg.layer_formats = {f};
  ContiguousCache cache(cfg);
  const auto k = gaussian(static_cast<size_t>(c.written) * c.H * c.d, 11, 0.7f);
  const auto v = gaussian(k.size(), 12);
  for (int t0 = 0; t0 < c.written; t0 += 97) {  // several writes so the ring wraps mid-batch
    const int n = std::min(97, c.written - t0);
    cache.write(0, t0, n, k.data() + static_cast<size_t>(t0) * c.H * c.d, v.data() + static_cast<size_t>(t0) * c.H * c.d);
  }
  const auto q = gaussian(static_cast<size_t>(c.n_q) * c.Hq * c.d, 13);
  const int64_t pos0 = cache.seq_len() - c.n_q;
  AttentionParams p;
  p.n_q_heads = c.Hq;
  p.window = c.window;
  std::vector<float> ref(q.size());
  attention_reference(cache, 0, q.data(), c.n_q, pos0, p, ref.data());
  LevelGuard guard;
  testing_util::ScoresGuard exact(KeyScores::Exact);
  for (SimdLevel level : testing_util::supported_levels()) {
    for (int threads : {1, 2, 3}) {
      set_simd_level(level);
      set_num_threads(threads);
      std::vector<float> out(q.size(), NAN);
      attention(cache, 0, q.data(), c.n_q, pos0, p, out.data());
      EXPECT_LT(rel_error(out, ref), 1e-5) << f.name() << " level " << simd_level_name(level) << " threads "
                                           << threads << " d " << c.d << " n_q " << c.n_q << " window "
                                           << c.window;
    }
  }
}

TEST(AttentionSimd, DecodeEveryFormatEveryLevelMatchesReference) {
  for (const Format& f : test_formats()) {
    check_case(f, {128, 2, 8, 1024, 700, 1, 0});   // GQA 4:1, splits across threads
    check_case(f, {64, 3, 9, 300, 520, 1, 0});     // GQA 3:1, ring wrapped
  }
  for (int g : {1, 2, 5, 6, 7, 8, 12})  // every row-block size of the kernel (and two blocks)
    check_case(find_format("turboquant_4bit_nc"), {64, 1, g, 512, 300, 1, 0});
}

// The split decode of 2-4-bit codes (a block of W*k channels per widening load) applies when
// the head dim is a multiple of the block: 32/64/64 channels for 4/2/3 bits on AVX-512,
// 16/32 for 4/2 bits on AVX2 (3 bits decode per vector there). head_dim 64 is one block,
// 256 several; GQA 4:1 decode, GQA 2:1 prefill chunks.
TEST(AttentionSimd, SplitDecodeEveryWidthAndHeadDim) {
  for (const char* name : {"turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "tq-k4v2", "tq-k3v2",
                           "tq-k2v2", "tq-k3v3", "tq-k2v4", "tq-k4v3"})
    for (int d : {64, 128, 256}) {
      check_case(find_format(name), {d, 2, 8, 512, 300, 1, 0});
      check_case(find_format(name), {d, 1, 2, 256, 200, 9, 0});
    }
}

TEST(AttentionSimd, PrefillAndWindowEveryLevelMatchesReference) {
  for (const char* name : {"f16", "bf16", "fp8", "turboquant_k8v4", "turboquant_k3v4_nc", "tq-k4v2", "tq-k3v3"}) {
    check_case(find_format(name), {64, 2, 4, 512, 400, 37, 0});    // causal chunk over cached tokens
    check_case(find_format(name), {128, 1, 3, 256, 300, 20, 50});  // sliding window, wrapped ring
  }
}

// A query's result does not depend on the other queries of its call (their number sets the
// kernel's row blocks and which rows are a block's tail): a prefill chunk split in two gives the
// same bits at every level. A server that copies a prompt prefix computes the rest as a shorter
// chunk; before the tail rows were reduced as the others are, AVX2 differed in the last bit.
TEST(AttentionSimd, QueryResultsDoNotDependOnTheirCall) {
  for (const char* name : {"f32", "f16", "turboquant_k8v4", "turboquant_4bit_nc"}) {
    ContiguousCacheConfig cfg;
    cfg.n_kv_heads = 1;
    cfg.head_dim = 64;
    cfg.capacity = 128;
    cfg.layer_formats = {find_format(name)};
    ContiguousCache cache(cfg);
    const int n = 53, hq = 3;
    const auto k = gaussian(static_cast<size_t>(n) * 64, 21, 0.7f), v = gaussian(k.size(), 22);
    cache.write(0, 0, n, k.data(), v.data());
    const auto q = gaussian(static_cast<size_t>(n) * hq * 64, 23);
    AttentionParams p;
    p.n_q_heads = hq;
    LevelGuard guard;
    for (SimdLevel level : testing_util::supported_levels()) {
      set_simd_level(level);
      set_num_threads(1);
      std::vector<float> whole(q.size()), split(q.size());
      attention(cache, 0, q.data(), n, 0, p, whole.data());
      for (int cut : {16, 32, 48}) {
        const size_t at = static_cast<size_t>(cut) * hq * 64;
        attention(cache, 0, q.data(), cut, 0, p, split.data());
        attention(cache, 0, q.data() + at, n - cut, cut, p, split.data() + at);
        EXPECT_EQ(split, whole) << name << " level " << simd_level_name(level) << " cut " << cut;
      }
    }
  }
}

TEST(AttentionSimd, OddHeadDimsFallBackCorrectly) {
  // 96 is not a multiple of 16 (AVX-512 falls back to AVX2), 40 not of 16 nor a power of two
  // (dense rotation; AVX2 handles 40 = 5 x 8), 20 only the scalar kernel.
  for (int d : {96, 40, 20})
    for (const char* name : {"f32", "fp8", "turboquant_4bit_nc", "tq-k4v2"})
      check_case(find_format(name), {d, 2, 4, 128, 150, 3, 0});
}

// Several threads calling attention at once: one owns the pool, the others run serially on
// their own thread; every caller gets the single-threaded answer (and TSan sees no race).
TEST(AttentionThreads, ConcurrentCallersAgree) {
  LevelGuard guard;
  set_num_threads(2);
  ContiguousCacheConfig cfg;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.capacity = 1024;
  cfg.layer_formats = {find_format("turboquant_k3v4_nc")};
  ContiguousCache cache(cfg);
  const auto k = gaussian(900 * 2 * 64, 1), v = gaussian(k.size(), 2), q = gaussian(8 * 64, 3);
  cache.write(0, 0, 900, k.data(), v.data());
  AttentionParams p;
  p.n_q_heads = 8;
  std::vector<float> want(q.size());
  attention(cache, 0, q.data(), 1, 899, p, want.data());
  std::vector<std::vector<float>> got(3, std::vector<float>(q.size()));
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; ++c)
    callers.emplace_back([&, c] {
      for (int rep = 0; rep < 5; ++rep) attention(cache, 0, q.data(), 1, 899, p, got[c].data());
    });
  for (auto& t : callers) t.join();
  for (const auto& g : got) EXPECT_EQ(g, want);
}

// The format list above only proves agreement; this pins which formats the SIMD builds take
// (so a fallback to the scalar kernel cannot pass unnoticed).
TEST(AttentionSimd, SimdBuildsTakeEveryTableWidth) {
  cpu::KernelFormat f{};
  f.dim = 64;
  f.key = KeyCodec::Mse;
  f.value = ValueCodec::Mse;
  for (int kb = 2; kb <= 8; ++kb) {
    f.key_bits = f.value_bits = kb;
    EXPECT_TRUE(cpu::simd_handles(f, 8)) << kb;
    EXPECT_TRUE(cpu::simd_handles(f, 16)) << kb;
  }
  f.value = ValueCodec::Uniform;
  f.value_bits = 5;
  EXPECT_FALSE(cpu::simd_handles(f, 8));
  f.value = ValueCodec::Mse;
  f.key_bits = 1;
  EXPECT_FALSE(cpu::simd_handles(f, 8));
}

TEST(AttentionSimd, LevelOverrideAndNames) {
  LevelGuard guard;
  EXPECT_EQ(parse_simd_level("avx2"), SimdLevel::Avx2);
  EXPECT_EQ(simd_level_name(SimdLevel::Avx512), "avx512");
  EXPECT_THROW(parse_simd_level("neon"), Error);
  set_simd_level(SimdLevel::Scalar);
  EXPECT_EQ(active_simd_level(), SimdLevel::Scalar);
  EXPECT_TRUE(simd_level_supported(SimdLevel::Scalar));
  set_num_threads(5);
  EXPECT_EQ(num_threads(), 5);
}

}  // namespace
}  // namespace tqkv
