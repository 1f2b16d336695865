// Host entry points of the tqkv_vllm kernels (store.cu, decode*.cu, dequant.cu). Every pointer
// is device memory; every call only enqueues work on `stream` (no allocation, no
// synchronisation), so the decode can be captured in a CUDA graph. ops.cpp checks the torch
// tensors and fills these structs.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "slot.h"

namespace tqkv_vllm {

// A vLLM preset at one head dim: key bits 3/4 (MSE) or 8 (FP8), value bits 3/4.
struct Preset {
  int key_bits = 4;
  int value_bits = 4;
  int head_dim = 128;
  bool norm_correction = true;
};

// Calls f(integral_constant KB, VB, D) for the presets vLLM ships (turboquant_k8v4, _4bit_nc,
// _k3v4_nc, _3bit_nc) at head dims 64, 128, 256; throws std::invalid_argument otherwise.
template <typename F>
void dispatch_preset(const Preset& p, F&& f) {
  auto by_dim = [&](auto kb, auto vb) {
    switch (p.head_dim) {
      case 64: return f(kb, vb, std::integral_constant<int, 64>{});
      case 128: return f(kb, vb, std::integral_constant<int, 128>{});
      case 256: return f(kb, vb, std::integral_constant<int, 256>{});
      default: throw std::invalid_argument("tqkv_vllm: head dim " + std::to_string(p.head_dim) + " (64, 128 or 256)");
    }
  };
  using C3 = std::integral_constant<int, 3>;
  using C4 = std::integral_constant<int, 4>;
  if (p.key_bits == 8 && p.value_bits == 4) return by_dim(std::integral_constant<int, 8>{}, C4{});
  if (p.key_bits == 4 && p.value_bits == 4) return by_dim(C4{}, C4{});
  if (p.key_bits == 3 && p.value_bits == 4) return by_dim(C3{}, C4{});
  if (p.key_bits == 3 && p.value_bits == 3) return by_dim(C3{}, C3{});
  throw std::invalid_argument("tqkv_vllm: key/value bits " + std::to_string(p.key_bits) + "/" +
                              std::to_string(p.value_bits) + " are not a vLLM preset (8/4, 4/4, 3/4, 3/3)");
}

// A [rows, heads, head_dim] tensor of float32/float16/bfloat16 with contiguous rows: element
// (r, h, j) at data[r * stride_row + h * stride_head + j].
struct Rows {
  void* data = nullptr;
  DType dtype = DType::BF16;
  int64_t stride_row = 0, stride_head = 0;
  __host__ __device__ int64_t at(int64_t r, int64_t h) const { return r * stride_row + h * stride_head; }
};

struct StoreParams {
  CacheView cache;
  int n_tokens = 0;
  const void* slot_mapping = nullptr;  // [n_tokens], int64 or int32; negative: skip
  bool slot_mapping_i64 = true;
  Rows k;  // FP8 keys: [n_tokens, H, D]
  // MSE keys: y [n_tokens * H, D] float32, rotated and normalised; norms [n_tokens * H] float32;
  // midpoints [2^bits - 1] float32, sorted (vLLM's layer._tq_midpoints).
  const float* y = nullptr;
  const float* norms = nullptr;
  const float* midpoints = nullptr;
  Rows v;  // [n_tokens, H, D]
};
void store(const StoreParams& p, const Preset& preset, cudaStream_t stream);

// Which decode kernel runs: Auto takes the tensor-core one (decode_mma_kernel.cuh) for GQA groups
// of up to 8 heads and the CUDA-core one (decode_kernel.cuh) above; Scalar and Mma force one
// (Mma refuses groups over 8). Same results within float rounding.
enum class DecodeKernel : int { Auto = 0, Scalar = 1, Mma = 2 };

// Split-KV decode, one query row per entry of seq_lens (its last position), GQA group
// n_q_heads / n_kv_heads <= 16. The row of query head h reads kv head h / group.
struct DecodeParams {
  CacheView cache;
  Rows q;    // [batch, n_q_heads, D], original domain
  Rows out;  // [batch, n_q_heads, D]
  const int32_t* block_table = nullptr;  // [batch, *]: row stride bt_stride (0: one row for all)
  int64_t bt_stride = 0;
  const int32_t* seq_lens = nullptr;  // [batch]
  const float* centroids = nullptr;   // [2^key_bits] float32 (MSE keys), vLLM's layer._tq_centroids
  float* workspace = nullptr;         // [batch, n_q_heads, num_splits, D + 1] float32 (num_splits > 1)
  int batch = 0;
  int n_q_heads = 0;
  int num_splits = 1;
  float scale = 0.0f;  // softmax scale
  bool norm_correction = true;    // MSE keys: scale by 1 / |centroid vector| (vLLM's _nc presets)
  bool contiguous_tiles = false;  // 16 slots of a head lie back to back, 16-byte aligned (cp.async)
  DecodeKernel kernel = DecodeKernel::Auto;
};
void decode(const DecodeParams& p, const Preset& preset, cudaStream_t stream);
int max_splits();  // the most splits decode takes (the merge's shared-memory bound)

// Tokens [0, n_tokens) of one sequence, decoded into k_out and v_out ([n_tokens, H, D]), keys
// rotated back to the original domain.
struct DequantParams {
  CacheView cache;
  const int32_t* block_table = nullptr;  // the sequence's pages
  const float* centroids = nullptr;
  int n_tokens = 0;
  bool norm_correction = true;
  Rows k_out, v_out;  // one dtype
};
void dequant(const DequantParams& p, const Preset& preset, cudaStream_t stream);

}  // namespace tqkv_vllm
