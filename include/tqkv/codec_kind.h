// The key and value codec ids of a Format (format.h), in a header without dependencies so that
// CUDA device code and the CPU kernels name the codecs by the same enums.
#pragma once
#include <cstdint>

namespace tqkv {

enum class KeyCodec : uint8_t {
  F32,   // 4 B/elem, no meta
  F16,   // 2 B/elem
  BF16,  // 2 B/elem
  Fp8,   // FP8 E4M3 per element, no scale
  Mse,   // b-bit Lloyd-Max codes of R k/|k| + fp16 norm (norm-corrected when asked)
};

enum class ValueCodec : uint8_t {
  F32,
  F16,
  BF16,
  Fp8,
  Uniform,  // b-bit codes of (v - min)/scale + fp16 scale + fp16 zero (= min), no rotation
  Mse,      // like KeyCodec::Mse, in the rotated domain
};

}  // namespace tqkv
