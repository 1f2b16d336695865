// The GPU benchmarks' error check: a failed CUDA runtime call prints where and exits.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#define CK(expr)                                                                                      \
  do {                                                                                                \
    const cudaError_t e_ = (expr);                                                                    \
    if (e_ != cudaSuccess) {                                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_));      \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)
