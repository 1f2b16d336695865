#include "tqkv/bitpack.h"

#include <cstring>

namespace tqkv {

void pack_bits(const uint8_t* codes, size_t n, int bits, uint8_t* out) {
  const size_t nbytes = packed_bytes(n, bits);
  std::memset(out, 0, nbytes);
  const unsigned mask = (1u << bits) - 1u;
  for (size_t i = 0; i < n; ++i) {
    const size_t bit = i * static_cast<size_t>(bits);
    const unsigned v = (codes[i] & mask) << (bit % 8);
    out[bit / 8] |= static_cast<uint8_t>(v);
    if ((bit % 8) + bits > 8) out[bit / 8 + 1] |= static_cast<uint8_t>(v >> 8);
  }
}

void unpack_bits(const uint8_t* in, size_t n, int bits, uint8_t* codes) {
  for (size_t i = 0; i < n; ++i) codes[i] = unpack_one(in, i, bits);
}

}  // namespace tqkv
