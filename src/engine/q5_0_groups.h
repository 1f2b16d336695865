// Q5_0 matrices in groups of eight blocks: the layout the AVX2 int8 kernel reads (qgemv.h).
//
// A GGUF Q5_0 block (22 bytes, 32 weights) holds its fp16 scale d, the 32 high bits qh and 16
// bytes of low nibbles. Read block by block, an AVX2 core spends ~24 instructions a block on
// converting one fp16, spreading qh over 32 bytes with a shuffle, a mask and a compare, and
// splitting the nibbles with a 128-bit insert: the kernel was bound by instructions at 7-9 GB/s,
// about half of one core's read bandwidth (docs/RESULTS.md, "Q5_0 weights in groups of eight").
// The same bytes, regrouped per row (still 22 bytes a block, so row strides do not change):
//
//   full groups g = 0 .. nb / 8 - 1 of 176 bytes each, nb = cols / 32 blocks a row:
//     [0, 16)    the 8 blocks' fp16 d, in block order: one vcvtph2ps converts all eight;
//     [16, 48)   the 8 blocks' high bits, a 32-bit word each, bit 8k + m = the high bit of
//                element 4m + k (m < 8, k < 4): broadcast to the 8 dwords m of a vector and
//                shifted left by 7 - m, every byte's sign bit is its element's high bit;
//     [48, 176)  4 pairs of blocks (8g + 2p, 8g + 2p + 1), 32 bytes a pair: byte i = the low
//                nibble of element i of the first block | that of the second block << 4, so one
//                load, a mask and a shift give both blocks' 32 nibbles in element order;
//   then the row's last nb % 8 blocks unchanged (GGUF layout).
//
// Packing moves bits only; unpack_q5_0_rows restores the GGUF bytes exactly, and the other
// products (the f32 path, the scalar and AVX-512 int8 kernels) read rows restored by it;
// dequantize_q5_0_groups reads the groups directly (prefill's tiles, embedding rows).
#pragma once
#include <cstddef>
#include <cstdint>

namespace tqkv::engine {

// The type id a packed matrix carries where GGUF type ids go (qgemm, CpuMatrix::qtype); no
// GGUF file uses it.
inline constexpr uint32_t kQ5_0Groups = 0x10006;
inline constexpr int kQ5_0GroupBlocks = 8;
inline constexpr int kQ5_0GroupBytes = 176;

// rows x cols Q5_0 weights (cols a multiple of 32), GGUF layout at src, packed into dst (same
// size, not overlapping src). unpack is its inverse.
void pack_q5_0_rows(const uint8_t* src, size_t rows, int cols, uint8_t* dst);
void unpack_q5_0_rows(const uint8_t* src, size_t rows, int cols, uint8_t* dst);
// dequantize() of the unpacked rows, bit for bit, without unpacking them.
void dequantize_q5_0_groups(const uint8_t* src, size_t rows, int cols, float* dst);

// Whether CpuDevice packs the Q5_0 matrices it loads: where the int8 path runs the AVX2
// kernels (not AVX-512's, which read the GGUF layout as fast). TQKV_Q5_0_GROUPS=0|1 overrides.
bool pack_q5_0_by_default();

}  // namespace tqkv::engine
