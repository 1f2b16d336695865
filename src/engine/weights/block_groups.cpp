#include "engine/weights/block_groups.h"

#include <cstdlib>
#include <cstring>

#include "engine/weights/dequant.h"
#include "engine/gguf/gguf.h"
#include "engine/weights/qgemv.h"
#include "tqkv/error.h"
#include "tqkv/options.h"
#include "tqkv/simd.h"

namespace tqkv::engine {
namespace {

constexpr uint32_t kQ5_0 = static_cast<uint32_t>(TensorType::Q5_0);
constexpr uint32_t kQ4_1 = static_cast<uint32_t>(TensorType::Q4_1);
constexpr uint32_t kQ8_0 = static_cast<uint32_t>(TensorType::Q8_0);

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

// Block j's nibbles (16 GGUF bytes at qs) into / out of the group's pairs at `pairs`.
void put_nibbles(const uint8_t* qs, int j, uint8_t* pairs) {
  uint8_t* pair = pairs + 32 * (j / 2);
  for (int i = 0; i < 32; ++i) pair[i] |= static_cast<uint8_t>(nibble(qs, i) << (j % 2 ? 4 : 0));
}
void get_nibbles(const uint8_t* pairs, int j, uint8_t* qs) {
  const uint8_t* pair = pairs + 32 * (j / 2);
  for (int i = 0; i < 16; ++i) {
    const int lo = (pair[i] >> (j % 2 ? 4 : 0)) & 15, hi = (pair[i + 16] >> (j % 2 ? 4 : 0)) & 15;
    qs[i] = static_cast<uint8_t>(lo | hi << 4);
  }
}

// One type's layout: its grouped and GGUF ids, block and group bytes, one group packed /
// unpacked, and the environment variable that overrides packing it at load.
struct Layout {
  uint32_t grouped, gguf;
  int block_bytes, group_bytes;
  void (*pack)(const uint8_t* src, uint8_t* g);
  void (*unpack)(const uint8_t* g, uint8_t* dst);
  const char* env;
};

void pack_q5_0(const uint8_t* src, uint8_t* g) {
  std::memset(g, 0, kQ5_0GroupBytes);
  for (int j = 0; j < kGroupBlocks; ++j) {
    const uint8_t* b = src + j * 22;
    std::memcpy(g + 2 * j, b, 2);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const uint32_t w = group_word(qh);
    std::memcpy(g + 16 + 4 * j, &w, 4);
    put_nibbles(b + 6, j, g + 48);
  }
}
void unpack_q5_0(const uint8_t* g, uint8_t* dst) {
  for (int j = 0; j < kGroupBlocks; ++j) {
    uint8_t* b = dst + j * 22;
    std::memcpy(b, g + 2 * j, 2);
    uint32_t w;
    std::memcpy(&w, g + 16 + 4 * j, 4);
    const uint32_t qh = gguf_qh(w);
    std::memcpy(b + 2, &qh, 4);
    get_nibbles(g + 48, j, b + 6);
  }
}
void pack_q4_1(const uint8_t* src, uint8_t* g) {
  std::memset(g, 0, kQ4_1GroupBytes);
  for (int j = 0; j < kGroupBlocks; ++j) {
    const uint8_t* b = src + j * 20;
    std::memcpy(g + 2 * j, b, 2);
    std::memcpy(g + 16 + 2 * j, b + 2, 2);
    put_nibbles(b + 4, j, g + 32);
  }
}
void unpack_q4_1(const uint8_t* g, uint8_t* dst) {
  for (int j = 0; j < kGroupBlocks; ++j) {
    uint8_t* b = dst + j * 20;
    std::memcpy(b, g + 2 * j, 2);
    std::memcpy(b + 2, g + 16 + 2 * j, 2);
    get_nibbles(g + 32, j, b + 4);
  }
}

void pack_q8_0(const uint8_t* src, uint8_t* g) {
  for (int j = 0; j < kGroupBlocks; ++j) {
    std::memcpy(g + 2 * j, src + j * 34, 2);
    std::memcpy(g + 16 + 32 * j, src + j * 34 + 2, 32);
  }
}
void unpack_q8_0(const uint8_t* g, uint8_t* dst) {
  for (int j = 0; j < kGroupBlocks; ++j) {
    std::memcpy(dst + j * 34, g + 2 * j, 2);
    std::memcpy(dst + j * 34 + 2, g + 16 + 32 * j, 32);
  }
}

constexpr Layout kLayouts[] = {
    {kQ5_0Groups, kQ5_0, 22, kQ5_0GroupBytes, pack_q5_0, unpack_q5_0, "TQKV_Q5_0_GROUPS"},
    {kQ4_1Groups, kQ4_1, 20, kQ4_1GroupBytes, pack_q4_1, unpack_q4_1, "TQKV_Q4_1_GROUPS"},
    {kQ8_0Groups, kQ8_0, 34, kQ8_0GroupBytes, pack_q8_0, unpack_q8_0, "TQKV_Q8_0_GROUPS"},
};

// The layout whose grouped id (by_gguf: GGUF id) is `type`, or nullptr.
const Layout* find_layout(uint32_t type, bool by_gguf) {
  for (const Layout& l : kLayouts)
    if ((by_gguf ? l.gguf : l.grouped) == type) return &l;
  return nullptr;
}

const Layout& layout_of(uint32_t grouped) {
  if (const Layout* l = find_layout(grouped, false)) return *l;
  throw Error(ErrorCode::InvalidArgument, "block groups: type " + std::to_string(grouped) + " is not a grouped type");
}

// group(src group, dst group) over each row's full groups; the tail blocks copied.
template <class Group>
void over_rows(const Layout& l, const uint8_t* src, size_t rows, int cols, uint8_t* dst, Group group) {
  const int nb = cols / 32, groups = nb / kGroupBlocks;
  const size_t row_bytes = static_cast<size_t>(nb) * l.block_bytes;
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* s = src + r * row_bytes;
    uint8_t* d = dst + r * row_bytes;
    for (int g = 0; g < groups; ++g) group(s + g * l.group_bytes, d + g * l.group_bytes);
    const size_t tail = static_cast<size_t>(groups) * l.group_bytes;
    std::memcpy(d + tail, s + tail, row_bytes - tail);
  }
}

}  // namespace

bool is_grouped(uint32_t type) { return find_layout(type, false) != nullptr; }

uint32_t ungrouped_type(uint32_t type) {
  const Layout* l = find_layout(type, false);
  return l ? l->gguf : type;
}

uint32_t grouped_type(uint32_t gguf_type) {
  const Layout* l = find_layout(gguf_type, true);
  return l ? l->grouped : 0;
}

void pack_group_rows(uint32_t grouped, const uint8_t* src, size_t rows, int cols, uint8_t* dst) {
  const Layout& l = layout_of(grouped);
  over_rows(l, src, rows, cols, dst, l.pack);
}

void unpack_group_rows(uint32_t grouped, const uint8_t* src, size_t rows, int cols, uint8_t* dst) {
  const Layout& l = layout_of(grouped);
  over_rows(l, src, rows, cols, dst, l.unpack);
}

void dequantize_group_rows(uint32_t grouped, const uint8_t* src, size_t rows, int cols, float* dst) {
  const Layout& l = layout_of(grouped);
  const int nb = cols / 32, groups = nb / kGroupBlocks;
  const size_t row_bytes = static_cast<size_t>(nb) * l.block_bytes;
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* row = src + r * row_bytes;
    float* y = dst + r * static_cast<size_t>(cols);
    uint8_t blocks[kQ8_0GroupBytes];  // one group back in GGUF layout (L1-resident; the largest size)
    for (int g = 0; g < groups; ++g) {
      l.unpack(row + g * l.group_bytes, blocks);
      dequantize(l.gguf, blocks, y + g * 256, 256);
    }
    const size_t tail = static_cast<size_t>(groups) * l.group_bytes;
    dequantize(l.gguf, row + tail, y + groups * 256, static_cast<int64_t>(nb - groups * kGroupBlocks) * 32);
  }
}

uint32_t group_at_load(uint32_t gguf_type) {
  const Layout* l = find_layout(gguf_type, true);
  if (!l) return 0;
  const bool avx2_int8 = qdot_mode() == QdotMode::Int8 && std::strcmp(qdot_isa(), "avx2") == 0;
  return env_bool(l->env, avx2_int8) ? l->grouped : 0;
}

}  // namespace tqkv::engine
