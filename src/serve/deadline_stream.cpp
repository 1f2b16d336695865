#include "deadline_stream.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

namespace tqkv::serve {
namespace {

// The peer's (getpeername) or our (getsockname) address of a socket.
template <typename Name>
void address(int fd, Name name, std::string& ip, int& port) {
  sockaddr_storage a{};
  socklen_t n = sizeof a;
  char host[INET6_ADDRSTRLEN] = "";
  port = 0;
  if (name(fd, reinterpret_cast<sockaddr*>(&a), &n) != 0) return;
  if (a.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
    inet_ntop(AF_INET, &v4->sin_addr, host, sizeof host);
    port = ntohs(v4->sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
    inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof host);
    port = ntohs(v6->sin6_port);
  }
  ip = host;
}

}  // namespace

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(std::max(0.0, seconds) * 1000.0));
}

bool DeadlineStream::wait_for_request(const std::function<bool()>& stopping) {
  const Clock::time_point end = Clock::now() + millis(lim_.idle_timeout_s);
  while (pos_ == len_) {
    if (stopping()) return false;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
    if (left.count() <= 0) return false;
    if (poll_for(POLLIN, std::min<int64_t>(left.count(), 100))) return true;
  }
  return true;
}

void DeadlineStream::begin_request() {
  deadline_ = Clock::now() + millis(lim_.read_timeout_s);
  budget_ = lim_.max_request_bytes;
  timed_out_ = over_budget_ = false;
}

bool DeadlineStream::peer_gone() const {
  if (pos_ < len_) return false;
  pollfd p{fd_, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLRDHUP)) return true;
  char c;
  return ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

bool DeadlineStream::is_readable() const { return pos_ < len_ || poll_until(POLLIN, deadline_); }
bool DeadlineStream::is_writable() const { return poll_for(POLLOUT, millis(lim_.write_timeout_s).count()); }

ssize_t DeadlineStream::read(char* ptr, size_t size) {
  if (pos_ == len_) {
    if (!poll_until(POLLIN, deadline_)) {
      timed_out_ = true;
      return -1;
    }
    if (fill() <= 0) return -1;
  }
  const size_t n = std::min(size, len_ - pos_);
  std::memcpy(ptr, buf_ + pos_, n);
  pos_ += n;
  return static_cast<ssize_t>(n);
}

ssize_t DeadlineStream::write(const char* ptr, size_t size) {
  if (!is_writable()) return -1;
  return ::send(fd_, ptr, size, MSG_NOSIGNAL);
}

void DeadlineStream::get_remote_ip_and_port(std::string& ip, int& port) const { address(fd_, ::getpeername, ip, port); }
void DeadlineStream::get_local_ip_and_port(std::string& ip, int& port) const { address(fd_, ::getsockname, ip, port); }

ssize_t DeadlineStream::fill() {
  if (budget_ == 0) {
    over_budget_ = true;
    return -1;
  }
  const ssize_t n = ::recv(fd_, buf_, std::min(sizeof buf_, budget_), 0);
  if (n <= 0) return n;
  budget_ -= static_cast<size_t>(n);
  pos_ = 0;
  len_ = static_cast<size_t>(n);
  return n;
}

bool DeadlineStream::poll_for(short events, int64_t ms) const {
  pollfd p{fd_, events, 0};
  return ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30))) > 0;
}

bool DeadlineStream::poll_until(short events, Clock::time_point end) const {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
  return left > 0 && poll_for(events, left);
}

}  // namespace tqkv::serve
