// Q5_0, Q4_1 and Q8_0 matrices in groups of eight blocks: the layouts the AVX2 int8 kernels read
// (qgemv.h).
//
// Read block by block, an AVX2 core spends most of a 32-weight block's instructions on its own
// bookkeeping: converting one or two fp16 fields, splitting 16 nibble bytes with a 128-bit insert
// and, for Q5_0, spreading 32 high bits over 32 bytes with a shuffle, a mask and a compare
// (~24 instructions a Q5_0 block). Those kernels were bound by instructions at about half of one
// core's read bandwidth (docs/journal/RESULTS-journal.md, "Q5_0 weights in groups of eight"). The
// same bytes, regrouped per row (the same bytes a block, so row strides do not change), full groups
// g = 0 .. nb / 8 - 1 (nb = cols / 32 blocks a row), then the row's last nb % 8 blocks unchanged
// (GGUF layout):
//
//   Q5_0 (22-byte blocks; groups of 176 bytes):
//     [0, 16)    the 8 blocks' fp16 d, in block order: one vcvtph2ps converts all eight;
//     [16, 48)   the 8 blocks' high bits, a 32-bit word each, bit 8k + m = the high bit of
//                element 4m + k (m < 8, k < 4): broadcast to the 8 dwords m of a vector and
//                shifted left by 7 - m, every byte's sign bit is its element's high bit;
//     [48, 176)  the nibble pairs below.
//   Q4_1 (20-byte blocks; groups of 160 bytes):
//     [0, 16)    the 8 blocks' fp16 d;  [16, 32) their fp16 m (the mins);
//     [32, 160)  the nibble pairs below.
//   Q8_0 (34-byte blocks; groups of 272 bytes):
//     [0, 16)    the 8 blocks' fp16 d;  [16, 272) their 32 int8 codes each, in block order.
//   Nibble pairs: 4 pairs of blocks (8g + 2p, 8g + 2p + 1), 32 bytes a pair: byte i = the low
//   nibble of element i of the first block | that of the second block << 4, so one load, a mask
//   and a shift give both blocks' 32 nibbles in element order.
//
// Packing moves bits only; unpack_group_rows restores the GGUF bytes exactly, and the other
// products (the f32 path, the scalar and AVX-512 int8 kernels) read rows restored by it;
// dequantize_group_rows reads the groups directly (prefill's tiles, embedding rows).
#pragma once
#include <cstddef>
#include <cstdint>

namespace tqkv::engine {

// The type ids packed matrices carry where GGUF type ids go (qgemm, CpuMatrix::qtype); no GGUF
// file uses them.
inline constexpr uint32_t kQ5_0Groups = 0x10006;
inline constexpr uint32_t kQ4_1Groups = 0x10003;
inline constexpr uint32_t kQ8_0Groups = 0x10008;
inline constexpr int kGroupBlocks = 8;
inline constexpr int kQ5_0GroupBytes = 176;
inline constexpr int kQ4_1GroupBytes = 160;
inline constexpr int kQ8_0GroupBytes = 272;

// Whether `type` is one of the grouped ids; the GGUF type of a grouped id (else `type` itself);
// a GGUF type's grouped id (0: none).
bool is_grouped(uint32_t type);
uint32_t ungrouped_type(uint32_t type);
uint32_t grouped_type(uint32_t gguf_type);

// rows x cols weights (cols a multiple of 32) of grouped type `grouped`, GGUF layout at src,
// packed into dst (same size, not overlapping src). unpack is its inverse.
void pack_group_rows(uint32_t grouped, const uint8_t* src, size_t rows, int cols, uint8_t* dst);
void unpack_group_rows(uint32_t grouped, const uint8_t* src, size_t rows, int cols, uint8_t* dst);
// dequantize() of the unpacked rows, bit for bit, without unpacking them.
void dequantize_group_rows(uint32_t grouped, const uint8_t* src, size_t rows, int cols, float* dst);

// The grouped id CpuDevice packs a matrix of GGUF type `gguf_type` into at load, or 0: where
// the int8 path runs the AVX2 kernels (not AVX-512's, which read the GGUF layouts as fast).
// TQKV_Q5_0_GROUPS, TQKV_Q4_1_GROUPS and TQKV_Q8_0_GROUPS (0|1) override.
uint32_t group_at_load(uint32_t gguf_type);

}  // namespace tqkv::engine
