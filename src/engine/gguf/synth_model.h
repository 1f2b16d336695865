// Synthetic models of real shapes, for speed and memory only: a GGUF with the metadata and tensor
// shapes of a named model (Llama-3.1-8B, Qwen2.5-7B, ...), its weights random blocks of the GGUF
// types such models ship in, and a byte-level tokenizer the engine loads. Nothing can be
// downloaded on the GPU machine, so `tqkv synth` writes the 7B-70B models there; their output is
// noise and never a quality figure.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tqkv::engine {

struct SynthShape {
  std::string name;  // e.g. "llama-3.1-8b"
  std::string arch;  // general.architecture: llama or qwen2
  int layers = 0, d_model = 0, heads = 0, kv_heads = 0, d_ff = 0, vocab = 0, context = 0;
  float rope_base = 10000.0f, rms_eps = 1e-5f;
  bool qkv_bias = false, tied = false;
  bool llama3_rope = false;  // rope_freqs.weight as Llama 3.1 (factor 8, 1, 4, original 8192)

  // Parameters (weights' elements) of the model.
  int64_t parameters() const;
};

// The named shapes (their configs on Hugging Face); `tqkv synth --list` prints them.
const std::vector<SynthShape>& synth_shapes();
// The shape of `name`; throws tqkv::Error(InvalidArgument) listing the known names.
const SynthShape& synth_shape(const std::string& name);

// How the weights are stored: q4_k_m (Q4_K, with Q6_K for the output head and for attn_v and
// ffn_down on llama.cpp's "more bits" layers), q8_0, or bf16. Norms and biases are F32.
enum class SynthWeights { Q4_K_M, Q8_0, BF16 };
SynthWeights synth_weights(const std::string& name);  // throws Error(InvalidArgument)

// Writes the model to path (seeded random blocks scaled so activations stay near unit size).
// Returns the bytes written. Throws tqkv::Error(InvalidArgument) when it cannot write.
size_t write_synthetic_model(const std::string& path, const SynthShape& shape, SynthWeights weights, uint64_t seed = 1);

}  // namespace tqkv::engine
