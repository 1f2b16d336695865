#include "tqkv/env.h"

#include <cerrno>
#include <cstdlib>
#include <string>

#include "tqkv/error.h"

namespace tqkv {

long long env_count(const char* name, const char* what, long long fallback, long long min, long long max) {
  const char* e = std::getenv(name);
  if (!e || !*e) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(e, &end, 10);
  if (end == e || *end != '\0' || errno == ERANGE || v < min || v > max)
    throw Error(ErrorCode::InvalidArgument, std::string(name) + "=" + e + ": give a count of " + what + " from " +
                                                std::to_string(min) + " to " + std::to_string(max));
  return v;
}

}  // namespace tqkv
