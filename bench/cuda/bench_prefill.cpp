// GPU benchmark of cuda::prefill_attention alone: a run of n_q queries at positions
// [history, history + n_q) attending causally over 16-bit K/V of history + n_q positions, as the
// engine's tiled prefill path calls it after dequantizing a sequence. Each shape runs with the
// CTA's keys unsplit (PrefillArgs::splits = 1) and split as the op chooses (with its workspace),
// with CTAs of 4 and of 8 warps (TQKV_PREFILL_WARPS), so the model forward's launches and
// products do not blur the kernel's own A/B. Caches warm (the engine reads the workspace right
// after writing it); median of --reps launches timed by events.
//
//   tqkv_prefill_bench [--d 64,128,256] [--heads HQ:HKV] [--nq 64,512,4096] [--history 0,4096,16384]
//                      [--reps N] [--f16]
// --heads applies to every --d (default 9:3 at d = 64, 12:2 at 128, 4:1 at 256: SmolLM2-135M,
// Qwen2.5-1.5B, Gemma-3-270m); --f16 times f16 K/V instead of bf16.
//
// Columns: µs per call; TFLOP/s counting 4 d flops per visible (query, key) pair and query head
// (Q Kᵀ and P V, the causal triangle only); the splits the op took; the largest difference of any
// variant's outputs from those of 4 warps unsplit (the same arithmetic in another order: small).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "check.h"
#include "tqkv/cuda_ops.h"
#include "tqkv/half.h"

namespace {

namespace tc = tqkv::cuda;

std::vector<int> parse_ints(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(std::atoi(x.c_str()));
  return v;
}

template <typename T>
T* device_copy(const std::vector<T>& h) {
  T* p = nullptr;
  CK(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(h.size(), 1) * sizeof(T)));
  CK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

struct Result {
  double us;
  int splits;
  std::vector<float> out;  // the call's output, to hold every variant against the first
};

// Median time of `reps` calls of args (after two untimed ones), and the splits it took (the
// workspace it asked for, over one split's bytes).
Result time_prefill(tc::PrefillArgs a, bool split, int reps) {
  a.splits = split ? 0 : 1;
  void* ws = nullptr;
  const size_t bytes = split ? tc::prefill_workspace_bytes(a) : 0;
  if (bytes) CK(cudaMalloc(&ws, bytes));
  a.workspace = ws;
  a.workspace_bytes = bytes;
  const size_t per_split = static_cast<size_t>(a.n_q) * a.n_q_heads * (a.head_dim + 1) * sizeof(float);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 2; ++i) tc::prefill_attention(a);
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(e0));
    tc::prefill_attention(a);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms * 1e3);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  cudaFree(ws);
  std::sort(t.begin(), t.end());
  std::vector<float> out(static_cast<size_t>(a.n_q) * a.n_q_heads * a.head_dim);
  CK(cudaMemcpy(out.data(), a.out, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return {t[t.size() / 2], bytes ? static_cast<int>(bytes / per_split) : 1, std::move(out)};
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> dims{64, 128, 256}, nqs{64, 512, 4096}, histories{0, 4096, 16384};
  int reps = 20, heads_q = 0, heads_kv = 0;
  bool f16 = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--d" && i + 1 < argc) dims = parse_ints(argv[++i]);
    else if (a == "--nq" && i + 1 < argc) nqs = parse_ints(argv[++i]);
    else if (a == "--history" && i + 1 < argc) histories = parse_ints(argv[++i]);
    else if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--f16") f16 = true;
    else if (a == "--heads" && i + 1 < argc) {
      if (std::sscanf(argv[++i], "%d:%d", &heads_q, &heads_kv) != 2 || heads_q <= 0 || heads_kv <= 0 || heads_q % heads_kv) {
        std::fprintf(stderr, "--heads wants HQ:HKV, HQ a positive multiple of HKV\n");
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--d D,..] [--heads HQ:HKV] [--nq N,..] [--history H,..] [--reps N] [--f16]\n", argv[0]);
      return 2;
    }
  }
  int dev = 0;
  cudaDeviceProp prop{};
  CK(cudaGetDevice(&dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("prefill attention on %s (%d SMs), %s K/V, median of %d, caches warm\n\n", prop.name,
              prop.multiProcessorCount, f16 ? "f16" : "bf16", reps);
  std::printf("| d | heads | n_q | history | warps | unsplit µs | TFLOP/s | split µs | TFLOP/s | splits | split / unsplit | max |diff| |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const int d : dims) {
    const int hq = heads_q ? heads_q : d == 64 ? 9 : d == 128 ? 12 : 4;
    const int hkv = heads_q ? heads_kv : d == 64 ? 3 : d == 128 ? 2 : 1;
    for (const int n_q : nqs)
      for (const int hist : histories) {
        const int n_kv = hist + n_q;
        std::vector<float> q(static_cast<size_t>(n_q) * hq * d);
        for (float& x : q) x = nd(rng);
        std::vector<uint16_t> kv(static_cast<size_t>(n_kv) * hkv * d);
        for (uint16_t& x : kv) x = f16 ? tqkv::float_to_half(nd(rng)) : tqkv::float_to_bf16(nd(rng));
        float* dq = device_copy(q);
        uint16_t* dk = device_copy(kv);
        uint16_t* dv = device_copy(kv);
        float* out = nullptr;
        CK(cudaMalloc(reinterpret_cast<void**>(&out), q.size() * sizeof(float)));
        tc::PrefillArgs a;
        a.q = dq;
        a.k = dk;
        a.v = dv;
        a.kv_dtype = f16 ? tc::DType::F16 : tc::DType::BF16;
        a.out = out;
        a.n_q = n_q;
        a.pos0 = hist;
        a.n_kv = n_kv;
        a.n_q_heads = hq;
        a.n_kv_heads = hkv;
        a.head_dim = d;
        // Visible (query, key) pairs: query i sees hist + i + 1 keys.
        const double pairs = static_cast<double>(n_q) * hist + static_cast<double>(n_q) * (n_q + 1) / 2;
        const double flops = 4.0 * d * hq * pairs;
        std::vector<float> first;  // 4 warps, unsplit: every other variant's outputs against it
        const auto diff = [&first](const std::vector<float>& o) {
          double m = 0;
          for (size_t i = 0; i < o.size(); ++i) m = std::max(m, static_cast<double>(std::fabs(o[i] - first[i])));
          return m;
        };
        for (const char* warps : {"4", "8"}) {
          setenv("TQKV_PREFILL_WARPS", warps, 1);
          const Result u = time_prefill(a, false, reps), s = time_prefill(a, true, reps);
          if (first.empty()) first = u.out;
          std::printf("| %d | %d:%d | %d | %d | %s | %.1f | %.1f | %.1f | %.1f | %d | %.2f | %.1e |\n", d, hq, hkv, n_q, hist,
                      warps, u.us, flops / u.us * 1e-6, s.us, flops / s.us * 1e-6, s.splits, s.us / u.us,
                      std::max(diff(u.out), diff(s.out)));
          std::fflush(stdout);
        }
        unsetenv("TQKV_PREFILL_WARPS");
        cudaFree(dq);
        cudaFree(dk);
        cudaFree(dv);
        cudaFree(out);
      }
  }
  return 0;
}
