// The attention kernel interface shared by the scalar, AVX2 and AVX-512 builds (internal).
//
// A kernel consumes "runs": stretches of consecutive key positions whose slots sit at constant
// strides (a contiguous ring between wrap points, the tokens of one page). Each run gives the
// address and stride of five fields so that the slot layout (fields interleaved per token) and
// the page layout (fields in planes) go through the same code.
//
// For a block of query rows (the query heads of one kv head, possibly for several query tokens)
// the kernel keeps the flash-attention state in the caller's buffers:
//   m[r]   running max of the scores seen so far (-inf: none yet)
//   l[r]   sum of exp(score - m[r])
//   acc[r] [dim] sum of exp(score - m[r]) * vfac * decoded value codes
//   zs[r]  sum of exp(score - m[r]) * vzero (Uniform values: the zero point, added at the end)
// The final output of a row is (acc[r] + zs[r]) / l[r], in the value domain (rotated for Mse
// values); partial states of disjoint key ranges merge by log-sum-exp (merge_states).
#pragma once
#include <cstddef>
#include <cstdint>

#include "tqkv/format.h"
#include "tqkv/simd.h"

namespace tqkv::cpu {

// Everything a kernel needs to know about the format, resolved once per call.
struct KernelFormat {
  int dim;
  KeyCodec key;
  int key_bits;
  ValueCodec value;
  int value_bits;
  // Mse codebook levels as floats (key / value), up to 256 entries; kernels with a table
  // lookup in registers use the first 16 (bits <= 4).
  const float* key_levels;
  const float* value_levels;
  // Register tables: entry j = level (j mod 2^bits), so that a table lookup that only looks at
  // the low 3 or 4 bits of a lane needs no masking of the bits above the code. Uniform values
  // of <= 4 bits: entry j = (j mod 2^bits) - (2^bits - 1)/2, the centred code.
  float key_lut[16];
  float value_lut[16];
  // Int8 key scores (tqkv/simd.h KeyScores): on for 2-8-bit Mse keys unless exact scoring is
  // asked for; a kernel without the int8 path for these bits and head dim scores exactly.
  // Every kernel that has it computes the same integers (kernel_impl.h, "Int8 scores"):
  //   L8[j] = round(level[j] / key_i8_step), key_i8_step = max_j |level[j]| / kI8LevelMax,
  //   key_u8[j] = L8[j mod 2^bits] + kI8Offset (64 entries, 1..127: an unsigned operand).
  bool int8_keys;
  float key_i8_step;
  uint8_t key_u8[256];
  // 6-8-bit keys (kI8WideBits .. kI8MaxKeyBits): levels as 12-bit integers in two bytes,
  // L16[j] = round(level[j] / key_i8_step) = 64 H + Lo (key_i8_step = max_j |level[j]| / (64
  // kI8LevelMax), H in [-63, 63], Lo in [0, 63]): key_u8 holds H + kI8Offset, key_lo holds Lo
  // (256 entries, replicated every 2^bits), and a key's score is 64 X + Y (X, Y the int8 dot
  // products with the two bytes), its offset 64 kI8Offset sum q8.
  bool key_wide;
  uint8_t key_lo[256];
  // Int8 value sums (KeyScores::Int8; kernel_impl.h "Int8 values"): on for 2-6-bit Mse and
  // 2-4-bit Uniform values; a kernel without the path for these bits and head dim sums in fp32.
  //   value_i8[j] = round(level[j mod 2^bits] / value_i8_step), |.| <= kI8LevelMax (Mse:
  //   value_i8_step = max_j |level[j]| / kI8LevelMax; Uniform: 2 (j mod 2^bits) - (2^bits - 1),
  //   value_i8_step = 1/2, so that value_i8_step * value_i8[code] = code - mid exactly).
  // 6-bit Mse values (kI8WideBits) take two-byte levels, as 6-bit keys do: L16[j] =
  // round(level[j] / value_i8_step) = 64 H + Lo, value_i8_step = max_j |level[j]| / (64
  // kI8LevelMax), value_i8 holding H (in [-63, 63]) and value_lo Lo (in [0, 63]); a channel's
  // sum is 64 sum(u8 H) + sum(u8 Lo), exact in int32 (below 64 * 255 * 4032 < 2^26 a tile).
  bool int8_values;
  bool value_wide;
  float value_i8_step;
  int8_t value_i8[64];
  int8_t value_lo[64];
  size_t key_code_bytes;    // bytes of one token's key codes / elements (prefetch size)
  size_t value_code_bytes;
};

// Int8 values: per tile and query row, the weights w (softmax numerators times the value's
// scale) become u8 = round(w * 255 / max w) <= kI8WeightMax, so that a pair of products u8 * L8
// fits in int16 (2 * 255 * 63 = 32130: vpmaddubsw) and a tile's sum (kTile * 255 * 63 < 2^24)
// is exact in float.
inline constexpr int kI8WeightMax = 255;

// Int8 values: the tile weights' exp(x) (x <= 0: a score minus the running max) is the cheaper
// exp_w of every build, the same float operations in each: 0 for x < -87 (and NaN for NaN);
// else t = x * log2(e), n = nearest-even(t), f = t - n, 2^n * p(f), p a degree-4 fit of 2^f on
// [-1/2, 1/2] with p(0) = 1 (relative error 2.8e-6, against the 1/510 of the u8 rounding that
// follows; exp_w(0) = 1 exactly, as for the tile's top key), evaluated by fused multiply-adds
// from the top coefficient down. 9 vector instructions on AVX-512 instead of the 16 of the
// 2e-7 exp that the exact paths keep.
inline constexpr float kExpWLog2e = 1.44269504088896341f;
inline constexpr float kExpWPoly[5] = {1.0f, 0.6931241750717163f, 0.24024099111557007f, 0.05590646713972092f,
                                      0.009582855738699436f};

// The widest Mse codes that take the int8 paths with one-byte levels (values; keys up to here,
// 6-bit keys in two bytes below). Past 5 bits the 7-bit level grid (step max|level| / 63) is
// about as coarse as the codebook itself near zero: 6-bit codes in it (SmolLM2-135M tq-4.375,
// whose recent window is 6-bit, and one k6v5 layer) moved the mean KL from 0.0129 to 0.0142,
// where 5-bit codes in int8 left it at 0.0128 (docs/journal/RESULTS-journal.md).
inline constexpr int kI8MaxBits = 5;
// 6-bit keys and values take the int8 paths with their levels in two bytes
// (KernelFormat::key_wide, value_wide): the same query or weight rounding, a level grid 64
// times finer, two products instead of one.
inline constexpr int kI8WideBits = 6;
// Keys of up to this many bits take the two-byte levels too (values stop at kI8WideBits): the
// 12-bit grid (step max|level| / 4032) is ~20 times finer than an 8-bit codebook's closest
// levels, and 7-8-bit keys scored in fp32 were the last pairs slower than f16 on AVX-512
// (Qwen2.5-0.5B's recipes keep layer 0 at k8; docs/journal/RESULTS-journal.md).
inline constexpr int kI8MaxKeyBits = 8;

// Int8 scores: |q8| <= 127 (per query row, step max|q| / 127) and |L8| <= 63, so that the
// unsigned level u8 = L8 + 64 <= 127 and a pair of products u8 * q8 fits in int16 (vpmaddubsw
// saturates above 32767: 2 * 127 * 127 = 32258), and every partial sum of <= 512 channels is an
// integer below 2^24, exact in float.
inline constexpr int kI8QueryMax = 127, kI8LevelMax = 63, kI8Offset = 64;

struct SlotRun {
  int64_t pos0;  // absolute position of the first slot
  int n;         // slots in the run
  const uint8_t* kc; size_t kc_stride;    // key codes / elements
  const uint8_t* km; size_t km_stride;    // key meta (fp16 norm) or null
  const uint8_t* vc; size_t vc_stride;    // value codes / elements
  const uint8_t* vm0; size_t vm0_stride;  // value meta 0 (fp16 scale or norm) or null
  const uint8_t* vm1; size_t vm1_stride;  // value meta 1 (fp16 zero) or null
};

// The value rows of a tile's keys [off, off + n): key off + j at base + j * stride (a tile
// spans up to a few runs).
struct ValueRun {
  const uint8_t* base;
  size_t stride;
  int n, off;
};

// Query rows: q[r] is already in the key domain (rotated for Mse keys) and multiplied by the
// softmax scale. Row r sees keys at positions [begin[r], end[r]] (inclusive).
struct RowBlock {
  const float* q;  // [rows, dim]
  int rows;
  const int64_t* begin;
  const int64_t* end;
};

struct RowState {
  float* m;    // [rows]
  float* l;    // [rows]
  float* acc;  // [rows, dim]
  float* zs;   // [rows]
};

// Keys per tile (a multiple of every vector width): 64 measured 7-9 % faster than 32 (the
// per-tile softmax bookkeeping halves) and faster than 128 on Zen 4.
inline constexpr int kTile = 64;

// Scratch floats a kernel needs for `rows` rows of `dim` channels (tile state, then the query
// rows in a split decode's channel order, one row of workspace, the int8 query rows with
// their scales and offsets, and the int8 value weights [rows, kTile] bytes with their scales).
constexpr size_t kernel_scratch_floats(int dim, int rows) {
  return 3 * kTile + static_cast<size_t>(rows) * (kTile + 2) + static_cast<size_t>(rows + 1) * dim +
         static_cast<size_t>(rows) * (2 + (dim + 3) / 4) + 64 + static_cast<size_t>(rows) * (1 + kTile / 4);
}

// Consumes runs[0 .. n_runs) in order (the next run's first tile is prefetched while the last
// tile of the current one is processed).
using RunKernel = void (*)(const KernelFormat& f, const SlotRun* runs, int n_runs, const RowBlock& rows,
                           const RowState& st, float* scratch);

void run_scalar(const KernelFormat&, const SlotRun*, int, const RowBlock&, const RowState&, float*);
#if defined(__x86_64__)
void run_avx2(const KernelFormat&, const SlotRun*, int, const RowBlock&, const RowState&, float*);
void run_avx512(const KernelFormat&, const SlotRun*, int, const RowBlock&, const RowState&, float*);
// The same AVX-512 kernel built with VNNI + VBMI as well: int8 key scores (vpermb, vpdpbusd).
void run_avx512_vnni(const KernelFormat&, const SlotRun*, int, const RowBlock&, const RowState&, float*);
#endif

// Whether a SIMD build with `width` floats per vector handles this format (dim a multiple of
// the width; Mse codes of 2-8 bits, Uniform codes of 2-4 bits); otherwise the scalar kernel runs.
bool simd_handles(const KernelFormat& f, int width);

// The kernel for a level (falling back to a lower one where the format needs it) and the
// level actually used.
RunKernel pick_kernel(const KernelFormat& f, SimdLevel level, SimdLevel* used = nullptr);

}  // namespace tqkv::cpu
