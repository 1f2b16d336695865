// GPU benchmark of the compressed paged cache: store (4,096-token chunk) and split-KV decode
// for every format, on the shapes, with the L2 flushed before every timed launch.
// Prints one table: times, cache bytes read per second, fraction of the measured
// device-to-device copy bandwidth, and ratios to PyTorch bf16 SDPA (--sdpa CSV from
// sdpa_bench.py) and to tqkv's own bf16 paged decode.
//
//   tqkv_cuda_bench [--sdpa FILE] [--reps N] [--formats a,b] [--d D] [--batch B] [--ctx T]
//                   [--splits N] [--decode-only] [--no-flush] [--no-cluster] [--variants V,V] [--heads HQ:HKV]
//                   [--fused W:S [--window-format F]]
// --splits forces the decode's split count (warps per (sequence, kv head)); --decode-only skips
// the store and dequantize timings (quick decode sweeps); --no-flush times with warm caches;
// --no-cluster merges the CTAs of a (sequence, kv head) through the workspace, not DSMEM;
// --variants times the decode once per kernel variant (decode_kernel.cuh), each V a '+'-joined set
// of smem|reg (TQKV_DECODE_VALUE_LUT: 2- and 3-bit MSE values looked up in the shared-memory table
// or in registers) and k128|k256 (TQKV_DECODE_KEY_LUT: 4-bit MSE keys at d = 64, table entries
// 128 or 256 bytes apart), e.g. --variants smem+k128,reg+k256; parts that do not apply to a format
// are dropped.
// --fused W:S also times each format as the compressed middle of a layer with copies, as the
// engine keeps them (tq-4.375's sinks and recent window): W recent positions in a ring of
// --window-format codes (default k6v6, recipes' wq6) and S f16 sinks. One row per format: the
// fused three-part launch (cuda::run_fused_decode), the same three parts as three launches and
// two merges on one stream, then with the window's and the sinks' launches on side streams
// (as a recorded engine step runs them), and each of those launches alone (queries and outputs in f32, as
// the engine passes them; the window and sink pools hold a constant byte pattern).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <initializer_list>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "check.h"
#include "tqkv/cuda.h"
#include "tqkv/cuda_ops.h"
#include "tqkv/error.h"
#include "tqkv/format.h"
#include "tqkv/half.h"

namespace {

using tqkv::cuda::DType;
using tqkv::cuda::PageLayout;


struct Shape {
  int d, hq, hkv, batch, ctx;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
};

uint8_t* g_flush = nullptr;
constexpr size_t kFlushBytes = 256u << 20;
bool g_no_flush = false;  // --no-flush: time with warm caches (diagnostics)
void flush_l2() {
  if (!g_no_flush) CK(cudaMemsetAsync(g_flush, 0x5a, kFlushBytes));
}

template <typename F>
double time_us(F&& fn, int reps, bool flush = true) {
  Timer t;
  for (int i = 0; i < 3; ++i) fn();
  CK(cudaDeviceSynchronize());
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) {
    if (flush) flush_l2();
    CK(cudaEventRecord(t.a));
    fn();
    CK(cudaEventRecord(t.b));
    CK(cudaEventSynchronize(t.b));
    CK(cudaGetLastError());
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, t.a, t.b));
    us.push_back(ms * 1000.0);
  }
  return median(us);
}

double copy_bandwidth_gbs() {
  const size_t bytes = 2ull << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  const double us = time_us([&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, 10, false);
  CK(cudaFree(a));
  CK(cudaFree(b));
  return 2.0 * bytes / (us * 1e3);  // read + write, GB/s
}

std::map<std::tuple<int, int, int, int, int>, double> read_sdpa(const std::string& path) {
  std::map<std::tuple<int, int, int, int, int>, double> m;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::stringstream ss(line);
    int d, hq, hkv, b, ctx;
    double us;
    char c;
    if (ss >> d >> c >> hq >> c >> hkv >> c >> b >> c >> ctx >> c >> us) m[{d, hq, hkv, b, ctx}] = us;
  }
  return m;
}

std::string ctx_str(int ctx) { return ctx % 1024 ? std::to_string(ctx) : std::to_string(ctx / 1024) + "K"; }

struct FusedRow {
  Shape s;
  std::string middle, window;
  int w = 0, sinks = 0;
  double fused_us = 0, fused_other_us = 0, three_us = 0, forked_us = 0, middle_us = 0, window_us = 0, sinks_us = 0, merges_us = 0;
};

// A decode plan with its prepared workspace.
struct PlannedDecode {
  tqkv::cuda::DecodePlan plan;
  void* ws = nullptr;
  PlannedDecode(const tqkv::cuda::CacheCodec& c, const tqkv::cuda::PagedKv& kv, int batch, int hq, int max_len) {
    plan = tqkv::cuda::plan_decode(c, kv, batch, hq, max_len);
    CK(cudaMalloc(&ws, std::max<size_t>(plan.workspace_bytes, 256)));
    tqkv::cuda::init_decode_workspace(c, kv, plan, ws);
  }
  ~PlannedDecode() { cudaFree(ws); }
  PlannedDecode(const PlannedDecode&) = delete;
  PlannedDecode& operator=(const PlannedDecode&) = delete;
};

// --fused: `codec` (its pool `kv`, block tables `bt`, lengths `lens` = ctx) as the middle of a
// layer whose last W positions also sit in a ring of window-format copies and whose first S in
// f16 copies, laid out as engine::CudaKvCache lays them out (the ring's block table maps each
// logical page to ring block page % ring_blocks of its sequence).
FusedRow time_fused(const tqkv::cuda::CacheCodec& codec, const tqkv::cuda::PagedKv& kv, const Shape& s,
                    const int32_t* bt, const int32_t* lens, const float* q, float* out, const std::string& window_format,
                    int W, int S, int reps) {
  namespace tc = tqkv::cuda;
  const int bs = kv.block_size, pages = s.ctx / bs;
  FusedRow r;
  r.s = s;
  r.middle = codec.format().name();
  r.window = window_format;
  r.w = W;
  r.sinks = S;
  const tc::CacheCodec wcodec(tqkv::Format::parse(window_format), s.d);
  const tc::CacheCodec scodec(tqkv::Format::parse("f16"), s.d);
  const int ring_blocks = W > 0 ? (W + 16 + bs - 1) / bs + 1 : 0;
  auto pool = [&](const tc::CacheCodec& c, int blocks) {
    uint8_t* p = nullptr;
    const size_t bytes = static_cast<size_t>(blocks) * bs * s.hkv * c.format().slot_bytes(s.d);
    CK(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(bytes, 256)));
    CK(cudaMemset(p, 0x3c, bytes));  // fp16 norms 0x3c3c = 1.06, every code 0x3c: finite everywhere
    return p;
  };
  tc::PagedKv wkv{pool(wcodec, std::max(1, ring_blocks * s.batch)), std::max(1, ring_blocks * s.batch), bs, s.hkv,
                  PageLayout::Page};
  tc::PagedKv skv{pool(scodec, s.batch), s.batch, bs, s.hkv, PageLayout::Page};
  std::vector<int32_t> wt(static_cast<size_t>(s.batch) * pages), st(s.batch), sl(s.batch, S);
  for (int b = 0; b < s.batch; ++b) {
    for (int p = 0; p < pages; ++p) wt[static_cast<size_t>(b) * pages + p] = ring_blocks ? b * ring_blocks + p % ring_blocks : 0;
    st[b] = b;
  }
  int32_t *dwt, *dst, *dsl;
  CK(cudaMalloc(reinterpret_cast<void**>(&dwt), wt.size() * 4));
  CK(cudaMalloc(reinterpret_cast<void**>(&dst), st.size() * 4));
  CK(cudaMalloc(reinterpret_cast<void**>(&dsl), sl.size() * 4));
  CK(cudaMemcpy(dwt, wt.data(), wt.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dst, st.data(), st.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dsl, sl.data(), sl.size() * 4, cudaMemcpyHostToDevice));

  tc::DecodePart parts[3];
  parts[tc::kFusedMain] = {&codec, kv, bt, pages, lens, s.ctx, S, 0, W};
  if (W > 0) parts[tc::kFusedWindow] = {&wcodec, wkv, dwt, pages, lens, W + 16, S, W, 0};
  if (S > 0) parts[tc::kFusedSinks] = {&scodec, skv, dst, 1, dsl, S, 0, 0, 0};
  tc::DecodeArgs a;
  a.q = q;
  a.q_dtype = DType::F32;
  a.out = out;
  a.out_dtype = DType::F32;
  a.batch = s.batch;
  a.params.n_q_heads = s.hq;
  a.params.scale = 1.0f / std::sqrt(static_cast<float>(s.d));
  const tc::FusedDecodePlan fplan = tc::plan_fused_decode(parts, s.batch, s.hq, tc::FusedDecodeOptions{});
  void* fws = nullptr;
  CK(cudaMalloc(&fws, std::max<size_t>(fplan.workspace_bytes, 256)));
  tc::init_fused_decode_workspace(fplan, s.hkv, fws);
  std::fprintf(stderr, "# fused %s + %s(%d) + %d sinks, d=%d b=%d ctx=%d: CTAs %d/%d/%d, %s merge%s\n", r.middle.c_str(),
               window_format.c_str(), W, S, s.d, s.batch, s.ctx, fplan.ctas[0], fplan.ctas[1], fplan.ctas[2],
               fplan.cluster_merge ? "cluster" : "workspace", fplan.short_first ? ", short parts first" : "");
  r.fused_us = time_us([&] { tc::run_fused_decode(parts, a, fplan, fws); }, reps);
  if (!fplan.cluster_merge) {  // the other dispatch order of the same plan
    tc::FusedDecodePlan other = fplan;
    other.short_first = !fplan.short_first;
    r.fused_other_us = time_us([&] { tc::run_fused_decode(parts, a, other, fws); }, reps);
  }
  CK(cudaFree(fws));

  // The three launches and two merges of the engine's unfused path, one stream.
  const size_t rows = static_cast<size_t>(s.batch) * s.hq;
  float *pw, *ps, *lse_m, *lse_w, *lse_s;
  CK(cudaMalloc(reinterpret_cast<void**>(&pw), rows * s.d * 4));
  CK(cudaMalloc(reinterpret_cast<void**>(&ps), rows * s.d * 4));
  CK(cudaMalloc(reinterpret_cast<void**>(&lse_m), rows * 3 * 4));
  lse_w = lse_m + rows;
  lse_s = lse_w + rows;
  // One part alone, as the engine's unfused path launches it: the part's tables, lengths and cuts.
  auto part_args = [&](const tc::DecodePart& part, float* o, float* lse) {
    tc::DecodeArgs pa = a;
    pa.block_tables = part.block_tables;
    pa.block_table_stride = part.block_table_stride;
    pa.seq_lens = part.seq_lens;
    pa.out = o;
    pa.params.min_key_pos = part.min_key_pos;
    pa.params.window = part.window;
    pa.params.exclude_recent = part.exclude_recent;
    pa.params.lse = lse;
    return pa;
  };
  PlannedDecode pm(codec, kv, s.batch, s.hq, s.ctx);
  const tc::DecodeArgs am = part_args(parts[tc::kFusedMain], out, lse_m);
  const tc::DecodeArgs aw = part_args(parts[tc::kFusedWindow], pw, lse_w);
  const tc::DecodeArgs as = part_args(parts[tc::kFusedSinks], ps, lse_s);
  std::unique_ptr<PlannedDecode> pwin, psink;
  if (W > 0) pwin = std::make_unique<PlannedDecode>(wcodec, wkv, s.batch, s.hq, W + 16);
  if (S > 0) psink = std::make_unique<PlannedDecode>(scodec, skv, s.batch, s.hq, S);
  auto middle = [&] { tc::run_decode(codec, kv, am, pm.plan, pm.ws); };
  auto window = [&] { if (pwin) tc::run_decode(wcodec, wkv, aw, pwin->plan, pwin->ws); };
  auto sinks = [&] { if (psink) tc::run_decode(scodec, skv, as, psink->plan, psink->ws); };
  auto merges = [&] {
    if (pwin) tc::merge_attention(out, lse_m, pw, lse_w, static_cast<int>(rows), s.d);
    if (psink) tc::merge_attention(out, lse_m, ps, lse_s, static_cast<int>(rows), s.d);
  };
  r.three_us = time_us([&] { middle(), window(), sinks(), merges(); }, reps);
  // The same launches with the window's and the sinks' decodes on side streams beside the
  // middle's, as a recorded engine step runs them (its graph's parallel branches).
  cudaStream_t sm, s1, s2;
  cudaEvent_t fork, j0, j1, j2;
  for (cudaStream_t* st : {&sm, &s1, &s2}) CK(cudaStreamCreateWithFlags(st, cudaStreamNonBlocking));
  for (cudaEvent_t* e : {&fork, &j0, &j1, &j2}) CK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  r.forked_us = time_us([&] {
    CK(cudaEventRecord(fork, nullptr));
    for (cudaStream_t st : {sm, s1, s2}) CK(cudaStreamWaitEvent(st, fork, 0));
    if (pwin) tc::run_decode(wcodec, wkv, aw, pwin->plan, pwin->ws, s1);
    CK(cudaEventRecord(j1, s1));
    if (psink) tc::run_decode(scodec, skv, as, psink->plan, psink->ws, s2);
    CK(cudaEventRecord(j2, s2));
    tc::run_decode(codec, kv, am, pm.plan, pm.ws, sm);
    CK(cudaStreamWaitEvent(sm, j1, 0));
    if (pwin) tc::merge_attention(out, lse_m, pw, lse_w, static_cast<int>(rows), s.d, sm);
    CK(cudaStreamWaitEvent(sm, j2, 0));
    if (psink) tc::merge_attention(out, lse_m, ps, lse_s, static_cast<int>(rows), s.d, sm);
    CK(cudaEventRecord(j0, sm));
    CK(cudaStreamWaitEvent(nullptr, j0, 0));
  }, reps);
  for (cudaStream_t st : {sm, s1, s2}) CK(cudaStreamDestroy(st));
  for (cudaEvent_t e : {fork, j0, j1, j2}) CK(cudaEventDestroy(e));
  r.middle_us = time_us(middle, reps);
  r.window_us = pwin ? time_us(window, reps) : 0;
  r.sinks_us = psink ? time_us(sinks, reps) : 0;
  r.merges_us = time_us(merges, reps);
  for (void* p : std::initializer_list<void*>{pw, ps, lse_m, dwt, dst, dsl, wkv.pages, skv.pages}) CK(cudaFree(p));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string sdpa_path, only_formats;
  int heads_q = 0, heads_kv = 0;  // --heads: every shape's query:kv heads (default 32:8 at d = 128, 9:3 at 64, 4:1 at 256)
  int reps = 15, only_batch = 0, only_ctx = 0, only_d = 0, splits = 0;
  bool decode_only = false, no_cluster = false;
  int fused_window = 0, fused_sinks = 0;  // --fused W:S
  std::string window_format = "k6v6";
  std::vector<std::string> variants;  // --variants smem+k128,reg+k256
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--sdpa" && i + 1 < argc) sdpa_path = argv[++i];
    else if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (a == "--formats" && i + 1 < argc) only_formats = "," + std::string(argv[++i]) + ",";
    else if (a == "--batch" && i + 1 < argc) only_batch = std::atoi(argv[++i]);
    else if (a == "--ctx" && i + 1 < argc) only_ctx = std::atoi(argv[++i]);
    else if (a == "--d" && i + 1 < argc) only_d = std::atoi(argv[++i]);
    else if (a == "--splits" && i + 1 < argc) splits = std::atoi(argv[++i]);
    else if (a == "--decode-only") decode_only = true;
    else if (a == "--heads" && i + 1 < argc) {
      if (std::sscanf(argv[++i], "%d:%d", &heads_q, &heads_kv) != 2 || heads_q <= 0 || heads_kv <= 0 || heads_q % heads_kv) {
        std::fprintf(stderr, "--heads wants HQ:HKV, HQ a positive multiple of HKV\n");
        return 2;
      }
    }
    else if (a == "--fused" && i + 1 < argc) {
      if (std::sscanf(argv[++i], "%d:%d", &fused_window, &fused_sinks) != 2 || fused_window < 0 || fused_sinks < 0 ||
          fused_sinks > 16 || fused_window + fused_sinks == 0) {
        std::fprintf(stderr, "--fused wants W:S, W >= 0 recent positions and 0 <= S <= 16 sinks, not both 0\n");
        return 2;
      }
    }
    else if (a == "--window-format" && i + 1 < argc) window_format = argv[++i];
    else if (a == "--no-flush") g_no_flush = true;
    else if (a == "--no-cluster") no_cluster = true;
    else if (a == "--variants" && i + 1 < argc) {
      std::stringstream ss(argv[++i]);
      for (std::string x; std::getline(ss, x, ',');) variants.push_back(x);
    }
  }
  const auto sdpa = read_sdpa(sdpa_path);
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  CK(cudaMalloc(reinterpret_cast<void**>(&g_flush), kFlushBytes));
  const double copy_gbs = copy_bandwidth_gbs();
  std::printf("GPU: %s, %d SMs; device-to-device copy: %.0f GB/s (read + write)\n", prop.name,
              prop.multiProcessorCount, copy_gbs);

  std::vector<Shape> shapes;
  // d = 256 with Gemma-3-270m's heads (4 query heads per kv head, 1 kv head).
  for (auto [d, hq, hkv] : {std::tuple{128, 32, 8}, std::tuple{64, 9, 3}, std::tuple{256, 4, 1}})
    for (int b : {1, 16, 64}) {
      if (heads_q) hq = heads_q, hkv = heads_kv;
      for (int ctx : only_ctx ? std::vector<int>{only_ctx} : std::vector<int>{4096, 32768})  // --ctx: any multiple of 16
        if ((!only_d || d == only_d) && (!only_batch || b == only_batch))
          shapes.push_back({d, hq, hkv, b, ctx});
    }
  // --formats names the formats (bf16 always first, the baseline), any the library parses, e.g. a
  // recipe's per-layer pairs (k5v5); without it, this list.
  std::vector<std::string> formats = {"bf16",          "fp8",     "turboquant_k8v4", "turboquant_4bit_nc",
                                      "turboquant_k3v4_nc", "turboquant_3bit_nc", "tq-k4v2",
                                      "tq-k3v2",       "tq-k4v3", "tq-k4v4",
                                      "k5v3",          "k6v3",    "k6v5",    "k6v6"};  // recipes' wide keys (k6v5: SmolLM2's tq-4.375 middle), wq6
  if (!only_formats.empty()) {
    formats = {"bf16"};
    std::stringstream names(only_formats.substr(1));
    for (std::string name; std::getline(names, name, ',');)
      if (!name.empty() && name != "bf16") formats.push_back(name);
  }
  for (const auto& name : formats) {  // every name parses, before any timing
    try {
      (void)tqkv::Format::parse(name);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "--formats: %s\n", e.what());
      return 2;
    }
  }
  const int bs = 16, chunk = 4096;
  std::vector<FusedRow> fused_rows;

  size_t pool_bytes = 0;
  for (const auto& s : shapes)
    pool_bytes = std::max(pool_bytes, static_cast<size_t>(s.batch) * s.ctx * s.hkv * tqkv::find_format("bf16").slot_bytes(s.d));
  uint8_t* pool;
  CK(cudaMalloc(reinterpret_cast<void**>(&pool), pool_bytes));
  std::mt19937_64 rng(std::random_device{}());

  std::printf("\n| d | Hq:Hkv | batch | ctx | format | B/slot | store us (4096 tok) | dequant us (4096 tok) | decode us | cache GB/s | %% of copy BW | vs SDPA | vs tqkv bf16 |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::map<std::pair<int, int>, std::pair<void*, void*>> inputs;  // (hkv, d) -> random bf16 K, V chunk
  for (const auto& s : shapes) {
    auto key = std::make_pair(s.hkv, s.d);
    if (!inputs.count(key)) {
      const size_t n = static_cast<size_t>(chunk) * s.hkv * s.d;
      std::vector<uint16_t> h(n);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      void *k, *v;
      CK(cudaMalloc(&k, n * 2));
      CK(cudaMalloc(&v, n * 2));
      for (auto& x : h) x = tqkv::float_to_bf16(nd(rng) * 2.0f);
      CK(cudaMemcpy(k, h.data(), n * 2, cudaMemcpyHostToDevice));
      for (auto& x : h) x = tqkv::float_to_bf16(nd(rng) * 0.5f + 0.1f);
      CK(cudaMemcpy(v, h.data(), n * 2, cudaMemcpyHostToDevice));
      inputs[key] = {k, v};
    }
    const auto [dk, dv] = inputs[key];
    const int pages_per_seq = s.ctx / bs, num_blocks = s.batch * pages_per_seq;
    std::vector<int32_t> perm(num_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int64_t> slots(static_cast<size_t>(s.batch) * s.ctx);
    for (int b = 0; b < s.batch; ++b)
      for (int t = 0; t < s.ctx; ++t)
        slots[static_cast<size_t>(b) * s.ctx + t] = static_cast<int64_t>(perm[b * pages_per_seq + t / bs]) * bs + t % bs;
    int32_t *dbt, *dlens;
    int64_t* dslots;
    CK(cudaMalloc(reinterpret_cast<void**>(&dbt), perm.size() * 4));
    CK(cudaMalloc(reinterpret_cast<void**>(&dlens), s.batch * 4));
    CK(cudaMalloc(reinterpret_cast<void**>(&dslots), slots.size() * 8));
    CK(cudaMemcpy(dbt, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));  // row b = perm[b*pps ...]
    std::vector<int32_t> lens(s.batch, s.ctx);
    CK(cudaMemcpy(dlens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dslots, slots.data(), slots.size() * 8, cudaMemcpyHostToDevice));
    std::vector<uint16_t> qh(static_cast<size_t>(s.batch) * s.hq * s.d);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& x : qh) x = tqkv::float_to_bf16(nd(rng));
    void *dq, *dout;
    CK(cudaMalloc(&dq, qh.size() * 2));
    CK(cudaMalloc(&dout, qh.size() * 2));
    CK(cudaMemcpy(dq, qh.data(), qh.size() * 2, cudaMemcpyHostToDevice));
    float *dq_f32 = nullptr, *dout_f32 = nullptr;  // --fused: f32 queries and outputs, as the engine's
    if (fused_window > 0 || fused_sinks > 0) {
      std::vector<float> qf(qh.size());
      for (size_t i = 0; i < qh.size(); ++i) qf[i] = tqkv::bf16_to_float(qh[i]);
      CK(cudaMalloc(reinterpret_cast<void**>(&dq_f32), qf.size() * 4));
      CK(cudaMalloc(reinterpret_cast<void**>(&dout_f32), qf.size() * 4));
      CK(cudaMemcpy(dq_f32, qf.data(), qf.size() * 4, cudaMemcpyHostToDevice));
    }
    double bf16_us = 0;
    const auto it = sdpa.find({s.d, s.hq, s.hkv, s.batch, s.ctx});
    const double sdpa_us = it == sdpa.end() ? 0 : it->second;
    for (const auto& name : formats) {
      const tqkv::Format f = tqkv::Format::parse(name);
      const tqkv::cuda::CacheCodec codec(f, s.d);
      if (!codec.decode_supported()) {  // a row skipped, never the run ended
        std::fprintf(stderr, "skipping %s at d %d: no compiled decode kernel (the engine dequantizes such pairs)\n",
                     name.c_str(), s.d);
        continue;
      }
      tqkv::cuda::PagedKv kv{pool, num_blocks, bs, s.hkv, PageLayout::Page};
      // Fill every sequence (the same random 4096-token chunk, stored at different pages).
      const int64_t total = static_cast<int64_t>(s.batch) * s.ctx;
      for (int64_t t0 = 0; t0 < total; t0 += chunk) {
        tqkv::cuda::StoreArgs a;
        a.k = dk;
        a.v = dv;
        a.dtype = DType::BF16;
        a.slot_mapping = dslots + t0;
        a.n_tokens = static_cast<int>(std::min<int64_t>(chunk, total - t0));
        tqkv::cuda::store(codec, kv, a);
      }
      CK(cudaDeviceSynchronize());
      tqkv::cuda::StoreArgs sa;
      sa.k = dk;
      sa.v = dv;
      sa.dtype = DType::BF16;
      sa.slot_mapping = dslots;
      sa.n_tokens = std::min<int64_t>(chunk, total);
      const double store_us = decode_only ? 0 : time_us([&] { tqkv::cuda::store(codec, kv, sa); }, reps);
      // Dequantize the first 4096 tokens of sequence 0 back to contiguous bf16 K and V.
      const int dq_tokens = std::min(chunk, s.ctx);
      void *dqk, *dqv;
      CK(cudaMalloc(&dqk, static_cast<size_t>(dq_tokens) * s.hkv * s.d * 2));
      CK(cudaMalloc(&dqv, static_cast<size_t>(dq_tokens) * s.hkv * s.d * 2));
      tqkv::cuda::DequantArgs qa;
      qa.block_table = dbt;
      qa.n_tokens = dq_tokens;
      qa.k_out = dqk;
      qa.v_out = dqv;
      qa.out_dtype = DType::BF16;
      const double dequant_us = decode_only ? 0 : time_us([&] { tqkv::cuda::dequantize(codec, kv, qa); }, reps);
      CK(cudaFree(dqk));
      CK(cudaFree(dqv));

      auto plan = tqkv::cuda::plan_decode(codec, kv, s.batch, s.hq, s.ctx, splits);
      if (no_cluster) plan.cluster_merge = false;
      void* ws;
      CK(cudaMalloc(&ws, plan.workspace_bytes));
      tqkv::cuda::init_decode_workspace(codec, kv, plan, ws);
      tqkv::cuda::DecodeArgs da;
      da.q = dq;
      da.q_dtype = DType::BF16;
      da.out = dout;
      da.out_dtype = DType::BF16;
      da.block_tables = dbt;
      da.block_table_stride = pages_per_seq;
      da.seq_lens = dlens;
      da.batch = s.batch;
      da.params.n_q_heads = s.hq;
      da.params.scale = 1.0f / std::sqrt(static_cast<float>(s.d));
      // --variants: the decode once per kernel variant that applies to this format (in order;
      // variants that pick the same kernel as an earlier one are skipped), one row each.
      const bool vvar = f.value == tqkv::ValueCodec::Mse && f.value_bits >= 2 && f.value_bits <= 3;
      const bool kvar = s.d == 64 && f.key == tqkv::KeyCodec::Mse && f.key_bits == 4;
      std::vector<std::pair<std::string, std::string>> runs;  // (value lut, key lut) as set
      for (const std::string& v : variants) {
        std::string vl, kl;
        std::stringstream ss(v);
        for (std::string x; std::getline(ss, x, '+');) {
          if (vvar && (x == "smem" || x == "reg")) vl = x;
          if (kvar && (x == "k128" || x == "k256")) kl = x.substr(1);
        }
        if ((!vl.empty() || !kl.empty()) && std::find(runs.begin(), runs.end(), std::make_pair(vl, kl)) == runs.end())
          runs.emplace_back(vl, kl);
      }
      if (runs.empty()) runs.emplace_back("", "");
      for (const auto& [vl, kl] : runs) {
        if (!vl.empty()) setenv("TQKV_DECODE_VALUE_LUT", vl.c_str(), 1);
        if (!kl.empty()) setenv("TQKV_DECODE_KEY_LUT", kl.c_str(), 1);
        const double dec_us = time_us([&] { tqkv::cuda::run_decode(codec, kv, da, plan, ws); }, reps);
        unsetenv("TQKV_DECODE_VALUE_LUT");
        unsetenv("TQKV_DECODE_KEY_LUT");
        std::string label = name;
        if (!vl.empty() || !kl.empty())
          label += " [" + vl + (vl.empty() || kl.empty() ? "" : "+") + (kl.empty() ? "" : "k" + kl) + "]";
        std::fprintf(stderr, "# %s d=%d b=%d ctx=%d: %d splits, %s merge\n", label.c_str(), s.d, s.batch, s.ctx,
                     plan.num_splits, plan.cluster_merge ? "cluster" : "workspace");
        if (name == "bf16") bf16_us = dec_us;
        const double bytes = static_cast<double>(total) * s.hkv * f.slot_bytes(s.d);
        const double gbs = bytes / (dec_us * 1e3);
        char vs_sdpa[32] = "-";
        if (sdpa_us > 0) std::snprintf(vs_sdpa, sizeof vs_sdpa, "%.2fx", sdpa_us / dec_us);
        std::printf("| %d | %d:%d | %d | %s | %s | %zu | %.1f | %.1f | %.1f | %.0f | %.0f%% | %s | %.2fx |\n", s.d, s.hq,
                    s.hkv, s.batch, ctx_str(s.ctx).c_str(), label.c_str(), f.slot_bytes(s.d), store_us, dequant_us, dec_us, gbs,
                    100.0 * gbs / copy_gbs, vs_sdpa, bf16_us / dec_us);
        std::fflush(stdout);
      }
      CK(cudaFree(ws));
      if ((fused_window > 0 || fused_sinks > 0) && name != "bf16" && fused_window + fused_sinks < s.ctx) {
        try {
          fused_rows.push_back(time_fused(codec, kv, s, dbt, dlens, dq_f32, dout_f32, window_format, fused_window,
                                          fused_sinks, reps));
        } catch (const tqkv::Error& e) {  // e.g. no fused kernel for the pair: skip the row
          std::fprintf(stderr, "skipping fused %s at d %d: %s\n", name.c_str(), s.d, e.what());
        }
      }
    }
    if (sdpa_us > 0) {
      const double bytes = 2.0 * s.batch * s.ctx * s.hkv * s.d * 2;
      std::printf("| %d | %d:%d | %d | %s | torch SDPA bf16 | %d | - | - | %.1f | %.0f | %.0f%% | 1.00x | %.2fx |\n", s.d,
                  s.hq, s.hkv, s.batch, ctx_str(s.ctx).c_str(), 4 * s.d, sdpa_us, bytes / (sdpa_us * 1e3),
                  100.0 * bytes / (sdpa_us * 1e3) / copy_gbs, bf16_us / sdpa_us);
    }
    CK(cudaFree(dbt));
    CK(cudaFree(dlens));
    CK(cudaFree(dslots));
    CK(cudaFree(dq));
    CK(cudaFree(dout));
    if (dq_f32) CK(cudaFree(dq_f32));
    if (dout_f32) CK(cudaFree(dout_f32));
  }
  if (!fused_rows.empty()) {
    std::printf("\n| d | Hq:Hkv | batch | ctx | middle | window (W) | sinks | fused us | other order us | three launches us | forked us | middle us | window us | sinks us | 2 merges us | fused / forked |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const FusedRow& r : fused_rows)
      std::printf("| %d | %d:%d | %d | %s | %s | %s (%d) | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.2fx |\n",
                  r.s.d, r.s.hq, r.s.hkv, r.s.batch, ctx_str(r.s.ctx).c_str(), r.middle.c_str(), r.window.c_str(), r.w,
                  r.sinks, r.fused_us, r.fused_other_us, r.three_us, r.forked_us, r.middle_us, r.window_us, r.sinks_us, r.merges_us,
                  r.fused_us / r.forked_us);
  }
  return 0;
}
