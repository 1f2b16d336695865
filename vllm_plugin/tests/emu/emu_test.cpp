// The plugin's CUDA kernels, run on the CPU by emu.h, against serial references of vLLM's
// TurboQuant slot (docs/VLLM.md, "The slot"): the store byte for byte, decode (every split count,
// GQA group, head-major and token-major caches, block sizes) and dequantize within float
// tolerance of double-precision attention. Every preset at head dims 64, 128, 256.
//   bash vllm_plugin/tests/emu/run.sh      (g++ with C++20 and the CUDA headers; no GPU)
#include "launch.h"

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

using namespace tqkv_vllm;

namespace {

struct PresetDef {
  const char* name;
  int kb, vb;
  bool nc;
};
constexpr PresetDef kPresets[] = {{"turboquant_k8v4", 8, 4, false},
                                  {"turboquant_4bit_nc", 4, 4, true},
                                  {"turboquant_k3v4_nc", 3, 4, true},
                                  {"turboquant_3bit_nc", 3, 3, true}};

int failures = 0;
#define CHECK(cond, ...)                             \
  do {                                               \
    if (!(cond)) {                                   \
      ++failures;                                    \
      std::printf("FAIL %s:%d ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);                      \
      std::printf("\n");                             \
    }                                                \
  } while (0)

// The slot's fields, as docs/VLLM.md gives them (written out again, not taken from slot.h).
struct Geo {
  int kc, kn, vc, kps, slot;
};
Geo geo_of(const PresetDef& p, int d) {
  Geo g;
  g.kc = p.kb == 8 ? d : (d * p.kb + 7) / 8;
  g.kn = p.kb == 8 ? 0 : 2;
  g.kps = g.kc + g.kn;
  g.vc = (d * p.vb + 7) / 8;
  g.slot = g.kps + g.vc + 4;
  g.slot += g.slot & 1;
  return g;
}

uint32_t get_bits(const uint8_t* p, int bit, int n) {
  uint32_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<uint32_t>((p[(bit + i) / 8] >> ((bit + i) % 8)) & 1) << i;
  return v;
}
void set_bits(uint8_t* p, int bit, int n, uint32_t v) {
  for (int i = 0; i < n; ++i) {
    const int b = bit + i;
    p[b / 8] = static_cast<uint8_t>((p[b / 8] & ~(1 << (b % 8))) | (((v >> i) & 1) << (b % 8)));
  }
}
uint16_t f16_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }
float f16_val(const uint8_t* p) { return __half2float(__ushort_as_half(static_cast<unsigned short>(p[0] | (p[1] << 8)))); }
void put16(uint8_t* p, float x) {
  const uint16_t b = f16_bits(x);
  p[0] = b & 0xFF, p[1] = b >> 8;
}
float fp8_val(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3)));
}
double hadamard(int i, int j) { return (__builtin_popcount(i & j) & 1) ? -1.0 : 1.0; }

struct Cache {
  std::vector<uint8_t> mem;
  uint8_t* base;
  int nb, bs, hk, slot;
  int64_t sb, sp, sh;  // byte strides of the [blocks, block_size, heads, slot] view
  Cache(int nb_, int bs_, int hk_, int slot_, bool head_major, std::mt19937& rng)
      : mem(static_cast<size_t>(nb_) * bs_ * hk_ * slot_ + 64), nb(nb_), bs(bs_), hk(hk_), slot(slot_) {
    base = mem.data() + (64 - reinterpret_cast<uintptr_t>(mem.data()) % 64) % 64;
    for (auto& b : mem) b = static_cast<uint8_t>(rng());
    sb = static_cast<int64_t>(hk) * bs * slot;
    sp = head_major ? slot : static_cast<int64_t>(hk) * slot;
    sh = head_major ? static_cast<int64_t>(bs) * slot : slot;
  }
  uint8_t* at(int64_t slot_index, int h) {
    return base + (slot_index / bs) * sb + (slot_index % bs) * sp + h * sh;
  }
  CacheView view() { return CacheView{base, sb, sp, sh, bs, hk}; }
  bool contiguous() const { return sp == slot; }
};

// A sorted codebook and its midpoints (any will do: the kernels take vLLM's as data).
void codebook(int bits, int d, std::vector<float>& cent, std::vector<float>& mids) {
  const int n = 1 << bits;
  cent.resize(n);
  for (int i = 0; i < n; ++i) cent[i] = static_cast<float>((i - (n - 1) / 2.0) * 2.7 / n / std::sqrt(d));
  mids.resize(n - 1);
  for (int i = 0; i + 1 < n; ++i) mids[i] = (cent[i] + cent[i + 1]) / 2;
}

std::vector<float> gauss(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// ---- store ------------------------------------------------------------------------------------
void ref_store(const PresetDef& pr, int d, Cache& c, const std::vector<float>& k, const std::vector<float>& v,
               const std::vector<float>& y, const std::vector<float>& norms, const std::vector<float>& mids,
               const std::vector<int64_t>& slots) {
  const Geo g = geo_of(pr, d);
  for (size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] < 0) continue;
    for (int h = 0; h < c.hk; ++h) {
      uint8_t* s = c.at(slots[t], h);
      const size_t row = t * c.hk + h;
      if (pr.kb == 8) {
        for (int j = 0; j < d; ++j)
          s[j] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(k[row * d + j], __NV_SATFINITE, __NV_E4M3));
      } else {
        for (int j = 0; j < d; ++j) {
          uint32_t code = 0;
          for (float m : mids) code += y[row * d + j] >= m;
          set_bits(s, j * pr.kb, pr.kb, code);
        }
        put16(s + g.kc, norms[row]);
      }
      float lo = INFINITY, hi = -INFINITY;
      for (int j = 0; j < d; ++j) lo = std::min(lo, v[row * d + j]), hi = std::max(hi, v[row * d + j]);
      const int maxc = (1 << pr.vb) - 1;
      const float scale = std::max((hi - lo) / static_cast<float>(maxc), 1e-8f);
      for (int j = 0; j < d; ++j) {
        const int q = static_cast<int>((v[row * d + j] - lo) / scale + 0.5f);
        set_bits(s + g.kps, j * pr.vb, pr.vb, static_cast<uint32_t>(std::clamp(q, 0, maxc)));
      }
      put16(s + g.kps + g.vc, scale);
      put16(s + g.kps + g.vc + 2, lo);
    }
  }
}

void test_store(const PresetDef& pr, int d, bool head_major) {
  std::mt19937 rng(d * 7 + pr.kb);
  const int hk = 3, bs = 16, nb = 9, n = 50;
  const Geo g = geo_of(pr, d);
  Cache a(nb, bs, hk, g.slot, head_major, rng);
  Cache b = a;
  b.base = b.mem.data() + (a.base - a.mem.data());
  std::vector<float> k = gauss(static_cast<size_t>(n) * hk * d, rng), v = gauss(k.size(), rng);
  for (size_t i = 0; i < v.size(); ++i) v[i] *= 1.0f + static_cast<float>(i / d % 5);
  std::vector<float> cent, mids, y(k.size()), norms(static_cast<size_t>(n) * hk);
  codebook(pr.kb == 8 ? 4 : pr.kb, d, cent, mids);
  for (size_t r = 0; r < norms.size(); ++r) {
    double s = 0;
    for (int j = 0; j < d; ++j) s += k[r * d + j] * k[r * d + j];
    norms[r] = static_cast<float>(std::sqrt(s));
    for (int i = 0; i < d; ++i) {
      double acc = 0;
      for (int j = 0; j < d; ++j) acc += hadamard(i, j) * k[r * d + j];
      y[r * d + i] = static_cast<float>(acc / norms[r] / std::sqrt(d));
    }
  }
  std::vector<int64_t> slots(n);
  std::vector<int64_t> perm(nb * bs);
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int64_t>(i);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int t = 0; t < n; ++t) slots[t] = t % 7 == 3 ? -1 : perm[t];
  ref_store(pr, d, a, k, v, y, norms, mids, slots);

  StoreParams p;
  p.cache = b.view();
  p.n_tokens = n;
  p.slot_mapping = slots.data();
  p.slot_mapping_i64 = true;
  p.k = Rows{k.data(), DType::F32, static_cast<int64_t>(hk) * d, d};
  p.v = Rows{v.data(), DType::F32, static_cast<int64_t>(hk) * d, d};
  p.y = y.data();
  p.norms = norms.data();
  p.midpoints = mids.data();
  launch_rows(pr.kb, pr.vb, d, n * hk, kStoreWarps, [&](auto kb, auto vb, auto dd) {
    store_kernel<decltype(kb)::value, decltype(vb)::value, decltype(dd)::value>(p);
  });
  size_t diff = 0;
  for (size_t i = 0; i < a.mem.size(); ++i) diff += a.mem[i] != b.mem[i];
  CHECK(diff == 0, "store %s d=%d %s: %zu bytes differ", pr.name, d, head_major ? "head-major" : "token-major", diff);
}

// ---- decode -----------------------------------------------------------------------------------
// One slot decoded as vLLM reads it: keys in the rotated domain (MSE) or as stored (FP8).
void ref_slot(const PresetDef& pr, int d, const uint8_t* s, const std::vector<float>& cent, std::vector<double>& key,
              std::vector<double>& val) {
  const Geo g = geo_of(pr, d);
  key.assign(d, 0.0);
  val.assign(d, 0.0);
  if (pr.kb == 8) {
    for (int j = 0; j < d; ++j) key[j] = fp8_val(s[j]);
  } else {
    double sq = 0;
    for (int j = 0; j < d; ++j) key[j] = cent[get_bits(s, j * pr.kb, pr.kb)], sq += key[j] * key[j];
    const double f = f16_val(s + g.kc) / (pr.nc ? std::sqrt(sq + 1e-16) : 1.0);
    for (auto& x : key) x *= f;
  }
  const double scale = f16_val(s + g.kps + g.vc), zero = f16_val(s + g.kps + g.vc + 2);
  for (int j = 0; j < d; ++j) val[j] = get_bits(s + g.kps, j * pr.vb, pr.vb) * scale + zero;
}

void test_decode(const PresetDef& pr, int d, int group, int splits, bool head_major, int bs, DecodeKernel kernel) {
  std::mt19937 rng(d + group * 31 + splits * 7 + bs);
  const int hk = 2, hq = hk * group;
  const std::vector<int> lens = {0, 1, 17, 100, 300};
  const int batch = static_cast<int>(lens.size());
  int pages_total = 0, width = 0;
  for (int n : lens) pages_total += (n + bs - 1) / bs, width = std::max(width, (n + bs - 1) / bs + 1);
  const int nb = pages_total + 4;
  const Geo g = geo_of(pr, d);
  Cache c(nb, bs, hk, g.slot, head_major, rng);
  std::vector<float> cent, mids;
  codebook(pr.kb == 8 ? 4 : pr.kb, d, cent, mids);
  // Valid slots for every token: random codes, sane fp16 norms / scales / zeros.
  std::vector<int> perm(nb);
  for (int i = 0; i < nb; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> bt(static_cast<size_t>(batch) * width, 0);
  std::uniform_real_distribution<float> u(0.2f, 2.0f);
  for (int b = 0, next = 0; b < batch; ++b)
    for (int pg = 0; pg < (lens[b] + bs - 1) / bs; ++pg) bt[b * width + pg] = perm[next++];
  for (int b = 0; b < batch; ++b)
    for (int t = 0; t < lens[b]; ++t)
      for (int h = 0; h < hk; ++h) {
        uint8_t* s = c.at(static_cast<int64_t>(bt[b * width + t / bs]) * bs + t % bs, h);
        for (int i = 0; i < g.slot; ++i) s[i] = static_cast<uint8_t>(rng());
        if (pr.kb == 8)
          for (int j = 0; j < d; ++j) s[j] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(gauss(1, rng)[0], __NV_SATFINITE, __NV_E4M3));
        else
          put16(s + g.kc, u(rng) * 3);
        put16(s + g.kps + g.vc, u(rng) * 0.1f);
        put16(s + g.kps + g.vc + 2, -u(rng));
      }
  std::vector<float> q = gauss(static_cast<size_t>(batch) * hq * d, rng);
  const double scale = 1.0 / std::sqrt(d);
  // Reference.
  std::vector<double> ref(q.size(), 0.0), key, val;
  for (int b = 0; b < batch; ++b)
    for (int hq_i = 0; hq_i < hq; ++hq_i) {
      const float* qp = &q[(static_cast<size_t>(b) * hq + hq_i) * d];
      std::vector<double> qr(d);
      for (int i = 0; i < d; ++i) {
        if (pr.kb == 8) {
          qr[i] = qp[i];
          continue;
        }
        double acc = 0;
        for (int j = 0; j < d; ++j) acc += hadamard(i, j) * qp[j];
        qr[i] = acc / std::sqrt(d);
      }
      std::vector<double> sc(lens[b]);
      std::vector<std::vector<double>> vals(lens[b]);
      double mx = -INFINITY;
      for (int t = 0; t < lens[b]; ++t) {
        ref_slot(pr, d, c.at(static_cast<int64_t>(bt[b * width + t / bs]) * bs + t % bs, hq_i / group), cent, key, val);
        double dot = 0;
        for (int j = 0; j < d; ++j) dot += qr[j] * key[j];
        sc[t] = dot * scale;
        mx = std::max(mx, sc[t]);
        vals[t] = val;
      }
      double sum = 0;
      for (int t = 0; t < lens[b]; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
      for (int t = 0; t < lens[b]; ++t)
        for (int j = 0; j < d; ++j) ref[(static_cast<size_t>(b) * hq + hq_i) * d + j] += sc[t] / sum * vals[t][j];
    }
  // Kernel.
  std::vector<float> out(q.size(), NAN), ws(static_cast<size_t>(batch) * hq * splits * (d + 1), NAN);
  std::vector<int32_t> lens32(lens.begin(), lens.end());
  DecodeParams p;
  p.cache = c.view();
  p.q = Rows{q.data(), DType::F32, static_cast<int64_t>(hq) * d, d};
  p.out = Rows{out.data(), DType::F32, static_cast<int64_t>(hq) * d, d};
  p.block_table = bt.data();
  p.bt_stride = width;
  p.seq_lens = lens32.data();
  p.centroids = cent.data();
  p.workspace = ws.data();
  p.batch = batch;
  p.n_q_heads = hq;
  p.num_splits = splits;
  p.scale = static_cast<float>(scale);
  p.norm_correction = pr.nc;
  p.contiguous_tiles = c.contiguous();
  p.kernel = kernel;
  Preset preset{pr.kb, pr.vb, d, pr.nc};
  dispatch_preset(preset, [&](auto kb, auto vb, auto dd) {
    launch_decode_emu<decltype(kb)::value, decltype(vb)::value, decltype(dd)::value>(p, group);
  });
  double err = 0, mag = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    err = std::max(err, std::isnan(out[i]) ? INFINITY : std::abs(out[i] - ref[i]));
    mag = std::max(mag, std::abs(ref[i]));
  }
  // The tensor-core kernel rounds q, the key centroids and p * scale to fp16.
  const double tol = kernel == DecodeKernel::Scalar ? 1e-4 : 1e-2;
  CHECK(err <= tol * std::max(1.0, mag), "decode %s %s d=%d group=%d splits=%d %s bs=%d: max err %.3g (|ref| %.3g)",
        kernel == DecodeKernel::Scalar ? "scalar" : "mma", pr.name, d, group, splits,
        head_major ? "head-major" : "token-major", bs, err, mag);
}

// ---- dequantize -------------------------------------------------------------------------------
void test_dequant(const PresetDef& pr, int d) {
  std::mt19937 rng(d * 3 + pr.vb);
  const int hk = 2, bs = 16, n = 70, nb = 8;
  const Geo g = geo_of(pr, d);
  Cache c(nb, bs, hk, g.slot, true, rng);
  std::vector<float> cent, mids;
  codebook(pr.kb == 8 ? 4 : pr.kb, d, cent, mids);
  std::vector<int32_t> bt = {5, 2, 7, 0, 3};
  std::uniform_real_distribution<float> u(0.2f, 2.0f);
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < hk; ++h) {
      uint8_t* s = c.at(static_cast<int64_t>(bt[t / bs]) * bs + t % bs, h);
      if (pr.kb == 8)
        for (int j = 0; j < d; ++j) s[j] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(gauss(1, rng)[0], __NV_SATFINITE, __NV_E4M3));
      else
        put16(s + g.kc, u(rng));
      put16(s + g.kps + g.vc, u(rng) * 0.1f);
      put16(s + g.kps + g.vc + 2, -u(rng));
    }
  std::vector<float> k_out(static_cast<size_t>(n) * hk * d), v_out(k_out.size());
  DequantParams p;
  p.cache = c.view();
  p.block_table = bt.data();
  p.centroids = cent.data();
  p.n_tokens = n;
  p.norm_correction = pr.nc;
  p.k_out = Rows{k_out.data(), DType::F32, static_cast<int64_t>(hk) * d, d};
  p.v_out = Rows{v_out.data(), DType::F32, static_cast<int64_t>(hk) * d, d};
  launch_rows(pr.kb, pr.vb, d, n * hk, kDequantWarps, [&](auto kb, auto vb, auto dd) {
    dequant_kernel<decltype(kb)::value, decltype(vb)::value, decltype(dd)::value>(p);
  });
  double err = 0;
  std::vector<double> key, val;
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < hk; ++h) {
      ref_slot(pr, d, c.at(static_cast<int64_t>(bt[t / bs]) * bs + t % bs, h), cent, key, val);
      for (int i = 0; i < d; ++i) {
        double x = key[i];
        if (pr.kb != 8) {
          x = 0;
          for (int j = 0; j < d; ++j) x += hadamard(i, j) * key[j];
          x /= std::sqrt(d);
        }
        const size_t o = (static_cast<size_t>(t) * hk + h) * d + i;
        err = std::max({err, std::abs(k_out[o] - x), std::abs(v_out[o] - val[i])});
      }
    }
  CHECK(err <= 1e-5, "dequant %s d=%d: max err %.3g", pr.name, d, err);
}

}  // namespace

int main() {
  int cases = 0;
  for (const auto& pr : kPresets)
    for (int d : {64, 128, 256}) {
      test_store(pr, d, true), test_store(pr, d, false);
      test_dequant(pr, d);
      for (DecodeKernel k : {DecodeKernel::Scalar, DecodeKernel::Mma}) {
        for (int group : {1, 3, 8}) test_decode(pr, d, group, 1, true, 16, k), test_decode(pr, d, group, 5, true, 16, k);
        test_decode(pr, d, 5, 2, false, 32, k);  // vLLM <= 0.25's token-major cache, no cp.async
      }
      test_decode(pr, d, 16, 3, true, 16, DecodeKernel::Auto);  // over 8 heads: the scalar kernel
      cases += 18;
    }
  std::printf("%d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}
