// The HTTP layer's pieces that need no socket: the one table from tqkv::Error codes to HTTP
// statuses (issue 42: no message text decides a status).
#include <gtest/gtest.h>

#include "serve/http_server.h"

namespace tqkv::serve {
namespace {

TEST(HttpStatus, OneEntryPerErrorCode) {
  EXPECT_EQ(http_status(ErrorCode::InvalidArgument), 400);
  EXPECT_EQ(http_status(ErrorCode::NonFinite), 400);
  EXPECT_EQ(http_status(ErrorCode::OutOfRange), 400);
  EXPECT_EQ(http_status(ErrorCode::Overflow), 400);
  EXPECT_EQ(http_status(ErrorCode::Capacity), 503);
  EXPECT_EQ(http_status(ErrorCode::Busy), 503);
  EXPECT_EQ(http_status(ErrorCode::Format), 500);
  EXPECT_EQ(http_status(ErrorCode::Device), 500);
}

}  // namespace
}  // namespace tqkv::serve
