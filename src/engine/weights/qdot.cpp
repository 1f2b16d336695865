// The int8 path's activation quantization (shared by every ISA, so all of them see the same
// codes) and its scalar twin: the definition of the integer and float contract of
// qgemv_kernels.h that the AVX2 and AVX-512 VNNI kernels meet bit for bit.
#include <cmath>
#include <cstring>

#include "engine/weights/qgemv_kernels.h"
#include "tqkv/half.h"
#include "tqkv/simd.h"

namespace tqkv::engine::detail {

namespace {

// Round to nearest even without a libm call: adding 1.5 * 2^23 leaves no fraction bits.
constexpr float kRound = 12582912.0f;

// The int8 scale of a block of x: max|x| / 127, NaN if the block holds inf or NaN (its codes
// are then 0, so the products are NaN too).
float block_scale(const float* xb, int len) {
  float amax = 0, z = 0;
  for (int j = 0; j < len; ++j) {
    const float a = std::fabs(xb[j]);
    amax = a > amax ? a : amax;
    z += xb[j] * 0.0f;  // NaN if the block holds inf or NaN
  }
  return z == 0 && std::isfinite(amax) ? amax / 127.0f : std::nanf("");
}

int8_t code(float v) {
  int c = static_cast<int>((v + kRound) - kRound);
  c = c > 127 ? 127 : c < -127 ? -127 : c;
  return static_cast<int8_t>(c);
}

// The per-256 codes of the K-quants (qgemv_kernels.h): base scale D = max|x| / (127 kSub)
// over the super-block, integer sub-scale u_j = ceil(kSub max_j|x| / max|x|) (1 .. kSub) per
// 32 elements, codes round(x / (D u_j)).
void quantize_rows_256(const float* x, int n, int cols, QdotBuffers& out) {
  const size_t total = static_cast<size_t>(n) * cols;
  out.xk.resize(total);
  out.xkd.resize(total / 256);
  out.xkb.resize(total / 16);
  out.xku.resize(total / 16);
  if (active_simd_level() >= SimdLevel::Avx512 && qdot_avx512_supported())
    return quantize_rows_256_avx512(x, total / 256, out.xk.data(), out.xkd.data(), out.xkb.data(), out.xku.data());
  for (size_t i = 0; i < total / 256; ++i) {
    const float* xi = x + 256 * i;
    float amax[8], top = 0, z = 0;
    for (int j = 0; j < 8; ++j) {
      float m = 0;
      for (int e = 32 * j; e < 32 * j + 32; ++e) {
        const float v = std::fabs(xi[e]);
        m = v > m ? v : m;
        z += xi[e] * 0.0f;  // NaN if the super-block holds inf or NaN
      }
      amax[j] = m;
      top = m > top ? m : top;
    }
    // A super-block with inf or NaN gets NaN for its scale (codes 0), so the products are NaN too.
    const float d = z == 0 && std::isfinite(top) ? top / (127.0f * kSub) : std::nanf("");
    out.xkd[i] = d;
    for (int j = 0; j < 8; ++j) {
      int u = 1;
      if (d > 0) u = static_cast<int>(std::ceil(kSub * amax[j] / top));
      u = u < 1 ? 1 : u > kSub ? kSub : u;
      const float id = d > 0 ? 1.0f / (d * static_cast<float>(u)) : 0.0f;
      for (int h = 0; h < 2; ++h) {
        int sum = 0;
        for (int e = 32 * j + 16 * h; e < 32 * j + 16 * h + 16; ++e) {
          const int8_t c = code(xi[e] * id);
          out.xk[256 * i + e] = c;
          sum += c;
        }
        out.xkb[16 * i + 2 * j + h] = static_cast<int16_t>(sum);
        out.xku[16 * i + 2 * j + h] = static_cast<int16_t>(u);
      }
    }
  }
}

}  // namespace

void quantize_rows(const float* x, int n, int cols, QdotBuffers& out, bool blocks32) {
  if (cols % 256 == 0) {
    quantize_rows_256(x, n, cols, out);
  } else {
    out.xk.clear();
    out.xkd.clear();
    out.xkb.clear();
    out.xku.clear();
    blocks32 = true;
  }
  if (!blocks32) {
    out.xq.clear();
    out.x4n.clear();
    out.xd8.clear();
    out.xs.clear();
    out.xd.clear();
    return;
  }
  const size_t nb = static_cast<size_t>(cols) / 32, total = static_cast<size_t>(n) * cols;
  out.xq.resize(total);
  out.x4n.resize(total / 4);
  out.xd8.resize(total / 4);
  out.xs.resize(static_cast<size_t>(n) * nb);
  out.xd.resize(static_cast<size_t>(n) * nb);
  for (size_t b = 0; b < static_cast<size_t>(n) * nb; ++b) {
    const float* xb = x + 32 * b;
    const float d = block_scale(xb, 32);
    const float id = d > 0 ? 1.0f / d : 0.0f;
    int8_t* q = out.xq.data() + 32 * b;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      q[j] = code(xb[j] * id);
      sum += q[j];
    }
    for (int l = 0; l < 8; ++l) {
      out.x4n[8 * b + l] = -(q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
      out.xd8[8 * b + l] = d;
    }
    out.xs[b] = d * static_cast<float>(sum);
    out.xd[b] = d;
  }
}

namespace {

float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// One 32-element block of a weight row as the contract reads it: codes minus their offset o,
// the float scale of each lane and the block's min weight (0 where the type has none).
struct Block32 {
  int c[32];
  float dw[8];
  float mw = 0;
};

// The tree of the contract over 16 lanes.
float tree(const float* acc) {
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = acc[l] + acc[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// For each weight row, its blocks of kElems elements (kBytes bytes), each block(b, j, out)
// giving its 32-element block j; kMin: +1 (y = tree + off) or 0 (no mins).
template <int N, int kElems, int kBytes, int kMin, class Block>
void over_rows(const QdotArgs& a, Block block) {
  const int nw = a.cols / kElems, cols4 = a.cols / 4, nb = a.cols / 32;
  for (int r = a.r0; r < a.r1; ++r) {
    const uint8_t* row = a.w + static_cast<size_t>(r) * nw * kBytes;
    float acc[N][16] = {};
    float off[N] = {};
    for (int i = 0; i < nw; ++i)
      for (int j = 0; j < kElems / 32; ++j) {
        Block32 k;
        block(row + static_cast<size_t>(i) * kBytes, j, k);
        const int b = i * (kElems / 32) + j;
        for (int t = 0; t < N; ++t) {
          const int8_t* xq = a.x.xq + static_cast<size_t>(t) * a.cols + 32 * b;
          const float xd = a.x.xd8[static_cast<size_t>(t) * cols4 + 8 * b];
          for (int l = 0; l < 8; ++l) {
            int32_t s = 0;
            for (int e = 4 * l; e < 4 * l + 4; ++e) s += k.c[e] * xq[e];
            float& lane = acc[t][8 * (b & 1) + l];
            lane = std::fma(static_cast<float>(s), k.dw[l] * xd, lane);
          }
          if (kMin != 0) off[t] = std::fma(k.mw, a.x.xs[static_cast<size_t>(t) * nb + b], off[t]);
        }
      }
    for (int t = 0; t < N; ++t) {
      const float s = tree(acc[t]);
      a.y[t * a.ldy + (r - a.r0)] = kMin > 0 ? s + off[t] : s;
    }
  }
}

void set_dw(Block32& k, float d) {
  for (float& v : k.dw) v = d;
}

// Q4_0/Q4_1/Q5_0 blocks: elements 0-15 are the low nibbles, 16-31 the high ones.
void nibbles(const uint8_t* qs, int o, int* c) {
  for (int j = 0; j < 16; ++j) {
    c[j] = (qs[j] & 0x0f) - o;
    c[j + 16] = (qs[j] >> 4) - o;
  }
}

template <int N>
void q4_0(const QdotArgs& a) {
  over_rows<N, 32, 18, 0>(a, [](const uint8_t* b, int, Block32& k) {
    nibbles(b + 2, 8, k.c);
    set_dw(k, f16(b));
  });
}

template <int N>
void q4_1(const QdotArgs& a) {
  over_rows<N, 32, 20, 1>(a, [](const uint8_t* b, int, Block32& k) {
    nibbles(b + 4, 0, k.c);
    set_dw(k, f16(b));
    k.mw = f16(b + 2);
  });
}

template <int N>
void q5_0(const QdotArgs& a) {
  over_rows<N, 32, 22, 0>(a, [](const uint8_t* b, int, Block32& k) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    nibbles(b + 6, 0, k.c);
    for (int j = 0; j < 32; ++j) k.c[j] += static_cast<int>(((qh >> j) & 1) << 4) - 16;
    set_dw(k, f16(b));
  });
}

template <int N>
void q8_0(const QdotArgs& a) {
  over_rows<N, 32, 34, 0>(a, [](const uint8_t* b, int, Block32& k) {
    for (int j = 0; j < 32; ++j) k.c[j] = static_cast<int8_t>(b[2 + j]);
    set_dw(k, f16(b));
  });
}

// The contract's tree over 8 lanes.
float tree8(const float* acc) {
  float s4[4];
  for (int l = 0; l < 4; ++l) s4[l] = acc[l] + acc[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// K-quants (per-256 activations): for each weight row, super-block i's lanes from
// lanes(block, i, t, S, M) (M: the mins' lanes, or unused), then the float steps.
template <int N, int kBytes, bool kMin, class Lanes>
void over_rows256(const QdotArgs& a, Lanes lanes) {
  const int nw = a.cols / 256;
  for (int r = a.r0; r < a.r1; ++r) {
    const uint8_t* row = a.w + static_cast<size_t>(r) * nw * kBytes;
    float acc[N][8] = {};
    for (int i = 0; i < nw; ++i) {
      const uint8_t* b = row + static_cast<size_t>(i) * kBytes;
      for (int t = 0; t < N; ++t) {
        int32_t S[8] = {}, M[8] = {};
        float d, dmin;
        lanes(b, static_cast<size_t>(t) * nw + i, S, M, d, dmin);
        const float xd = a.x.xkd[static_cast<size_t>(t) * nw + i];
        for (int l = 0; l < 8; ++l) {
          acc[t][l] = std::fma(static_cast<float>(S[l]), d * xd, acc[t][l]);
          if (kMin) acc[t][l] = std::fma(static_cast<float>(M[l]), -(dmin * xd), acc[t][l]);
        }
      }
    }
    for (int t = 0; t < N; ++t) a.y[t * a.ldy + (r - a.r0)] = tree8(acc[t]);
  }
}

// Q4_K: sub-block j is the low nibbles of qs[32 (j / 2) ..] for even j, the high ones for odd j.
template <int N>
void q4_k(const QdotArgs& a) {
  over_rows256<N, 144, true>(a, [&](const uint8_t* b, size_t i, int32_t* S, int32_t* M, float& d, float& dmin) {
    const int8_t* xk = a.x.xk + 256 * i;
    const int16_t* xb = a.x.xkb + 16 * i;
    const int16_t* u = a.x.xku + 16 * i;
    for (int j = 0; j < 8; ++j) {
      int s, m;
      q4_k_scale_min(b + 4, j, s, m);
      s *= u[2 * j];
      m *= u[2 * j];
      const uint8_t* qs = b + 16 + 32 * (j / 2);
      for (int e = 0; e < 32; ++e) {
        const int q = (j & 1) ? qs[e] >> 4 : qs[e] & 0x0f;
        S[e / 4] += s * q * xk[32 * j + e];
      }
      M[j] = m * (xb[2 * j] + xb[2 * j + 1]);
    }
    d = f16(b);
    dmin = f16(b + 2);
  });
}

// Q6_K: 32-element block bb = 4h + k of the super-block is elements 32k + e of half h
// (qgemv_kernels.h); elements 0-15 take scale sc[2 bb], 16-31 sc[2 bb + 1].
template <int N>
void q6_k(const QdotArgs& a) {
  over_rows256<N, kQ6kBytes, false>(a, [&](const uint8_t* b, size_t i, int32_t* S, int32_t*, float& d, float&) {
    const int8_t* xk = a.x.xk + 256 * i;
    const int16_t* xb = a.x.xkb + 16 * i;
    const int16_t* u = a.x.xku + 16 * i;
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int bb = 0; bb < 8; ++bb) {
      const int h = bb / 4, kk = bb % 4;
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
      for (int e = 0; e < 32; ++e) {
        const int lo = (ql[e + 32 * (kk & 1)] >> (kk < 2 ? 0 : 4)) & 0x0f;
        const int q = lo | (((qh[e] >> (2 * kk)) & 3) << 4);
        S[e / 4] += sc[2 * bb + e / 16] * u[2 * bb] * q * xk[32 * bb + e];
      }
    }
    for (int l = 0; l < 8; ++l) S[l] -= 32 * (sc[2 * l] * u[2 * l] * xb[2 * l] + sc[2 * l + 1] * u[2 * l + 1] * xb[2 * l + 1]);
    d = f16(b + 208);
  });
}

}  // namespace

QdotKernels qdot_scalar() {
  return {TQKV_QDOT_ENTRY(q4_0), TQKV_QDOT_ENTRY(q4_1), TQKV_QDOT_ENTRY(q5_0),
          TQKV_QDOT_ENTRY(q8_0), TQKV_QDOT_ENTRY(q4_k), TQKV_QDOT_ENTRY(q6_k)};
}

}  // namespace tqkv::engine::detail
