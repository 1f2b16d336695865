// Fused store: one warp per (token, kv head) rotates (FWHT in registers), normalises,
// quantizes, packs and scatters K and V into the paged cache through the slot mapping.
// Every arithmetic step mirrors src/core/codec.cpp so the bytes match the CPU reference.
#include <string>
#include <type_traits>

#include "common.cuh"
#include "store.cuh"

namespace tqkv::cuda {
namespace detail {
namespace {

constexpr int kStoreWarps = 8;

// One destination of a launch: its pages, codebooks and slot mapping.
struct StoreDest {
  Layout L;
  CodecTables tab;
  const int64_t* slot_mapping;
};

// N destinations of the same K/V rows (blockIdx.y picks one): a layer's compressed pages and its
// copies in one launch. About 5 KB per destination, within the 32 KB of kernel parameters that
// sm_70+ takes since CUDA 12.1.
template <int N>
struct StoreParams {
  StoreDest dest[N];
  const void* k;
  const void* v;
  DType dtype;
  int64_t token_stride;
  int n_tokens;
  int n_kv_heads;
  bool split_kv;  // StoreArgs::split_kv: even warps keys, odd warps values
  const float* key_mean;   // null, or centre the keys: (k - mean) / scale per channel
  const float* key_scale;  // [n_kv_heads * head_dim], as centre_keys does
};

// Packs the warp's D codes (E = D/32 per lane, lane l holding codes [E*l, E*l+E)) into the
// little-endian bit stream. A lane's E*bits bits are contiguous in the stream; where they are not
// a whole number of bytes, G neighbouring lanes pool theirs through shuffles and the first writes
// (at most 64 bits: E*bits <= 64, and G*E*bits <= 56 where E*bits is not a whole byte count).
template <int D, int BITS>
__device__ __forceinline__ void pack_and_write(const uint32_t (&codes)[D / 32], uint8_t* dst, int lane) {
  constexpr int E = D / 32;
  constexpr int nb = E * BITS;  // <= 64
  constexpr int G = (nb % 8 == 0) ? 1 : (nb % 4 == 0) ? 2 : (nb % 2 == 0) ? 4 : 8;
  using W = std::conditional_t<(G * nb > 32), unsigned long long, uint32_t>;
  W v = 0;
#pragma unroll
  for (int j = 0; j < E; ++j) v |= static_cast<W>(codes[j]) << (j * BITS);
  static_assert(G * nb <= 8 * static_cast<int>(sizeof(W)), "pooled bits fit the word");
  W tot = v;
#pragma unroll
  for (int k = 1; k < G; ++k) {
    const W o = __shfl_down_sync(0xffffffffu, v, k);
    tot |= o << (k * nb);
  }
  if (lane % G) return;
  constexpr int nbytes = G * nb / 8;
  uint8_t* p = dst + lane * nb / 8;
  if constexpr ((nbytes & 1) == 0) {  // even byte count at an even offset: 16-bit stores
#pragma unroll
    for (int i = 0; i < nbytes / 2; ++i) reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(tot >> (16 * i));
  } else {
#pragma unroll
    for (int i = 0; i < nbytes; ++i) p[i] = static_cast<uint8_t>((tot >> (8 * i)) & 0xffu);
  }
}

// Calls f(std::integral_constant<int, B>) for the runtime code width bits (1..8).
template <class F>
__device__ __forceinline__ void with_bits(int bits, F&& f) {
  switch (bits) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// Code of y: the number of thresholds t with y >= t (ties go up), by binary search over the
// ascending thresholds (padded with +inf to 256 entries). NaN gives 0.
template <int BITS>
__device__ __forceinline__ uint32_t quantize(float y, const float* th) {
  uint32_t code = 0;
#pragma unroll
  for (int step = 1 << (BITS - 1); step > 0; step >>= 1)
    if (y >= th[code + step - 1]) code += step;
  return code;
}

// Every fp16/bf16 field of FORMAT.md is 2-byte aligned (slots are even-sized, fields start at
// even offsets), so one 16-bit store writes it. (Byte stores of a 16-bit register holding a
// converted half were seen to write a wrong low byte on sm_90, so this also avoids them.)
__device__ __forceinline__ void write_u16(uint8_t* p, uint32_t v) {
  *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(v & 0xffffu);
}

// Loads a lane's E consecutive input elements, with one vector load for 16-bit inputs.
template <int E>
__device__ __forceinline__ void load_row(float (&x)[E], const void* src, DType t, int64_t base) {
  if (t != DType::F32 && E % 4 == 0 && (base & 3) == 0 && (reinterpret_cast<uintptr_t>(src) & 7) == 0) {
    const uint2* p = reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(src) + base);
#pragma unroll
    for (int q = 0; q < E / 4; ++q) {
      const uint2 w = p[q];
      const uint32_t u[2] = {w.x, w.y};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint16_t h = static_cast<uint16_t>(u[k >> 1] >> (16 * (k & 1)));
        x[4 * q + k] = t == DType::F16 ? h2f_bits(h) : __uint_as_float(static_cast<uint32_t>(h) << 16);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = load_elem(src, t, base + j);
  }
}

// MSE codec: codes of R x/|x| and the (norm-corrected) fp16 norm.
template <int D, int BITS>
__device__ void encode_mse(float (&x)[D / 32], const float* levels, const float* thresholds, bool nc,
                           const CodecTables& tab, uint32_t neg_mask, uint8_t* codes_dst, uint8_t* meta_dst,
                           int lane) {
  constexpr int E = D / 32;
  double sq = 0;
#pragma unroll
  for (int j = 0; j < E; ++j) sq += static_cast<double>(x[j]) * static_cast<double>(x[j]);
  sq = warp_sum(sq);
  const float norm = static_cast<float>(sqrt(sq));
  if (norm > 0) {
    const float inv = __fdiv_rn(1.0f, norm);
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = __fmul_rn(x[j], inv);
  }
  if (neg_mask) {  // SRHT signs of this lane's elements
#pragma unroll
    for (int j = 0; j < E; ++j)
      if ((neg_mask >> j) & 1u) x[j] = -x[j];
  }
  warp_fwht<E>(x, lane);
  double csq = 0;
  uint32_t codes[E];
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const float y = __fmul_rn(x[j], tab.rot_scale);
    codes[j] = quantize<BITS>(y, thresholds);
    const double c = levels[codes[j]];
    csq += c * c;
  }
  csq = warp_sum(csq);
  float stored = norm;
  if (nc && csq > 0) stored = static_cast<float>(static_cast<double>(norm) / sqrt(csq));
  pack_and_write<D, BITS>(codes, codes_dst, lane);
  if (lane == 0) write_u16(meta_dst, f2h_bits(stored));
}

template <int D>
__device__ void encode_plain(const float (&x)[D / 32], KeyCodec codec, uint8_t* dst, int lane) {
  constexpr int E = D / 32;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const int i = lane * E + j;
    if (codec == KeyCodec::F32) {
      reinterpret_cast<uint32_t*>(dst)[i] = __float_as_uint(x[j]);  // f32 slots are 4-byte aligned
    } else if (codec == KeyCodec::F16) {
      write_u16(dst + 2 * i, f2h_bits(x[j]));
    } else if (codec == KeyCodec::BF16) {
      write_u16(dst + 2 * i, __bfloat16_as_ushort(__float2bfloat16_rn(x[j])));
    } else {
      dst[i] = __nv_cvt_float_to_fp8(x[j], __NV_SATFINITE, __NV_E4M3);
    }
  }
}

template <int D, int BITS>
__device__ void encode_uniform(const float (&x)[D / 32], uint8_t* codes_dst,
                               uint8_t* meta0, uint8_t* meta1, int lane) {
  constexpr int E = D / 32;
  float lo = x[0], hi = x[0];
#pragma unroll
  for (int j = 1; j < E; ++j) {
    lo = fminf(lo, x[j]);
    hi = fmaxf(hi, x[j]);
  }
  lo = warp_min(lo);
  hi = warp_max(hi);
  constexpr int max_code = (1 << BITS) - 1;
  const float scale = fmaxf(__fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(max_code)), 1e-8f);
  uint16_t sh = f2h_bits(scale);
  if (h2f_bits(sh) == 0.0f) sh = 0x0001;
  const uint16_t zh = f2h_bits(lo);
  const float s = h2f_bits(sh), z = h2f_bits(zh);
  uint32_t codes[E];
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const float q = floorf(__fadd_rn(__fdiv_rn(__fsub_rn(x[j], z), s), 0.5f));
    codes[j] = static_cast<uint32_t>(fminf(fmaxf(q, 0.0f), static_cast<float>(max_code)));
  }
  pack_and_write<D, BITS>(codes, codes_dst, lane);
  if (lane == 0) {
    write_u16(meta0, sh);
    write_u16(meta1, zh);
  }
}

template <int D, int N>
__global__ void __launch_bounds__(kStoreWarps * 32) store_kernel(const __grid_constant__ StoreParams<N> p) {
  constexpr int E = D / 32;
  const StoreDest& dest = p.dest[N == 1 ? 0 : blockIdx.y];
  const Layout& L = dest.L;
  const CodecTables& tab = dest.tab;
  // Codebooks in shared memory: lanes index them with different codes. Only the 2^bits entries
  // a code width uses are copied (the parameter space holds 256 of each).
  constexpr int NL = CodecTables::kMaxLevels;
  __shared__ float th_k[NL], th_v[NL], lv_k[NL], lv_v[NL];
  const int nk = L.kcodec == KeyCodec::Mse ? 1 << L.kbits : 0;
  const int nv = L.vcodec == ValueCodec::Mse ? 1 << L.vbits : 0;
  for (int i = threadIdx.x; i < nk; i += blockDim.x) {
    th_k[i] = tab.k_thresholds[i];
    lv_k[i] = tab.k_levels[i];
  }
  for (int i = threadIdx.x; i < nv; i += blockDim.x) {
    th_v[i] = tab.v_thresholds[i];
    lv_v[i] = tab.v_levels[i];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int wib = threadIdx.x >> 5;
  const int64_t warp_item = static_cast<int64_t>(blockIdx.x) * kStoreWarps + wib;
  const int64_t item = p.split_kv ? warp_item >> 1 : warp_item;
  if (item >= static_cast<int64_t>(p.n_tokens) * p.n_kv_heads) return;
  const bool keys = !p.split_kv || (warp_item & 1) == 0, values = !p.split_kv || (warp_item & 1) == 1;
  const int t = static_cast<int>(item / p.n_kv_heads);
  const int h = static_cast<int>(item % p.n_kv_heads);
  const int64_t slot = dest.slot_mapping[t];
  if (slot < 0) return;
  const SlotAddr a = slot_addr(L, slot / L.geo.block_size, static_cast<int>(slot % L.geo.block_size), h);
  // This lane's E SRHT sign bits (E divides 32, so they sit in one word).
  const uint32_t neg_mask = (tab.sign_bits[(lane * E) >> 5] >> ((lane * E) & 31)) & ((1u << E) - 1u);
  const int64_t base = static_cast<int64_t>(t) * p.token_stride + static_cast<int64_t>(h) * D + lane * E;

  float x[E];
  if (keys) {
    load_row<E>(x, p.k, p.dtype, base);
    if (p.key_mean) {  // the same float operations as centre_keys, so the same centred keys
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const int c = h * D + lane * E + j;
        x[j] = (x[j] - p.key_mean[c]) / p.key_scale[c];
      }
    }
    if (L.kcodec == KeyCodec::Mse) {
      with_bits(L.kbits, [&](auto b) { encode_mse<D, decltype(b)::value>(x, lv_k, th_k, L.nc, tab, neg_mask, a.kc, a.km, lane); });
    } else {
      encode_plain<D>(x, L.kcodec, a.kc, lane);
    }
  }
  if (!values) return;

  load_row<E>(x, p.v, p.dtype, base);
  if (L.vcodec == ValueCodec::Mse) {
    with_bits(L.vbits, [&](auto b) { encode_mse<D, decltype(b)::value>(x, lv_v, th_v, L.nc, tab, neg_mask, a.vc, a.vm, lane); });
  } else if (L.vcodec == ValueCodec::Uniform) {
    with_bits(L.vbits, [&](auto b) { encode_uniform<D, decltype(b)::value>(x, a.vc, a.vm, a.vm + a.vm1, lane); });
  } else {
    encode_plain<D>(x, plain_codec(L.vcodec), a.vc, lane);
  }
  if (lane == 0 && ((L.geo.key_code_bytes + L.geo.key_meta_bytes + L.geo.value_code_bytes + L.geo.value_meta_bytes) & 1))
    *a.pad = 0;
}

}  // namespace

namespace {

template <int N>
void launch_store(const StoreParams<N>& p, int head_dim, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(p.n_tokens) * p.n_kv_heads * (p.split_kv ? 2 : 1);
  const dim3 grid(static_cast<unsigned>((items + kStoreWarps - 1) / kStoreWarps), N);
  switch (head_dim) {
    case 64: store_kernel<64, N><<<grid, kStoreWarps * 32, 0, stream>>>(p); break;
    case 128: store_kernel<128, N><<<grid, kStoreWarps * 32, 0, stream>>>(p); break;
    default: store_kernel<256, N><<<grid, kStoreWarps * 32, 0, stream>>>(p); break;
  }
  TQKV_CUDA_CHECK(cudaGetLastError());
}

// The fields every destination shares.
template <int N>
void fill_common(StoreParams<N>& p, const StoreArgs& args, int n_kv_heads, int head_dim) {
  p.k = args.k;
  p.v = args.v;
  p.dtype = args.dtype;
  p.token_stride = args.token_stride ? args.token_stride : static_cast<int64_t>(n_kv_heads) * head_dim;
  p.n_tokens = args.n_tokens;
  p.n_kv_heads = n_kv_heads;
  p.split_kv = args.split_kv;
}

template <int N>
void store_n(const StoreTarget* targets, const StoreArgs& args, const float* key_mean, const float* key_scale,
             cudaStream_t stream) {
  StoreParams<N> p{};
  for (int i = 0; i < N; ++i) p.dest[i] = {make_layout(*targets[i].codec, targets[i].kv), targets[i].codec->tables(),
                                           targets[i].slot_mapping};
  fill_common(p, args, targets[0].kv.n_kv_heads, targets[0].codec->head_dim());
  p.key_mean = key_mean;
  p.key_scale = key_scale;
  launch_store(p, targets[0].codec->head_dim(), stream);
}

}  // namespace
}  // namespace detail

void store(const CacheCodec& codec, const PagedKv& kv, const StoreArgs& args, cudaStream_t stream) {
  using namespace detail;
  if (args.n_tokens < 0) throw_arg("n_tokens must be >= 0");
  if (args.n_tokens == 0) return;
  if (!args.k || !args.v || !args.slot_mapping) throw_arg("store: null input");
  StoreParams<1> p{};
  p.dest[0] = {make_layout(codec, kv), codec.tables(), args.slot_mapping};
  fill_common(p, args, kv.n_kv_heads, codec.head_dim());
  launch_store(p, codec.head_dim(), stream);
}

void store_many(const StoreTarget* targets, int n_targets, const StoreArgs& args, const float* key_mean,
                const float* key_scale, cudaStream_t stream) {
  using namespace detail;
  if (n_targets < 1 || n_targets > kMaxStoreTargets)
    throw_arg("store_many: 1 to " + std::to_string(kMaxStoreTargets) + " targets");
  if (args.n_tokens < 0) throw_arg("n_tokens must be >= 0");
  if (!args.k || !args.v) throw_arg("store_many: null input");
  if (!key_mean != !key_scale) throw_arg("store_many: key_mean and key_scale go together");
  for (int i = 0; i < n_targets; ++i) {
    if (!targets[i].codec || !targets[i].slot_mapping) throw_arg("store_many: a target without codec or slot mapping");
    if (targets[i].codec->head_dim() != targets[0].codec->head_dim() || targets[i].kv.n_kv_heads != targets[0].kv.n_kv_heads)
      throw_arg("store_many: targets of different head_dim or kv heads");
  }
  if (args.n_tokens == 0) return;
  switch (n_targets) {
    case 1: store_n<1>(targets, args, key_mean, key_scale, stream); break;
    case 2: store_n<2>(targets, args, key_mean, key_scale, stream); break;
    default: store_n<3>(targets, args, key_mean, key_scale, stream); break;
  }
}

}  // namespace tqkv::cuda
