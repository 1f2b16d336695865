#include "engine/cache/cache_spec.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <sstream>

#include "tqkv/contiguous_cache.h"
#include "tqkv/error.h"

#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

// Law / rotation / codec variants are plain values: Format::name() spells those not in the
// traits table.
Format variant_format(KeyCodec kc, int kb, ValueCodec vc, int vb, bool nc, Law law, RotationKind rot) {
  return Format{kc, static_cast<uint8_t>(kb), vc, static_cast<uint8_t>(vb), nc, law, rot};
}

[[noreturn]] void bad_spec(const std::string& spec, const std::string& why) {
  throw Error(ErrorCode::InvalidArgument, "cache spec '" + spec + "': " + why);
}

// The number after the first `prefix` characters of option o, checked to lie in [lo, hi] (an
// integer unless fractional); a malformed or out-of-range one is a bad spec.
double option_number(const std::string& spec, const std::string& o, size_t prefix, double lo, double hi,
                     const char* what, bool fractional = false) {
  size_t used = 0;
  double x = 0;
  try {
    x = fractional ? std::stod(o.substr(prefix), &used) : std::stoi(o.substr(prefix), &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != o.size() - prefix || !(x >= lo && x <= hi)) {
    std::ostringstream os;
    os << "bad " << what << " '" << o << "' (" << lo << ".." << hi << ")";
    bad_spec(spec, os.str());
  }
  return x;
}

bool parse_kv(const std::string& s, int& kb, int& vb) {
  if (s.size() < 4 || s[0] != 'k') return false;
  const size_t v = s.find('v');
  if (v == std::string::npos || v < 2 || v + 1 >= s.size()) return false;
  try {
    size_t a = 0, b = 0;
    kb = std::stoi(s.substr(1, v - 1), &a);
    vb = std::stoi(s.substr(v + 1), &b);
    return a == v - 1 && b == s.size() - v - 1 && kb >= 1 && kb <= 8 && vb >= 1 && vb <= 8;
  } catch (const std::exception&) {
    return false;
  }
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : s) {
    if (ch == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  out.push_back(cur);
  return out;
}

}  // namespace

bool SpecSources::is_rule_based(const std::string& name) const {
  return std::find(rule_based.begin(), rule_based.end(), name) != rule_based.end();
}

CacheSpec resolve_cache_spec(const std::string& spec, const ModelConfig& cfg, const SpecSources& sources) {
  std::vector<std::string> parts = split(spec, '+');
  std::string base = parts[0];
  std::vector<std::string> opts(parts.begin() + 1, parts.end());
  bool recipe_found = false;
  for (const auto& [name, recipe] : sources.recipes)
    if (base == name) {
      std::vector<std::string> rp = split(recipe, '+');
      base = rp[0];
      opts.insert(opts.begin(), rp.begin() + 1, rp.end());
      recipe_found = true;
      break;
    }
  if (!recipe_found && sources.why_not) {
    const std::string why = sources.why_not(base);
    if (!why.empty()) bad_spec(spec, why);
  }
  const NamedFormat* named = find_named_format(base);
  int kb = 0, vb = 0;
  Format f;
  if (named) {
    f = named->format;
  } else {
    if (!parse_kv(base, kb, vb)) bad_spec(spec, "unknown format or recipe '" + base + "'; formats: " + format_names_joined());
    f = variant_format(KeyCodec::Mse, kb, ValueCodec::Mse, vb, true, Law::Sphere, RotationKind::Srht);
  }
  KeyCodec kc = f.key;
  ValueCodec vc = f.value;
  kb = f.key_bits;
  vb = f.value_bits;
  bool nc = f.norm_correction;
  Law law = f.law;
  RotationKind rot = f.rotation;
  CacheSpec out;
  out.name = spec;
  int skip = -1;
  std::vector<int> only;
  std::vector<std::pair<std::vector<int>, std::pair<int, int>>> overrides;
  for (const std::string& o : opts) {
    if (o == "c") {
      out.centre_keys = true;
    } else if (o == "s") {
      out.centre_keys = out.scale_channels = true;
    } else if (o == "gauss" || o == "sphere") {
      law = parse_law(o);
    } else if (o == "had" || o == "srht") {
      rot = o == "had" ? RotationKind::Hadamard : RotationKind::Srht;
    } else if (o == "vu") {
      vc = ValueCodec::Uniform;
    } else if (o == "vm") {
      vc = ValueCodec::Mse;
    } else if (o == "raw") {
      nc = false;
    } else if (o.size() > 1 && o[0] == 'w' && std::isdigit(static_cast<unsigned char>(o[1]))) {
      out.recent_window = static_cast<int>(option_number(spec, o, 1, 1, 1 << 20, "recent window"));
    } else if (o.rfind("wq", 0) == 0 && o.size() > 2) {
      const int b = static_cast<int>(option_number(spec, o, 2, 4, 8, "window code width"));
      out.window_format = variant_format(KeyCodec::Mse, b, ValueCodec::Mse, b, true, Law::Sphere, RotationKind::Srht);
    } else if (o.rfind("fill", 0) == 0 && o.size() > 4) {
      out.fill_bits = option_number(spec, o, 4, 1e-9, 32, "bit budget", true);
    } else if (o.rfind("sink", 0) == 0 && o.size() > 4) {
      out.sinks = static_cast<int>(option_number(spec, o, 4, 1, CacheSpec::kMaxSinks, "sink count"));
    } else if (o.rfind("skip", 0) == 0 && o.size() > 4) {
      try {
        skip = std::stoi(o.substr(4));
      } catch (const std::exception&) {
        bad_spec(spec, "bad option '" + o + "'");
      }
    } else if (o.rfind("only", 0) == 0 && o.size() > 4) {
      for (const std::string& x : split(o.substr(4), '.')) {
        try {
          only.push_back(std::stoi(x));
        } catch (const std::exception&) {
          bad_spec(spec, "bad layer list in '" + o + "'");
        }
      }
    } else if (o.size() > 1 && o[0] == 'L' && o.find('=') != std::string::npos) {
      const size_t eq = o.find('=');
      int k2 = 0, v2 = 0;
      if (!parse_kv(o.substr(eq + 1), k2, v2)) bad_spec(spec, "bad layer override '" + o + "'");
      std::vector<int> layers;
      for (const std::string& x : split(o.substr(1, eq - 1), '.')) {
        try {
          layers.push_back(std::stoi(x));
        } catch (const std::exception&) {
          bad_spec(spec, "bad layer list in '" + o + "'");
        }
        if (layers.back() < 0 || layers.back() >= cfg.n_layers) bad_spec(spec, "layer out of range in '" + o + "'");
      }
      overrides.push_back({layers, {k2, v2}});
    } else {
      bad_spec(spec, "unknown option '" + o + "'");
    }
  }
  const bool plain_key = kc != KeyCodec::Mse, plain_value = vc != ValueCodec::Mse && vc != ValueCodec::Uniform;
  auto make = [&](int k, int v) -> Format {
    if (plain_key && plain_value) return f;
    return variant_format(kc, plain_key ? f.key_bits : k, vc, plain_value ? f.value_bits : v, nc, law, rot);
  };
  const Format inner = make(kb, vb);
  out.layers = boundary_layer_formats(cfg.n_layers, inner, skip);
  if (!only.empty())
    for (int l = 0; l < cfg.n_layers; ++l)
      if (std::find(only.begin(), only.end(), l) == only.end()) out.layers[l] = find_format("f16");
  for (const auto& [layers, kv] : overrides)
    for (int l : layers)
      if (out.layers[l].compressed()) out.layers[l] = make(kv.first, kv.second);
  const int d = cfg.head_dim;
  out.model = cfg;
  double sum = 0, sum_all = 0;
  int n_inner = 0;
  std::ostringstream det;
  for (int l = 0; l < cfg.n_layers; ++l) {
    const Format& lf = out.layers[l];
    sum_all += lf.bits_per_element(d);
    if (lf.compressed() || !inner.compressed()) {
      sum += lf.bits_per_element(d);
      ++n_inner;
    }
    if (l == 0 || out.layers[l] != out.layers[l - 1]) det << (l ? " " : "") << "L" << l << ":" << lf.name();
  }
  out.bits = n_inner ? sum / n_inner : 0;
  out.bits_all = sum_all / cfg.n_layers;
  if (out.fill_bits > 0 && out.recent_window > 0) bad_spec(spec, "fill<B> and w<N> both set the recent window");
  if (out.fill_bits > 0 && out.fill_bits <= out.bits)
    bad_spec(spec, "the slots alone take " + std::to_string(out.bits) + " bits per element: no room for a window");
  if (out.centre_keys) det << (out.scale_channels ? " centred+scaled-keys" : " centred-keys");
  if (out.recent_window) det << " f16-window-" << out.recent_window;
  if (out.fill_bits > 0) det << " window-to-" << out.fill_bits << "-bits";
  if (out.window_format) det << " window-as-" << out.window_format->name();
  if (out.sinks) det << " f16-sinks-" << out.sinks;
  out.detail = det.str();
  if (out.centre_keys) {
    if (!sources.key_stats)
      bad_spec(spec, "key centring (+c/+s) needs key statistics for this model, and its recipe file has none: run "
                     "`tqkv calibrate` (docs/FORMAT.md, \"Recipe files\")");
    const KeyStats& ks = *sources.key_stats;
    const bool any_model = cfg.n_layers == 1 << 16;  // check_cache_spec: statistics come later
    if (!any_model && (ks.n_layers != cfg.n_layers || ks.n_kv_heads != cfg.n_kv_heads || ks.head_dim != cfg.head_dim))
      bad_spec(spec, "the key statistics are shaped for another model (" + std::to_string(ks.n_layers) + " layers, " +
                         std::to_string(ks.n_kv_heads) + " kv heads, head_dim " + std::to_string(ks.head_dim) + ")");
    out.key_stats = sources.key_stats;
  }
  return out;
}

namespace {
double copy_bits(const CacheSpec& s) {  // bits per element of one window position
  return s.window_format ? s.window_format->bits_per_element(s.model.head_dim) : 16.0;
}
}  // namespace

int CacheSpec::window_at(int ctx) const {
  int w = recent_window;
  if (fill_bits > 0 && ctx > 0) {
    // Whole window positions that fit next to the slots and the f16 sinks, over ctx positions.
    const double room = (fill_bits - bits) * ctx - 16.0 * sinks;
    w = std::max(0, static_cast<int>(std::floor(room / copy_bits(*this) + 1e-9)));
  }
  // A model with sliding-window layers: no longer than the shortest of their windows (a longer
  // copy buys nothing there, and their rings hold only that much of the cache).
  for (int l = 0; l < model.n_layers; ++l)
    if (model.window(l) > 0) w = std::min(w, model.window(l));
  return w;
}

double CacheSpec::window_bits(int ctx) const {
  if (ctx <= 0) return 0.0;
  const int s = std::min(sinks, ctx), w = std::min(window_at(ctx), ctx - s);
  return (16.0 * s + copy_bits(*this) * w) / ctx;
}

double CacheSpec::bits_all_at(int ctx) const {
  int compressed = 0;
  for (const Format& f : layers) compressed += f.compressed();
  return layers.empty() ? bits_all : bits_all + window_bits(ctx) * compressed / static_cast<double>(layers.size());
}

int64_t CacheSpec::ring_positions(int layer, int capacity) const {
  const int w = model.window(layer);
  if (w <= 0) return 0;
  bool any_full = false;
  for (int l = 0; l < model.n_layers; ++l) any_full = any_full || model.window(l) <= 0;
  const int64_t ring = static_cast<int64_t>(w) + kWindowStepTokens - 1;
  return any_full && ring < capacity ? ring : 0;
}

CacheBytes CacheSpec::bytes(int64_t held, int capacity) const {
  CacheBytes b;
  b.positions = held;
  const int H = model.n_kv_heads, d = model.head_dim;
  size_t copy_sink = 0, copy_window = 0;  // bytes of one position, every layer
  const size_t window_slot = window_format ? window_format->slot_bytes(d) : find_format("f16").slot_bytes(d);
  for (size_t l = 0; l < layers.size(); ++l) {
    const Format& f = layers[l];
    const int64_t ring = ring_positions(static_cast<int>(l), capacity);
    b.slots += f.slot_bytes(d) * static_cast<size_t>(H) * static_cast<size_t>(ring > 0 ? std::min(held, ring) : held);
    if (!f.compressed()) continue;
    copy_sink += static_cast<size_t>(4) * d * H;  // f16 key and value
    copy_window += window_slot * static_cast<size_t>(H);
  }
  const int64_t s = std::min<int64_t>(sinks, held), w = std::min<int64_t>(window_at(capacity), held);
  b.copies = copy_sink * static_cast<size_t>(s) + copy_window * static_cast<size_t>(w);
  return b;
}

void check_cache_spec(const std::string& spec, const std::vector<std::string>& known_recipes) {
  ModelConfig any;  // no layer is out of range, every head dim is fine
  any.n_layers = 1 << 16;
  any.head_dim = 64;
  any.n_kv_heads = 1;
  SpecSources names;  // recipe names resolve to f16 here: only the syntax of the options is checked
  for (const std::string& r : known_recipes) names.recipes.push_back({r, "f16"});
  names.key_stats = std::make_shared<KeyStats>();  // statistics are checked once the model is known
  resolve_cache_spec(spec, any, names);
}

std::string cache_spec_help(const std::vector<std::string>& known_recipes) {
  std::string recipes;
  for (const std::string& name : known_recipes) recipes += (recipes.empty() ? "" : ", ") + name;
  return "KV-cache spec: a format (" + format_names_joined() + ")" +
         (recipes.empty() ? "" : ", a recipe (" + recipes + ")") +
         " or k<K>v<V> with +options (docs/FORMAT.md, \"Cache specs\")";
}

}  // namespace tqkv::engine
