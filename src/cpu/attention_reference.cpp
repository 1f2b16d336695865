// attention_reference: the scalar oracle applied to a contiguous cache, plus the argument
// checks shared by every CPU attention path.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "attention_checks.h"
#include "tqkv/attention.h"
#include "tqkv/error.h"
#include "tqkv/reference_attention.h"

namespace tqkv {

AttentionPlan check_attention(const ContiguousCache& cache, int layer, int n_q, int64_t q_pos0,
                              const AttentionParams& params) {
  if (layer < 0 || layer >= cache.n_layers())
    throw Error(ErrorCode::OutOfRange, "attention: layer " + std::to_string(layer) + " out of range");
  const int H = cache.n_kv_heads();
  if (params.n_q_heads < H || params.n_q_heads % H != 0)
    throw Error(ErrorCode::InvalidArgument, "attention: n_q_heads " + std::to_string(params.n_q_heads) +
                                                " is not a multiple of n_kv_heads " + std::to_string(H));
  if (n_q < 0) throw Error(ErrorCode::InvalidArgument, "attention: negative query count");
  if (n_q > 0 && (q_pos0 < cache.first_pos() || q_pos0 + n_q > cache.seq_len()))
    throw Error(ErrorCode::OutOfRange, "attention: query positions [" + std::to_string(q_pos0) + ", " +
                                           std::to_string(q_pos0 + n_q) + ") are not in the cache window [" +
                                           std::to_string(cache.first_pos()) + ", " +
                                           std::to_string(cache.seq_len()) + ")");
  if (params.head_dim != 0 && params.head_dim != cache.head_dim())
    throw Error(ErrorCode::InvalidArgument, "attention: query head dim " + std::to_string(params.head_dim) +
                                                " does not match the cache's " + std::to_string(cache.head_dim()));
  if (params.window < 0) throw Error(ErrorCode::InvalidArgument, "attention: negative window");
  if (params.exclude_recent < 0) throw Error(ErrorCode::InvalidArgument, "attention: negative exclude_recent");
  AttentionPlan plan;
  plan.group = params.n_q_heads / H;
  plan.scale = params.scale != 0 ? params.scale : 1.0f / std::sqrt(static_cast<float>(cache.head_dim()));
  return plan;
}

int64_t key_begin(const ContiguousCache& cache, int64_t pos, const AttentionParams& params) {
  int64_t begin = std::max(cache.first_pos(), params.min_key_pos);
  if (params.window > 0) begin = std::max(begin, pos - params.window + 1);
  return begin;
}

int64_t key_end(int64_t pos, const AttentionParams& params) { return pos - params.exclude_recent; }

void attention_reference(const ContiguousCache& cache, int layer, const float* q, int n_q, int64_t q_pos0,
                         const AttentionParams& params, float* out) {
  const AttentionPlan plan = check_attention(cache, layer, n_q, q_pos0, params);
  const int H = cache.n_kv_heads(), d = cache.head_dim();
  const SlotCodec& codec = cache.codec(layer);
  std::vector<const uint8_t*> slots;
  for (int t = 0; t < n_q; ++t) {
    const int64_t pos = q_pos0 + t;
    const int64_t begin = key_begin(cache, pos, params), end = key_end(pos, params);
    for (int h = 0; h < H; ++h) {
      slots.clear();
      for (int64_t p = begin; p <= end; ++p) slots.push_back(cache.slot(layer, h, p));
      const size_t off = (static_cast<size_t>(t) * params.n_q_heads + static_cast<size_t>(h) * plan.group) * d;
      float* lse = params.lse ? params.lse + static_cast<size_t>(t) * params.n_q_heads +
                                    static_cast<size_t>(h) * plan.group
                              : nullptr;
      reference_attention(codec, slots.data(), static_cast<int>(slots.size()), q + off, plan.group, plan.scale,
                          out + off, lse);
    }
  }
}

}  // namespace tqkv
