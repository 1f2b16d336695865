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
//   exp_scalar(x), prefetch(p), half(p) (one fp16 -> float), halfs(p) (W dense fp16),
//   f32(p, i) / f16(p, i) / bf16(p, i) / fp8(p, i): elements i .. i+W-1 of a row of that type
//     (fp8 returns value / kFp8Factor),
//   codes<B>(p, i): codes i .. i+W-1 of a packed B-bit row as floats,
//   lut<B>(p, i, table): table[code]; for B <= 4 SIMD builds get the replicated 16-entry table
//     (see KernelFormat) and may ignore bits above the code, for B = 5..8 the full level table.
//   kAnyBits: the build handles every bit width 1..8 (scalar); SIMD builds take table-decoded
//     (Mse) codes of 2..8 bits and Uniform codes of 2..4 bits.
#pragma once
#include <cstdint>
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

template <class I>
struct Kernel {
  using V = typename I::V;
  static constexpr int W = I::W;
  static constexpr float kNegInf = -__builtin_inff();

  // Calls fn(decoder) with the decoder of the key codec: V decoder(const uint8_t* row, int i).
  template <class Fn>
  static void with_key_decoder(const KernelFormat& f, Fn&& fn) {
    switch (f.key) {
      case KeyCodec::F32: return fn([](const uint8_t* p, int i) { return I::f32(p, i); });
      case KeyCodec::F16: return fn([](const uint8_t* p, int i) { return I::f16(p, i); });
      case KeyCodec::BF16: return fn([](const uint8_t* p, int i) { return I::bf16(p, i); });
      case KeyCodec::Fp8: return fn([](const uint8_t* p, int i) { return I::fp8(p, i); });
      case KeyCodec::Mse: return with_table_decoder(f.key_bits, f.key_lut, f.key_levels, fn);
    }
  }

  template <class Fn>
  static void with_value_decoder(const KernelFormat& f, Fn&& fn) {
    switch (f.value) {
      case ValueCodec::F32: return fn([](const uint8_t* p, int i) { return I::f32(p, i); });
      case ValueCodec::F16: return fn([](const uint8_t* p, int i) { return I::f16(p, i); });
      case ValueCodec::BF16: return fn([](const uint8_t* p, int i) { return I::bf16(p, i); });
      case ValueCodec::Fp8: return fn([](const uint8_t* p, int i) { return I::fp8(p, i); });
      case ValueCodec::Mse: return with_table_decoder(f.value_bits, f.value_lut, f.value_levels, fn);
      case ValueCodec::Uniform:
        // Codes are centred (code - mid), the zero point moved to mid (see decode_value_meta).
        switch (f.value_bits) {
          case 2: return fn(centred<2>());
          case 3: return fn(centred<3>());
          case 4: return fn(centred<4>());
          default:
            if constexpr (I::kAnyBits) {
              switch (f.value_bits) {
                case 1: return fn(centred<1>());
                case 5: return fn(centred<5>());
                case 6: return fn(centred<6>());
                case 7: return fn(centred<7>());
                default: return fn(centred<8>());
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

  // Codes of up to 4 bits look up the replicated 16-entry register table (lut16); wider codes
  // index the full level table (levels, 2^bits entries; SIMD builds gather from it).
  template <class Fn>
  static void with_table_decoder(int bits, const float* lut16, const float* levels, Fn&& fn) {
    auto dec = [](auto b, const float* table) {
      return [table](const uint8_t* p, int i) { return I::template lut<decltype(b)::value>(p, i, table); };
    };
    const float* narrow = I::kAnyBits ? levels : lut16;
    switch (bits) {
      case 2: return fn(dec(std::integral_constant<int, 2>{}, narrow));
      case 3: return fn(dec(std::integral_constant<int, 3>{}, narrow));
      case 4: return fn(dec(std::integral_constant<int, 4>{}, narrow));
      case 5: return fn(dec(std::integral_constant<int, 5>{}, levels));
      case 6: return fn(dec(std::integral_constant<int, 6>{}, levels));
      case 7: return fn(dec(std::integral_constant<int, 7>{}, levels));
      case 8: return fn(dec(std::integral_constant<int, 8>{}, levels));
      default:
        if constexpr (I::kAnyBits) return fn(dec(std::integral_constant<int, 1>{}, levels));
        return;
    }
  }

  template <int NR>
  [[gnu::always_inline]] static void reduce_rows(const V* a, float* out) {
    int r = 0;
    for (; r + 4 <= NR; r += 4) I::reduce4(a[r], a[r + 1], a[r + 2], a[r + 3], out + r);
    if constexpr (NR % 4 >= 2) {  // 2 or 3 left: one joint reduction, padded with zeros
      float tmp[4];
      I::reduce4(a[r], a[r + 1], NR % 4 == 3 ? a[r + 2] : I::zero(), I::zero(), tmp);
      for (int i = 0; i < NR % 4; ++i) out[r + i] = tmp[i];
    } else if constexpr (NR % 4 == 1) {
      out[r] = I::reduce(a[r]);
    }
  }

  // s[r * kTile + j] = <q[r], key j> (the per-key factor is applied by the caller). (Two keys
  // per pass, sharing the q loads, measured slower on Zen 4: more live registers, no gain.)
  template <int NR, class Dec, class Pf>
  static void scores(const float* q, int d, const uint8_t* base, size_t stride, int nt, float* s, const Dec& dec,
                     const Pf& pf) {
    for (int j = 0; j < nt; ++j) {
      pf(j);
      const uint8_t* p = base + static_cast<size_t>(j) * stride;
      V a[NR];
      for (int r = 0; r < NR; ++r) a[r] = I::zero();
      for (int i = 0; i < d; i += W) {
        const V kv = dec(p, i);
        for (int r = 0; r < NR; ++r) a[r] = I::fmadd(I::load(q + static_cast<size_t>(r) * d + i), kv, a[r]);
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
    for (int i = 0; i < d; i += W) {
      V a[NR];
      for (int r = 0; r < NR; ++r) a[r] = I::mul(I::load(acc + static_cast<size_t>(r) * d + i), I::set1(alpha[r]));
      for (int j = 0; j < nt; ++j) {
        const V v = dec(base + static_cast<size_t>(j) * stride, i);
        for (int r = 0; r < NR; ++r) a[r] = I::fmadd(I::set1(w[r * kTile + j]), v, a[r]);
      }
      for (int r = 0; r < NR; ++r) I::store(acc + static_cast<size_t>(r) * d + i, a[r]);
    }
  }

  template <class Dec, class Pf>
  static void scores_rows(int R, const float* q, int d, const uint8_t* base, size_t stride, int nt, float* s,
                          const Dec& dec, const Pf& prefetch) {
    const auto none = [](int) {};
    for (int r0 = 0; r0 < R; r0 += 8) {
      const float* qr = q + static_cast<size_t>(r0) * d;
      float* sr = s + r0 * kTile;
      if (r0 == 0) {  // the first row block walks the keys first: it issues the prefetches
        switch (kf_min(8, R)) {
          case 1: scores<1>(qr, d, base, stride, nt, sr, dec, prefetch); break;
          case 2: scores<2>(qr, d, base, stride, nt, sr, dec, prefetch); break;
          case 3: scores<3>(qr, d, base, stride, nt, sr, dec, prefetch); break;
          case 4: scores<4>(qr, d, base, stride, nt, sr, dec, prefetch); break;
          case 5: scores<5>(qr, d, base, stride, nt, sr, dec, prefetch); break;
          case 6: scores<6>(qr, d, base, stride, nt, sr, dec, prefetch); break;
          case 7: scores<7>(qr, d, base, stride, nt, sr, dec, prefetch); break;
          default: scores<8>(qr, d, base, stride, nt, sr, dec, prefetch); break;
        }
        continue;
      }
      switch (kf_min(8, R - r0)) {
        case 1: scores<1>(qr, d, base, stride, nt, sr, dec, none); break;
        case 2: scores<2>(qr, d, base, stride, nt, sr, dec, none); break;
        case 3: scores<3>(qr, d, base, stride, nt, sr, dec, none); break;
        case 4: scores<4>(qr, d, base, stride, nt, sr, dec, none); break;
        case 5: scores<5>(qr, d, base, stride, nt, sr, dec, none); break;
        case 6: scores<6>(qr, d, base, stride, nt, sr, dec, none); break;
        case 7: scores<7>(qr, d, base, stride, nt, sr, dec, none); break;
        default: scores<8>(qr, d, base, stride, nt, sr, dec, none); break;
      }
    }
  }

  template <class Dec>
  static void accumulate_rows(int R, float* acc, int d, const uint8_t* base, size_t stride, int nt, const float* w,
                              const float* alpha, const Dec& dec) {
    for (int r0 = 0; r0 < R; r0 += 8) {
      float* ar = acc + static_cast<size_t>(r0) * d;
      const float* wr = w + r0 * kTile;
      const float* al = alpha + r0;
      switch (kf_min(8, R - r0)) {
        case 1: accumulate<1>(ar, d, base, stride, nt, wr, al, dec); break;
        case 2: accumulate<2>(ar, d, base, stride, nt, wr, al, dec); break;
        case 3: accumulate<3>(ar, d, base, stride, nt, wr, al, dec); break;
        case 4: accumulate<4>(ar, d, base, stride, nt, wr, al, dec); break;
        case 5: accumulate<5>(ar, d, base, stride, nt, wr, al, dec); break;
        case 6: accumulate<6>(ar, d, base, stride, nt, wr, al, dec); break;
        case 7: accumulate<7>(ar, d, base, stride, nt, wr, al, dec); break;
        default: accumulate<8>(ar, d, base, stride, nt, wr, al, dec); break;
      }
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

  // value j = zero[j] + fac[j] * decoder output.
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
        for (int j = 0; j < nt; ++j) zero[j] = 0.0f;
        return;
      default: {
        const float c = f.value == ValueCodec::Fp8 ? I::kFp8Factor : 1.0f;
        for (int j = 0; j < nt; ++j) {
          fac[j] = c;
          zero[j] = 0.0f;
        }
        return;
      }
    }
  }

  // Prefetches key and value rows of one slot into L2.
  static void prefetch_slot(const KernelFormat& f, const SlotRun& run, int t) {
    if constexpr (W == 1) return;
    const auto lines = [](const uint8_t* p, size_t n) {
      const uintptr_t end = reinterpret_cast<uintptr_t>(p) + n;
      for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; a < end; a += 64)
        I::prefetch(reinterpret_cast<const uint8_t*>(a));
    };
    lines(run.kc + static_cast<size_t>(t) * run.kc_stride, f.key_code_bytes);
    lines(run.vc + static_cast<size_t>(t) * run.vc_stride, f.value_code_bytes);
  }

  static void run(const KernelFormat& f, const SlotRun* runs, int n_runs, const RowBlock& rb, const RowState& st,
                  float* scratch) {
    for (int i = 0; i < n_runs; ++i) run_one(f, runs[i], i + 1 < n_runs ? &runs[i + 1] : nullptr, rb, st, scratch);
  }

  static void run_one(const KernelFormat& f, const SlotRun& run, const SlotRun* next, const RowBlock& rb,
                      const RowState& st, float* scratch) {
    const int d = f.dim, R = rb.rows;
    float* kfac = scratch;
    float* vfac = kfac + kTile;
    float* vzero = vfac + kTile;
    float* p = vzero + kTile;                           // [R, kTile] scores, then weights
    float* alpha = p + static_cast<size_t>(R) * kTile;  // [R] accumulator rescale of this tile
    float* live = alpha + R;                            // [R] 1 if the row sees a key of this tile
    for (int j0 = 0; j0 < run.n; j0 += kTile) {
      const int nt = kf_min(kTile, run.n - j0);
      const int64_t first = run.pos0 + j0, last = first + nt - 1;
      bool any = false;
      for (int r = 0; r < R; ++r) {
        live[r] = rb.begin[r] <= last && rb.end[r] >= first ? 1.0f : 0.0f;
        any = any || live[r] != 0.0f;
      }
      if (!any) continue;
      // One slot a tile ahead is prefetched per key scored (into the next run at the end of
      // this one): spread out, the prefetches stay within the core's outstanding-miss budget;
      // issued as a burst of a whole tile (256 lines for f16), most of them were dropped.
      const auto prefetch = [&](int j) {
        const int t = j0 + j + kTile;
        if (t < run.n)
          prefetch_slot(f, run, t);
        else if (next && t - run.n < next->n)
          prefetch_slot(f, *next, t - run.n);
      };
      with_key_decoder(f, [&](const auto& dec) {
        scores_rows(R, rb.q, d, run.kc + static_cast<size_t>(j0) * run.kc_stride, run.kc_stride, nt, p, dec,
                    prefetch);
      });
      key_factors(f, run, j0, nt, kfac);
      const V kf_first = I::load(kfac);
      for (int r = 0; r < R; ++r) {
        float* s = p + r * kTile;
        float mt = kNegInf;
        if (live[r] != 0.0f) {
          if (nt == kTile && rb.begin[r] <= first && rb.end[r] >= last) {  // whole tile visible
            V mx = I::mul(I::load(s), kf_first);
            I::store(s, mx);
            for (int j = W; j < kTile; j += W) {
              const V x = I::mul(I::load(s + j), I::load(kfac + j));
              I::store(s + j, x);
              mx = I::max(mx, x);
            }
            mt = I::reduce_max(mx);
          } else {
            for (int j = 0; j < kTile; ++j) {
              const int64_t pos = first + j;
              s[j] = (j >= nt || pos < rb.begin[r] || pos > rb.end[r]) ? kNegInf : s[j] * kfac[j];
              mt = s[j] > mt ? s[j] : mt;
            }
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
        alpha[r] = m_old == kNegInf ? 0.0f : (m_old == m_new ? 1.0f : I::exp_scalar(m_old - m_new));
        st.m[r] = m_new;
        const V mv = I::set1(m_new);
        V sum = I::zero();
        for (int j = 0; j < kTile; j += W) {
          const V e = I::exp(I::sub(I::load(s + j), mv));
          I::store(s + j, e);
          sum = I::add(sum, e);
        }
        st.l[r] = st.l[r] * alpha[r] + I::reduce(sum);
      }
      value_factors(f, run, j0, nt, vfac, vzero);
      for (int j = nt; j < kTile; ++j) vfac[j] = vzero[j] = 0.0f;  // weights there are 0 already
      for (int r = 0; r < R; ++r) {
        if (live[r] == 0.0f) continue;
        float* w = p + r * kTile;
        V z = I::zero();
        for (int j = 0; j < kTile; j += W) {
          const V wv = I::load(w + j);
          z = I::fmadd(wv, I::load(vzero + j), z);
          I::store(w + j, I::mul(wv, I::load(vfac + j)));
        }
        st.zs[r] = st.zs[r] * alpha[r] + I::reduce(z);
      }
      with_value_decoder(f, [&](const auto& dec) {
        accumulate_rows(R, st.acc, d, run.vc + static_cast<size_t>(j0) * run.vc_stride, run.vc_stride, nt, p,
                        alpha, dec);
      });
    }
  }
};

}  // namespace
}  // namespace tqkv::cpu
