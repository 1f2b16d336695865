// Bit packing of b-bit codes (1 <= b <= 8) into a little-endian bit stream:
// code i occupies bits [i*b, (i+1)*b) of the stream, bit j of the stream being bit (j % 8)
// of byte j / 8. This one rule gives: 4-bit = two codes per byte, low nibble first;
// 2-bit = four per byte, lowest bits first; 3-bit = eight codes in three bytes (dense).
#pragma once
#include <cstddef>
#include <cstdint>

namespace tqkv {

constexpr size_t packed_bytes(size_t n_codes, int bits) { return (n_codes * static_cast<size_t>(bits) + 7) / 8; }

// codes: [n] values < 2^bits (higher bits are ignored); out: [packed_bytes(n, bits)] bytes,
// fully written (unused trailing bits are zero).
void pack_bits(const uint8_t* codes, size_t n, int bits, uint8_t* out);
// in: [packed_bytes(n, bits)] bytes; codes: [n].
void unpack_bits(const uint8_t* in, size_t n, int bits, uint8_t* codes);

// One code, read straight from a packed stream.
inline uint8_t unpack_one(const uint8_t* in, size_t i, int bits) {
  const size_t bit = i * static_cast<size_t>(bits);
  const size_t byte = bit / 8;
  const unsigned shift = bit % 8;
  unsigned v = in[byte] >> shift;
  if (shift + bits > 8) v |= static_cast<unsigned>(in[byte + 1]) << (8 - shift);
  return static_cast<uint8_t>(v & ((1u << bits) - 1u));
}

}  // namespace tqkv
