// The key/value pairs that have a compiled split-KV decode kernel (decode_kernel.cuh), one
// list for every head dim: X(key kind, value kind), kinds as decode_kernel.cuh names them
// (kmse(b), vmse(b), vuni(b), K_FP8, ...). Each pair costs three kernel instantiations (and
// compile time), so the list holds what the presets, the named pairs, the recipes and the
// default recent-window copies (wq6) use; any other pair of codecs still stores, dequantizes and
// attends through engine::CudaKvCache's dequantize + tiled path.
#pragma once

#define TQKV_DECODE_PAIRS(X)                                                                   \
  /* uncompressed and FP8 */                                                                   \
  X(K_F16, V_F16) X(K_BF16, V_BF16) X(K_FP8, V_FP8)                                            \
  /* vLLM's presets: turboquant_k8v4, _4bit_nc, _k3v4_nc, _3bit_nc */                           \
  X(K_FP8, vuni(4)) X(kmse(4), vuni(4)) X(kmse(3), vuni(4)) X(kmse(3), vuni(3))                 \
  /* the spec's pairs tq-k<K>v<V>, K, V in 2..4 */                                              \
  X(kmse(2), vmse(2)) X(kmse(2), vmse(3)) X(kmse(2), vmse(4))                                  \
  X(kmse(3), vmse(2)) X(kmse(3), vmse(3)) X(kmse(3), vmse(4))                                  \
  X(kmse(4), vmse(2)) X(kmse(4), vmse(3)) X(kmse(4), vmse(4))                                  \
  /* the recipes' wide keys (tq-4.36, tq-4.25, tq-4.375-b16, tq-3.12) */                        \
  X(kmse(5), vmse(2)) X(kmse(5), vmse(3)) X(kmse(5), vmse(4)) X(kmse(6), vmse(3))              \
  /* the all-layer recipes (calibrate --boundary-in-budget): SmolLM2's k6v5, Qwen2.5-Coder's  \
     k6v4 and its layer 0's 8-bit keys */                                                      \
  X(kmse(6), vmse(4)) X(kmse(6), vmse(5)) X(kmse(8), vmse(2)) X(kmse(8), vmse(3))              \
  /* Qwen2.5-Coder-1.5B's tq-4.375 (k5v5 layers) */                                            \
  X(kmse(5), vmse(5))                                                                          \
  /* the recent window's copies of the recipes (wq6) */                                         \
  X(kmse(6), vmse(6))

// The kernel picker of head dim D over the list (one per decode_d<D>.cu, inside
// namespace tqkv::cuda::detail, after decode_kernel.cuh).
#define TQKV_DECODE_CASE(K, V) \
  if (kk == (K) && vk == (V)) return make_kernel<TQKV_DECODE_D, (K), (V)>();
#define TQKV_DEFINE_PICK_KERNEL()                    \
  template <>                                        \
  Kernel pick_kernel<TQKV_DECODE_D>(int kk, int vk) { \
    TQKV_DECODE_PAIRS(TQKV_DECODE_CASE)              \
    return Kernel{};                                 \
  }

// The fused decode of a layer with copies (run_fused_decode: the compressed middle, the recent
// window's copies, the sinks' f16 copies in one launch): X(middle key kind, middle value kind,
// window key kind, window value kind), per head dim. Each costs one kernel of three tile loops;
// a layer whose pair is not listed takes the three launches and merges (engine::CudaKvCache).
#define TQKV_FUSED_QUADS_64(X)                                                                  \
  /* SmolLM2's recipes (tq-4.375, tq-3.375, tq-2.5, their all-layer forms) with wq6 windows */  \
  X(kmse(2), vmse(2), kmse(6), vmse(6)) X(kmse(2), vmse(3), kmse(6), vmse(6))                  \
  X(kmse(3), vmse(2), kmse(6), vmse(6)) X(kmse(3), vmse(3), kmse(6), vmse(6))                  \
  X(kmse(3), vmse(4), kmse(6), vmse(6)) X(kmse(4), vmse(2), kmse(6), vmse(6))                  \
  X(kmse(4), vmse(3), kmse(6), vmse(6)) X(kmse(4), vmse(4), kmse(6), vmse(6))                  \
  X(kmse(5), vmse(3), kmse(6), vmse(6)) X(kmse(5), vmse(4), kmse(6), vmse(6))                  \
  X(kmse(6), vmse(3), kmse(6), vmse(6)) X(kmse(6), vmse(5), kmse(6), vmse(6))                  \
  /* f16 windows (w<N> without wq<B>; no window: the f16 kinds) */                             \
  X(kmse(3), vmse(2), K_F16, V_F16) X(kmse(4), vmse(2), K_F16, V_F16) X(kmse(5), vmse(3), K_F16, V_F16)
#define TQKV_FUSED_QUADS_128(X) \
  X(kmse(4), vmse(2), K_F16, V_F16) X(kmse(4), vmse(3), kmse(6), vmse(6)) X(kmse(3), vmse(2), kmse(6), vmse(6))

#define TQKV_FUSED_CASE(K, V, WK, WV) \
  if (kk == (K) && vk == (V) && wk == (WK) && wv == (WV)) return make_fused_kernel<TQKV_DECODE_D, (K), (V), (WK), (WV)>();
#define TQKV_DEFINE_PICK_FUSED_KERNEL(LIST)                                  \
  template <>                                                                \
  FusedKernel pick_fused_kernel<TQKV_DECODE_D>(int kk, int vk, int wk, int wv) { \
    LIST(TQKV_FUSED_CASE)                                                    \
    return FusedKernel{};                                                    \
  }
