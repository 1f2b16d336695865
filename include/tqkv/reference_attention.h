// Scalar reference attention over compressed slots: the oracle for every SIMD and CUDA kernel.
// It decodes each slot on the fly in the codec's domain (never a dequantized cache), rotates
// the queries once, runs a two-pass softmax in double precision, and rotates the output back
// once when values are stored rotated.
#pragma once
#include <cstdint>

#include "tqkv/codec.h"

namespace tqkv {

// One kv-head and the `group` query heads that share it (GQA).
//   slots:  [n_keys] pointers to slots of this kv-head (key at offset 0, value at key_bytes)
//   q:      [group, dim] queries in the original domain
//   out:    [group, dim]
//   lse:    optional [group] natural-log sum of exp(scores) (for merging partial results)
// n_keys == 0 writes zeros and lse = -inf.
void reference_attention(const SlotCodec& codec, const uint8_t* const* slots, int n_keys, const float* q,
                         int group, float scale, float* out, float* lse = nullptr);

}  // namespace tqkv
