#include "engine/gguf/synth_model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <numbers>
#include <span>

#include "engine/gguf/gguf_writer.h"
#include "tqkv/error.h"
#include "tqkv/half.h"

namespace tqkv::engine {
namespace {

// Shapes from each model's config.json on Hugging Face.
std::vector<SynthShape> make_shapes() {
  std::vector<SynthShape> v;
  auto add = [&](std::string name, std::string arch, int layers, int d, int heads, int kv, int ff, int vocab, int ctx,
                 float base, float eps, bool bias, bool llama3) {
    SynthShape s;
    s.name = std::move(name);
    s.arch = std::move(arch);
    s.layers = layers, s.d_model = d, s.heads = heads, s.kv_heads = kv, s.d_ff = ff, s.vocab = vocab, s.context = ctx;
    s.rope_base = base, s.rms_eps = eps, s.qkv_bias = bias, s.llama3_rope = llama3;
    v.push_back(s);
  };
  add("llama-3.1-8b", "llama", 32, 4096, 32, 8, 14336, 128256, 131072, 500000.0f, 1e-5f, false, true);
  add("llama-3.1-70b", "llama", 80, 8192, 64, 8, 28672, 128256, 131072, 500000.0f, 1e-5f, false, true);
  add("mistral-7b", "llama", 32, 4096, 32, 8, 14336, 32768, 32768, 1e6f, 1e-5f, false, false);  // v0.3
  add("qwen2.5-7b", "qwen2", 28, 3584, 28, 4, 18944, 152064, 32768, 1e6f, 1e-6f, true, false);
  add("qwen2.5-32b", "qwen2", 64, 5120, 40, 8, 27648, 152064, 32768, 1e6f, 1e-6f, true, false);
  return v;
}

// xorshift64*: fast enough to fill tens of gigabytes.
struct Rng {
  uint64_t s;
  uint64_t next() {
    s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
    return s * 0x2545F4914F6CDD1DULL;
  }
  void fill(std::span<uint8_t> out) {
    size_t i = 0;
    for (; i + 8 <= out.size(); i += 8) {
      const uint64_t x = next();
      std::memcpy(out.data() + i, &x, 8);
    }
    for (const uint64_t x = next(); i < out.size(); ++i) out[i] = static_cast<uint8_t>(x >> (8 * (i % 8)));
  }
  float uniform() { return static_cast<float>(next() >> 40) / static_cast<float>(1 << 24); }  // [0, 1)
};

void set_half(uint8_t* p, float v) {
  const uint16_t h = float_to_half(v);
  std::memcpy(p, &h, 2);
}

// Random blocks of `type` whose weights have a standard deviation of about `sd`, mean about 0:
// codes random, each block's scales set (the expected spread of the codes worked out per type).
void fill_weights(std::span<uint8_t> out, TensorType type, float sd, Rng& rng) {
  if (type == TensorType::BF16) {
    for (size_t i = 0; i + 2 <= out.size(); i += 2) {
      const float w = (rng.uniform() * 2.0f - 1.0f) * sd * std::numbers::sqrt3_v<float>;
      uint32_t bits;
      std::memcpy(&bits, &w, 4);
      const uint16_t b = static_cast<uint16_t>(bits >> 16);
      std::memcpy(out.data() + i, &b, 2);
    }
    return;
  }
  rng.fill(out);
  const TensorTypeTraits& t = *tensor_type_traits(static_cast<uint32_t>(type));
  for (size_t b = 0; b + t.block_bytes <= out.size(); b += t.block_bytes) {
    uint8_t* p = out.data() + b;
    switch (type) {
      case TensorType::Q8_0:  // d * q, q uniform int8 (sd ~74)
        set_half(p, sd / 74.0f);
        break;
      case TensorType::Q4_K:  // d * sc * q - dmin * m, sc, m 6-bit, q 4-bit: sd ~150 d, mean ~ (236 d - 31.5 dmin)
        set_half(p, sd / 150.0f);
        set_half(p + 2, sd / 150.0f * 7.5f);
        break;
      case TensorType::Q6_K:  // d * scale * (q - 32), scale int8 (sd ~74), q 6-bit (sd ~18.5)
        set_half(p + 208, sd / 1370.0f);
        break;
      default:
        throw Error(ErrorCode::InvalidArgument, "synth: no random blocks for " + tensor_type_name(static_cast<uint32_t>(type)));
    }
  }
}

// GPT-2's byte-to-character map: the printable bytes stand for themselves, the rest map to
// U+0100 upwards in order.
std::vector<std::string> byte_tokens() {
  std::vector<std::string> tok(256);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    const int cp = printable ? b : next++;
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    tok[b] = s;
  }
  return tok;
}

// Llama 3.1's per-pair divisors (rope_type llama3, as llama.cpp's converter writes them).
std::vector<float> llama3_factors(int head_dim, float base) {
  const double factor = 8, low = 1, high = 4, old_ctx = 8192;
  std::vector<float> out;
  for (int i = 0; i < head_dim / 2; ++i) {
    const double freq = std::pow(static_cast<double>(base), -2.0 * i / head_dim);
    const double wavelen = 2 * std::numbers::pi / freq;
    if (wavelen < old_ctx / high) {
      out.push_back(1.0f);
    } else if (wavelen > old_ctx / low) {
      out.push_back(static_cast<float>(factor));
    } else {
      const double smooth = (old_ctx / wavelen - low) / (high - low);
      out.push_back(static_cast<float>(1 / ((1 - smooth) / factor + smooth)));
    }
  }
  return out;
}

// llama.cpp's Q4_K_M: more bits (Q6_K) for attn_v and ffn_down on the first and last eighth of
// the layers and every third layer between.
bool more_bits(int layer, int layers) {
  return layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2;
}

}  // namespace

int64_t SynthShape::parameters() const {
  const int64_t hd = d_model / heads, q = static_cast<int64_t>(heads) * hd, kv = static_cast<int64_t>(kv_heads) * hd;
  const int64_t per_layer = d_model * (q + 2 * kv) + q * d_model + 3LL * d_model * d_ff + 2 * d_model + (qkv_bias ? q + 2 * kv : 0);
  return per_layer * layers + static_cast<int64_t>(vocab) * d_model * (tied ? 1 : 2) + d_model;
}

const std::vector<SynthShape>& synth_shapes() {
  static const std::vector<SynthShape> shapes = make_shapes();
  return shapes;
}

const SynthShape& synth_shape(const std::string& name) {
  std::string known;
  for (const SynthShape& s : synth_shapes()) {
    if (s.name == name) return s;
    known += (known.empty() ? "" : ", ") + s.name;
  }
  throw Error(ErrorCode::InvalidArgument, "synth: unknown model '" + name + "' (known: " + known + ")");
}

SynthWeights synth_weights(const std::string& name) {
  if (name == "q4_k_m") return SynthWeights::Q4_K_M;
  if (name == "q8_0") return SynthWeights::Q8_0;
  if (name == "bf16") return SynthWeights::BF16;
  throw Error(ErrorCode::InvalidArgument, "synth: weights '" + name + "': give q4_k_m, q8_0 or bf16");
}

size_t write_synthetic_model(const std::string& path, const SynthShape& s, SynthWeights weights, uint64_t seed) {
  if (s.layers <= 0 || s.heads <= 0 || s.kv_heads <= 0 || s.heads % s.kv_heads || s.d_model % s.heads || s.vocab < 260)
    throw Error(ErrorCode::InvalidArgument, "synth: shape '" + s.name + "' is inconsistent");
  const int hd = s.d_model / s.heads, q = s.heads * hd, kv = s.kv_heads * hd;
  const std::string a = s.arch;
  GgufWriter w;
  w.str("general.architecture", a)
      .str("general.name", s.name + " (synthetic: random weights, for speed only)")
      .u32(a + ".block_count", static_cast<uint32_t>(s.layers))
      .u32(a + ".context_length", static_cast<uint32_t>(s.context))
      .u32(a + ".embedding_length", static_cast<uint32_t>(s.d_model))
      .u32(a + ".feed_forward_length", static_cast<uint32_t>(s.d_ff))
      .u32(a + ".attention.head_count", static_cast<uint32_t>(s.heads))
      .u32(a + ".attention.head_count_kv", static_cast<uint32_t>(s.kv_heads))
      .u32(a + ".rope.dimension_count", static_cast<uint32_t>(hd))
      .f32(a + ".rope.freq_base", s.rope_base)
      .f32(a + ".attention.layer_norm_rms_epsilon", s.rms_eps);
  // The tokenizer: GPT-2 byte tokens, one merge, an end-of-text token, control tokens to the
  // vocabulary's size.
  std::vector<std::string> tokens = byte_tokens();
  tokens.push_back("\xC4\xA0t");  // "Ġt"
  tokens.push_back("<|endoftext|>");
  std::vector<int32_t> types(tokens.size(), 1);
  types.back() = 3;
  while (static_cast<int>(tokens.size()) < s.vocab) {
    tokens.push_back("<|synth_" + std::to_string(tokens.size()) + "|>");
    types.push_back(3);
  }
  w.str("tokenizer.ggml.model", "gpt2")
      .str("tokenizer.ggml.pre", "default")
      .strs("tokenizer.ggml.tokens", tokens)
      .i32s("tokenizer.ggml.token_type", types)
      .strs("tokenizer.ggml.merges", {"\xC4\xA0 t"})
      .u32("tokenizer.ggml.eos_token_id", 257)
      .u32("tokenizer.ggml.bos_token_id", 257);

  const bool q4 = weights == SynthWeights::Q4_K_M;
  const TensorType base = q4 ? TensorType::Q4_K : weights == SynthWeights::Q8_0 ? TensorType::Q8_0 : TensorType::BF16;
  const TensorType more = q4 ? TensorType::Q6_K : base;
  // What fills each tensor, in the order added.
  enum class Fill { Weights, Ones, Bias, RopeFactors };
  struct Init {
    Fill fill;
    TensorType type;
    float sd;
  };
  std::vector<Init> init;
  auto mat = [&](const std::string& name, int64_t cols, int64_t rows, TensorType t) {
    w.tensor(name, {cols, rows}, t);
    init.push_back({Fill::Weights, t, 1.0f / std::sqrt(static_cast<float>(cols))});
  };
  auto vec = [&](const std::string& name, int64_t n, Fill fill) {
    w.tensor(name, {n}, TensorType::F32);
    init.push_back({fill, TensorType::F32, 0.1f});
  };
  mat("token_embd.weight", s.d_model, s.vocab, base);
  vec("output_norm.weight", s.d_model, Fill::Ones);
  if (!s.tied) mat("output.weight", s.d_model, s.vocab, more);
  if (s.llama3_rope) vec("rope_freqs.weight", hd / 2, Fill::RopeFactors);
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    const TensorType vd = more_bits(l, s.layers) ? more : base;
    vec(p + "attn_norm.weight", s.d_model, Fill::Ones);
    mat(p + "attn_q.weight", s.d_model, q, base);
    mat(p + "attn_k.weight", s.d_model, kv, base);
    mat(p + "attn_v.weight", s.d_model, kv, vd);
    if (s.qkv_bias) {
      vec(p + "attn_q.bias", q, Fill::Bias);
      vec(p + "attn_k.bias", kv, Fill::Bias);
      vec(p + "attn_v.bias", kv, Fill::Bias);
    }
    mat(p + "attn_output.weight", q, s.d_model, base);
    vec(p + "ffn_norm.weight", s.d_model, Fill::Ones);
    mat(p + "ffn_gate.weight", s.d_model, s.d_ff, base);
    mat(p + "ffn_up.weight", s.d_model, s.d_ff, base);
    mat(p + "ffn_down.weight", s.d_ff, s.d_model, vd);
  }
  const std::vector<float> factors = s.llama3_rope ? llama3_factors(hd, s.rope_base) : std::vector<float>{};
  Rng rng{seed * 0x9E3779B97F4A7C15ULL + 1};
  w.write(path, [&](size_t i, std::span<uint8_t> out) {
    const Init& in = init[i];
    if (in.fill == Fill::Weights) return fill_weights(out, in.type, in.sd, rng);
    std::vector<float> v(out.size() / 4);  // the F32 vectors only (norms, biases, factors)
    switch (in.fill) {
      case Fill::Weights:
        break;
      case Fill::Ones:
        v.assign(v.size(), 1.0f);
        break;
      case Fill::Bias:
        for (float& x : v) x = (rng.uniform() * 2.0f - 1.0f) * in.sd;
        break;
      case Fill::RopeFactors:
        v = factors;
        break;
    }
    std::memcpy(out.data(), v.data(), out.size());
  });
  return std::filesystem::file_size(path);
}

}  // namespace tqkv::engine
