// A replayable random seed for tests that draw fresh inputs every run: TQKV_TEST_SEED when set
// (a decimal number), else std::random_device. While the TestSeed lives, every failure in its
// scope prints the seed and how to replay it, so a failure seen once can be run again.
#pragma once
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <source_location>
#include <stdexcept>
#include <string>

namespace tqkv::testing_util {

// TQKV_TEST_SEED if set (a malformed value throws: a replay must not silently run another
// seed), else 64 bits from std::random_device.
inline uint64_t pick_test_seed() {
  if (const char* env = std::getenv("TQKV_TEST_SEED"); env && *env) {
    char* end = nullptr;
    errno = 0;
    const unsigned long long v = std::strtoull(env, &end, 10);
    if (errno != 0 || *end != '\0' || *env == '-')
      throw std::invalid_argument(std::string("TQKV_TEST_SEED=") + env + ": give a decimal number");
    return static_cast<uint64_t>(v);
  }
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// Construct one at the top of a test (or of a loop body); its failures then carry the seed at
// the place it was made: `const TestSeed seed; std::mt19937_64 rng(seed.value());`.
class TestSeed {
 public:
  explicit TestSeed(std::source_location at = std::source_location::current())
      : value_(pick_test_seed()),
        trace_(at.file_name(), static_cast<int>(at.line()),
               "seed " + std::to_string(value_) + " (replay: TQKV_TEST_SEED=" + std::to_string(value_) + ")") {}
  TestSeed(const TestSeed&) = delete;
  TestSeed& operator=(const TestSeed&) = delete;
  uint64_t value() const { return value_; }

 private:
  uint64_t value_;
  ::testing::ScopedTrace trace_;
};

}  // namespace tqkv::testing_util
