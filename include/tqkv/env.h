// Reading tqkv's environment knobs (TQKV_THREADS, TQKV_POOL_SPIN_US, TQKV_FUSED_MAX_ROWS, ...).
// A malformed value is an error that names the variable, never a silent fallback: "abc" read
// as 0 would quietly turn a feature off.
#pragma once

namespace tqkv {

// The whole-number value of the environment variable `name`, or `fallback` when it is unset
// or empty. Throws Error(InvalidArgument) naming the variable and `what` it counts when the
// value is not a base-10 integer in [min, max].
long long env_count(const char* name, const char* what, long long fallback, long long min, long long max);

}  // namespace tqkv
