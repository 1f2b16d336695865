// The HTTP layer's pieces below cpp-httplib: the one table from tqkv::Error codes to HTTP
// statuses (issue 42: no message text decides a status), and the connection's deadlines and
// byte limit on a socket pair (issue 45), where a test controls both ends.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "serve/deadline_stream.h"
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

// A connected pair of stream sockets: [0] the server's end, [1] the client's; small buffers.
struct SocketPair {
  int fd[2];
  SocketPair() {
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fd), 0);
    const int small = 4096;
    for (int f : fd) {
      ::setsockopt(f, SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
      ::setsockopt(f, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    }
  }
  ~SocketPair() {
    for (int f : fd)
      if (f >= 0) ::close(f);
  }
  void close_client() {
    ::close(fd[1]);
    fd[1] = -1;
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(DeadlineStream, AReadWaitsNoLongerThanTheRequestsDeadline) {
  SocketPair sp;
  DeadlineStream s(sp.fd[0], {.idle_timeout_s = 0.2, .read_timeout_s = 0.3, .write_timeout_s = 0.3});
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(s.wait_for_request([] { return false; }));  // idle: nothing came
  EXPECT_NEAR(seconds_since(t0), 0.2, 0.15);
  ASSERT_EQ(::send(sp.fd[1], "GET", 3, 0), 3);
  EXPECT_TRUE(s.wait_for_request([] { return false; }));
  s.begin_request();
  char buf[8];
  EXPECT_EQ(s.read(buf, sizeof buf), 3);
  const auto t1 = std::chrono::steady_clock::now();
  EXPECT_EQ(s.read(buf, sizeof buf), -1);  // the rest never comes: cut at the deadline
  EXPECT_TRUE(s.timed_out());
  EXPECT_LT(seconds_since(t1), 0.5);
  // The deadline is the whole request's, not a byte's: bytes trickling in do not extend it.
  std::thread client([&] {
    for (int i = 0; i < 20; ++i) {
      ::send(sp.fd[1], "x", 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  s.begin_request();
  const auto t2 = std::chrono::steady_clock::now();
  int bytes = 0;
  while (s.read(buf, 1) == 1) ++bytes;
  EXPECT_TRUE(s.timed_out());
  EXPECT_GT(bytes, 2);
  EXPECT_LT(seconds_since(t2), 0.6);
  ::shutdown(sp.fd[0], SHUT_RDWR);  // the client's blocked send fails
  client.join();
}

TEST(DeadlineStream, ARequestBeyondItsByteBudgetFails) {
  SocketPair sp;
  DeadlineStream s(sp.fd[0], {.read_timeout_s = 1, .max_request_bytes = 100});
  std::thread client([&] {
    const std::string data(1000, 'x');
    ::send(sp.fd[1], data.data(), data.size(), MSG_NOSIGNAL);
  });
  s.begin_request();
  char buf[64];
  size_t total = 0;
  for (ssize_t n; (n = s.read(buf, sizeof buf)) > 0;) total += static_cast<size_t>(n);
  EXPECT_EQ(total, 100u);
  EXPECT_TRUE(s.over_budget());
  EXPECT_FALSE(s.timed_out());
  ::shutdown(sp.fd[0], SHUT_RDWR);  // the client's blocked send fails
  client.join();
}

TEST(DeadlineStream, AWriteThatMakesNoProgressFailsAfterTheWriteTimeout) {
  SocketPair sp;
  DeadlineStream s(sp.fd[0], {.write_timeout_s = 0.3});
  const std::string chunk(1024, 'x');
  const auto t0 = std::chrono::steady_clock::now();
  size_t sent = 0;
  for (ssize_t n; (n = s.write(chunk.data(), chunk.size())) > 0;) sent += static_cast<size_t>(n);  // the client never reads
  EXPECT_GT(sent, 0u);
  EXPECT_NEAR(seconds_since(t0), 0.3, 0.25);
}

TEST(DeadlineStream, PeerGoneOnlyOnceTheClientClosed) {
  SocketPair sp;
  DeadlineStream s(sp.fd[0], {});
  EXPECT_FALSE(s.peer_gone());
  sp.close_client();
  EXPECT_TRUE(s.peer_gone());
}

}  // namespace
}  // namespace tqkv::serve
