// Dequantize kernel: paged (either layout) -> contiguous K and V in the original domain, for
// long continuation prefill. One warp per (token, kv head); decoding mirrors
// SlotCodec::decode_key / decode_value (rotated codes go back through R^T = D H / sqrt(d)).
#include "common.cuh"
#include "dequant.cuh"

namespace tqkv::cuda {
namespace detail {
namespace {

constexpr int kDequantWarps = 8;

struct DequantParams {
  Layout L;
  CodecTables tab;
  const int32_t* block_table;
  int start, n_tokens;
  void* k_out;
  void* v_out;
  DType out_dtype;
};

__device__ __forceinline__ uint16_t read_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

__device__ __forceinline__ uint32_t code_at(const uint8_t* bytes, int nbytes, int i, int bits) {
  const int bit = i * bits, byte = bit >> 3, sh = bit & 7;
  uint32_t v = bytes[byte];
  if (byte + 1 < nbytes) v |= static_cast<uint32_t>(bytes[byte + 1]) << 8;
  return (v >> sh) & ((1u << bits) - 1u);
}

__device__ __forceinline__ float plain_elem(const uint8_t* p, KeyCodec codec, int i) {
  if (codec == KeyCodec::F32) {
    const uint32_t b = p[4 * i] | (p[4 * i + 1] << 8) | (p[4 * i + 2] << 16) | (static_cast<uint32_t>(p[4 * i + 3]) << 24);
    return __uint_as_float(b);
  }
  if (codec == KeyCodec::F16) return h2f_bits(read_u16(p + 2 * i));
  if (codec == KeyCodec::BF16) return __uint_as_float(static_cast<uint32_t>(read_u16(p + 2 * i)) << 16);
  const __half_raw h = __nv_cvt_fp8_to_halfraw(p[i], __NV_E4M3);
  return __half2float(__half(h));
}

template <int D>
__device__ void decode_mse(float (&x)[D / 32], const uint8_t* codes, const uint8_t* meta, int bits,
                           const float* levels, const CodecTables& tab, bool srht, int lane) {
  constexpr int E = D / 32;
  const float norm = h2f_bits(read_u16(meta));
  const int nbytes = D * bits / 8;
#pragma unroll
  for (int j = 0; j < E; ++j) x[j] = __fmul_rn(norm, levels[code_at(codes, nbytes, lane * E + j, bits)]);
  warp_fwht<E>(x, lane);
#pragma unroll
  for (int j = 0; j < E; ++j) {
    x[j] = __fmul_rn(x[j], tab.rot_scale);
    if (srht && sign_negative(tab, lane * E + j)) x[j] = -x[j];
  }
}

template <int D>
__global__ void __launch_bounds__(kDequantWarps * 32) dequant_kernel(const __grid_constant__ DequantParams p) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kDequantWarps + (threadIdx.x >> 5);
  const Layout& L = p.L;
  if (item >= static_cast<int64_t>(p.n_tokens) * L.geo.n_kv_heads) return;
  const int i = static_cast<int>(item / L.geo.n_kv_heads), h = static_cast<int>(item % L.geo.n_kv_heads);
  const int t = p.start + i;
  const SlotAddr a = slot_addr(L, p.block_table[t / L.geo.block_size], t % L.geo.block_size, h);
  bool srht = false;
#pragma unroll
  for (int w = 0; w < 8; ++w) srht |= p.tab.sign_bits[w] != 0;
  const int64_t out0 = item * D + lane * E;
  float x[E];
  if (L.kcodec == KeyCodec::Mse) {
    decode_mse<D>(x, a.kc, a.km, L.kbits, p.tab.k_levels, p.tab, srht, lane);
  } else {
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = plain_elem(a.kc, L.kcodec, lane * E + j);
  }
#pragma unroll
  for (int j = 0; j < E; ++j) store_elem(p.k_out, p.out_dtype, out0 + j, x[j]);

  if (L.vcodec == ValueCodec::Mse) {
    decode_mse<D>(x, a.vc, a.vm, L.vbits, p.tab.v_levels, p.tab, srht, lane);
  } else if (L.vcodec == ValueCodec::Uniform) {
    const float s = h2f_bits(read_u16(a.vm)), z = h2f_bits(read_u16(a.vm + a.vm1));
    const int nbytes = D * L.vbits / 8;
#pragma unroll
    for (int j = 0; j < E; ++j)
      x[j] = __fadd_rn(z, __fmul_rn(s, static_cast<float>(code_at(a.vc, nbytes, lane * E + j, L.vbits))));
  } else {
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = plain_elem(a.vc, plain_codec(L.vcodec), lane * E + j);
  }
#pragma unroll
  for (int j = 0; j < E; ++j) store_elem(p.v_out, p.out_dtype, out0 + j, x[j]);
}

}  // namespace
}  // namespace detail

void dequantize(const CacheCodec& codec, const PagedKv& kv, const DequantArgs& args, cudaStream_t stream) {
  using namespace detail;
  if (args.n_tokens < 0 || args.start < 0) throw_arg("dequantize: negative range");
  if (args.n_tokens == 0) return;
  if (!args.block_table || !args.k_out || !args.v_out) throw_arg("dequantize: null argument");
  DequantParams p{};
  p.L = make_layout(codec, kv);
  p.tab = codec.tables();
  p.block_table = args.block_table;
  p.start = args.start;
  p.n_tokens = args.n_tokens;
  p.k_out = args.k_out;
  p.v_out = args.v_out;
  p.out_dtype = args.out_dtype;
  const int64_t items = static_cast<int64_t>(args.n_tokens) * kv.n_kv_heads;
  const dim3 grid(static_cast<unsigned>((items + kDequantWarps - 1) / kDequantWarps));
  switch (codec.head_dim()) {
    case 64: dequant_kernel<64><<<grid, kDequantWarps * 32, 0, stream>>>(p); break;
    case 128: dequant_kernel<128><<<grid, kDequantWarps * 32, 0, stream>>>(p); break;
    default: dequant_kernel<256><<<grid, kDequantWarps * 32, 0, stream>>>(p); break;
  }
  TQKV_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tqkv::cuda
