// A whole tiny Llama model as GGUF bytes (gguf_builder.h), for tests that need a model that
// loads and no file: 1 layer, d_model 32, 2 heads of 16, d_ff 64, 8 tokens, F32 weights of a
// fixed small pattern, no tokenizer. Any tensor can be given other bytes and type (a damaged
// or a quantized one).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "gguf_builder.h"

namespace tqkv::engine::test {

struct TinyTensor {
  uint32_t type;  // ggml type id
  std::vector<uint8_t> bytes;
};

constexpr int kTinyDim = 32, kTinyFf = 64, kTinyVocab = 8;

// The F32 bytes of n pattern weights (about 0.1 in size, none zero).
inline std::vector<uint8_t> tiny_f32(size_t n, float scale = 0.1f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * std::sin(0.37f * static_cast<float>(i) + 0.5f);
  std::vector<uint8_t> b(n * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// The model; `replace` maps tensor names to the type and bytes they get instead.
inline std::vector<uint8_t> tiny_llama_gguf(const std::map<std::string, TinyTensor>& replace = {}) {
  GgufBuilder b;
  b.str("general.architecture", "llama")
      .u32("llama.block_count", 1)
      .u32("llama.embedding_length", kTinyDim)
      .u32("llama.attention.head_count", 2)
      .u32("llama.feed_forward_length", kTinyFf)
      .u32("llama.context_length", 64);
  const std::vector<std::pair<std::string, std::vector<uint64_t>>> tensors = {
      {"token_embd.weight", {kTinyDim, kTinyVocab}},   {"output_norm.weight", {kTinyDim}},
      {"blk.0.attn_norm.weight", {kTinyDim}},          {"blk.0.attn_q.weight", {kTinyDim, kTinyDim}},
      {"blk.0.attn_k.weight", {kTinyDim, kTinyDim}},   {"blk.0.attn_v.weight", {kTinyDim, kTinyDim}},
      {"blk.0.attn_output.weight", {kTinyDim, kTinyDim}}, {"blk.0.ffn_norm.weight", {kTinyDim}},
      {"blk.0.ffn_gate.weight", {kTinyDim, kTinyFf}},  {"blk.0.ffn_up.weight", {kTinyDim, kTinyFf}},
      {"blk.0.ffn_down.weight", {kTinyFf, kTinyDim}}};
  for (const auto& [name, shape] : tensors) {
    if (const auto it = replace.find(name); it != replace.end()) {
      b.tensor(name, shape, it->second.type, it->second.bytes);
      continue;
    }
    size_t n = 1;
    for (uint64_t d : shape) n *= d;
    const bool norm = shape.size() == 1;
    b.tensor(name, shape, 0, norm ? tiny_f32(n, 1.0f) : tiny_f32(n));
  }
  return b.build();
}

}  // namespace tqkv::engine::test
