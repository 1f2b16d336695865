#include "tqkv/options.h"

#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "tqkv/error.h"

namespace tqkv {
namespace {

using K = OptionKind;

// One row per variable, grouped as docs/ENV.md groups them. A default in words (not a number or
// a name the kind takes) is worked out by the reader at run time.
constexpr OptionInfo kOptions[] = {
    // Files.
    {"TQKV_MODEL", K::Path, "models/SmolLM2-135M-Instruct.Q4_1.gguf", "files",
     "the GGUF an engine command loads without -m (relative: ./ first, then the source tree)"},
    {"TQKV_TEXT", K::Path, "data/kjv-genesis.txt", "files", "the text perplexity and eval read without -f"},
    {"TQKV_CALIBRATION_TEXT", K::Path, "data/kjv-exodus.txt", "files", "the text calibrate fits recipes on"},
    {"TQKV_RECIPES", K::Path, "(none)", "files",
     "colon-separated directories searched for recipe files before ./recipes and the source tree's"},
    // CPU.
    {"TQKV_THREADS", K::Count, "all hardware threads", "CPU",
     "threads of the pool that runs attention and the matrix products (-t, set_num_threads override)", 1, 4096},
    {"TQKV_POOL_SPIN_US", K::Count, "50", "CPU",
     "microseconds an idle pool worker polls for the next job before it sleeps (0: sleep at once)", 0, 1'000'000},
    {"TQKV_SIMD", K::Choice, "the CPU's best", "CPU", "the SIMD level every CPU kernel takes (set_simd_level overrides)",
     0, 0, "scalar|avx2|avx512"},
    {"TQKV_SCORES", K::Choice, "int8", "CPU",
     "CPU attention: int8 key scores and value sums, int8 scores with fp32 sums, or fp32 throughout (exact)", 0, 0,
     "int8|int8-keys|exact"},
    {"TQKV_QDOT", K::Choice, "int8", "CPU",
     "decode's quantized-weight products: activations rounded to int8 per block, or kept float32 (set_qdot_mode)", 0, 0,
     "int8|f32"},
    {"TQKV_Q5_0_GROUPS", K::Bool, "1 with int8 products on AVX2, else 0", "CPU",
     "Q5_0 weights regrouped eight blocks at a time at load"},
    {"TQKV_Q4_1_GROUPS", K::Bool, "1 with int8 products on AVX2, else 0", "CPU",
     "Q4_1 weights regrouped eight blocks at a time at load"},
    {"TQKV_Q8_0_GROUPS", K::Bool, "1 with int8 products on AVX2, else 0", "CPU",
     "Q8_0 weights regrouped eight blocks at a time at load"},
    {"TQKV_GROUP_PRODUCTS", K::Bool, "1", "CPU and GPU",
     "products that share an input (Q, K, V; gate, up) run as one group (set_group_products)"},
    {"TQKV_FOLD_NEWEST", K::Bool, "1", "CPU and GPU",
     "a layer with copies folds each query's own position in from its k and v as computed (0: read back)"},
    // The GPU device.
    {"TQKV_CUDA_GRAPHS", K::Bool, "1", "GPU", "decode steps recorded and replayed as CUDA graphs (0: op by op)"},
    {"TQKV_FUSE_OPS", K::Bool, "1", "GPU",
     "the fused operations (residual add + RMSNorm, RoPE + store, ...) rather than their plain ones (set_fused_ops)"},
    {"TQKV_CUDA_SKINNY_MAX", K::Count, "16", "GPU",
     "products of at most this many rows take the skinny kernel, not cuBLAS (0: always cuBLAS)", 0, 64},
    {"TQKV_CUDA_WEIGHTS", K::Choice, "bf16", "GPU",
     "the layers' weight matrices in GPU memory: bf16, or kept in their GGUF blocks (Q4_0/1, Q5_0/1, Q8_0, Q4_K, "
     "Q6_K) and expanded to bf16 by each product", 0, 0, "bf16|quantized"},
    // The GPU cache.
    {"TQKV_FUSED_MAX_ROWS", K::Count, "256", "GPU",
     "steps of at most this many decode rows take the fused launch; larger ones the three launches", 0, INT_MAX},
    {"TQKV_FUSED_CLUSTER", K::Bool, "1", "GPU",
     "the fused decode merges in a thread-block cluster where its CTAs fit one (0: through the workspace)"},
    {"TQKV_FUSED_SHORT_FIRST", K::Choice, "auto", "GPU",
     "the fused grid starts the window's and sinks' CTAs first: auto where it takes more than one wave", 0, 0,
     "auto|0|1"},
    {"TQKV_PREFILL_PATH", K::Choice, "auto", "GPU",
     "prefill runs: the tiled kernel from TQKV_PREFILL_TILED_FROM queries, else decode rows; or forced", 0, 0,
     "auto|tiled|rows"},
    {"TQKV_PREFILL_TILED_FROM", K::Count, "64", "GPU",
     "with TQKV_PREFILL_PATH=auto, runs of at least this many queries take the tiled kernel", 2, LLONG_MAX},
    {"TQKV_PREFILL_WORKSPACE", K::Choice, "f16", "GPU",
     "what compressed formats dequantize to for the tiled prefill kernel", 0, 0, "f16|bf16"},
    // The GPU kernels.
    {"TQKV_PREFILL_KERNEL", K::Choice, "auto", "GPU",
     "the tiled prefill kernel: tensor cores where K and V fit them (auto), or the scalar kernel", 0, 0,
     "auto|scalar"},
    {"TQKV_PREFILL_WARPS", K::Choice, "4", "GPU", "warps of a tensor-core prefill CTA", 0, 0, "4|8"},
    {"TQKV_PREFILL_SPLITS", K::Count, "16", "GPU", "most splits of a tensor-core prefill CTA's keys (1: unsplit)", 1,
     64},
    {"TQKV_DECODE_VALUE_LUT", K::Choice, "smem", "GPU",
     "2- and 3-bit MSE values looked up in the shared-memory pair table or in registers", 0, 0, "smem|reg"},
    {"TQKV_DECODE_KEY_LUT", K::Choice, "256", "GPU",
     "4-bit MSE keys at head dim 64: table entries 256 or 128 bytes apart", 0, 0, "256|128"},
    {"TQKV_DECODE_FILL", K::Choice, "sms for compressed kernels at head dim 256, else slots", "GPU",
     "short contexts' decode grid fills every resident CTA slot or one CTA an SM", 0, 0, "slots|sms"},
    {"TQKV_DECODE_FILL_LONG", K::Choice, "slots", "GPU", "the same for long contexts (more than 512 tiles)", 0, 0,
     "slots|sms"},
    {"TQKV_DECODE_MIN_TILES", K::Count, "2", "GPU", "short contexts' decode: least tiles a warp", 1, 32},
    {"TQKV_DECODE_LONG_MIN_TILES", K::Count, "16 where the grid still fills the SMs, else 8", "GPU",
     "long contexts' decode: least tiles a warp", 1, 32},
};

const char* kind_name(OptionKind k) {
  switch (k) {
    case K::Bool: return "bool";
    case K::Count: return "count";
    case K::Choice: return "choice";
    case K::Path: return "path";
    case K::Text: return "text";
  }
  return "?";
}

[[noreturn]] void bad_value(const OptionInfo& o, const std::string& v) {
  throw Error(ErrorCode::InvalidArgument, std::string(o.name) + "=" + v + ": give " + option_allowed(o) + " (" +
                                              o.description + ")");
}

const OptionInfo& expect(const char* name, OptionKind kind) {
  const OptionInfo& o = option_info(name);
  if (o.kind != kind)
    throw std::logic_error(std::string(name) + " is a " + kind_name(o.kind) + ", read as a " + kind_name(kind));
  return o;
}

bool parse_bool(const OptionInfo& o, const std::string& v) {
  if (v == "1") return true;
  if (v == "0") return false;
  bad_value(o, v);
}

long long parse_count(const OptionInfo& o, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (end == v.c_str() || *end != '\0' || errno == ERANGE || n < o.min || n > o.max ||
      std::isspace(static_cast<unsigned char>(v[0])))
    bad_value(o, v);
  return n;
}

bool is_choice(const OptionInfo& o, std::string_view v) {
  std::string_view rest = o.choices;
  while (!rest.empty()) {
    const size_t bar = rest.find('|');
    if (rest.substr(0, bar) == v) return true;
    if (bar == std::string_view::npos) break;
    rest.remove_prefix(bar + 1);
  }
  return false;
}

// The registry's default of a Count or Choice where it is a value, not words.
[[noreturn]] void no_default(const OptionInfo& o) {
  throw std::logic_error(std::string(o.name) + "'s default (" + o.fallback + ") is worked out by its reader");
}

// The checked value of `o` as text where set.
std::optional<std::string> checked(const OptionInfo& o) {
  std::optional<std::string> v = env_raw(o.name);
  if (!v) return v;
  switch (o.kind) {
    case K::Bool: parse_bool(o, *v); break;
    case K::Count: parse_count(o, *v); break;
    case K::Choice:
      if (!is_choice(o, *v)) bad_value(o, *v);
      break;
    case K::Path:
    case K::Text: break;
  }
  return v;
}

}  // namespace

std::span<const OptionInfo> option_registry() { return kOptions; }

const OptionInfo& option_info(std::string_view name) {
  for (const OptionInfo& o : kOptions)
    if (name == o.name) return o;
  throw Error(ErrorCode::InvalidArgument, std::string(name) + " is not a variable tqkv reads (tqkv env lists them)");
}

std::string option_allowed(const OptionInfo& o) {
  switch (o.kind) {
    case K::Bool: return "0 or 1";
    case K::Count:
      return "a whole number from " + std::to_string(o.min) + " to " +
             (o.max == LLONG_MAX ? std::string("any") : std::to_string(o.max));
    case K::Choice: {
      std::string s = "one of ";
      for (const char* c = o.choices; *c; ++c) s += *c == '|' ? std::string(", ") : std::string(1, *c);
      return s;
    }
    case K::Path: return "a path";
    case K::Text: return "any text";
  }
  return "?";
}

std::optional<std::string> env_raw(const char* name) {
  const char* e = std::getenv(name);
  if (!e || !*e) return std::nullopt;
  return std::string(e);
}

bool env_bool(const char* name) {
  const OptionInfo& o = expect(name, K::Bool);
  if (const std::optional<std::string> v = env_raw(name)) return parse_bool(o, *v);
  if (std::strcmp(o.fallback, "0") != 0 && std::strcmp(o.fallback, "1") != 0) no_default(o);
  return std::strcmp(o.fallback, "1") == 0;
}

bool env_bool(const char* name, bool fallback) {
  const OptionInfo& o = expect(name, K::Bool);
  const std::optional<std::string> v = env_raw(name);
  return v ? parse_bool(o, *v) : fallback;
}

long long env_count(const char* name) {
  const OptionInfo& o = expect(name, K::Count);
  if (const std::optional<std::string> v = env_raw(name)) return parse_count(o, *v);
  char* end = nullptr;
  const long long d = std::strtoll(o.fallback, &end, 10);
  if (end == o.fallback || *end) no_default(o);
  return d;
}

long long env_count(const char* name, long long fallback) {
  const OptionInfo& o = expect(name, K::Count);
  const std::optional<std::string> v = env_raw(name);
  return v ? parse_count(o, *v) : fallback;
}

std::string env_choice(const char* name) {
  const OptionInfo& o = expect(name, K::Choice);
  if (std::optional<std::string> v = checked(o)) return *v;
  if (!is_choice(o, o.fallback)) no_default(o);
  return o.fallback;
}

std::optional<std::string> env_choice_if_set(const char* name) { return checked(expect(name, K::Choice)); }

std::string env_text(const char* name) {
  const OptionInfo& o = option_info(name);
  if (o.kind != K::Path && o.kind != K::Text)
    throw std::logic_error(std::string(name) + " is a " + kind_name(o.kind) + ", read as text");
  return env_raw(name).value_or("");
}

std::string option_value(const OptionInfo& o, bool* from_env) {
  const std::optional<std::string> v = checked(o);
  if (from_env) *from_env = v.has_value();
  return v.value_or(o.fallback);
}

void check_options() {
  for (const OptionInfo& o : kOptions) checked(o);
}

}  // namespace tqkv
