// Storage sizes multiplied with overflow checks (internal). A product of heads, positions and
// slot bytes that wraps past size_t would map a short buffer that later writes overrun, so it
// is refused before anything is allocated.
#pragma once
#include <cstddef>
#include <initializer_list>
#include <string>
#include <utility>

#include "tqkv/error.h"

namespace tqkv::cpu {

// The product of factors (each a count and what it counts, e.g. {n_kv_heads, "kv heads"}), or
// tqkv::Error(InvalidArgument) "<what>: A kv heads x B positions x ... overflows size_t".
inline size_t checked_size(const std::string& what, std::initializer_list<std::pair<size_t, const char*>> factors) {
  size_t product = 1;
  bool overflow = false;
  std::string terms;
  for (const auto& [n, name] : factors) {
    overflow = __builtin_mul_overflow(product, n, &product) || overflow;
    terms += (terms.empty() ? "" : " x ") + std::to_string(n) + " " + name;
  }
  if (overflow) throw Error(ErrorCode::InvalidArgument, what + ": " + terms + " overflows size_t");
  return product;
}

}  // namespace tqkv::cpu
