// Fused store: one warp per (token, kv head) rotates (FWHT in registers), normalises,
// quantizes, packs and scatters K and V into the paged cache through the slot mapping.
// Every arithmetic step mirrors src/core/codec.cpp so the bytes match the CPU reference.
#include "common.cuh"
#include "store.cuh"

namespace tqkv::cuda {
namespace detail {
namespace {

constexpr int kStoreWarps = 8;

struct StoreParams {
  Layout L;
  CodecTables tab;
  const void* k;
  const void* v;
  DType dtype;
  int64_t token_stride;
  const int64_t* slot_mapping;
  int n_tokens;
};

// Packs the warp's D codes (staged in shared memory) into the little-endian bit stream.
template <int D>
__device__ void pack_and_write(const uint8_t* codes, int bits, uint8_t* dst, int lane) {
  const int nbytes = (D * bits + 7) / 8;
  for (int j = lane; j < nbytes; j += 32) {
    const int bit0 = 8 * j;
    uint32_t acc = 0;
    for (int i = bit0 / bits; i < D && i * bits < bit0 + 8; ++i) {
      const int s = i * bits - bit0;
      acc |= s >= 0 ? static_cast<uint32_t>(codes[i]) << s : static_cast<uint32_t>(codes[i]) >> -s;
    }
    dst[j] = static_cast<uint8_t>(acc & 0xffu);
  }
}

// Every fp16/bf16 field of FORMAT.md is 2-byte aligned (slots are even-sized, fields start at
// even offsets), so one 16-bit store writes it. (Byte stores of a 16-bit register holding a
// converted half were seen to write a wrong low byte on sm_90, so this also avoids them.)
__device__ __forceinline__ void write_u16(uint8_t* p, uint32_t v) {
  *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(v & 0xffffu);
}

// MSE codec: codes of R x/|x| and the (norm-corrected) fp16 norm.
template <int D>
__device__ void encode_mse(float (&x)[D / 32], const float* levels, const float* thresholds, int bits, bool nc,
                           const CodecTables& tab, bool srht, uint8_t* codes_smem, uint8_t* codes_dst,
                           uint8_t* meta_dst, int lane) {
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
  if (srht) {
#pragma unroll
    for (int j = 0; j < E; ++j)
      if (sign_negative(tab, lane * E + j)) x[j] = -x[j];
  }
  warp_fwht<E>(x, lane);
  const int nth = (1 << bits) - 1;
  double csq = 0;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const float y = __fmul_rn(x[j], tab.rot_scale);
    int code = 0;
    for (int t = 0; t < nth; ++t) code += y >= thresholds[t] ? 1 : 0;
    codes_smem[lane * E + j] = static_cast<uint8_t>(code);
    const double c = levels[code];
    csq += c * c;
  }
  csq = warp_sum(csq);
  float stored = norm;
  if (nc && csq > 0) stored = static_cast<float>(static_cast<double>(norm) / sqrt(csq));
  __syncwarp();
  pack_and_write<D>(codes_smem, bits, codes_dst, lane);
  if (lane == 0) write_u16(meta_dst, f2h_bits(stored));
  __syncwarp();
}

template <int D>
__device__ void encode_plain(const float (&x)[D / 32], int codec, uint8_t* dst, int lane) {
  constexpr int E = D / 32;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const int i = lane * E + j;
    if (codec == kF32) {
      reinterpret_cast<uint32_t*>(dst)[i] = __float_as_uint(x[j]);  // f32 slots are 4-byte aligned
    } else if (codec == kF16) {
      write_u16(dst + 2 * i, f2h_bits(x[j]));
    } else if (codec == kBF16) {
      write_u16(dst + 2 * i, __bfloat16_as_ushort(__float2bfloat16_rn(x[j])));
    } else {
      dst[i] = __nv_cvt_float_to_fp8(x[j], __NV_SATFINITE, __NV_E4M3);
    }
  }
}

template <int D>
__device__ void encode_uniform(const float (&x)[D / 32], int bits, uint8_t* codes_smem, uint8_t* codes_dst,
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
  const int max_code = (1 << bits) - 1;
  const float scale = fmaxf(__fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(max_code)), 1e-8f);
  uint16_t sh = f2h_bits(scale);
  if (h2f_bits(sh) == 0.0f) sh = 0x0001;
  const uint16_t zh = f2h_bits(lo);
  const float s = h2f_bits(sh), z = h2f_bits(zh);
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const float q = floorf(__fadd_rn(__fdiv_rn(__fsub_rn(x[j], z), s), 0.5f));
    codes_smem[lane * E + j] = static_cast<uint8_t>(fminf(fmaxf(q, 0.0f), static_cast<float>(max_code)));
  }
  __syncwarp();
  pack_and_write<D>(codes_smem, bits, codes_dst, lane);
  if (lane == 0) {
    write_u16(meta0, sh);
    write_u16(meta1, zh);
  }
  __syncwarp();
}

template <int D>
__global__ void __launch_bounds__(kStoreWarps * 32) store_kernel(const __grid_constant__ StoreParams p) {
  constexpr int E = D / 32;
  __shared__ uint8_t codes_smem[kStoreWarps][D];
  const int lane = threadIdx.x & 31;
  const int wib = threadIdx.x >> 5;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kStoreWarps + wib;
  const Layout& L = p.L;
  if (item >= static_cast<int64_t>(p.n_tokens) * L.n_kv_heads) return;
  const int t = static_cast<int>(item / L.n_kv_heads);
  const int h = static_cast<int>(item % L.n_kv_heads);
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;
  const SlotAddr a = slot_addr(L, slot / L.block_size, static_cast<int>(slot % L.block_size), h);
  const bool srht = (p.tab.sign_bits[0] | p.tab.sign_bits[1] | p.tab.sign_bits[2] | p.tab.sign_bits[3] |
                     p.tab.sign_bits[4] | p.tab.sign_bits[5] | p.tab.sign_bits[6] | p.tab.sign_bits[7]) != 0;
  const int64_t base = static_cast<int64_t>(t) * p.token_stride + static_cast<int64_t>(h) * D + lane * E;

  float x[E];
#pragma unroll
  for (int j = 0; j < E; ++j) x[j] = load_elem(p.k, p.dtype, base + j);
  if (L.kcodec == kKeyMse)
    encode_mse<D>(x, p.tab.k_levels, p.tab.k_thresholds, L.kbits, L.nc, p.tab, srht, codes_smem[wib], a.kc, a.km, lane);
  else
    encode_plain<D>(x, L.kcodec, a.kc, lane);

#pragma unroll
  for (int j = 0; j < E; ++j) x[j] = load_elem(p.v, p.dtype, base + j);
  if (L.vcodec == kValMse)
    encode_mse<D>(x, p.tab.v_levels, p.tab.v_thresholds, L.vbits, L.nc, p.tab, srht, codes_smem[wib], a.vc, a.vm, lane);
  else if (L.vcodec == kValUniform)
    encode_uniform<D>(x, L.vbits, codes_smem[wib], a.vc, a.vm, a.vm + a.vm1, lane);
  else
    encode_plain<D>(x, L.vcodec, a.vc, lane);
  if (lane == 0 && ((L.kcb + L.kmb + L.vcb + L.vmb) & 1)) *a.pad = 0;
}

}  // namespace
}  // namespace detail

void store(const CacheCodec& codec, const PagedKv& kv, const StoreArgs& args, cudaStream_t stream) {
  using namespace detail;
  if (args.n_tokens < 0) throw_arg("n_tokens must be >= 0");
  if (args.n_tokens == 0) return;
  if (!args.k || !args.v || !args.slot_mapping) throw_arg("store: null input");
  StoreParams p{};
  p.L = make_layout(codec, kv);
  p.tab = codec.tables();
  p.k = args.k;
  p.v = args.v;
  p.dtype = args.dtype;
  p.token_stride = args.token_stride ? args.token_stride : static_cast<int64_t>(kv.n_kv_heads) * codec.head_dim();
  p.slot_mapping = args.slot_mapping;
  p.n_tokens = args.n_tokens;
  const int64_t items = static_cast<int64_t>(args.n_tokens) * kv.n_kv_heads;
  const dim3 grid(static_cast<unsigned>((items + kStoreWarps - 1) / kStoreWarps));
  switch (codec.head_dim()) {
    case 64: store_kernel<64><<<grid, kStoreWarps * 32, 0, stream>>>(p); break;
    case 128: store_kernel<128><<<grid, kStoreWarps * 32, 0, stream>>>(p); break;
    default: store_kernel<256><<<grid, kStoreWarps * 32, 0, stream>>>(p); break;
  }
  TQKV_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tqkv::cuda
