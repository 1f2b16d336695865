// tqkv bench attention --ctx N --batch B --dim D --gqa G [--formats a,b,...] [--json] ... (a whole
// model's decode and prefill: tqkv bench decode, cmd_bench_decode.cpp)
//
// Times decode attention (one query token per sequence, every query head) over a paged cache
// of B sequences of N tokens, for every listed format in this one process, and prints per
// format: seconds per step, tokens*heads per second (B * N * query heads / seconds), cache
// bytes read per second (B * N * kv heads * slot bytes / seconds) and the speed ratio against
// the f16 cache (timed too if not listed).
//
// The cache holds several layers when one layer is small, so that the bytes a step reads are
// not left in the last-level cache by the previous step (a model's other layers would evict
// them): each step runs one layer, round robin, over at least --footprint-mb of cache.
// Each format reports its best step (the machine is shared; interference only adds time), in
// wall time and in process CPU time (all threads), with both ratios against f16.
// Pages are filled by encoding 256 tokens of Gaussian K/V and copying those encoded pages.
//
// tqkv bench prefill --ctx N --chunk C ...: the engine's chunked prefill on the CPU, per format:
// write time and attention time per token, and both as a ratio to f16's.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "cli_util.h"
#include "commands.h"
#include "tqkv/attention.h"
#include "tqkv/contiguous_cache.h"
#include "tqkv/paged_cache.h"
#include "tqkv/simd.h"
#include "tqkv/threads.h"

namespace {

struct BenchOptions {
  int ctx = 4096, batch = 1, dim = 128, gqa = 4, kv_heads = 8, block_size = 64, threads = 0;
  std::string formats, simd, layout = "slot";
  double min_time = 0.5, footprint_mb = 512;
  bool json = false;
};

struct Row {
  std::string format;
  size_t slot_bytes;
  double seconds, cpu_seconds, tokens_heads, bytes_per_s, speedup = 0, cpu_speedup = 0;
  int layers;
};

// CPU time of the whole process (all threads): unlike wall time it does not grow while other
// processes hold the cores, so on a shared machine it is the steadier measure of the kernel.
double process_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

Row time_format(const tqkv::Format& f, const BenchOptions& o) {
  using namespace tqkv;
  const int H = o.kv_heads, Hq = o.kv_heads * o.gqa, d = o.dim, bs = o.block_size;
  const int pages_per_seq = (o.ctx + bs - 1) / bs;
  const size_t slot = f.slot_bytes(d);
  const double layer_bytes = static_cast<double>(slot) * bs * H * pages_per_seq * o.batch;
  const int layers = std::clamp(static_cast<int>(std::ceil(o.footprint_mb * 1048576.0 / layer_bytes)), 1, 64);
  PagedCacheConfig cfg;
  cfg.n_layers = layers;
  cfg.n_kv_heads = H;
  cfg.head_dim = d;
  cfg.block_size = bs;
  cfg.num_blocks = pages_per_seq * o.batch;
  cfg.layout = o.layout == "page" ? PageLayout::Page : PageLayout::Slot;
  cfg.layer_formats.assign(layers, f);
  PagedCache cache(cfg);
  std::vector<int64_t> seqs;
  for (int b = 0; b < o.batch; ++b) {
    seqs.push_back(cache.add_sequence());
    cache.append_slots(seqs.back(), o.ctx);
  }
  // Template pages: 256 encoded tokens (or fewer for a short context) of sequence 0, layer 0.
  const int tmpl_tokens = std::min(o.ctx, 256);
  const int tmpl_pages = std::max(1, tmpl_tokens / bs);
  {
    std::mt19937_64 rng(1);
    std::normal_distribution<float> g;
    std::vector<float> k(static_cast<size_t>(tmpl_tokens) * H * d), v(k.size());
    for (auto& x : k) x = g(rng);
    for (auto& x : v) x = g(rng);
    std::vector<int64_t> slots(tmpl_tokens);
    for (int i = 0; i < tmpl_tokens; ++i) slots[i] = static_cast<int64_t>(cache.block_table(seqs[0])[i / bs]) * bs + i % bs;
    cache.store(0, slots, k.data(), v.data(), H, d);
  }
  const size_t pb = cache.page_bytes(0);
  const auto& t0 = cache.block_table(seqs[0]);
  for (int l = 0; l < layers; ++l) {
    uint8_t* pool = cache.pool_mut(l);
    int i = 0;
    for (int64_t s : seqs)
      for (int32_t blk : cache.block_table(s)) {
        const int32_t src = t0[i++ % tmpl_pages];
        if (l != 0 || blk != src) std::memcpy(pool + blk * pb, cache.pool(0) + src * pb, pb);
      }
  }
  std::vector<float> q(static_cast<size_t>(o.batch) * Hq * d), out(q.size());
  std::mt19937_64 rng(2);
  std::normal_distribution<float> g;
  for (auto& x : q) x = g(rng);
  AttentionParams p;
  p.n_q_heads = Hq;
  paged_attention(cache, 0, seqs, q.data(), p, out.data());  // warm-up (thread pool, pages)
  // Best step time: the machine is shared, and other processes only ever add time.
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  int steps = 0;
  double elapsed = 0, best = 1e300, best_cpu = 1e300;
  while (steps < 5 || elapsed < o.min_time) {
    const auto t = clock::now();
    const double c = process_cpu_seconds();
    paged_attention(cache, steps % layers, seqs, q.data(), p, out.data());
    best = std::min(best, std::chrono::duration<double>(clock::now() - t).count());
    best_cpu = std::min(best_cpu, process_cpu_seconds() - c);
    ++steps;
    elapsed = std::chrono::duration<double>(clock::now() - start).count();
  }
  Row r;
  r.format = f.name();
  r.slot_bytes = slot;
  r.layers = layers;
  r.seconds = best;
  r.cpu_seconds = best_cpu;
  r.tokens_heads = static_cast<double>(o.batch) * o.ctx * Hq / r.seconds;
  r.bytes_per_s = static_cast<double>(o.batch) * o.ctx * H * slot / r.seconds;
  return r;
}

// Chunked prefill as the engine runs it on the CPU (src/engine/device/cpu_kv_cache.cpp): per chunk,
// the chunk's keys and values are written (encoded) into a contiguous cache, then its queries
// attend causally to every cached position, the chunk's own included.
struct PrefillOptions {
  int ctx = 4096, chunk = 512, dim = 64, gqa = 3, kv_heads = 3, threads = 0, reps = 3;
  std::string formats, simd;
  bool json = false;
};

struct PrefillRow {
  std::string format;
  double write_s = 1e300, attend_s = 1e300;  // best over the repetitions, whole prefill
};

PrefillRow time_prefill(const tqkv::Format& f, const PrefillOptions& o) {
  using namespace tqkv;
  const int H = o.kv_heads, Hq = o.kv_heads * o.gqa, d = o.dim;
  ContiguousCacheConfig cfg;
  cfg.n_kv_heads = H;
  cfg.head_dim = d;
  cfg.capacity = o.ctx;
  cfg.layer_formats = {f};
  ContiguousCache cache(cfg);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> g;
  std::vector<float> k(static_cast<size_t>(o.ctx) * H * d), v(k.size());
  std::vector<float> q(static_cast<size_t>(o.chunk) * Hq * d), out(q.size());
  for (auto* x : {&k, &v, &q})
    for (auto& e : *x) e = g(rng);
  AttentionParams p;
  p.n_q_heads = Hq;
  using clock = std::chrono::steady_clock;
  PrefillRow r;
  r.format = f.name();
  for (int rep = 0; rep < o.reps; ++rep) {  // a repetition overwrites positions 0.. again
    double w = 0, a = 0;
    for (int t0 = 0; t0 < o.ctx; t0 += o.chunk) {
      const int n = std::min(o.chunk, o.ctx - t0);
      const size_t at = static_cast<size_t>(t0) * H * d;
      const auto t = clock::now();
      cache.write(0, t0, n, k.data() + at, v.data() + at);
      const auto t1 = clock::now();
      attention(cache, 0, q.data(), n, t0, p, out.data());
      w += std::chrono::duration<double>(t1 - t).count();
      a += std::chrono::duration<double>(clock::now() - t1).count();
    }
    r.write_s = std::min(r.write_s, w);
    r.attend_s = std::min(r.attend_s, a);
  }
  return r;
}

}  // namespace

void register_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
#ifdef TQKV_HAVE_ENGINE
  register_bench_decode(*bench);  // cmd_bench_decode.cpp: a whole model's decode and prefill
#endif
  auto* cmd = bench->add_subcommand("attention", "Time decode attention of every listed format against f16");
  static BenchOptions o;
  cmd->add_option("--ctx", o.ctx, "context tokens per sequence")->check(CLI::Range(1, 1 << 22));
  cmd->add_option("--batch", o.batch, "sequences")->check(CLI::Range(1, 4096));
  cmd->add_option("--dim", o.dim, "head dimension")->check(CLI::Range(2, 1024));
  cmd->add_option("--gqa", o.gqa, "query heads per kv head")->check(CLI::Range(1, 64));
  cmd->add_option("--kv-heads", o.kv_heads, "kv heads")->check(CLI::Range(1, 256));
  cmd->add_option("--formats", o.formats, "comma-separated formats or k<K>v<V> Mse pairs (default: all)");
  cmd->add_option("--block-size", o.block_size, "page size in tokens (16, 32, 64, 128)");
  cmd->add_option("--layout", o.layout, "page arrangement: slot or page")->check(CLI::IsMember({"slot", "page"}));
  cmd->add_option("--threads", o.threads, "threads (default: $TQKV_THREADS or all hardware threads)");
  cmd->add_option("--simd", o.simd, "force a kernel level: scalar, avx2, avx512");
  cmd->add_option("--min-time", o.min_time, "seconds to time each format");
  cmd->add_option("--footprint-mb", o.footprint_mb, "cycle over layers covering at least this much cache");
  cmd->add_flag("--json", o.json, "print a JSON array");
  cmd->callback([] {
    using namespace tqkv;
    if (!o.simd.empty()) set_simd_level(parse_simd_level(o.simd));
    set_num_threads(o.threads);  // 0: the default
    // Named formats or variants such as k5v4 (Format::parse), as the engine's per-layer widths use.
    std::vector<Format> formats;
    if (o.formats.empty()) {
      for (const NamedFormat& f : named_formats()) formats.push_back(f.format);
    } else {
      for (const auto& name : split_list(o.formats)) formats.push_back(find_format(name));
    }
    const Format f16 = find_format("f16");
    const bool listed_f16 = std::find(formats.begin(), formats.end(), f16) != formats.end();
    std::vector<Row> rows;
    double f16_seconds = 0, f16_cpu = 0;
    if (!listed_f16) {
      const Row r = time_format(f16, o);
      f16_seconds = r.seconds;
      f16_cpu = r.cpu_seconds;
    }
    for (const Format& f : formats) {
      rows.push_back(time_format(f, o));
      if (f == f16) {
        f16_seconds = rows.back().seconds;
        f16_cpu = rows.back().cpu_seconds;
      }
    }
    for (auto& r : rows) {
      r.speedup = f16_seconds / r.seconds;
      r.cpu_speedup = f16_cpu / r.cpu_seconds;
    }
    if (o.json) {
      nlohmann::json arr = nlohmann::json::array();
      for (const auto& r : rows)
        arr.push_back({{"format", r.format},
                       {"seconds_per_step", r.seconds},
                       {"tokens_heads_per_s", r.tokens_heads},
                       {"bytes_per_s", r.bytes_per_s},
                       {"speedup_vs_f16", r.speedup},
                       {"cpu_seconds_per_step", r.cpu_seconds},
                       {"cpu_speedup_vs_f16", r.cpu_speedup}});
      std::cout << arr.dump(2) << "\n";
      return;
    }
    std::printf("decode attention: ctx %d, batch %d, dim %d, %d kv heads x GQA %d, %s layout, block %d, %s, %d threads\n",
                o.ctx, o.batch, o.dim, o.kv_heads, o.gqa, o.layout.c_str(), o.block_size,
                std::string(simd_level_name(active_simd_level())).c_str(), num_threads());
    std::printf("%-20s %6s %7s %12s %16s %10s %8s %12s %10s\n", "format", "slot_B", "layers", "s/step",
                "tokens*heads/s", "GB/s read", "vs f16", "cpu s/step", "cpu vs f16");
    for (const auto& r : rows)
      std::printf("%-20s %6zu %7d %12.5g %16.4g %10.3f %7.2fx %12.5g %9.2fx\n", r.format.c_str(), r.slot_bytes,
                  r.layers, r.seconds, r.tokens_heads, r.bytes_per_s / 1e9, r.speedup, r.cpu_seconds, r.cpu_speedup);
  });

  auto* pre = bench->add_subcommand("prefill", "Time a chunked prefill (write, then causal attention) of every listed format against f16");
  static PrefillOptions po;
  pre->add_option("--ctx", po.ctx, "tokens prefilled")->check(CLI::Range(1, 1 << 20));
  pre->add_option("--chunk", po.chunk, "tokens per chunk (the engine's step)")->check(CLI::Range(1, 1 << 16));
  pre->add_option("--dim", po.dim, "head dimension")->check(CLI::Range(2, 1024));
  pre->add_option("--gqa", po.gqa, "query heads per kv head")->check(CLI::Range(1, 64));
  pre->add_option("--kv-heads", po.kv_heads, "kv heads")->check(CLI::Range(1, 256));
  pre->add_option("--formats", po.formats, "comma-separated formats (default: f16 and the named compressed formats)");
  pre->add_option("--threads", po.threads, "threads (default: $TQKV_THREADS or all hardware threads)");
  pre->add_option("--simd", po.simd, "force a kernel level: scalar, avx2, avx512");
  pre->add_option("--reps", po.reps, "repetitions (the best is reported)")->check(CLI::Range(1, 1000));
  pre->add_flag("--json", po.json, "print a JSON array");
  pre->callback([] {
    using namespace tqkv;
    if (!po.simd.empty()) set_simd_level(parse_simd_level(po.simd));
    set_num_threads(po.threads);
    const Format f16 = find_format("f16");
    std::vector<Format> formats{f16};
    if (po.formats.empty()) {
      for (const NamedFormat& f : named_formats())
        if (f.format.key_bits < 8 || f.format.value_bits < 8) formats.push_back(f.format);
    } else {
      for (const auto& name : split_list(po.formats))
        if (find_format(name) != f16) formats.push_back(find_format(name));
    }
    std::vector<PrefillRow> rows;
    for (const Format& f : formats) rows.push_back(time_prefill(f, po));
    const double n = po.ctx;
    if (po.json) {
      nlohmann::json arr = nlohmann::json::array();
      for (const auto& r : rows)
        arr.push_back({{"format", r.format},
                       {"write_s_per_token", r.write_s / n},
                       {"attention_s_per_token", r.attend_s / n},
                       {"attention_vs_f16", r.attend_s / rows[0].attend_s},
                       {"total_vs_f16", (r.write_s + r.attend_s) / (rows[0].write_s + rows[0].attend_s)}});
      std::cout << arr.dump(2) << "\n";
      return;
    }
    std::printf("chunked prefill: ctx %d, chunk %d, dim %d, %d kv heads x GQA %d, %s, %d threads (time per token; "
                "ratios: time / f16's time)\n",
                po.ctx, po.chunk, po.dim, po.kv_heads, po.gqa, std::string(simd_level_name(active_simd_level())).c_str(),
                num_threads());
    std::printf("%-20s %12s %14s %14s %12s\n", "format", "write us/tok", "attend us/tok", "attend / f16", "total / f16");
    for (const auto& r : rows)
      std::printf("%-20s %12.3f %14.3f %13.2fx %11.2fx\n", r.format.c_str(), 1e6 * r.write_s / n, 1e6 * r.attend_s / n,
                  r.attend_s / rows[0].attend_s, (r.write_s + r.attend_s) / (rows[0].write_s + rows[0].attend_s));
  });
}
