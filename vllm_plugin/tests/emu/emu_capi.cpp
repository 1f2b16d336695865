// The plugin's kernels on the CPU (emu.h) behind a C interface, for vs_vllm.py, which runs them
// beside vLLM's own Triton kernels in Triton's interpreter on the same tensors. Float32 K/V/Q/out,
// contiguous; the cache through its byte strides; returns 0, or 1 with the message on stderr.
#include "launch.h"

#include <cstdio>
#include <exception>

using namespace tqkv_vllm;

namespace {

CacheView view(uint8_t* base, int64_t sb, int64_t sp, int64_t sh, int bs, int hk) {
  return CacheView{base, sb, sp, sh, bs, hk};
}

template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tqkv emu: %s\n", e.what());
    return 1;
  }
}

}  // namespace

extern "C" {

int tqkv_emu_store(uint8_t* cache, int64_t sb, int64_t sp, int64_t sh, int bs, int hk, int n_tokens,
                   const int64_t* slots, const float* k, const float* v, const float* y, const float* norms,
                   const float* mids, int kb, int vb, int d) {
  return guarded([&] {
    StoreParams p;
    p.cache = view(cache, sb, sp, sh, bs, hk);
    p.n_tokens = n_tokens;
    p.slot_mapping = slots;
    p.k = Rows{const_cast<float*>(k), DType::F32, static_cast<int64_t>(hk) * d, d};
    p.v = Rows{const_cast<float*>(v), DType::F32, static_cast<int64_t>(hk) * d, d};
    p.y = y, p.norms = norms, p.midpoints = mids;
    launch_rows(kb, vb, d, n_tokens * hk, kStoreWarps, [&](auto KB, auto VB, auto D) {
      store_kernel<decltype(KB)::value, decltype(VB)::value, decltype(D)::value>(p);
    });
  });
}

int tqkv_emu_decode(uint8_t* cache, int64_t sb, int64_t sp, int64_t sh, int bs, int hk, const float* q, float* out,
                    const int32_t* bt, int64_t bt_stride, const int32_t* lens, const float* cent, float* ws, int batch,
                    int hq, int splits, float scale, int nc, int kb, int vb, int d, int kernel) {
  return guarded([&] {
    DecodeParams p;
    p.cache = view(cache, sb, sp, sh, bs, hk);
    p.q = Rows{const_cast<float*>(q), DType::F32, static_cast<int64_t>(hq) * d, d};
    p.out = Rows{out, DType::F32, static_cast<int64_t>(hq) * d, d};
    p.block_table = bt, p.bt_stride = bt_stride, p.seq_lens = lens, p.centroids = cent, p.workspace = ws;
    p.batch = batch, p.n_q_heads = hq, p.num_splits = splits, p.scale = scale, p.norm_correction = nc != 0;
    // As ops.cpp decides it: 16 slots of a head back to back, 16-byte aligned.
    p.contiguous_tiles = sb % 16 == 0 && sh % 16 == 0 && reinterpret_cast<uintptr_t>(cache) % 16 == 0;
    p.kernel = static_cast<DecodeKernel>(kernel);
    dispatch_preset(Preset{kb, vb, d, nc != 0}, [&](auto KB, auto VB, auto D) {
      constexpr int kKB = decltype(KB)::value, kVB = decltype(VB)::value, kD = decltype(D)::value;
      p.contiguous_tiles = p.contiguous_tiles && sp == Slot<kKB, kVB, kD>::kAligned;
      launch_decode_emu<kKB, kVB, kD>(p, hq / hk);
    });
  });
}

int tqkv_emu_dequant(uint8_t* cache, int64_t sb, int64_t sp, int64_t sh, int bs, int hk, const int32_t* bt,
                     const float* cent, int n_tokens, int nc, float* k_out, float* v_out, int kb, int vb, int d) {
  return guarded([&] {
    DequantParams p;
    p.cache = view(cache, sb, sp, sh, bs, hk);
    p.block_table = bt, p.centroids = cent, p.n_tokens = n_tokens, p.norm_correction = nc != 0;
    p.k_out = Rows{k_out, DType::F32, static_cast<int64_t>(hk) * d, d};
    p.v_out = Rows{v_out, DType::F32, static_cast<int64_t>(hk) * d, d};
    launch_rows(kb, vb, d, n_tokens * hk, kDequantWarps, [&](auto KB, auto VB, auto D) {
      dequant_kernel<decltype(KB)::value, decltype(VB)::value, decltype(D)::value>(p);
    });
  });
}

}  // extern "C"
