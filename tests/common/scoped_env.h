// An environment variable set for what is made in its scope (the caches read their knobs,
// TQKV_FOLD_NEWEST and others, in their constructors), unset when the scope ends.
#pragma once
#include <cstdlib>

namespace tqkv::testing_util {

struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  const char* name_;
};

}  // namespace tqkv::testing_util
