// One HTTP connection's socket as cpp-httplib reads and writes it, with the limits a server on
// a network needs (issue 45): a request (its line, headers and body) must arrive whole within
// `read_timeout_s` of its first byte and within `max_request_bytes`; a write must make progress
// within `write_timeout_s`; a connection waits at most `idle_timeout_s` for its next request.
// What ended a read is kept (timed_out, over_budget) so that the server can answer 408 or 413.
#pragma once
#include <httplib.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

namespace tqkv::serve {

struct StreamLimits {
  double idle_timeout_s = 5, read_timeout_s = 30, write_timeout_s = 30;
  size_t max_request_bytes = 1 << 20;  // request line, headers and body together
};

std::chrono::milliseconds millis(double seconds);

class DeadlineStream final : public httplib::Stream {
 public:
  DeadlineStream(int fd, const StreamLimits& limits) : fd_(fd), lim_(limits) {}

  // Waits (in slices of 100 ms, so that `stopping` is seen) for the first byte of the next
  // request, at most the idle timeout. False: the client went quiet, or the server stops.
  bool wait_for_request(const std::function<bool()>& stopping);
  // A request starts: its deadline and byte budget.
  void begin_request();
  bool timed_out() const { return timed_out_; }
  bool over_budget() const { return over_budget_; }
  // The client closed its end (or reset it) and nothing it sent is unread.
  bool peer_gone() const;

  bool is_readable() const override;
  bool is_writable() const override;
  ssize_t read(char* ptr, size_t size) override;
  ssize_t write(const char* ptr, size_t size) override;
  void get_remote_ip_and_port(std::string& ip, int& port) const override;
  void get_local_ip_and_port(std::string& ip, int& port) const override;
  socket_t socket() const override { return fd_; }

 private:
  using Clock = std::chrono::steady_clock;
  ssize_t fill();
  bool poll_for(short events, int64_t ms) const;
  bool poll_until(short events, Clock::time_point end) const;

  const int fd_;
  const StreamLimits lim_;
  char buf_[16 << 10];
  size_t pos_ = 0, len_ = 0;
  Clock::time_point deadline_ = Clock::now();
  size_t budget_ = 0;
  bool timed_out_ = false, over_budget_ = false;
};

}  // namespace tqkv::serve
