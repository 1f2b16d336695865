// tqkv::env_count: the knobs read from the environment take whole numbers in range or fail
// with an error naming the variable; unset or empty means the default.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "tqkv/env.h"
#include "tqkv/error.h"

namespace {

constexpr const char* kVar = "TQKV_TEST_ENV_COUNT";

struct EnvGuard {
  ~EnvGuard() { unsetenv(kVar); }
};

TEST(EnvCount, UnsetOrEmptyGivesTheFallback) {
  EnvGuard g;
  unsetenv(kVar);
  EXPECT_EQ(tqkv::env_count(kVar, "things", 7, 0, 10), 7);
  setenv(kVar, "", 1);
  EXPECT_EQ(tqkv::env_count(kVar, "things", 7, 0, 10), 7);
}

TEST(EnvCount, ReadsWholeNumbersInRange) {
  EnvGuard g;
  setenv(kVar, "0", 1);
  EXPECT_EQ(tqkv::env_count(kVar, "things", 7, 0, 10), 0);
  setenv(kVar, "10", 1);
  EXPECT_EQ(tqkv::env_count(kVar, "things", 7, 0, 10), 10);
}

TEST(EnvCount, RejectsMalformedOrOutOfRangeValuesByName) {
  EnvGuard g;
  for (const char* bad : {"abc", "5x", " ", "-1", "11", "1e3", "99999999999999999999999"}) {
    setenv(kVar, bad, 1);
    try {
      tqkv::env_count(kVar, "things", 7, 0, 10);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const tqkv::Error& e) {
      EXPECT_EQ(e.code(), tqkv::ErrorCode::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find(kVar), std::string::npos) << e.what();
    }
  }
}

}  // namespace
