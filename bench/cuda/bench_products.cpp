// The products of a decode step without attention, as the CUDA device runs them: for every
// layer Q/K/V with biases, the output projection, gate/up with the GLU and the down projection,
// then the output head, over separate weights per layer (so nothing stays in L2), each way
// recorded as one CUDA graph and replayed. Two ways per row count n:
//   cublas: the input converted to bf16, cublasGemmEx per product (bf16 x bf16 -> float32),
//           one launch for the group's biases, one for the GLU (the engine's path before the
//           skinny products, TQKV_CUDA_SKINNY_MAX=0);
//   skinny: cuda::skinny_gemm for Q/K/V with biases and for the projections (float32 input read
//           directly), cuda::skinny_gemm_glu for gate/up/GLU (one launch each).
// Prints ms per step, the weights' bytes per second and the ratio, and the device-to-device copy
// rate measured in the same run (the bound for reading the weights once).
//
//   tqkv_products_bench [--model qwen1.5b|smollm2] [--n 1,2,4,8,16,32,64] [--reps 20]
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "check.h"
#include "tqkv/cuda_ops.h"

namespace {

#define CKB(expr)                                                                  \
  do {                                                                             \
    if ((expr) != CUBLAS_STATUS_SUCCESS) {                                         \
      std::fprintf(stderr, "%s:%d %s failed\n", __FILE__, __LINE__, #expr);        \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

struct ModelShape {
  const char* name;
  int layers, d, q, kv, ff, vocab;
};
constexpr ModelShape kQwen15{"Qwen2.5-Coder-1.5B", 28, 1536, 1536, 256, 8960, 151936};
constexpr ModelShape kSmol{"SmolLM2-135M", 30, 576, 576, 192, 1536, 49152};

uint16_t* random_bf16(size_t n, std::mt19937& rng) {
  std::vector<uint16_t> h(n);
  std::uniform_int_distribution<int> u(0x3c00, 0x3d00);  // small positive and negative values
  for (auto& v : h) v = static_cast<uint16_t>(u(rng) | (rng() & 1 ? 0x8000 : 0));
  uint16_t* d = nullptr;
  CK(cudaMalloc(reinterpret_cast<void**>(&d), n * 2));
  CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
  return d;
}

float* zeros(size_t n) {
  float* d = nullptr;
  CK(cudaMalloc(reinterpret_cast<void**>(&d), std::max<size_t>(n, 1) * 4));
  CK(cudaMemset(d, 0, std::max<size_t>(n, 1) * 4));
  return d;
}

struct Layer {
  uint16_t *wq, *wk, *wv, *wo, *wg, *wu, *wd;
  float *bq, *bk, *bv;
};

}  // namespace

int main(int argc, char** argv) {
  ModelShape m = kQwen15;
  std::vector<int> ns{1, 2, 4, 8, 16, 32, 64};
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model" && i + 1 < argc) {
      const std::string v = argv[++i];
      m = v == "smollm2" ? kSmol : kQwen15;
    } else if (a == "--n" && i + 1 < argc) {
      ns.clear();
      std::stringstream ss(argv[++i]);
      for (std::string t; std::getline(ss, t, ',');) ns.push_back(std::stoi(t));
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: tqkv_products_bench [--model qwen1.5b|smollm2] [--n 1,2,...] [--reps N]\n");
      return 2;
    }
  }
  const int max_n = *std::max_element(ns.begin(), ns.end());
  std::mt19937 rng(7);
  std::vector<Layer> layers(m.layers);
  for (Layer& L : layers) {
    L.wq = random_bf16(size_t(m.q) * m.d, rng);
    L.wk = random_bf16(size_t(m.kv) * m.d, rng);
    L.wv = random_bf16(size_t(m.kv) * m.d, rng);
    L.wo = random_bf16(size_t(m.d) * m.q, rng);
    L.wg = random_bf16(size_t(m.ff) * m.d, rng);
    L.wu = random_bf16(size_t(m.ff) * m.d, rng);
    L.wd = random_bf16(size_t(m.d) * m.ff, rng);
    L.bq = zeros(m.q);
    L.bk = zeros(m.kv);
    L.bv = zeros(m.kv);
  }
  uint16_t* head = random_bf16(size_t(m.vocab) * m.d, rng);
  const double weight_bytes =
      2.0 * (double(m.layers) * (double(m.q) * m.d * 2 + 2.0 * m.kv * m.d + 3.0 * m.ff * m.d) + double(m.vocab) * m.d);

  float *x = zeros(size_t(max_n) * std::max(m.d, m.ff)), *q = zeros(size_t(max_n) * m.q), *k = zeros(size_t(max_n) * m.kv),
        *v = zeros(size_t(max_n) * m.kv), *o = zeros(size_t(max_n) * m.d), *g = zeros(size_t(max_n) * m.ff),
        *u = zeros(size_t(max_n) * m.ff), *logits = zeros(size_t(max_n) * m.vocab);
  uint16_t* xb = nullptr;
  CK(cudaMalloc(reinterpret_cast<void**>(&xb), size_t(max_n) * std::max(m.d, m.ff) * 2));
  CK(cudaMemset(xb, 0, size_t(max_n) * std::max(m.d, m.ff) * 2));

  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cublasHandle_t blas;
  CKB(cublasCreate(&blas));
  CKB(cublasSetStream(blas, s));
  void* ws = nullptr;
  CK(cudaMalloc(&ws, size_t{32} << 20));
  CKB(cublasSetWorkspace(blas, ws, size_t{32} << 20));

  auto gemm = [&](const uint16_t* w, int out, int in, int n, float* y) {
    const float one = 1.0f, zero = 0.0f;
    CKB(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, w, CUDA_R_16BF, in, xb, CUDA_R_16BF, in, &zero, y,
                     CUDA_R_32F, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  // The parts of a step (a mask of kParts): each layer's Q/K/V, output projection, gate/up/GLU,
  // down projection, and the output head.
  enum Part { kQkv = 1, kOut = 2, kGlu = 4, kDown = 8, kHead = 16, kAll = 31 };
  auto step_cublas = [&](int n, int parts) {
    for (const Layer& L : layers) {
      if (parts & kQkv) {
        tqkv::cuda::f32_to_bf16(x, xb, size_t(n) * m.d, s);
        gemm(L.wq, m.q, m.d, n, q);
        gemm(L.wk, m.kv, m.d, n, k);
        gemm(L.wv, m.kv, m.d, n, v);
        float* ys[3] = {q, k, v};
        const float* bs[3] = {L.bq, L.bk, L.bv};
        int cols[3] = {m.q, m.kv, m.kv};
        tqkv::cuda::add_biases(ys, bs, cols, 3, n, s);
      }
      if (parts & kOut) {
        tqkv::cuda::f32_to_bf16(q, xb, size_t(n) * m.q, s);
        gemm(L.wo, m.d, m.q, n, o);
      }
      if (parts & kGlu) {
        tqkv::cuda::f32_to_bf16(x, xb, size_t(n) * m.d, s);
        gemm(L.wg, m.ff, m.d, n, g);
        gemm(L.wu, m.ff, m.d, n, u);
        tqkv::cuda::glu(false, g, u, size_t(n) * m.ff, xb, s);
      }
      if (parts & kDown) gemm(L.wd, m.d, m.ff, n, o);
    }
    if (parts & kHead) {
      tqkv::cuda::f32_to_bf16(x, xb, size_t(n) * m.d, s);
      gemm(head, m.vocab, m.d, n, logits);
    }
  };
  auto step_skinny = [&](int n, int parts) {
    for (const Layer& L : layers) {
      if (parts & kQkv) {
        const tqkv::cuda::SkinnyProduct qkv[3] = {{L.wq, m.q, q, L.bq}, {L.wk, m.kv, k, L.bk}, {L.wv, m.kv, v, L.bv}};
        tqkv::cuda::skinny_gemm(nullptr, x, n, m.d, qkv, 3, s);
      }
      if (parts & kOut) {
        const tqkv::cuda::SkinnyProduct po{L.wo, m.d, o, nullptr};
        tqkv::cuda::skinny_gemm(nullptr, q, n, m.q, &po, 1, s);
      }
      if (parts & kGlu) tqkv::cuda::skinny_gemm_glu(false, nullptr, x, n, m.d, L.wg, L.wu, m.ff, g, xb, s);
      if (parts & kDown) {
        const tqkv::cuda::SkinnyProduct pd{L.wd, m.d, o, nullptr};
        tqkv::cuda::skinny_gemm(xb, nullptr, n, m.ff, &pd, 1, s);
      }
    }
    if (parts & kHead) {
      const tqkv::cuda::SkinnyProduct ph{head, m.vocab, logits, nullptr};
      tqkv::cuda::skinny_gemm(nullptr, x, n, m.d, &ph, 1, s);
    }
  };
  // Weight bytes of the parts.
  auto part_bytes = [&](int parts) {
    double e = 0;
    if (parts & kQkv) e += double(m.layers) * (double(m.q) + 2.0 * m.kv) * m.d;
    if (parts & kOut) e += double(m.layers) * m.d * m.q;
    if (parts & kGlu) e += double(m.layers) * 2.0 * m.ff * m.d;
    if (parts & kDown) e += double(m.layers) * m.d * m.ff;
    if (parts & kHead) e += double(m.vocab) * m.d;
    return 2.0 * e;
  };

  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time_graph = [&](auto&& body) {
    body();  // warm-up (cuBLAS picks and loads its kernels outside the capture)
    CK(cudaStreamSynchronize(s));
    cudaGraph_t graph;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    body();
    CK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    CK(cudaGraphInstantiate(&exec, graph, 0));
    CK(cudaGraphLaunch(exec, s));
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
      CK(cudaEventRecord(e0, s));
      CK(cudaGraphLaunch(exec, s));
      CK(cudaEventRecord(e1, s));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms);
    }
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    std::sort(t.begin(), t.end());
    return double(t[t.size() / 2]);
  };

  // The copy rate: 1 GiB device to device.
  const size_t copy_bytes = size_t{1} << 30;
  void *ca = nullptr, *cb = nullptr;
  CK(cudaMalloc(&ca, copy_bytes));
  CK(cudaMalloc(&cb, copy_bytes));
  CK(cudaMemsetAsync(ca, 1, copy_bytes, s));
  const double copy_ms = time_graph([&] { CK(cudaMemcpyAsync(cb, ca, copy_bytes, cudaMemcpyDeviceToDevice, s)); });
  const double copy_gbs = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;  // read + write
  CK(cudaFree(ca));
  CK(cudaFree(cb));

  std::printf("%s: %d layers, weights %.0f MiB (bf16); device-to-device copy %.0f GB/s (read + write)\n", m.name,
              m.layers, weight_bytes / 1048576.0, copy_gbs);
  std::printf("| n | cublas ms/step | skinny ms/step | skinny / cublas speed | skinny weight GB/s | of copy rate |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const int n : ns) {
    if (n < 1 || n > tqkv::cuda::kSkinnyMaxRows) continue;
    const double tc = time_graph([&] { step_cublas(n, kAll); });
    const double ts = time_graph([&] { step_skinny(n, kAll); });
    const double gbs = weight_bytes / (ts * 1e-3) / 1e9;
    std::printf("| %d | %.3f | %.3f | %.2fx | %.0f | %.0f%% |\n", n, tc, ts, tc / ts, gbs, 100.0 * gbs / copy_gbs);
  }
  // Each part alone (all layers), at each n: ms and weight GB/s, cuBLAS / skinny.
  const std::pair<int, const char*> parts[] = {{kQkv, "qkv"}, {kOut, "out"}, {kGlu, "gate+up+glu"}, {kDown, "down"}, {kHead, "head"}};
  std::printf("\n| n | part | cublas ms | skinny ms | cublas GB/s | skinny GB/s |\n|---|---|---|---|---|---|\n");
  for (const int n : ns) {
    if (n < 1 || n > tqkv::cuda::kSkinnyMaxRows) continue;
    for (const auto& [mask, name] : parts) {
      const double tc = time_graph([&] { step_cublas(n, mask); });
      const double ts = time_graph([&] { step_skinny(n, mask); });
      const double b = part_bytes(mask);
      std::printf("| %d | %s | %.3f | %.3f | %.0f | %.0f |\n", n, name, tc, ts, b / (tc * 1e-3) / 1e9, b / (ts * 1e-3) / 1e9);
    }
  }
  return 0;
}
