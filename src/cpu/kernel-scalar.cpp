// Scalar build of the attention kernel: one float per "vector". Always compiled; runs every
// format and head dim (any bit width), and is the level the SIMD builds are checked against.
#include <cmath>

#include "kernel_impl.h"
#include "tqkv/bitpack.h"
#include "tqkv/fp8.h"

namespace tqkv::cpu {
namespace {

struct IsaScalar {
  using V = float;
  static constexpr int W = 1;
  static constexpr bool kAnyBits = true;
  static constexpr float kFp8Factor = 1.0f;
  static constexpr int kAccRegs = 8;
  static constexpr int split_codes(int) { return 1; }
  // Int8 key scores (kernel_impl.h) one channel at a time: the integers every build computes.
  static constexpr bool kHasI8 = true;
  using IV = int32_t;
  using IT = const uint8_t*;
  static constexpr int i8_block(int b) { return b >= 2 && b <= kI8MaxKeyBits ? 1 : 0; }
  static IT i8_table(const uint8_t* t) { return t; }
  static IV izero() { return 0; }
  static V i2f(IV a) { return static_cast<float>(a); }
  static IV dot_u8i8(IV acc, IV u, const int8_t* q) { return acc + u * q[0]; }
  static IV dot_u8i8_wide(IV acc, IV h, IV l, const int8_t* q) { return acc + 64 * h * q[0] + l * q[0]; }
  static void reduce4_i(IV a, IV b, IV c, IV d, int32_t* out) {
    out[0] = a;
    out[1] = b;
    out[2] = c;
    out[3] = d;
  }
  template <int B>
  static IV levels_u8(const uint8_t* p, int i, IT table) {
    return table[unpack_one(p, i, B)];
  }
  static IT i8_table_wide(const uint8_t* t) { return t; }
  template <int B>
  static void levels_wide(const uint8_t* p, int i, IT hi, IT lo, IV& h, IV& l) {
    const unsigned c = unpack_one(p, i, B);
    h = hi[c];
    l = lo[c];
  }
  // Int8 value sums (kernel_impl.h) one channel at a time, in channel order.
  static constexpr bool kI8Values = true;
  static constexpr int i8v_block(int b) { return b >= 2 && b <= kI8WideBits ? 1 : 0; }
  static const int8_t* i8v_table(const int8_t* t) { return t; }
  // 6-bit values (kernel.h value_wide): level 64 H + Lo from the two tables.
  struct WideTable {
    const int8_t *h, *lo;
  };
  static WideTable i8v_table_wide(const int8_t* h, const int8_t* lo) { return {h, lo}; }
  static int value_level(const int8_t* t, unsigned c) { return t[c]; }
  static int value_level(const WideTable& t, unsigned c) { return 64 * t.h[c] + t.lo[c]; }
  static int i8v_channel(int, int t) { return t; }
  static void store_u8(uint8_t* p, V x) {
    const float y = std::nearbyint(x);  // nearest-even, as vcvtps2dq
    *p = static_cast<uint8_t>(y > static_cast<float>(kI8WeightMax) ? kI8WeightMax : y > 0.0f ? y : 0.0f);
  }
  template <int NR, int B, class Table>
  static void values_i8_tile(float* acc, int d, const ValueRun* vr, int nv, const uint8_t* w8, const float* alpha,
                             const float* scale, const Table& table) {
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < d; ++c) {
        int32_t sum = 0;
        for (int g = 0; g < nv; ++g)
          for (int j = 0; j < vr[g].n; ++j)
            sum += w8[r * kTile + vr[g].off + j] *
                   value_level(table, unpack_one(vr[g].base + static_cast<size_t>(j) * vr[g].stride, c, B));
        float& a = acc[static_cast<size_t>(r) * d + c];
        a = std::fma(static_cast<float>(sum), scale[r], a * alpha[r]);
      }
  }
  static V zero() { return 0.0f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V add(V a, V b) { return a + b; }
  static V mul(V a, V b) { return a * b; }
  static V sub(V a, V b) { return a - b; }
  static V max(V a, V b) { return a > b ? a : b; }
  static float reduce_max(V v) { return v; }
  static V fmadd(V a, V b, V c) { return std::fma(a, b, c); }
  static float reduce(V v) { return v; }
  static void reduce4(V a, V b, V c, V d, float* out) {
    out[0] = a;
    out[1] = b;
    out[2] = c;
    out[3] = d;
  }
  static void prefetch(const uint8_t*) {}
  static void prefetch_l1(const uint8_t*) {}
  static float half(const uint8_t* p) { return kf_half(p); }
  static V halfs(const uint8_t* p) { return kf_half(p); }
  static V exp(V x) { return std::exp(x); }
  static float exp_scalar(float x) { return std::exp(x); }
  // The int8 value weights' exp: the SIMD builds' operations one lane at a time (kernel.h).
  static V exp_w(V x) {
    if (!(x >= -87.0f)) return x < -87.0f ? 0.0f : x;  // NaN stays NaN
    const float t = x * kExpWLog2e, n = std::nearbyint(t);
    return std::ldexp(exp_w_poly<IsaScalar>(t - n), static_cast<int>(n));
  }
  static V f32(const uint8_t* p, int i) {
    float v;
    std::memcpy(&v, p + 4 * i, 4);
    return v;
  }
  static V f16(const uint8_t* p, int i) { return kf_half(p + 2 * i); }
  static V bf16(const uint8_t* p, int i) {
    const uint32_t b = static_cast<uint32_t>(p[2 * i] | (p[2 * i + 1] << 8)) << 16;
    float v;
    std::memcpy(&v, &b, 4);
    return v;
  }
  static V fp8(const uint8_t* p, int i) { return fp8_e4m3_to_float(p[i]); }
  template <int B>
  static V codes(const uint8_t* p, int i) {
    return static_cast<float>(unpack_one(p, i, B));
  }
  template <int B>
  static V lut(const uint8_t* p, int i, const float* table) {
    return table[unpack_one(p, i, B)];
  }
};

}  // namespace

void run_scalar(const KernelFormat& f, const SlotRun* runs, int n_runs, const RowBlock& rows, const RowState& st,
                float* scratch) {
  Kernel<IsaScalar>::run(f, runs, n_runs, rows, st, scratch);
}

}  // namespace tqkv::cpu
