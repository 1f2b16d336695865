// TQKV_REQUIRE_CUDA=1 (the GPU scripts, scripts/gpu_*.sh, set it): a test that needs a CUDA
// device fails without one instead of skipping, so a run meant for the GPU cannot pass by
// skipping everything. Without the switch the CUDA tests skip on machines with no device.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

namespace tqkv::testing_util {

inline bool cuda_required() {
  const char* v = std::getenv("TQKV_REQUIRE_CUDA");
  return v && std::strcmp(v, "1") == 0;
}

}  // namespace tqkv::testing_util

// In a test body or SetUp(): without a CUDA device (`present` false) the test skips, or fails
// under TQKV_REQUIRE_CUDA=1. Either way it returns from the enclosing function.
#define TQKV_SKIP_WITHOUT_CUDA(present)                                                          \
  do {                                                                                           \
    if (!(present)) {                                                                            \
      if (::tqkv::testing_util::cuda_required())                                                 \
        GTEST_FAIL() << "TQKV_REQUIRE_CUDA=1 but there is no CUDA device (or the driver failed)"; \
      GTEST_SKIP() << "no CUDA device";                                                          \
    }                                                                                            \
  } while (0)
