// Host side of the CUDA backend: codec tables, layout descriptors, error helpers.
#include <cmath>
#include <cstring>
#include <string>

#include "common.cuh"
#include "tqkv/codebook.h"

namespace tqkv::cuda {
namespace detail {

void throw_cuda(cudaError_t err, const char* expr, const char* file, int line) {
  throw Error(ErrorCode::Device, std::string("CUDA error ") + cudaGetErrorName(err) + " (" +
                                              cudaGetErrorString(err) + ") in " + expr + " at " + file + ":" +
                                              std::to_string(line));
}

void throw_arg(const std::string& what) { throw Error(ErrorCode::InvalidArgument, "tqkv::cuda: " + what); }

Layout make_layout(const CacheCodec& codec, const PagedKv& kv) {
  const Format& f = codec.format();
  const int d = codec.head_dim();
  if (kv.pages == nullptr) throw_arg("null page pool");
  if (kv.block_size != 16 && kv.block_size != 32 && kv.block_size != 64 && kv.block_size != 128)
    throw_arg("block_size must be 16, 32, 64 or 128, got " + std::to_string(kv.block_size));
  if (kv.n_kv_heads <= 0) throw_arg("n_kv_heads must be positive");
  Layout L{};
  L.pages = kv.pages;
  L.geo = page_geometry(f, d, kv.block_size, kv.n_kv_heads, kv.layout);
  L.kcodec = f.key;
  L.kbits = f.key_bits;
  L.vcodec = f.value;
  L.vbits = f.value_bits;
  L.nc = f.norm_correction;
  return L;
}

}  // namespace detail

CacheCodec::CacheCodec(const Format& format, int head_dim, uint64_t seed)
    : format_(format), head_dim_(head_dim), seed_(seed), tables_{} {
  if (head_dim != 64 && head_dim != 128 && head_dim != 256)
    detail::throw_arg("head_dim must be 64, 128 or 256, got " + std::to_string(head_dim));
  const bool kmse = format.key == KeyCodec::Mse, vmse = format.value == ValueCodec::Mse;
  const bool vcoded = vmse || format.value == ValueCodec::Uniform;
  if ((kmse && (format.key_bits < 1 || format.key_bits > 8)) || (vcoded && (format.value_bits < 1 || format.value_bits > 8)))
    detail::throw_arg("format " + format.name() + ": CUDA kernels support 1..8-bit codes");
  auto fill = [&](int bits, float* levels, float* thresholds, uint16_t* levels_h) {
    const Codebook& cb = get_codebook(format.law, head_dim, bits);
    for (int i = 0; i < cb.size(); ++i) levels[i] = cb.levels_f32[i];
    for (int i = 0; i + 1 < cb.size(); ++i) thresholds[i] = cb.thresholds_f32[i];
    for (int i = cb.size() - 1; i < CodecTables::kMaxLevels; ++i) thresholds[i] = INFINITY;
    for (int i = 0; i < cb.size(); ++i) levels_h[i] = __half_as_ushort(__float2half_rn(levels[i]));
  };
  if (kmse) fill(format.key_bits, tables_.k_levels, tables_.k_thresholds, tables_.k_levels_h);
  if (vmse) fill(format.value_bits, tables_.v_levels, tables_.v_thresholds, tables_.v_levels_h);
  if (format.uses_rotation()) {
    const Rotation rot(format.rotation, head_dim, seed);
    if (rot.kind() == RotationKind::Srht)
      for (int i = 0; i < head_dim; ++i)
        if (rot.signs()[i] < 0) tables_.sign_bits[i >> 5] |= 1u << (i & 31);
  }
  tables_.rot_scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
}

size_t page_bytes(const CacheCodec& codec, const PagedKv& kv) {
  return static_cast<size_t>(
      page_geometry(codec.format(), codec.head_dim(), kv.block_size, kv.n_kv_heads, kv.layout).page_bytes());
}

}  // namespace tqkv::cuda
