// Slot encode / decode throughput of every format, d = 128 (Google Benchmark), at the scalar
// level (the reference SlotCodec) and at the fastest level this CPU runs (the vectorised
// encoder, include/tqkv/slot_encoder.h; same bytes). Attention never decodes slots this way:
// its kernels decode codes in registers (bench_attention.cpp); these numbers bound the write
// path (ContiguousCache::write, PagedCache::store) and tools that decode whole caches.
// Counters: vectors per second (one key + one value = two vectors) and slot bytes per second.
#include <benchmark/benchmark.h>

#include <random>
#include <string>
#include <vector>

#include "tqkv/simd.h"
#include "tqkv/slot_encoder.h"

namespace {

constexpr int kDim = 128, kSlots = 256;

std::vector<float> gaussian(size_t n) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> g;
  std::vector<float> v(n);
  for (auto& x : v) x = g(rng);
  return v;
}

void encode(benchmark::State& state, const tqkv::Format& f, tqkv::SimdLevel level) {
  tqkv::set_simd_level(level);
  const tqkv::SlotCodec codec(f, kDim);
  const auto k = gaussian(static_cast<size_t>(kSlots) * kDim), v = gaussian(k.size());
  std::vector<uint8_t> slots(kSlots * codec.slot_bytes());
  for (auto _ : state) {
    tqkv::encode_slots(codec, k.data(), v.data(), kSlots, slots.data(), codec.slot_bytes());
    benchmark::DoNotOptimize(slots.data());
  }
  state.counters["vectors"] = benchmark::Counter(2.0 * kSlots * state.iterations(), benchmark::Counter::kIsRate);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kSlots * codec.slot_bytes());
}

void decode(benchmark::State& state, const tqkv::Format& f, tqkv::SimdLevel level) {
  tqkv::set_simd_level(level);
  const tqkv::SlotCodec codec(f, kDim);
  const auto k = gaussian(static_cast<size_t>(kSlots) * kDim), v = gaussian(k.size());
  std::vector<uint8_t> slots(kSlots * codec.slot_bytes());
  tqkv::encode_slots(codec, k.data(), v.data(), kSlots, slots.data(), codec.slot_bytes());
  std::vector<float> out(static_cast<size_t>(kSlots) * kDim);
  for (auto _ : state) {
    tqkv::decode_slots(codec, slots.data(), codec.slot_bytes(), kSlots, true, out.data());
    tqkv::decode_slots(codec, slots.data(), codec.slot_bytes(), kSlots, false, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["vectors"] = benchmark::Counter(2.0 * kSlots * state.iterations(), benchmark::Counter::kIsRate);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kSlots * codec.slot_bytes());
}

const int registered = [] {
  const tqkv::SimdLevel best = tqkv::detected_simd_level();
  for (const tqkv::NamedFormat& nf : tqkv::named_formats()) {
    const tqkv::Format& f = nf.format;
    for (tqkv::SimdLevel level : {tqkv::SimdLevel::Scalar, best}) {
      const std::string suffix = std::string(nf.name) + "/" + std::string(tqkv::simd_level_name(level));
      benchmark::RegisterBenchmark(("BM_Encode/" + suffix).c_str(),
                                   [&f, level](benchmark::State& s) { encode(s, f, level); });
      benchmark::RegisterBenchmark(("BM_Decode/" + suffix).c_str(),
                                   [&f, level](benchmark::State& s) { decode(s, f, level); });
      if (best == tqkv::SimdLevel::Scalar) break;
    }
  }
  return 0;
}();

}  // namespace
