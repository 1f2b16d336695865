#include "q5_0_groups.h"

#include <cstdlib>
#include <cstring>

#include "dequant.h"
#include "gguf.h"
#include "qgemv.h"
#include "tqkv/simd.h"

namespace tqkv::engine {
namespace {

constexpr int kBlockBytes = 22;  // Q5_0: fp16 d, 4 bytes qh, 16 bytes of nibbles

// GGUF qh (bit i = element i's high bit) <-> the group word (bit 8k + m = element 4m + k's):
// byte k of the word is every fourth bit of qh from bit k, gathered (and spread back).
uint32_t every_fourth_bit(uint32_t x) {  // bits 0, 4, 8, ..., 28 of x into bits 0-7
  x &= 0x11111111u;
  x = (x | x >> 3) & 0x03030303u;
  x = (x | x >> 6) & 0x000f000fu;
  return (x | x >> 12) & 0xffu;
}
uint32_t spread_to_fourth(uint32_t x) {  // the inverse: bits 0-7 into bits 0, 4, ..., 28
  x = (x | x << 12) & 0x000f000fu;
  x = (x | x << 6) & 0x03030303u;
  return (x | x << 3) & 0x11111111u;
}
uint32_t group_word(uint32_t qh) {
  uint32_t w = 0;
  for (int k = 0; k < 4; ++k) w |= every_fourth_bit(qh >> k) << (8 * k);
  return w;
}
uint32_t gguf_qh(uint32_t w) {
  uint32_t qh = 0;
  for (int k = 0; k < 4; ++k) qh |= spread_to_fourth((w >> (8 * k)) & 0xffu) << k;
  return qh;
}

// Low nibble of element i (0-31) of a GGUF block's 16 nibble bytes.
int nibble(const uint8_t* qs, int i) { return i < 16 ? qs[i] & 15 : qs[i - 16] >> 4; }

void pack_group(const uint8_t* src, uint8_t* g) {
  std::memset(g, 0, kQ5_0GroupBytes);
  for (int j = 0; j < kQ5_0GroupBlocks; ++j) {
    const uint8_t* b = src + j * kBlockBytes;
    std::memcpy(g + 2 * j, b, 2);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const uint32_t w = group_word(qh);
    std::memcpy(g + 16 + 4 * j, &w, 4);
    uint8_t* pair = g + 48 + 32 * (j / 2);
    for (int i = 0; i < 32; ++i) pair[i] |= static_cast<uint8_t>(nibble(b + 6, i) << (j % 2 ? 4 : 0));
  }
}

void unpack_group(const uint8_t* g, uint8_t* dst) {
  for (int j = 0; j < kQ5_0GroupBlocks; ++j) {
    uint8_t* b = dst + j * kBlockBytes;
    std::memcpy(b, g + 2 * j, 2);
    uint32_t w;
    std::memcpy(&w, g + 16 + 4 * j, 4);
    const uint32_t qh = gguf_qh(w);
    std::memcpy(b + 2, &qh, 4);
    const uint8_t* pair = g + 48 + 32 * (j / 2);
    for (int i = 0; i < 16; ++i) {
      const int lo = (pair[i] >> (j % 2 ? 4 : 0)) & 15, hi = (pair[i + 16] >> (j % 2 ? 4 : 0)) & 15;
      b[6 + i] = static_cast<uint8_t>(lo | hi << 4);
    }
  }
}

template <class Group>
void over_rows(const uint8_t* src, size_t rows, int cols, uint8_t* dst, Group group) {
  const int nb = cols / 32, groups = nb / kQ5_0GroupBlocks;
  const size_t row_bytes = static_cast<size_t>(nb) * kBlockBytes;
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* s = src + r * row_bytes;
    uint8_t* d = dst + r * row_bytes;
    for (int g = 0; g < groups; ++g) group(s + g * kQ5_0GroupBytes, d + g * kQ5_0GroupBytes);
    const size_t tail = static_cast<size_t>(groups) * kQ5_0GroupBytes;
    std::memcpy(d + tail, s + tail, row_bytes - tail);
  }
}

}  // namespace

void pack_q5_0_rows(const uint8_t* src, size_t rows, int cols, uint8_t* dst) {
  over_rows(src, rows, cols, dst, pack_group);
}

void unpack_q5_0_rows(const uint8_t* src, size_t rows, int cols, uint8_t* dst) {
  over_rows(src, rows, cols, dst, unpack_group);
}

void dequantize_q5_0_groups(const uint8_t* src, size_t rows, int cols, float* dst) {
  const int nb = cols / 32, groups = nb / kQ5_0GroupBlocks;
  const size_t row_bytes = static_cast<size_t>(nb) * kBlockBytes;
  const auto q5_0 = static_cast<uint32_t>(TensorType::Q5_0);
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* row = src + r * row_bytes;
    float* y = dst + r * static_cast<size_t>(cols);
    uint8_t blocks[kQ5_0GroupBytes];  // one group back in GGUF layout (L1-resident)
    for (int g = 0; g < groups; ++g) {
      unpack_group(row + g * kQ5_0GroupBytes, blocks);
      dequantize(q5_0, blocks, y + g * 256, 256);
    }
    const size_t tail = static_cast<size_t>(groups) * kQ5_0GroupBytes;
    dequantize(q5_0, row + tail, y + groups * 256, static_cast<int64_t>(nb - groups * kQ5_0GroupBlocks) * 32);
  }
}

bool pack_q5_0_by_default() {
  if (const char* e = std::getenv("TQKV_Q5_0_GROUPS"); e && *e) return std::strcmp(e, "0") != 0;
  return qdot_mode() == QdotMode::Int8 && std::strcmp(qdot_isa(), "avx2") == 0;
}

}  // namespace tqkv::engine
