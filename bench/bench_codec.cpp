// Slot encode / decode throughput of every format through the scalar reference codec
// (SlotCodec), d = 128 (Google Benchmark). Attention never decodes slots this way: its kernels
// decode codes in registers (bench_attention.cpp); these numbers bound the write path
// (ContiguousCache::write, PagedCache::store) and the tools that decode whole caches.
// Counters: vectors per second (one key + one value = one slot) and bytes of slots per second.
#include <benchmark/benchmark.h>

#include <random>
#include <string>
#include <vector>

#include "tqkv/codec.h"

namespace {

constexpr int kDim = 128, kSlots = 256;

std::vector<float> gaussian(size_t n) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> g;
  std::vector<float> v(n);
  for (auto& x : v) x = g(rng);
  return v;
}

void encode(benchmark::State& state, const tqkv::Format& f) {
  const tqkv::SlotCodec codec(f, kDim);
  const auto k = gaussian(static_cast<size_t>(kSlots) * kDim), v = gaussian(k.size());
  std::vector<uint8_t> slots(kSlots * codec.slot_bytes());
  for (auto _ : state) {
    for (int i = 0; i < kSlots; ++i)
      codec.encode(&k[static_cast<size_t>(i) * kDim], &v[static_cast<size_t>(i) * kDim],
                   &slots[i * codec.slot_bytes()]);
    benchmark::DoNotOptimize(slots.data());
  }
  state.counters["vectors"] = benchmark::Counter(2.0 * kSlots * state.iterations(), benchmark::Counter::kIsRate);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kSlots * codec.slot_bytes());
}

void decode(benchmark::State& state, const tqkv::Format& f) {
  const tqkv::SlotCodec codec(f, kDim);
  const auto k = gaussian(static_cast<size_t>(kSlots) * kDim), v = gaussian(k.size());
  std::vector<uint8_t> slots(kSlots * codec.slot_bytes());
  for (int i = 0; i < kSlots; ++i)
    codec.encode(&k[static_cast<size_t>(i) * kDim], &v[static_cast<size_t>(i) * kDim], &slots[i * codec.slot_bytes()]);
  std::vector<float> out(2 * kDim);
  for (auto _ : state) {
    for (int i = 0; i < kSlots; ++i) {
      const uint8_t* s = &slots[i * codec.slot_bytes()];
      codec.decode_key(s, out.data());
      codec.decode_value(s + codec.key_bytes(), out.data() + kDim);
      benchmark::DoNotOptimize(out.data());
    }
  }
  state.counters["vectors"] = benchmark::Counter(2.0 * kSlots * state.iterations(), benchmark::Counter::kIsRate);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kSlots * codec.slot_bytes());
}

const int registered = [] {
  for (const tqkv::Format& f : tqkv::all_formats()) {
    benchmark::RegisterBenchmark((std::string("BM_Encode/") + f.name).c_str(),
                                 [&f](benchmark::State& s) { encode(s, f); });
    benchmark::RegisterBenchmark((std::string("BM_Decode/") + f.name).c_str(),
                                 [&f](benchmark::State& s) { decode(s, f); });
  }
  return 0;
}();

}  // namespace
