// Decode attention over a paged cache, every format beside f16 (Google Benchmark).
//   BM_DecodeAttention/<format>/d<dim>/ctx<N>/b<batch>   d128: 8 kv heads x GQA 4; d64: 3 x GQA 3
//   BM_DecodeAttentionLevel/<level>/<format>              ctx 4096, batch 1, d128, one per SIMD level
// Counters: tokens_heads (context tokens x query heads per second) and bytes_per_second (cache
// bytes read). Each benchmark cycles over enough layers (>= 512 MiB of cache) that a step
// reads from DRAM, as in a model whose other layers evict this one's pages.
// The tqkv CLI (`tqkv bench attention`) times the same thing with a ratio against f16.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tqkv/paged_cache.h"
#include "tqkv/simd.h"

namespace {

struct Setup {
  tqkv::PagedCache cache;
  std::vector<int64_t> seqs;
  int layers;
};

tqkv::PagedCacheConfig config_for(const tqkv::Format& f, int ctx, int batch, int dim, int H, int bs) {
  const int pages = (ctx + bs - 1) / bs;
  const double layer_bytes = static_cast<double>(f.slot_bytes(dim)) * bs * H * pages * batch;
  const int layers = std::clamp(static_cast<int>(std::ceil(512.0 * 1048576.0 / layer_bytes)), 1, 64);
  tqkv::PagedCacheConfig cfg;
  cfg.n_layers = layers;
  cfg.n_kv_heads = H;
  cfg.head_dim = dim;
  cfg.block_size = bs;
  cfg.num_blocks = pages * batch;
  cfg.layer_formats.assign(layers, f);
  return cfg;
}

// Encodes 256 tokens of Gaussian K/V into the first pages and copies them everywhere.
Setup make_setup(const tqkv::Format& f, int ctx, int batch, int dim, int H) {
  const int bs = 64;
  Setup s{tqkv::PagedCache(config_for(f, ctx, batch, dim, H, bs)), {}, 0};
  s.layers = s.cache.n_layers();
  for (int b = 0; b < batch; ++b) {
    s.seqs.push_back(s.cache.add_sequence());
    s.cache.append_slots(s.seqs.back(), ctx);
  }
  const int tmpl = std::min(ctx, 256), tmpl_pages = std::max(1, tmpl / bs);
  std::mt19937_64 rng(1);
  std::normal_distribution<float> g;
  std::vector<float> k(static_cast<size_t>(tmpl) * H * dim), v(k.size());
  for (auto& x : k) x = g(rng);
  for (auto& x : v) x = g(rng);
  std::vector<int64_t> slots(tmpl);
  const auto t0 = s.cache.block_table(s.seqs[0]);
  for (int i = 0; i < tmpl; ++i) slots[i] = static_cast<int64_t>(t0[i / bs]) * bs + i % bs;
  s.cache.store(0, slots, k.data(), v.data(), H, dim);
  const size_t pb = s.cache.page_bytes(0);
  for (int l = 0; l < s.layers; ++l) {
    int i = 0;
    for (int64_t q : s.seqs)
      for (int32_t blk : s.cache.block_table(q)) {
        const int32_t src = t0[i++ % tmpl_pages];
        if (l != 0 || blk != src) std::memcpy(s.cache.pool_mut(l) + blk * pb, s.cache.pool(0) + src * pb, pb);
      }
  }
  return s;
}

void run_decode(benchmark::State& state, const tqkv::Format& f, int ctx, int batch, int dim, int H, int gqa) {
  Setup s = make_setup(f, ctx, batch, dim, H);
  const int Hq = H * gqa;
  std::vector<float> q(static_cast<size_t>(batch) * Hq * dim, 0.1f), out(q.size());
  std::mt19937_64 rng(2);
  std::normal_distribution<float> g;
  for (auto& x : q) x = g(rng);
  tqkv::AttentionParams p;
  p.n_q_heads = Hq;
  int layer = 0;
  for (auto _ : state) {
    tqkv::paged_attention(s.cache, layer, s.seqs, q.data(), p, out.data());
    benchmark::DoNotOptimize(out.data());
    layer = (layer + 1) % s.layers;
  }
  const double steps = static_cast<double>(state.iterations());
  state.counters["tokens_heads"] =
      benchmark::Counter(steps * batch * ctx * Hq, benchmark::Counter::kIsRate);
  state.SetBytesProcessed(static_cast<int64_t>(steps * batch * ctx * H * f.slot_bytes(dim)));
  state.SetLabel(std::string(tqkv::simd_level_name(tqkv::active_simd_level())));
}

void register_all() {
  for (const tqkv::NamedFormat& nf : tqkv::named_formats()) {
    const tqkv::Format& f = nf.format;
    for (int dim : {128, 64}) {
      const int H = dim == 128 ? 8 : 3, gqa = dim == 128 ? 4 : 3;
      for (int ctx : {1024, 4096, 8192, 32768}) {
        for (int batch : {1, 16}) {
          const std::string name = std::string("BM_DecodeAttention/") + std::string(nf.name) + "/d" + std::to_string(dim) + "/ctx" +
                                   std::to_string(ctx) + "/b" + std::to_string(batch);
          benchmark::RegisterBenchmark(name.c_str(), [&f, ctx, batch, dim, H, gqa](benchmark::State& st) {
            run_decode(st, f, ctx, batch, dim, H, gqa);
          })->Unit(benchmark::kMillisecond)->UseRealTime();
        }
      }
    }
  }
  for (tqkv::SimdLevel level : {tqkv::SimdLevel::Scalar, tqkv::SimdLevel::Avx2, tqkv::SimdLevel::Avx512}) {
    if (!tqkv::simd_level_supported(level)) continue;
    for (const char* fname : {"f16", "turboquant_4bit_nc", "tq-k4v2"}) {
      const tqkv::Format f = tqkv::find_format(fname);
      const std::string name =
          std::string("BM_DecodeAttentionLevel/") + std::string(tqkv::simd_level_name(level)) + "/" + fname;
      benchmark::RegisterBenchmark(name.c_str(), [f, level](benchmark::State& st) {
        const tqkv::SimdLevel before = tqkv::active_simd_level();
        tqkv::set_simd_level(level);
        run_decode(st, f, 4096, 1, 128, 8, 4);
        tqkv::set_simd_level(before);
      })->Unit(benchmark::kMillisecond)->UseRealTime();
    }
  }
}

const int registered = (register_all(), 0);

}  // namespace
