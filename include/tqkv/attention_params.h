// The parameters of one attention call, shared by the CPU paths (tqkv::attention,
// tqkv::paged_attention) and the CUDA decode (tqkv::cuda::DecodeArgs). Plain data, includable
// by g++ and nvcc. A path that cannot honour a field throws tqkv::Error(InvalidArgument) when
// it is set, never ignores it.
#pragma once
#include <cstdint>

namespace tqkv {

struct AttentionParams {
  int n_q_heads = 1;  // a multiple of the cache's n_kv_heads (grouped-query attention)
  int head_dim = 0;   // the caller's head dim; must equal the cache's (0: take the cache's)
  float scale = 0;    // softmax scale; 0 means 1/sqrt(head_dim)
  int window = 0;     // sliding window: a query at position p sees keys in (p - window, p]; 0 = all
  // Cuts for attention split over several caches (the engine keeps some positions in a
  // separate uncompressed cache, src/engine/cache/recent_window.h): a query at p sees no key below
  // min_key_pos and none above p - exclude_recent.
  int64_t min_key_pos = 0;
  int exclude_recent = 0;
  // Optional [n_q, n_q_heads]: ln of the sum of exp(scaled score) over the keys each row saw
  // (-inf when it saw none; its output row is then 0), so that the outputs of disjoint key
  // sets can be merged exactly.
  float* lse = nullptr;
};

}  // namespace tqkv
