// RoPE as a model declares it: which coordinates pair up, the base, and how the frequencies were
// stretched for a longer context than the model first trained at (linear, YaRN, Llama 3's
// per-pair factors). Both devices and the cache's key centring take their frequencies from here,
// so a scaled model rotates the same way in prefill, decode and the cache's statistics.
#pragma once
#include <vector>

namespace tqkv::engine {

// How RoPE pairs the coordinates of a head: Llama GGUFs (whose q/k rows the converter
// permuted) rotate adjacent pairs (2i, 2i+1); NeoX-style models (Qwen2, Gemma, ...) rotate
// (i, i + n_rot/2).
enum class RopeLayout { Adjacent, Halves };

// The context extension a model's RoPE carries (GGUF {arch}.rope.scaling.*, rope_freqs.weight).
// Each form matches transformers' rope_type of the same name.
struct RopeScaling {
  enum class Kind { None, Linear, Yarn };
  Kind kind = Kind::None;
  double factor = 1.0;       // Linear, Yarn: how many times longer the context became
  int original_context = 0;  // Yarn: the context the model trained at before the extension
  double beta_fast = 32.0;   // Yarn: pairs turning more than beta_fast times over it keep their frequency,
  double beta_slow = 1.0;    //   pairs turning fewer than beta_slow times are interpolated, a ramp between
  double ext_factor = 1.0;   // Yarn: the ramp's weight (llama.cpp's yarn_ext_factor; 1 in transformers)
  double attn_factor = 0.0;  // Yarn: cos and sin are scaled by it; 0: 0.1 ln(factor) + 1 (transformers' default)
  // Llama 3 (rope_type "llama3"; rope_freqs.weight): pair i's frequency divided by
  // freq_factors[i]. Empty: none. [n_rot / 2]
  std::vector<float> freq_factors;

  bool active() const { return kind != Kind::None || !freq_factors.empty(); }
};

struct RopeParams {
  int n_rot = 0;  // leading dims of each head that RoPE rotates (even)
  float base = 10000.0f;
  RopeLayout layout = RopeLayout::Adjacent;
  RopeScaling scaling;

  // Pair i's angle per position, scaling applied: base^(-2i/n_rot) in double, then the scaling,
  // rounded to float once. [n_rot / 2]
  std::vector<float> inv_freq() const;
  // The factor on cos and sin (YaRN's attention factor; 1 for every other form), which scales
  // both q and k and so the attention logits by its square.
  float mscale() const;
  // Throws tqkv::Error(Format) naming what is inconsistent (a factor below 1, freq_factors of the
  // wrong length or not positive, a YaRN ramp with beta_slow >= beta_fast).
  void validate() const;
};

}  // namespace tqkv::engine
