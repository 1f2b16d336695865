// The attention kernel body, written once over an ISA traits class `I` (internal header).
//
// Included by exactly one source file per ISA (kernel-scalar.cpp, kernel-avx2.cpp,
// kernel-avx512.cpp), each compiled with its own flags. Everything here lives in an anonymous
// namespace so that no inline function compiled with AVX-512 flags can be picked by the linker
// for code that runs on a CPU without it; for the same reason it calls no inline function from
// other headers (it has its own fp16 conversion) and no std::min/max.
//
// Traits interface (W floats per vector V):
//   zero(), set1(x), load(const float*), store(float*, V), mul(a, b), fmadd(a, b, c) = a*b + c,
//   reduce(V) -> float, exp(V) (0 for inputs below about -87),
//   f32(p, i) / f16(p, i) / bf16(p, i) / fp8(p, i): elements i .. i+W-1 of a row of that type
//     (fp8 returns value / kFp8Factor),
//   codes(p, i, bits): codes i .. i+W-1 of a packed row as floats,
//   lut(p, i, bits, table16): table16[code] for those codes (bits <= 4).
#pragma once
#include <cstdint>
#include <cstring>

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

template <class I>
struct Kernel {
  using V = typename I::V;
  static constexpr int W = I::W;
  static constexpr float kNegInf = -__builtin_inff();

  // Keys j0 .. j0+nt-1 of the run -> tile [nt, dim] (codes or elements, no per-token factor)
  // and fac [nt] (the per-token factor: fp16 norm for Mse, the fp8 factor, else 1).
  static void decode_keys(const KernelFormat& f, const SlotRun& run, int j0, int nt, float* tile, float* fac) {
    const int d = f.dim;
    const uint8_t* base = run.kc + static_cast<size_t>(j0) * run.kc_stride;
    auto each = [&](auto&& row_fn) {
      for (int j = 0; j < nt; ++j) {
        const uint8_t* p = base + static_cast<size_t>(j) * run.kc_stride;
        float* o = tile + static_cast<size_t>(j) * d;
        for (int i = 0; i < d; i += W) I::store(o + i, row_fn(p, i));
      }
    };
    switch (f.key) {
      case KeyCodec::F32: each([](const uint8_t* p, int i) { return I::f32(p, i); }); break;
      case KeyCodec::F16: each([](const uint8_t* p, int i) { return I::f16(p, i); }); break;
      case KeyCodec::BF16: each([](const uint8_t* p, int i) { return I::bf16(p, i); }); break;
      case KeyCodec::Fp8: each([](const uint8_t* p, int i) { return I::fp8(p, i); }); break;
      case KeyCodec::Mse: {
        const int bits = f.key_bits;
        const float* lut = I::kFullTable ? f.key_levels : f.key_lut;
        each([&](const uint8_t* p, int i) { return I::lut(p, i, bits, lut); });
        for (int j = 0; j < nt; ++j) fac[j] = kf_half(run.km + static_cast<size_t>(j0 + j) * run.km_stride);
        return;
      }
    }
    const float c = f.key == KeyCodec::Fp8 ? I::kFp8Factor : 1.0f;
    for (int j = 0; j < nt; ++j) fac[j] = c;
  }

  // Values -> tile [nt, dim], fac [nt] and zero [nt]: value = zero + fac * tile.
  static void decode_values(const KernelFormat& f, const SlotRun& run, int j0, int nt, float* tile, float* fac,
                            float* zero) {
    const int d = f.dim;
    const uint8_t* base = run.vc + static_cast<size_t>(j0) * run.vc_stride;
    auto each = [&](auto&& row_fn) {
      for (int j = 0; j < nt; ++j) {
        const uint8_t* p = base + static_cast<size_t>(j) * run.vc_stride;
        float* o = tile + static_cast<size_t>(j) * d;
        for (int i = 0; i < d; i += W) I::store(o + i, row_fn(p, i));
      }
    };
    float c = 1.0f;
    switch (f.value) {
      case ValueCodec::F32: each([](const uint8_t* p, int i) { return I::f32(p, i); }); break;
      case ValueCodec::F16: each([](const uint8_t* p, int i) { return I::f16(p, i); }); break;
      case ValueCodec::BF16: each([](const uint8_t* p, int i) { return I::bf16(p, i); }); break;
      case ValueCodec::Fp8:
        each([](const uint8_t* p, int i) { return I::fp8(p, i); });
        c = I::kFp8Factor;
        break;
      case ValueCodec::Uniform: {
        // Codes are centred (code - mid) and the zero point moved to the middle of the range:
        // zero + scale * code = (zero + scale * mid) + scale * (code - mid). Without this the
        // sums of scale * code and of zero cancel (both ~ the range, their sum ~ the mean) and
        // float accumulation over thousands of keys loses ~1e-5 of relative accuracy.
        const int bits = f.value_bits;
        const float mid = 0.5f * static_cast<float>((1 << bits) - 1);
        const V midv = I::set1(mid);
        each([&](const uint8_t* p, int i) { return I::sub(I::codes(p, i, bits), midv); });
        for (int j = 0; j < nt; ++j) {
          fac[j] = kf_half(run.vm0 + static_cast<size_t>(j0 + j) * run.vm0_stride);
          zero[j] = kf_half(run.vm1 + static_cast<size_t>(j0 + j) * run.vm1_stride) + fac[j] * mid;
        }
        return;
      }
      case ValueCodec::Mse: {
        const int bits = f.value_bits;
        const float* lut = I::kFullTable ? f.value_levels : f.value_lut;
        each([&](const uint8_t* p, int i) { return I::lut(p, i, bits, lut); });
        for (int j = 0; j < nt; ++j) {
          fac[j] = kf_half(run.vm0 + static_cast<size_t>(j0 + j) * run.vm0_stride);
          zero[j] = 0.0f;
        }
        return;
      }
    }
    for (int j = 0; j < nt; ++j) {
      fac[j] = c;
      zero[j] = 0.0f;
    }
  }

  // s[r * kTile + j] = fac[j] * <q[r], tile[j]> for NR rows.
  template <int NR>
  static void scores(const float* q, int d, const float* tile, int nt, const float* fac, float* s) {
    for (int j = 0; j < nt; ++j) {
      V a[NR];
      for (int r = 0; r < NR; ++r) a[r] = I::zero();
      const float* k = tile + static_cast<size_t>(j) * d;
      for (int i = 0; i < d; i += W) {
        const V kv = I::load(k + i);
        for (int r = 0; r < NR; ++r) a[r] = I::fmadd(I::load(q + static_cast<size_t>(r) * d + i), kv, a[r]);
      }
      for (int r = 0; r < NR; ++r) s[r * kTile + j] = I::reduce(a[r]) * fac[j];
    }
  }

  // acc[r] = acc[r] * alpha[r] + sum_j w[r * kTile + j] * tile[j] for NR rows.
  template <int NR>
  static void accumulate(float* acc, int d, const float* tile, int nt, const float* w, const float* alpha) {
    for (int i = 0; i < d; i += W) {
      V a[NR];
      for (int r = 0; r < NR; ++r) a[r] = I::mul(I::load(acc + static_cast<size_t>(r) * d + i), I::set1(alpha[r]));
      for (int j = 0; j < nt; ++j) {
        const V v = I::load(tile + static_cast<size_t>(j) * d + i);
        for (int r = 0; r < NR; ++r) a[r] = I::fmadd(I::set1(w[r * kTile + j]), v, a[r]);
      }
      for (int r = 0; r < NR; ++r) I::store(acc + static_cast<size_t>(r) * d + i, a[r]);
    }
  }

  template <int NR = 8>
  static void scores_rows(int nr, const float* q, int d, const float* tile, int nt, const float* fac, float* s) {
    if constexpr (NR > 1) {
      if (nr < NR) return scores_rows<NR - 1>(nr, q, d, tile, nt, fac, s);
    }
    scores<NR>(q, d, tile, nt, fac, s);
  }
  template <int NR = 8>
  static void accumulate_rows(int nr, float* acc, int d, const float* tile, int nt, const float* w,
                              const float* alpha) {
    if constexpr (NR > 1) {
      if (nr < NR) return accumulate_rows<NR - 1>(nr, acc, d, tile, nt, w, alpha);
    }
    accumulate<NR>(acc, d, tile, nt, w, alpha);
  }

  static void run(const KernelFormat& f, const SlotRun& run, const RowBlock& rb, const RowState& st,
                  float* scratch) {
    const int d = f.dim, R = rb.rows;
    float* ktile = scratch;
    float* vtile = ktile + static_cast<size_t>(kTile) * d;
    float* kfac = vtile + static_cast<size_t>(kTile) * d;
    float* vfac = kfac + kTile;
    float* vzero = vfac + kTile;
    float* p = vzero + kTile;                       // [R, kTile] scores, then weights
    float* alpha = p + static_cast<size_t>(R) * kTile;  // [R]
    float* live = alpha + R;                        // [R] 1 if the row sees a key of this tile
    for (int j0 = 0; j0 < run.n; j0 += kTile) {
      const int nt = kf_min(kTile, run.n - j0);
      const int64_t first = run.pos0 + j0, last = first + nt - 1;
      bool any = false;
      for (int r = 0; r < R; ++r) {
        live[r] = rb.begin[r] <= last && rb.end[r] >= first ? 1.0f : 0.0f;
        any = any || live[r] != 0.0f;
      }
      if (!any) continue;
      decode_keys(f, run, j0, nt, ktile, kfac);
      for (int r0 = 0; r0 < R; r0 += 8)
        scores_rows(kf_min(8, R - r0), rb.q + static_cast<size_t>(r0) * d, d, ktile, nt, kfac, p + r0 * kTile);
      for (int r = 0; r < R; ++r) {
        float* s = p + r * kTile;
        float mt = kNegInf;
        if (live[r] != 0.0f) {
          for (int j = 0; j < kTile; ++j) {
            const int64_t pos = first + j;
            if (j >= nt || pos < rb.begin[r] || pos > rb.end[r]) s[j] = kNegInf;
            mt = s[j] > mt ? s[j] : mt;
          }
        }
        if (mt == kNegInf) {  // nothing visible in this tile: state unchanged
          live[r] = 0.0f;
          alpha[r] = 1.0f;
          for (int j = 0; j < kTile; ++j) s[j] = 0.0f;
          continue;
        }
        const float m_old = st.m[r];
        const float m_new = m_old > mt ? m_old : mt;
        alpha[r] = m_old == kNegInf ? 0.0f : I::exp_scalar(m_old - m_new);
        st.m[r] = m_new;
        const V mv = I::set1(m_new);
        float sum = 0.0f;
        for (int j = 0; j < kTile; j += W) {
          const V e = I::exp(I::sub(I::load(s + j), mv));
          I::store(s + j, e);
          sum += I::reduce(e);
        }
        st.l[r] = st.l[r] * alpha[r] + sum;
      }
      decode_values(f, run, j0, nt, vtile, vfac, vzero);
      for (int r = 0; r < R; ++r) {
        if (live[r] == 0.0f) continue;
        float* w = p + r * kTile;
        float z = 0.0f;
        for (int j = 0; j < nt; ++j) {
          z += w[j] * vzero[j];
          w[j] *= vfac[j];
        }
        st.zs[r] = st.zs[r] * alpha[r] + z;
      }
      for (int r0 = 0; r0 < R; r0 += 8)
        accumulate_rows(kf_min(8, R - r0), st.acc + static_cast<size_t>(r0) * d, d, vtile, nt, p + r0 * kTile,
                        alpha + r0);
    }
  }
};

}  // namespace
}  // namespace tqkv::cpu
