// The attention kernel body, written once over an ISA traits class `I` (internal header).
//
// Included by exactly one source file per ISA (kernel-scalar.cpp, kernel-avx2.cpp,
// kernel-avx512.cpp), each compiled with its own flags. Everything here lives in an anonymous
// namespace so that no inline function compiled with AVX-512 flags can be picked by the linker
// for code that runs on a CPU without it; for the same reason it calls no inline function from
// other headers (it has its own fp16 conversion) and no std::min/max.
//
// Per tile of kTile keys and a block of <= 8 query rows held in registers:
//   1. scores: each key's codes are decoded W at a time straight from the slot and multiplied
//      into all rows (GQA: one decode serves every query head of the kv head);
//   2. online softmax per row (running max, rescale of the accumulator only when it moves);
//   3. values: decoded W at a time and accumulated into all rows.
// Nothing is written back but the running state: there is no dequantized tile in memory.
//
// Traits interface (W floats per vector V):
//   zero(), set1(x), load(const float*), store(float*, V), add, mul, sub, fmadd(a, b, c) = a*b + c,
//   reduce(V) -> float, reduce4(a, b, c, d, float* out4), exp(V) (0 below about -87),
//   exp_scalar(x), exp_w(V) (the int8 value weights' cheaper exp, kernel.h kExpWPoly: the same
//   float operations in every build), prefetch(p) / prefetch_l1(p) (into L2 / L1), half(p) (one fp16 -> float),
//   halfs(p) (W dense fp16),
//   f32(p, i) / f16(p, i) / bf16(p, i) / fp8(p, i): elements i .. i+W-1 of a row of that type
//     (fp8 returns value / kFp8Factor),
//   codes<B>(p, i): codes i .. i+W-1 of a packed B-bit row as floats,
//   lut<B>(p, i, table): table[code]; for B <= 4 SIMD builds get the replicated 16-entry table
//     (see KernelFormat) and may ignore bits above the code, for B = 5..8 the full level table.
//   kAnyBits: the build handles every bit width 1..8 (scalar); SIMD builds take table-decoded
//     (Mse) codes of 2..8 bits and Uniform codes of 2..4 bits.
//   split_codes(B): k > 1 if the build has a split decode of B-bit codes (else 1):
//   lut_split<B>(p, i, table, out[k]): one block of W*k codes starting at code i, k codes per
//     32-bit lane (the whole bytes they fill), looked up in the replicated 16-entry table:
//     out[m] lane l = table[code i + l*k + m]. One widening load and one shift per vector
//     replace the per-vector unpacking; the channels come out in a permuted order (below).
//   kAccRegs: accumulator registers the value loop may keep (rows x vectors of a block).
//   kHasI8: the build has int8 key scores (below), with
//     IV, IT: integer vector, level table register; i8_block(B): channels per vector of B-bit
//     codes (0: no int8 path for B); i8_table(key_u8): the table; izero(); i2f(IV) (exact:
//     the lanes stay below 2^24); dot_u8i8(acc, u8, q8 pointer): acc += sums of 4 adjacent
//     u8 * s8 products per 32-bit lane (vpdpbusd); levels_u8<B>(p, i, table): the u8 levels
//     of the codes of the block starting at stored channel i, in the order of i8_channel()
//     (builds without a whole-tile scorer; those with one, kI8Tiles, give scores_i8_tile).
//
// Int8 scores. For 2-8-bit Mse keys (f.int8_keys) and a build with the int8 path for them, a
// key's score is sum_c q8[c] * L8[code c], computed as sum_c q8[c] * (L8 + 64) - 64 * sum_c q8[c]
// in int32, then (float) times s_q * s_k (the row's and the codebook's steps) and the norm
// (6-8-bit keys: L16 in two bytes, 64 X + Y; kernel.h key_wide). The integers are the same in
// every build, and so are the float scores.
//
// Int8 values. For 2-6-bit Mse or 2-4-bit Uniform values (f.int8_values) and a build with the path
// (kI8Values: i8v_block(B) channels per block, i8v_table, i8v_channel, store_u8, and either
// values_i8_tile (scalar) or levels_i8v, dot_u8v, set1_u32 (SIMD: Kernel::values_i8_tile)),
// each tile's weights w[r][j] (exp_w(score - m) times the value's scale) are rounded per row to
// u8[j] = round(w[j] * (kI8WeightMax / max_j w[j])) (store_u8: nearest-even, clamped), and
//   acc[r][c] = acc[r][c] * alpha[r] + (float)(sum_j u8[j] * value_i8[code j c]) * scale[r],
//   scale[r] = max_j w[j] / kI8WeightMax * value_i8_step,
// the integer sums being the same in every build. A tile with a non-finite or negative value
// scale (corrupt data) gives the rows that see it scale NaN: their output is NaN. The
// accumulators are held in the build's int8 value order (i8v_channel) during a call.
//
// Split order. With a split decode, a block of W*k channels is held as k vectors, vector m
// holding channels m, k + m, 2k + m, ...: the kernel works in that "stored" order throughout.
// The query rows are permuted into it once per call (scores are sums over channels, so their
// value is unchanged) and the value accumulators are permuted into it on entry and back on exit.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernel.h"

namespace tqkv::cpu {
namespace {

inline float kf_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else {
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline int kf_min(int a, int b) { return a < b ? a : b; }

// p(f) of exp_w (kernel.h kExpWPoly) by fused multiply-adds from the top coefficient down: the
// same float operations in every build.
template <class I, class V>
[[gnu::always_inline]] inline V exp_w_poly(V f) {
  V y = I::fmadd(I::set1(kExpWPoly[4]), f, I::set1(kExpWPoly[3]));
  y = I::fmadd(y, f, I::set1(kExpWPoly[2]));
  y = I::fmadd(y, f, I::set1(kExpWPoly[1]));
  return I::fmadd(y, f, I::set1(kExpWPoly[0]));
}

// Whether the traits have a whole-tile int8 scorer (scores_i8_tile, i8_broadcast_rows).
template <class I>
constexpr bool has_i8_tiles() {
  if constexpr (requires { I::kI8Tiles; })
    return I::kI8Tiles;
  else
    return false;
}

// Whether the traits have int8 value sums (values_i8_tile, i8v_table, i8v_channel, store_u8).
template <class I>
constexpr bool has_i8_values() {
  if constexpr (requires { I::kI8Values; })
    return I::kI8Values;
  else
    return false;
}

// Rows per pass of the int8 value sums (the traits' kI8vRows, else 4).
template <class I>
constexpr int i8v_rows() {
  if constexpr (requires { I::kI8vRows; })
    return I::kI8vRows;
  else
    return 4;
}

// Query rows rounded to int8 in a build's int8 channel order, with their score factors.
struct I8Rows {
  const int8_t* q;     // [rows, dim] (a tile scorer's broadcast layout where the build has one)
  const float* scale;  // [rows] s_q * s_k
  const float* corr;   // [rows] kI8Offset * sum_c q8[c]
};

template <class I>
struct Kernel {
  using V = typename I::V;
  static constexpr int W = I::W;
  static constexpr float kNegInf = -__builtin_inff();
  // Runs per tile at most: a tile takes whole runs (pages) while they fit, so that pages of
  // 16-64 slots still fill tiles of kTile keys and the per-tile softmax bookkeeping is paid per
  // kTile keys, not per page.
  static constexpr int kMaxSegs = 8;
  // Keys [j, j + n) of run, at key off of the tile.
  struct TileSeg {
    const SlotRun* run;
    int j, n, off;
  };

  // Calls fn(decoder) with the decoder of the key codec: V decoder(const uint8_t* row, int i).
  template <class Fn>
  static void with_key_decoder(const KernelFormat& f, Fn&& fn) {
    switch (f.key) {
      case KeyCodec::F32: return fn(one([](const uint8_t* p, int i) { return I::f32(p, i); }));
      case KeyCodec::F16: return fn(one([](const uint8_t* p, int i) { return I::f16(p, i); }));
      case KeyCodec::BF16: return fn(one([](const uint8_t* p, int i) { return I::bf16(p, i); }));
      case KeyCodec::Fp8: return fn(one([](const uint8_t* p, int i) { return I::fp8(p, i); }));
      case KeyCodec::Mse: return with_table_decoder(f.key_bits, f.dim, f.key_lut, f.key_levels, fn);
    }
  }

  template <class Fn>
  static void with_value_decoder(const KernelFormat& f, Fn&& fn) {
    switch (f.value) {
      case ValueCodec::F32: return fn(one([](const uint8_t* p, int i) { return I::f32(p, i); }));
      case ValueCodec::F16: return fn(one([](const uint8_t* p, int i) { return I::f16(p, i); }));
      case ValueCodec::BF16: return fn(one([](const uint8_t* p, int i) { return I::bf16(p, i); }));
      case ValueCodec::Fp8: return fn(one([](const uint8_t* p, int i) { return I::fp8(p, i); }));
      case ValueCodec::Mse: return with_table_decoder(f.value_bits, f.dim, f.value_lut, f.value_levels, fn);
      case ValueCodec::Uniform:
        // Codes are centred (code - mid), the zero point moved to mid (see decode_value_meta);
        // a split decode looks code - mid up in value_lut (exact small integers).
        switch (f.value_bits) {
          case 2: return with_centred<2>(f, fn);
          case 3: return with_centred<3>(f, fn);
          case 4: return with_centred<4>(f, fn);
          default:
            if constexpr (I::kAnyBits) {
              switch (f.value_bits) {
                case 1: return fn(one(centred<1>()));
                case 5: return fn(one(centred<5>()));
                case 6: return fn(one(centred<6>()));
                case 7: return fn(one(centred<7>()));
                default: return fn(one(centred<8>()));
              }
            }
            return;
        }
    }
  }

  template <int B>
  static auto centred() {
    return [](const uint8_t* p, int i) {
      return I::sub(I::template codes<B>(p, i), I::set1(0.5f * static_cast<float>((1 << B) - 1)));
    };
  }

  template <int B, class Fn>
  static void with_centred(const KernelFormat& f, Fn&& fn) {
    if constexpr (I::split_codes(B) > 1) {
      if (split_of(B, f.dim) > 1) return fn(split<B>(f.value_lut));
    }
    fn(one(centred<B>()));
  }

  // A decoder: fn(row, i, out[kVecs]) writes the vectors of stored channels i .. i + W*kVecs - 1.
  template <int K, class F>
  struct Decoder {
    F fn;
    static constexpr int kVecs = K;
  };
  template <class F>
  static auto one(F fn) {
    const auto g = [fn](const uint8_t* p, int i, V* out) { out[0] = fn(p, i); };
    return Decoder<1, decltype(g)>{g};
  }
  template <int B>
  static auto split(const float* table16) {
    const auto g = [table16](const uint8_t* p, int i, V* out) { I::template lut_split<B>(p, i, table16, out); };
    return Decoder<I::split_codes(B), decltype(g)>{g};
  }

  // Codes per lane of the split decode of B-bit rows of d channels (1: no split).
  static int split_of(int bits, int d) {
    const int k = I::split_codes(bits);
    return k > 1 && d % (W * k) == 0 ? k : 1;
  }
  static int key_split(const KernelFormat& f) { return f.key == KeyCodec::Mse ? split_of(f.key_bits, f.dim) : 1; }
  static int value_split(const KernelFormat& f) {
    return f.value == ValueCodec::Mse || f.value == ValueCodec::Uniform ? split_of(f.value_bits, f.dim) : 1;
  }
  // x[d] into the split order of k codes per lane (or back, `back`), through tmp[d]: channel
  // b + l*k + m of a block starting at b is stored at b + m*W + l.
  static void permute(float* x, int d, int k, float* tmp, bool back) {
    for (int b = 0; b < d; b += W * k)
      for (int m = 0; m < k; ++m)
        for (int l = 0; l < W; ++l) {
          const int c = b + l * k + m, at = b + m * W + l;
          if (back)
            tmp[c] = x[at];
          else
            tmp[at] = x[c];
        }
    std::memcpy(x, tmp, sizeof(float) * static_cast<size_t>(d));
  }

  template <class Fn>
  static void with_table_decoder(int bits, int d, const float* lut16, const float* levels, Fn&& fn) {
    auto dec = [](auto b, const float* table) {
      return one([table](const uint8_t* p, int i) { return I::template lut<decltype(b)::value>(p, i, table); });
    };
    const float* narrow = I::kAnyBits ? levels : lut16;
    const auto narrow_dec = [&](auto b) {
      constexpr int B = decltype(b)::value;
      if constexpr (I::split_codes(B) > 1) {
        if (split_of(B, d) > 1) return fn(split<B>(lut16));
      }
      fn(dec(b, narrow));
    };
    switch (bits) {
      case 2: return narrow_dec(std::integral_constant<int, 2>{});
      case 3: return narrow_dec(std::integral_constant<int, 3>{});
      case 4: return narrow_dec(std::integral_constant<int, 4>{});
      case 5: return fn(dec(std::integral_constant<int, 5>{}, levels));
      case 6: return fn(dec(std::integral_constant<int, 6>{}, levels));
      case 7: return fn(dec(std::integral_constant<int, 7>{}, levels));
      case 8: return fn(dec(std::integral_constant<int, 8>{}, levels));
      default:
        if constexpr (I::kAnyBits) return fn(dec(std::integral_constant<int, 1>{}, levels));
        return;
    }
  }

  // Channels per block of the int8 value sums, or 0 where the build sums values in fp32.
  static int i8v_block(const KernelFormat& f) {
    if constexpr (has_i8_values<I>()) {
      if (!f.int8_values) return 0;
      const int c = I::i8v_block(f.value_bits);
      return c > 0 && f.dim % c == 0 ? c : 0;
    }
    return 0;
  }
  // The int8 value weights [R, kTile] bytes and their scales [R], after the rest of the scratch.
  static float* i8v_scales(float* scratch, int R, int d) {
    return scratch + 3 * kTile + static_cast<size_t>(R) * (kTile + 2) + static_cast<size_t>(R + 1) * d +
           static_cast<size_t>(R) * (2 + (d + 3) / 4) + 64;
  }
  // x[d] into the int8 value order of blocks of C channels (or back): position t of a block
  // holds channel i8v_channel(bits, t).
  static void permute_i8v(float* x, int d, int C, int bits, float* tmp, bool back) {
    if constexpr (has_i8_values<I>()) {
      int chan[64];
      for (int t = 0; t < C; ++t) chan[t] = I::i8v_channel(bits, t);
      for (int b = 0; b < d; b += C)
        for (int t = 0; t < C; ++t) {
          const int c = b + chan[t], at = b + t;
          if (back)
            tmp[c] = x[at];
          else
            tmp[at] = x[c];
        }
      std::memcpy(x, tmp, sizeof(float) * static_cast<size_t>(d));
    }
  }

  // Rounds row r's tile weights w[kTile] (in memory, or in kTile / W registers) to u8 and sets
  // its scale (see "Int8 values").
  template <class Load>
  [[gnu::always_inline]] static void quantize_weights_from(const KernelFormat& f, const Load& w, float mx, bool bad,
                                                           uint8_t* o, float* scale) {
    if constexpr (has_i8_values<I>()) {
      if (bad || !(mx > 0.0f)) {
        std::memset(o, 0, kTile);
        *scale = bad ? __builtin_nanf("") : 0.0f;
        return;
      }
      const V inv = I::set1(static_cast<float>(kI8WeightMax) / mx);
      for (int v = 0; v < kTile / W; ++v) I::store_u8(o + v * W, I::mul(w(v), inv));
      *scale = mx / static_cast<float>(kI8WeightMax) * f.value_i8_step;
    }
  }
  static void quantize_weights(const KernelFormat& f, const float* w, float mx, bool bad, uint8_t* o, float* scale) {
    quantize_weights_from(f, [w](int v) { return I::load(w + v * W); }, mx, bad, o, scale);
  }

  // Quad j of run v (keys j .. j + 3; keys past v.n, the next run's in a tile of several, get
  // weight 0 and the codes of key v.n - 1): their code rows into p, and the mask of the real
  // keys' weight bytes (returned).
  [[gnu::always_inline]] static uint32_t quad_keys(const ValueRun& v, int j, const uint8_t** p) {
    const int n = v.n - j < 4 ? v.n - j : 4;
    for (int k = 0; k < 4; ++k) p[k] = v.base + static_cast<size_t>(j + (k < n ? k : n - 1)) * v.stride;
    return n == 4 ? ~0u : (1u << (8 * n)) - 1u;
  }
  // The quad's level vectors of channels [i, i + 4W) (lo: the low bytes of two-byte levels).
  template <int B, class IV, class IT>
  [[gnu::always_inline]] static void quad_levels(const uint8_t* const* p, int i, const IT& table, IV* t, IV* lo) {
    if constexpr (B == kI8WideBits)
      I::template levels_i8v_wide<B>(p, i, table, t, lo);
    else
      I::template levels_i8v<B>(p, i, table, t);
  }
  // a[q] += the four u8 weights of wb times the quad's levels, per lane.
  template <int B, class IV>
  [[gnu::always_inline]] static void quad_dot(IV* a, IV wb, const IV* t, const IV* lo) {
    for (int q = 0; q < 4; ++q)
      if constexpr (B == kI8WideBits)
        a[q] = I::dot_u8v(I::dot_u8v64(a[q], wb, t[q]), wb, lo[q]);
      else
        a[q] = I::dot_u8v(a[q], wb, t[q]);
  }
  // Row r's accumulators of channels [i, i + 4W) <- alpha * them + scale * the integer sums a.
  template <class IV>
  [[gnu::always_inline]] static void rescale_add(float* x, const IV* a, float scale, float alpha) {
    const V sc = I::set1(scale), al = I::set1(alpha);
    for (int q = 0; q < 4; ++q) I::store(x + W * q, I::fmadd(I::i2f(a[q]), sc, I::mul(I::load(x + W * q), al)));
  }

  // The SIMD builds' int8 value sums of one tile for NR rows, blocks of 4 vectors (4W channels,
  // i8v_block): levels_i8v<B>(p[4], i, table, t[4]) gives four keys' levels with a 32-bit lane
  // per channel and a byte per key, dot_u8v(acc, w, t) adds the four u8 weights (one dword,
  // set1_u32) times them per lane. 6-bit values: levels_i8v_wide gives the high and the low
  // bytes, and dot_u8v64 adds 64 times the high bytes' products.
  template <int NR, int B, class IT>
  [[gnu::noinline]] static void values_i8_tile(float* acc, int d, const ValueRun* vr, int nv, const uint8_t* w8,
                                               const float* alpha, const float* scale, IT table) {
    if constexpr (has_i8_values<I>() && W > 1) {
      using IV = typename I::IV;
      for (int i = 0; i < d; i += 4 * W) {
        IV a[NR][4];
        for (int r = 0; r < NR; ++r)
          for (int q = 0; q < 4; ++q) a[r][q] = I::izero();
        for (int g = 0; g < nv; ++g) {
          const uint8_t* wg = w8 + vr[g].off;
          for (int j = 0; j < vr[g].n; j += 4) {
            const uint8_t* p[4];
            const uint32_t wmask = quad_keys(vr[g], j, p);
            IV t[4], lo[4];
            quad_levels<B>(p, i, table, t, lo);
            for (int r = 0; r < NR; ++r) {
              uint32_t w4;
              std::memcpy(&w4, wg + r * kTile + j, 4);
              quad_dot<B>(a[r], I::set1_u32(w4 & wmask), t, lo);
            }
          }
        }
        for (int r = 0; r < NR; ++r) rescale_add(acc + static_cast<size_t>(r) * d + i, a[r], scale[r], alpha[r]);
      }
    }
  }

  // Rows per pass of the int8 value sums: up to kRows; three (AVX2) spill the third row's
  // accumulators but decode each key's levels once for three rows: faster where it saves a pass
  // (3 rows: one pass, not 2 + 1), slower than 2 + 2 for 4 (d = 128: +3-9%). So 3 where what is
  // left is a multiple of 3 or odd (then 2s), else 2. (6-bit values, twice the level vectors:
  // the same rule; at GQA 3 one pass of 3 beat 2 + 1 by 20%, and 2 + 1 beat 1 + 1 + 1 by 15%.)
  static int i8v_pass_rows(int left) {
    constexpr int kRows = i8v_rows<I>();
    int n = kf_min(kRows, left);
    if (kRows == 3 && n == 3 && left % 3 != 0 && left % 2 == 0) n = 2;
    return n;
  }

  // The SIMD builds' int8 value sums of one tile for all R rows when they take more than one
  // pass (GQA 4 and up): each block of 4W channels has its keys' level vectors decoded once into
  // a buffer in L1, then every pass of rows reads them there, instead of each pass decoding them
  // again. The same integers and float operations per row as values_i8_tile.
  template <int B, class IT>
  static void values_i8_shared(int R, float* acc, int d, const ValueRun* vr, int nv, const uint8_t* w8,
                               const float* alpha, const float* scale, IT table) {
    if constexpr (has_i8_values<I>() && W > 1) {
      using IV = typename I::IV;
      constexpr bool kWide = B == kI8WideBits;
      constexpr int kQuads = kTile / 4 + kMaxSegs;  // a tile's keys in fours, each run's last padded
      alignas(64) IV hi[kQuads][4];
      alignas(64) IV lo[kWide ? kQuads : 1][4];
      int at[kQuads];          // the quad's first key in the tile (its weights' offset)
      uint32_t mask[kQuads];   // its real keys' weight bytes
      for (int i = 0; i < d; i += 4 * W) {
        int nq = 0;
        for (int g = 0; g < nv; ++g)
          for (int j = 0; j < vr[g].n; j += 4, ++nq) {
            const uint8_t* p[4];
            mask[nq] = quad_keys(vr[g], j, p);
            at[nq] = vr[g].off + j;
            quad_levels<B>(p, i, table, hi[nq], lo[kWide ? nq : 0]);
          }
        for (int r0 = 0, n = 0; r0 < R; r0 += n) {
          n = i8v_pass_rows(R - r0);
          with_rows<i8v_rows<I>()>(n, [&](auto nr) {
            constexpr int N = decltype(nr)::value;
            IV a[N][4];
            for (int r = 0; r < N; ++r)
              for (int q = 0; q < 4; ++q) a[r][q] = I::izero();
            for (int k = 0; k < nq; ++k)
              for (int r = 0; r < N; ++r) {
                uint32_t w4;
                std::memcpy(&w4, w8 + (r0 + r) * kTile + at[k], 4);
                quad_dot<B>(a[r], I::set1_u32(w4 & mask[k]), hi[k], lo[kWide ? k : 0]);
              }
            for (int r = 0; r < N; ++r)
              rescale_add(acc + static_cast<size_t>(r0 + r) * d + i, a[r], scale[r0 + r], alpha[r0 + r]);
          });
        }
      }
    }
  }

  // The int8 value table(s) of B-bit codes as the traits hold them (two for 6-bit values).
  template <int B>
  static auto value_table(const KernelFormat& f) {
    if constexpr (B == kI8WideBits)
      return I::i8v_table_wide(f.value_i8, f.value_lo);
    else
      return I::i8v_table(f.value_i8);
  }

  // go(integral_constant<int, B>) for the int8 value widths (2-6 bits; 4 for any other).
  template <class Go>
  static void with_value_bits(int bits, const Go& go) {
    switch (bits) {
      case 2: return go(std::integral_constant<int, 2>{});
      case 3: return go(std::integral_constant<int, 3>{});
      case 5: return go(std::integral_constant<int, 5>{});
      case 6: return go(std::integral_constant<int, 6>{});
      default: return go(std::integral_constant<int, 4>{});
    }
  }

  static void values_i8_rows(const KernelFormat& f, int R, float* acc, const ValueRun* vr, int nv, const uint8_t* w8,
                             const float* alpha, const float* scale) {
    if constexpr (has_i8_values<I>()) {
      const int d = f.dim;
      constexpr int kRows = i8v_rows<I>();
      if (W > 1 && i8v_pass_rows(R) < R) {  // several passes: levels decoded once
        const auto go = [&](auto b) {
          constexpr int B = decltype(b)::value;
          if constexpr (I::i8v_block(B) > 0)
            values_i8_shared<B>(R, acc, d, vr, nv, w8, alpha, scale, value_table<B>(f));
        };
        return with_value_bits(f.value_bits, go);
      }
      for (int r0 = 0, n = 0; r0 < R; r0 += n) {
        n = i8v_pass_rows(R - r0);
        with_rows<kRows>(n, [&](auto nr) {
          constexpr int N = decltype(nr)::value;
          const auto go = [&](auto b) {
            constexpr int B = decltype(b)::value;
            if constexpr (I::i8v_block(B) == 0)
              return;  // no int8 value path for B bits in this build (i8v_block(f) was 0)
            else if constexpr (W == 1)
              I::template values_i8_tile<N, B>(acc + static_cast<size_t>(r0) * d, d, vr, nv, w8 + r0 * kTile,
                                               alpha + r0, scale + r0, value_table<B>(f));
            else
              values_i8_tile<N, B>(acc + static_cast<size_t>(r0) * d, d, vr, nv, w8 + r0 * kTile, alpha + r0,
                                   scale + r0, value_table<B>(f));
          };
          with_value_bits(f.value_bits, go);
        });
      }
    }
  }

  // Channels per int8 vector of the key codes, or 0 where the build scores keys in fp32.
  static int i8_block(const KernelFormat& f) {
    if constexpr (I::kHasI8) {
      if (!f.int8_keys) return 0;
      const int c = I::i8_block(f.key_bits);
      return c > 0 && f.dim % c == 0 ? c : 0;
    }
    return 0;
  }
  // The channel at stored position t of an int8 block of C channels: the code bytes (nb of
  // them) are read once per code in the byte (k = 8/B), code m of every byte forming the m-th
  // run of nb positions. 3- and 5-8-bit codes are unpacked in channel order.
  static int i8_channel(int bits, int C, int t) {
    if (bits == 3 || bits >= 5 || C == 1) return t;
    const int nb = C * bits / 8, k = 8 / bits;
    return k * (t % nb) + t / nb;
  }
  // Rounds the rows to int8 (the same integers in every build).
  static void quantize_rows(const KernelFormat& f, const RowBlock& rb, int C, int8_t* q8, float* scale, float* corr) {
    const int d = f.dim;
    // The channel of each position of a block, once per call (two integer divisions each: at
    // d 128 and 4 rows they were most of the call's fixed cost).
    int chan[64];
    for (int t = 0; t < C; ++t) chan[t] = i8_channel(f.key_bits, C, t);
    for (int r = 0; r < rb.rows; ++r) {
      const float* q = rb.q + static_cast<size_t>(r) * d;
      float amax = 0.0f;
      bool finite = true;
      for (int c = 0; c < d; ++c) {
        const float a = __builtin_fabsf(q[c]);
        finite = finite && a <= 3.4028234e38f;
        amax = a > amax ? a : amax;
      }
      // A row with NaN or Inf scores NaN, as the fp32 path does (and rounds nothing undefined).
      const float step = finite ? amax / static_cast<float>(kI8QueryMax) : 0.0f;
      int8_t* o = q8 + static_cast<size_t>(r) * d;
      int sum = 0;
      for (int b = 0; b < d; b += C)
        for (int t = 0; t < C; ++t) {
          int v = 0;
          if (step > 0.0f) {
            const float x = __builtin_rintf(q[b + chan[t]] / step);
            v = static_cast<int>(x > kI8QueryMax ? kI8QueryMax : x < -kI8QueryMax ? -kI8QueryMax : x);
          }
          o[b + t] = static_cast<int8_t>(v);
          sum += v;
        }
      scale[r] = finite ? step * f.key_i8_step : __builtin_nanf("");
      corr[r] = static_cast<float>((f.key_wide ? 64 : 1) * kI8Offset * sum);
    }
  }

  // s[r * kTile + j] = the integer score of key j and row r (as float; see "Int8 scores").
  template <int NR, int B, class Pf>
  static void scores_i8(const int8_t* q, int d, const uint8_t* base, size_t stride, int nt, float* s,
                        const uint8_t* table, const Pf& pf) {
    if constexpr (I::kHasI8) {
      constexpr int C = I::i8_block(B);
      const typename I::IT tab = I::i8_table(table);
      for (int j = 0; j < nt; ++j) {
        pf(j, 1);
        const uint8_t* p = base + static_cast<size_t>(j) * stride;
        typename I::IV a[NR];
        for (int r = 0; r < NR; ++r) a[r] = I::izero();
        for (int i = 0; i < d; i += C) {
          const typename I::IV lv = I::template levels_u8<B>(p, i, tab);
          for (int r = 0; r < NR; ++r) a[r] = I::dot_u8i8(a[r], lv, q + static_cast<size_t>(r) * d + i);
        }
        V fa[NR];
        for (int r = 0; r < NR; ++r) fa[r] = I::i2f(a[r]);
        float out[NR];
        reduce_rows<NR>(fa, out);
        for (int r = 0; r < NR; ++r) s[r * kTile + j] = out[r];
      }
    }
  }

  // 6-8-bit keys with two-byte levels (KernelFormat::key_wide): s = 64 X + Y, X and Y the integer
  // products with the high and the low bytes, summed as one integer per row (|64 X + Y| < 2^31:
  // dot_u8i8_wide) and converted once, so every build gives the same float (round(64 X + Y)).
  // One accumulator a row: up to 8 rows a pass, the levels decoded once for all of them.
  template <int NR, int B, class Pf>
  static void scores_i8_wide(const int8_t* q, int d, const uint8_t* base, size_t stride, int nt, float* s,
                             const uint8_t* hi, const uint8_t* lo, const Pf& pf) {
    if constexpr (requires { I::template levels_wide<B>; }) {
      const auto th = I::i8_table_wide(hi), tl = I::i8_table_wide(lo);
      for (int j = 0; j < nt; ++j) {
        pf(j, 1);
        const uint8_t* p = base + static_cast<size_t>(j) * stride;
        typename I::IV a[NR];
        for (int r = 0; r < NR; ++r) a[r] = I::izero();
        for (int i = 0; i < d; i += I::i8_block(B)) {
          typename I::IV lh, ll;
          I::template levels_wide<B>(p, i, th, tl, lh, ll);
          for (int r = 0; r < NR; ++r) a[r] = I::dot_u8i8_wide(a[r], lh, ll, q + static_cast<size_t>(r) * d + i);
        }
        int32_t x[NR];
        reduce_rows_i<NR>(a, x);
        for (int r = 0; r < NR; ++r) s[r * kTile + j] = static_cast<float>(x[r]);
      }
    }
  }

  template <class Pf>
  static void scores_i8_rows(const KernelFormat& f, int R, const int8_t* q, const uint8_t* base, size_t stride,
                             int nt, float* s, const Pf& prefetch) {
    const auto none = [](int, int) {};
    const int d = f.dim;
    if (f.key_wide) {  // 8 rows a pass, as below
      for (int r0 = 0; r0 < R; r0 += 8)
        with_rows<8>(kf_min(8, R - r0), [&](auto nr) {
          constexpr int N = decltype(nr)::value;
          const auto go = [&](auto b, const auto& pf) {
            constexpr int B = decltype(b)::value;
            if constexpr (I::i8_block(B) == 0)
              return;  // no int8 path for B-bit keys in this build (i8_block(f) was 0)
            else if constexpr (has_i8_tiles<I>())  // four keys a group, both level bytes' tables
              I::template scores_i8_tile_wide<N, B>(q + static_cast<size_t>(r0) * d * 4, d, base, stride, nt,
                                                    s + r0 * kTile, f.key_u8, f.key_lo, pf);
            else
              scores_i8_wide<N, B>(q + static_cast<size_t>(r0) * d, d, base, stride, nt, s + r0 * kTile, f.key_u8,
                                   f.key_lo, pf);
          };
          const auto bits = [&](const auto& pf) {
            switch (f.key_bits) {
              case 7: return go(std::integral_constant<int, 7>{}, pf);
              case 8: return go(std::integral_constant<int, 8>{}, pf);
              default: return go(std::integral_constant<int, kI8WideBits>{}, pf);
            }
          };
          if (r0 == 0)
            bits(prefetch);
          else
            bits(none);
        });
      return;
    }
    for (int r0 = 0; r0 < R; r0 += 8) {
      const int8_t* qr = q + static_cast<size_t>(r0) * d;
      float* sr = s + r0 * kTile;
      with_rows<8>(kf_min(8, R - r0), [&](auto nr) {
        constexpr int N = decltype(nr)::value;
        const auto go = [&](auto b) {
          constexpr int B = decltype(b)::value;
          if constexpr (I::i8_block(B) > 0 && has_i8_tiles<I>()) {
            const int8_t* qb = q + static_cast<size_t>(r0) * d * 4;
            if (r0 == 0)
              I::template scores_i8_tile<N, B>(qb, d, base, stride, nt, sr, I::i8_table(f.key_u8), prefetch);
            else
              I::template scores_i8_tile<N, B>(qb, d, base, stride, nt, sr, I::i8_table(f.key_u8), none);
          } else if constexpr (I::i8_block(B) > 0) {
            if (r0 == 0)
              scores_i8<N, B>(qr, d, base, stride, nt, sr, f.key_u8, prefetch);
            else
              scores_i8<N, B>(qr, d, base, stride, nt, sr, f.key_u8, none);
          }
        };
        switch (f.key_bits) {
          case 2: return go(std::integral_constant<int, 2>{});
          case 3: return go(std::integral_constant<int, 3>{});
          case 5: return go(std::integral_constant<int, 5>{});
          default: return go(std::integral_constant<int, 4>{});
        }
      });
    }
  }

  // reduce_rows for integer lanes (exact in any order): rows in fours, the last padded with zeros.
  template <int NR, class IV>
  [[gnu::always_inline]] static void reduce_rows_i(const IV* a, int32_t* out) {
    int r = 0;
    for (; r + 4 <= NR; r += 4) I::reduce4_i(a[r], a[r + 1], a[r + 2], a[r + 3], out + r);
    if constexpr (NR % 4 != 0) {
      int32_t tmp[4];
      I::reduce4_i(a[r], NR % 4 >= 2 ? a[r + 1] : I::izero(), NR % 4 == 3 ? a[r + 2] : I::izero(), I::izero(), tmp);
      for (int i = 0; i < NR % 4; ++i) out[r + i] = tmp[i];
    }
  }

  template <int NR>
  [[gnu::always_inline]] static void reduce_rows(const V* a, float* out) {
    int r = 0;
    for (; r + 4 <= NR; r += 4) I::reduce4(a[r], a[r + 1], a[r + 2], a[r + 3], out + r);
    // The rows left (1 to 3): one joint reduction padded with zeros, so that every row's sum is
    // reduce4's, whatever its place in the block (I::reduce adds in another order on AVX2, and a
    // row's score then depended on how many rows a prefill chunk gave its block).
    if constexpr (NR % 4 != 0) {
      float tmp[4];
      I::reduce4(a[r], NR % 4 >= 2 ? a[r + 1] : I::zero(), NR % 4 == 3 ? a[r + 2] : I::zero(), I::zero(), tmp);
      for (int i = 0; i < NR % 4; ++i) out[r + i] = tmp[i];
    }
  }

  // s[r * kTile + j] = <q[r], key j> (the per-key factor is applied by the caller). (Two keys
  // per pass, sharing the q loads, measured slower on Zen 4: more live registers, no gain.)
  template <int NR, class Dec, class Pf>
  static void scores(const float* q, int d, const uint8_t* base, size_t stride, int nt, float* s, const Dec& dec,
                     const Pf& pf) {
    for (int j = 0; j < nt; ++j) {
      pf(j, 1);
      const uint8_t* p = base + static_cast<size_t>(j) * stride;
      constexpr int K = Dec::kVecs;
      V a[NR];
      for (int r = 0; r < NR; ++r) a[r] = I::zero();
      for (int i = 0; i < d; i += W * K) {
        V kv[K];
        dec.fn(p, i, kv);
        for (int k = 0; k < K; ++k)
          for (int r = 0; r < NR; ++r)
            a[r] = I::fmadd(I::load(q + static_cast<size_t>(r) * d + i + k * W), kv[k], a[r]);
      }
      float out[NR];
      reduce_rows<NR>(a, out);
      for (int r = 0; r < NR; ++r) s[r * kTile + j] = out[r];
    }
  }

  // acc[r] = acc[r] * alpha[r] + sum_j w[r * kTile + j] * value j.
  template <int NR, class Dec>
  static void accumulate(float* acc, int d, const uint8_t* base, size_t stride, int nt, const float* w,
                         const float* alpha, const Dec& dec) {
    constexpr int K = Dec::kVecs;
    for (int i = 0; i < d; i += W * K) {
      V a[K][NR];
      for (int k = 0; k < K; ++k)
        for (int r = 0; r < NR; ++r)
          a[k][r] = I::mul(I::load(acc + static_cast<size_t>(r) * d + i + k * W), I::set1(alpha[r]));
      for (int j = 0; j < nt; ++j) {
        V v[K];
        dec.fn(base + static_cast<size_t>(j) * stride, i, v);
        for (int r = 0; r < NR; ++r) {
          const V wr = I::set1(w[r * kTile + j]);
          for (int k = 0; k < K; ++k) a[k][r] = I::fmadd(wr, v[k], a[k][r]);
        }
      }
      for (int k = 0; k < K; ++k)
        for (int r = 0; r < NR; ++r) I::store(acc + static_cast<size_t>(r) * d + i + k * W, a[k][r]);
    }
  }

  // f(std::integral_constant<int, n>) for 1 <= n <= N.
  template <int N, class F>
  static void with_rows(int n, F&& f) {
    if constexpr (N > 1) {
      if (n < N) return with_rows<N - 1>(n, f);
    }
    f(std::integral_constant<int, N>{});
  }

  template <class Dec, class Pf>
  static void scores_rows(int R, const float* q, int d, const uint8_t* base, size_t stride, int nt, float* s,
                          const Dec& dec, const Pf& prefetch) {
    const auto none = [](int, int) {};
    for (int r0 = 0; r0 < R; r0 += 8) {
      const float* qr = q + static_cast<size_t>(r0) * d;
      float* sr = s + r0 * kTile;
      with_rows<8>(kf_min(8, R - r0), [&](auto nr) {
        // The first row block walks the keys first: it issues the prefetches.
        if (r0 == 0)
          scores<decltype(nr)::value>(qr, d, base, stride, nt, sr, dec, prefetch);
        else
          scores<decltype(nr)::value>(qr, d, base, stride, nt, sr, dec, none);
      });
    }
  }

  template <class Dec>
  static void accumulate_rows(int R, float* acc, int d, const uint8_t* base, size_t stride, int nt, const float* w,
                              const float* alpha, const Dec& dec) {
    // Rows per pass: their K-vector accumulators must stay in registers.
    constexpr int kRows = I::kAccRegs / Dec::kVecs < 8 ? I::kAccRegs / Dec::kVecs : 8;
    for (int r0 = 0; r0 < R; r0 += kRows) {
      with_rows<kRows>(kf_min(kRows, R - r0), [&](auto nr) {
        accumulate<decltype(nr)::value>(acc + static_cast<size_t>(r0) * d, d, base, stride, nt, w + r0 * kTile,
                                        alpha + r0, dec);
      });
    }
  }

  // n fp16 values at p, p + stride, ... -> out[n]. Dense planes (the page layout) load W at a
  // time; strided ones (slot layout) convert one by one.
  static void load_halfs(const uint8_t* p, size_t stride, int n, float* out) {
    int j = 0;
    if (stride == 2)
      for (; j + W <= n; j += W) I::store(out + j, I::halfs(p + 2 * j));
    for (; j < n; ++j) out[j] = I::half(p + static_cast<size_t>(j) * stride);
  }

  // Per-key factor of the scores (fp16 norm for Mse keys, the fp8 factor, else 1).
  static void key_factors(const KernelFormat& f, const SlotRun& run, int j0, int nt, float* fac) {
    if (f.key == KeyCodec::Mse) return load_halfs(run.km + static_cast<size_t>(j0) * run.km_stride, run.km_stride, nt, fac);
    const float c = f.key == KeyCodec::Fp8 ? I::kFp8Factor : 1.0f;
    for (int j = 0; j < nt; ++j) fac[j] = c;
  }

  // value j = zero[j] + fac[j] * decoder output (zero: Uniform values only; the others have none).
  static void value_factors(const KernelFormat& f, const SlotRun& run, int j0, int nt, float* fac, float* zero) {
    switch (f.value) {
      case ValueCodec::Uniform: {
        // zero + scale * code = (zero + scale * mid) + scale * (code - mid): centring keeps
        // the sum of scale * code and the sum of zero from cancelling (both ~ the range,
        // their sum ~ the mean) and losing ~1e-5 in float over thousands of keys.
        const float mid = 0.5f * static_cast<float>((1 << f.value_bits) - 1);
        load_halfs(run.vm0 + static_cast<size_t>(j0) * run.vm0_stride, run.vm0_stride, nt, fac);
        load_halfs(run.vm1 + static_cast<size_t>(j0) * run.vm1_stride, run.vm1_stride, nt, zero);
        for (int j = 0; j < nt; ++j) zero[j] += fac[j] * mid;
        return;
      }
      case ValueCodec::Mse:
        load_halfs(run.vm0 + static_cast<size_t>(j0) * run.vm0_stride, run.vm0_stride, nt, fac);
        return;
      default: {
        const float c = f.value == ValueCodec::Fp8 ? I::kFp8Factor : 1.0f;
        for (int j = 0; j < nt; ++j) fac[j] = c;
        return;
      }
    }
  }

  // The fp16 metadata (norms, scales, zero points) of slots [a, b) of a run, into L1: a tile's
  // worth is a few lines per field, asked for once per tile.
  static void prefetch_meta(const SlotRun& run, int a, int b) {
    if constexpr (W == 1) return;
    const auto span = [&](const uint8_t* p, size_t stride) {
      if (!p || stride > 64) return;  // the slot layout: the code rows' prefetches cover them
      const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(b - 1) * stride + 2;
      for (uintptr_t line = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(a) * stride) & ~uintptr_t{63};
           line < end; line += 64)
        I::prefetch_l1(reinterpret_cast<const uint8_t*>(line));
    };
    span(run.km, run.km_stride);
    span(run.vm0, run.vm0_stride);
    span(run.vm1, run.vm1_stride);
  }

  // The slots a tile ahead of the one being scored, prefetched as its keys are scored: pf(j, n)
  // asks for the slots of keys j .. j + n - 1 of the tile, a tile on (in the next run at the
  // end of this one). Spread out, the prefetches stay within the core's outstanding-miss
  // budget; issued as a burst of a whole tile (256 lines for f16), most of them were dropped.
  // Into L1 when a slot's rows take <= 128 bytes (the compressed formats: measured a third
  // faster at 32K x batch 16 than into L2), else into L2 (f16 and the like: 4-8 lines a slot
  // into L1 slowed f16 down by ~40 %). Each field's lines run from the first slot's first byte
  // to the last slot's last, less the line the slot before ends in (asked for by the previous
  // call): where a field's rows are dense (the page layout), slots that share a line cost one
  // prefetch, not one each. The plan is built once per tile; the scorers' hot loops keep only
  // a pointer to it (captured run state cost the f16 scorer registers).
  struct Ahead {
    struct Seg {
      uintptr_t k, v;  // key j's rows start at k + j * ks, v + j * vs
      size_t ks, vs;
      int lo, hi;      // the keys j of the tile that map into this run
      const SlotRun* run;
      int shift;       // key j is slot j + shift of run
    } seg[kMaxSegs];
    int ns;
    size_t kb, vb;     // bytes of one slot's key / value rows
    bool l1;

    // The kTile slots from slot j of runs[i] on (the next tile), key j of the tile mapped to
    // the j-th of them.
    void set(const KernelFormat& f, const SlotRun* runs, int n_runs, int i, int j) {
      kb = f.key_code_bytes;
      vb = f.value_code_bytes;
      l1 = kb + vb <= 128;
      ns = 0;
      for (int t = 0; t < kTile && i < n_runs && ns < kMaxSegs;) {
        const SlotRun& r = runs[i];
        const int n = kf_min(kTile - t, r.n - j);
        if (n > 0) {
          Seg& g = seg[ns++];
          g.ks = r.kc_stride;
          g.vs = r.vc_stride;
          g.shift = j - t;
          const int64_t kshift = static_cast<int64_t>(g.shift) * static_cast<int64_t>(g.ks);
          const int64_t vshift = static_cast<int64_t>(g.shift) * static_cast<int64_t>(g.vs);
          g.k = reinterpret_cast<uintptr_t>(r.kc) + static_cast<uintptr_t>(kshift);
          g.v = reinterpret_cast<uintptr_t>(r.vc) + static_cast<uintptr_t>(vshift);
          g.lo = t;
          g.hi = t + n;
          g.run = &r;
          t += n;
          j += n;
        }
        if (j >= r.n) {
          ++i;
          j = 0;
        }
      }
    }
    [[gnu::always_inline]] void line(uintptr_t a) const {
      if (l1)
        I::prefetch_l1(reinterpret_cast<const uint8_t*>(a));
      else
        I::prefetch(reinterpret_cast<const uint8_t*>(a));
    }
    [[gnu::always_inline]] void rows(uintptr_t p, size_t stride, size_t bytes, int a, int b, bool after) const {
      const uintptr_t first = p + static_cast<uintptr_t>(a) * stride;
      const uintptr_t end = p + static_cast<uintptr_t>(b - 1) * stride + bytes;
      uintptr_t at = first & ~uintptr_t{63};
      if (after) {
        const uintptr_t past_prev = ((first - stride + bytes - 1) | uintptr_t{63}) + 1;
        at = at > past_prev ? at : past_prev;
      }
      for (; at < end; at += 64) line(at);
    }
    void operator()(int j, int n) const {
      if constexpr (W == 1) return;
      if (n > 1 && kb >= 64 && vb >= 64) {  // whole lines a key: one key at a time
        for (int k = 0; k < n; ++k) (*this)(j + k, 1);
        return;
      }
      if (n == 1) {  // the per-key scorers: every line of the key's rows, as cheaply as possible
        for (int g = 0; g < ns; ++g) {
          const Seg& s = seg[g];
          if (j >= s.hi) continue;
          if (j < s.lo) return;
          rows(s.k, s.ks, kb, j, j + 1, false);
          rows(s.v, s.vs, vb, j, j + 1, false);
          return;
        }
        return;
      }
      for (int g = 0; g < ns; ++g) {
        const Seg& s = seg[g];
        const int a = j > s.lo ? j : s.lo, b = j + n < s.hi ? j + n : s.hi;
        if (a >= b) continue;
        rows(s.k, s.ks, kb, a, b, a > s.lo);
        rows(s.v, s.vs, vb, a, b, a > s.lo);
      }
    }
    // The fp16 metadata of the whole next tile, once.
    void meta() const {
      for (int g = 0; g < ns; ++g) prefetch_meta(*seg[g].run, seg[g].lo + seg[g].shift, seg[g].hi + seg[g].shift);
    }
  };

  static void run(const KernelFormat& f, const SlotRun* runs, int n_runs, const RowBlock& rb, const RowState& st,
                  float* scratch) {
    const int d = f.dim, R = rb.rows, ks = key_split(f), vs = value_split(f), c8 = i8_block(f);
    // After run_tile's part of the scratch: the permuted query rows [R, d], then [d] floats,
    // then the int8 rows' scales [R] and offsets [R] and the int8 rows [R, d].
    float* qs = scratch + 3 * kTile + static_cast<size_t>(R) * (kTile + 2);
    float* tmp = qs + static_cast<size_t>(R) * d;
    I8Rows i8{};
    if (c8 > 0) {
      float* scale = tmp + d;
      float* corr = scale + R;
      int8_t* q8 = reinterpret_cast<int8_t*>(corr + R);
      quantize_rows(f, rb, c8, q8, scale, corr);
      i8 = {q8, scale, corr};
      if constexpr (has_i8_tiles<I>()) {  // [R][d/16][64] bytes: the R * d floats of qs
        I::i8_broadcast_rows(q8, R, d, reinterpret_cast<int8_t*>(qs));
        i8.q = reinterpret_cast<const int8_t*>(qs);
      }
    }
    RowBlock rows = rb;
    if (ks > 1 && c8 == 0) {
      std::memcpy(qs, rb.q, sizeof(float) * static_cast<size_t>(R) * d);
      for (int r = 0; r < R; ++r) permute(qs + static_cast<size_t>(r) * d, d, ks, tmp, false);
      rows.q = qs;
    }
    const int cv = i8v_block(f);
    if (cv > 1)
      for (int r = 0; r < R; ++r) permute_i8v(st.acc + static_cast<size_t>(r) * d, d, cv, f.value_bits, tmp, false);
    else if (vs > 1)
      for (int r = 0; r < R; ++r) permute(st.acc + static_cast<size_t>(r) * d, d, vs, tmp, false);
    // Tiles: whole runs while they fit in kTile keys and follow each other without a gap (a
    // longer run is cut into kTile-key pieces).
    TileSeg seg[kMaxSegs];
    for (int i = 0, j = 0; i < n_runs;) {
      int ns = 0, nt = 0;
      while (i < n_runs && ns < kMaxSegs) {
        const SlotRun& r = runs[i];
        const int left = r.n - j;
        if (left <= 0) {
          ++i;
          j = 0;
          continue;
        }
        if (ns > 0 && (left > kTile - nt || r.pos0 + j != seg[ns - 1].run->pos0 + seg[ns - 1].j + seg[ns - 1].n)) break;
        const int n = kf_min(left, kTile - nt);
        seg[ns++] = {&r, j, n, nt};
        nt += n;
        j += n;
        if (j == r.n) {
          ++i;
          j = 0;
        }
        if (nt == kTile) break;
      }
      if (ns > 0) run_tile(f, seg, ns, nt, runs, n_runs, i, j, rows, c8 > 0 ? &i8 : nullptr, st, scratch);
    }
    if (cv > 1)
      for (int r = 0; r < R; ++r) permute_i8v(st.acc + static_cast<size_t>(r) * d, d, cv, f.value_bits, tmp, true);
    else if (vs > 1)
      for (int r = 0; r < R; ++r) permute(st.acc + static_cast<size_t>(r) * d, d, vs, tmp, true);
  }

  // One tile of nt keys (ns segments of consecutive runs); runs[i] slot j is where the next
  // tile starts (prefetched as this one is scored).
  static void run_tile(const KernelFormat& f, const TileSeg* seg, int ns, int nt, const SlotRun* runs, int n_runs,
                       int i_next, int j_next, const RowBlock& rb, const I8Rows* i8, const RowState& st,
                       float* scratch) {
    const int d = f.dim, R = rb.rows;
    float* kfac = scratch;
    float* vfac = kfac + kTile;
    float* vzero = vfac + kTile;
    float* p = vzero + kTile;                           // [R, kTile] scores, then weights
    float* alpha = p + static_cast<size_t>(R) * kTile;  // [R] accumulator rescale of this tile
    float* live = alpha + R;                            // [R] 1 if the row sees a key of this tile
    const int cv = i8v_block(f);
    float* wscale = i8v_scales(scratch, R, d);                         // [R] int8 value scales
    uint8_t* w8 = reinterpret_cast<uint8_t*>(wscale + R);              // [R, kTile] int8 weights
    {
      const int64_t first = seg[0].run->pos0 + seg[0].j, last = first + nt - 1;
      bool any = false;
      for (int r = 0; r < R; ++r) {
        live[r] = rb.begin[r] <= last && rb.end[r] >= first ? 1.0f : 0.0f;
        any = any || live[r] != 0.0f;
      }
      if (!any) return;
      Ahead plan;
      plan.set(f, runs, n_runs, i_next, j_next);
      plan.meta();
      const Ahead* pl = &plan;
      for (int g = 0; g < ns; ++g) {
        const SlotRun& run = *seg[g].run;
        const int j0 = seg[g].j, n = seg[g].n, off = seg[g].off;
        const auto prefetch = [pl, off](int j, int m) { (*pl)(off + j, m); };
        if (i8) {
          // Integer scores; to the query's domain with the norm below: ((s - corr) * scale) * norm.
          scores_i8_rows(f, R, i8->q, run.kc + static_cast<size_t>(j0) * run.kc_stride, run.kc_stride, n, p + off,
                         prefetch);
        } else {
          with_key_decoder(f, [&](const auto& dec) {
            scores_rows(R, rb.q, d, run.kc + static_cast<size_t>(j0) * run.kc_stride, run.kc_stride, n, p + off, dec,
                        prefetch);
          });
        }
        key_factors(f, run, j0, n, kfac + off);
        value_factors(f, run, j0, n, vfac + off, vzero + off);
      }
      // Uniform values only: the zero points' sum (Mse and float values have none).
      const bool zero_points = f.value == ValueCodec::Uniform;
      for (int j = nt; j < kTile; ++j) vfac[j] = 0.0f;  // weights there are 0 already
      if (zero_points)
        for (int j = nt; j < kTile; ++j) vzero[j] = 0.0f;
      // Int8 values: a non-finite or negative value scale in the tile makes every row NaN.
      bool bad_scales = false;
      if (cv > 0) {
        V total = I::zero(), neg = I::zero();
        for (int j = 0; j < kTile; j += W) {
          const V x = I::load(vfac + j);
          total = I::add(total, x);
          neg = I::max(neg, I::sub(I::zero(), x));
        }
        const float t = I::reduce(total);
        bad_scales = !(t - t == 0.0f) || I::reduce_max(neg) > 0.0f;
      }
      for (int r = 0; r < R; ++r) {
        float* s = p + r * kTile;
        float mt = kNegInf;
        // Int8 scores: s * norm below stands for ((s - corr) * scale) * norm.
        const float corr = i8 ? i8->corr[r] : 0.0f, sc = i8 ? i8->scale[r] : 1.0f;
        const auto key_score = [&](V x, int j) {
          if (i8) x = I::mul(I::sub(x, I::set1(corr)), I::set1(sc));
          return I::mul(x, I::load(kfac + j));
        };
        const bool whole = live[r] != 0.0f && nt == kTile && rb.begin[r] <= first && rb.end[r] >= last;
        if (whole && cv > 0) {
          // The common case of int8 value sums, the tile's scores held in registers from the
          // scaling to the u8 weights (the same operations as the general path below).
          constexpr int NV = kTile / W;
          V x[NV];
          V mx = I::set1(kNegInf);
          for (int v = 0; v < NV; ++v) {
            x[v] = key_score(I::load(s + v * W), v * W);
            mx = I::max(mx, x[v]);
          }
          const float m_old = st.m[r], top = I::reduce_max(mx);
          const float m_new = m_old > top ? m_old : top;
          alpha[r] = m_old == kNegInf ? 0.0f : (m_old == m_new ? 1.0f : I::exp_scalar(m_old - m_new));
          st.m[r] = m_new;
          const V mv = I::set1(m_new);
          V sum = I::zero(), z = I::zero(), wmx = I::zero();
          for (int v = 0; v < NV; ++v) {
            const V e = I::exp_w(I::sub(x[v], mv));
            sum = I::add(sum, e);
            if (zero_points) z = I::fmadd(e, I::load(vzero + v * W), z);
            x[v] = I::mul(e, I::load(vfac + v * W));
            wmx = I::max(wmx, x[v]);
          }
          st.l[r] = st.l[r] * alpha[r] + I::reduce(sum);
          if (zero_points) st.zs[r] = st.zs[r] * alpha[r] + I::reduce(z);
          quantize_weights_from(f, [&x](int v) { return x[v]; }, I::reduce_max(wmx), bad_scales, w8 + r * kTile,
                                wscale + r);
          continue;
        }
        if (live[r] != 0.0f) {
          if (whole) {
            V mx = key_score(I::load(s), 0);
            I::store(s, mx);
            for (int j = W; j < kTile; j += W) {
              const V x = key_score(I::load(s + j), j);
              I::store(s + j, x);
              mx = I::max(mx, x);
            }
            mt = I::reduce_max(mx);
          } else {
            for (int j = 0; j < kTile; ++j) {
              const int64_t pos = first + j;
              const float x = i8 ? (s[j] - corr) * sc : s[j];
              s[j] = (j >= nt || pos < rb.begin[r] || pos > rb.end[r]) ? kNegInf : x * kfac[j];
              mt = s[j] > mt ? s[j] : mt;
            }
          }
        }
        if (mt == kNegInf) {  // nothing visible in this tile: state unchanged
          live[r] = 0.0f;
          alpha[r] = 1.0f;
          for (int j = 0; j < kTile; ++j) s[j] = 0.0f;
          if (cv > 0) quantize_weights(f, s, 0.0f, false, w8 + r * kTile, wscale + r);
          continue;
        }
        const float m_old = st.m[r];
        const float m_new = m_old > mt ? m_old : mt;
        alpha[r] = m_old == kNegInf ? 0.0f : (m_old == m_new ? 1.0f : I::exp_scalar(m_old - m_new));
        st.m[r] = m_new;
        // One pass: e = exp(s - m) into l, e * vzero into zs, the weight e * vfac into s.
        const V mv = I::set1(m_new);
        V sum = I::zero(), z = I::zero(), mx = I::zero();
        for (int j = 0; j < kTile; j += W) {
          const V x = I::sub(I::load(s + j), mv);
          const V e = cv > 0 ? I::exp_w(x) : I::exp(x);
          sum = I::add(sum, e);
          if (zero_points) z = I::fmadd(e, I::load(vzero + j), z);
          const V w = I::mul(e, I::load(vfac + j));
          I::store(s + j, w);
          if (cv > 0) mx = I::max(mx, w);
        }
        st.l[r] = st.l[r] * alpha[r] + I::reduce(sum);
        if (zero_points) st.zs[r] = st.zs[r] * alpha[r] + I::reduce(z);
        if (cv > 0) quantize_weights(f, s, I::reduce_max(mx), bad_scales, w8 + r * kTile, wscale + r);
      }
      ValueRun vr[kMaxSegs];
      for (int g = 0; g < ns; ++g) {
        const SlotRun& run = *seg[g].run;
        vr[g] = {run.vc + static_cast<size_t>(seg[g].j) * run.vc_stride, run.vc_stride, seg[g].n, seg[g].off};
      }
      // Int8 sums: the integers of the whole tile, then one rescale of the accumulators.
      if (cv > 0) return values_i8_rows(f, R, st.acc, vr, ns, w8, alpha, wscale);
      // fp32 sums run by run: the accumulators are rescaled by alpha with the first one.
      for (int g = 0; g < ns; ++g) {
        if (g == 1)
          for (int r = 0; r < R; ++r) alpha[r] = 1.0f;
        with_value_decoder(f, [&](const auto& dec) {
          accumulate_rows(R, st.acc, d, vr[g].base, vr[g].stride, vr[g].n, p + vr[g].off, alpha, dec);
        });
      }
    }
  }
};

}  // namespace
}  // namespace tqkv::cpu
