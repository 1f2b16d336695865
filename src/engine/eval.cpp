#include "eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <stdexcept>

#include "perplexity.h"
#include "sampler.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

// Formats that are not in the traits table (law / rotation / codec variants) live here for the
// life of the process, so that a Format* stays valid like the table's own entries.
const Format& variant_format(KeyCodec kc, int kb, ValueCodec vc, int vb, bool nc, Law law, RotationKind rot) {
  for (const Format& f : all_formats())
    if (f.key == kc && f.key_bits == kb && f.value == vc && f.value_bits == vb && f.norm_correction == nc &&
        f.law == law && f.rotation == rot)
      return f;
  if (kc == KeyCodec::Mse && vc == ValueCodec::Mse && nc && law == Law::Sphere && rot == RotationKind::Srht &&
      kb >= 2 && kb <= 4 && vb >= 2 && vb <= 4)
    return mse_pair_format(kb, vb);
  static std::mutex mu;
  static std::deque<std::string> names;
  static std::deque<Format> formats;
  std::lock_guard<std::mutex> lock(mu);
  for (const Format& f : formats)
    if (f.key == kc && f.key_bits == kb && f.value == vc && f.value_bits == vb && f.norm_correction == nc &&
        f.law == law && f.rotation == rot)
      return f;
  std::ostringstream os;
  os << 'k' << kb << 'v' << vb << (vc == ValueCodec::Uniform ? "u" : "") << '-' << law_name(law) << '-'
     << rotation_name(rot) << (nc ? "" : "-raw");
  const std::string n = os.str();
  names.push_back(n);
  formats.push_back(Format{names.back().c_str(), kc, static_cast<uint8_t>(kb), vc, static_cast<uint8_t>(vb), nc, law,
                           rot, "issue-6 study variant"});
  return formats.back();
}

[[noreturn]] void bad_spec(const std::string& spec, const std::string& why) {
  throw std::invalid_argument("cache spec '" + spec + "': " + why);
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

const std::vector<std::pair<std::string, std::string>>& named_recipes() {
  static const std::vector<std::pair<std::string, std::string>> r = {
      // Chosen on SmolLM2-135M-Instruct (30 layers, head_dim 64) by the per-layer sensitivity
      // scan of docs/RESULTS.md: centred keys (channel balancing did not help at 4K); the six
      // most sensitive inner layers get one more key bit.
      {"tq-4.36", "k4v4+c+L19.18.13.25.17.23=k5v4"},
      {"tq-3.36", "k3v3+c+L19.18.13.25.17.23=k4v3"},
      {"tq-2.75", "k3v2+c"},
  };
  return r;
}

CacheSpec resolve_cache_spec(const std::string& spec, const ModelConfig& cfg) {
  std::vector<std::string> parts = split(spec, '+');
  std::string base = parts[0];
  std::vector<std::string> opts(parts.begin() + 1, parts.end());
  for (const auto& [name, recipe] : named_recipes())
    if (base == name) {
      std::vector<std::string> rp = split(recipe, '+');
      base = rp[0];
      opts.insert(opts.begin(), rp.begin() + 1, rp.end());
      break;
    }
  const Format* f = try_find_format(base);
  int kb = 0, vb = 0;
  if (!f) {
    if (!parse_kv(base, kb, vb)) bad_spec(spec, "unknown format '" + base + "'; valid: " + format_names_joined());
    f = &variant_format(KeyCodec::Mse, kb, ValueCodec::Mse, vb, true, Law::Sphere, RotationKind::Srht);
  }
  KeyCodec kc = f->key;
  ValueCodec vc = f->value;
  kb = f->key_bits;
  vb = f->value_bits;
  bool nc = f->norm_correction;
  Law law = f->law;
  RotationKind rot = f->rotation;
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
  auto make = [&](int k, int v) -> const Format& {
    if (plain_key && plain_value) return *f;
    return variant_format(kc, plain_key ? f->key_bits : k, vc, plain_value ? f->value_bits : v, nc, law, rot);
  };
  const Format& inner = make(kb, vb);
  out.layers = boundary_layer_formats(cfg.n_layers, inner, skip);
  if (!only.empty())
    for (int l = 0; l < cfg.n_layers; ++l)
      if (std::find(only.begin(), only.end(), l) == only.end()) out.layers[l] = &find_format("f16");
  for (const auto& [layers, kv] : overrides)
    for (int l : layers)
      if (out.layers[l]->compressed()) out.layers[l] = &make(kv.first, kv.second);
  const int d = cfg.head_dim;
  double sum = 0, sum_all = 0;
  int n_inner = 0;
  std::ostringstream det;
  for (int l = 0; l < cfg.n_layers; ++l) {
    const Format& lf = *out.layers[l];
    sum_all += lf.bits_per_element(d);
    if (lf.compressed() || !inner.compressed()) {
      sum += lf.bits_per_element(d);
      ++n_inner;
    }
    if (l == 0 || out.layers[l] != out.layers[l - 1]) det << (l ? " " : "") << "L" << l << ":" << lf.name;
  }
  out.bits = n_inner ? sum / n_inner : 0;
  out.bits_all = sum_all / cfg.n_layers;
  if (out.centre_keys) det << (out.scale_channels ? " centred+scaled-keys" : " centred-keys");
  out.detail = det.str();
  return out;
}

ContiguousCache make_spec_cache(const CacheSpec& spec, const ModelConfig& cfg, int capacity) {
  ContiguousCacheConfig cc;
  cc.n_layers = cfg.n_layers;
  cc.n_kv_heads = cfg.n_kv_heads;
  cc.head_dim = cfg.head_dim;
  cc.capacity = capacity;
  cc.layer_formats = spec.layers;
  return ContiguousCache(cc);
}

std::vector<EvalRow> evaluate(const Model& model, const std::vector<int32_t>& tokens,
                              const std::vector<CacheSpec>& specs, const EvalOptions& opt,
                              const std::function<void(int, int, const std::vector<EvalRow>&)>& progress) {
  using clock = std::chrono::steady_clock;
  const ModelConfig& cfg = model.config();
  if (opt.ctx < 16) throw Error(ErrorCode::InvalidArgument, "ctx must be at least 16");
  if (opt.batch < 1) throw Error(ErrorCode::InvalidArgument, "batch must be >= 1");
  const int64_t avail = static_cast<int64_t>(tokens.size()) / opt.ctx;
  const int64_t want = std::max<int64_t>(1, opt.max_tokens / opt.ctx);
  const int n_chunks = static_cast<int>(std::min(avail, want));
  if (n_chunks == 0)
    throw Error(ErrorCode::InvalidArgument, "the text has " + std::to_string(tokens.size()) +
                                                " tokens, fewer than one chunk of " + std::to_string(opt.ctx));
  const int V = cfg.n_vocab, ctx = opt.ctx, first = ctx / 2;
  const CacheSpec ref = resolve_cache_spec("f32", cfg);
  const size_t n_rows = specs.size() + 1;
  std::vector<EvalRow> rows(n_rows);
  std::vector<double> nll(n_rows, 0), kl(n_rows, 0), kl2(n_rows, 0);
  std::vector<int64_t> agree(n_rows, 0);
  for (size_t i = 0; i < n_rows; ++i) {
    const CacheSpec& s = i == 0 ? ref : specs[i - 1];
    rows[i].format = s.name;
    rows[i].detail = s.detail;
    rows[i].ctx = ctx;
    rows[i].bits = s.bits;
    rows[i].bits_all = s.bits_all;
  }
  std::vector<float> lref(static_cast<size_t>(opt.batch) * V), lt(static_cast<size_t>(opt.batch) * V);
  std::vector<int32_t> chunk(ctx);
  std::vector<int32_t> ref_top(opt.batch);
  for (int c = 0; c < n_chunks; ++c) {
    std::copy_n(tokens.begin() + static_cast<int64_t>(c) * ctx, ctx, chunk.begin());
    if (opt.bos >= 0) chunk[0] = opt.bos;
    std::vector<ContiguousCache> caches;
    std::vector<KeyCentring> centring(n_rows);
    for (size_t i = 1; i < n_rows; ++i) centring[i].scale_channels = specs[i - 1].scale_channels;
    for (size_t i = 0; i < n_rows; ++i) {
      caches.push_back(make_spec_cache(i == 0 ? ref : specs[i - 1], cfg, ctx));
      rows[i].bytes_per_token = static_cast<double>(caches.back().bytes_per_token());
    }
    for (int p = 0; p < ctx; p += opt.batch) {
      const int m = std::min(opt.batch, ctx - p);
      const int j0 = std::max(p, first), j1 = std::min(p + m, ctx - 1);  // scored rows [j0, j1)
      for (size_t i = 0; i < n_rows; ++i) {
        const CacheSpec& s = i == 0 ? ref : specs[i - 1];
        float* out = i == 0 ? lref.data() : lt.data();
        auto t0 = clock::now();
        model.forward(chunk.data() + p, m, p, caches[i], out, true, s.centre_keys ? &centring[i] : nullptr);
        rows[i].seconds += std::chrono::duration<double>(clock::now() - t0).count();
        for (int j = j0; j < j1; ++j) {
          float* lp = out + static_cast<size_t>(j - p) * V;
          log_softmax(lp, V);
          nll[i] -= lp[chunk[j + 1]];
          if (i == 0) {
            ref_top[j - p] = argmax(lp, V);
          } else {
            const double k = kl_divergence(lref.data() + static_cast<size_t>(j - p) * V, lp, V);
            kl[i] += k;
            kl2[i] += k * k;
            agree[i] += argmax(lp, V) == ref_top[j - p];
          }
          ++rows[i].tokens;
        }
      }
    }
    for (size_t i = 0; i < n_rows; ++i) {
      EvalRow& r = rows[i];
      const double n = static_cast<double>(r.tokens);
      r.chunks = c + 1;
      r.nll = nll[i] / n;
      r.ppl = std::exp(r.nll);
      r.kld = kl[i] / n;
      r.kld_stderr = n > 1 ? std::sqrt(std::max(0.0, kl2[i] / n - r.kld * r.kld) / (n - 1)) : 0;
      r.top1 = i == 0 ? 1.0 : static_cast<double>(agree[i]) / n;
    }
    if (progress) progress(c + 1, n_chunks, rows);
  }
  return rows;
}

std::vector<PasskeyCell> passkey(const Model& model, const Tokenizer& tok, const std::string& text,
                                 const std::vector<CacheSpec>& specs, const PasskeyOptions& opt,
                                 const std::function<void(const PasskeyCell&)>& on_cell) {
  const ModelConfig& cfg = model.config();
  const std::vector<int32_t> hay = tok.encode(text, false, false);
  const std::string intro =
      "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
      "I will quiz you about the pass key.\n\n";
  const std::string question = "\n\nWhat is the pass key? Answer with the 5-digit number only.";
  const std::string answer_prefix = "";
  auto render = [&](const std::string& body) {
    return tok.apply_chat_template({{"user", intro + body + question}}, true) + answer_prefix;
  };
  const int overhead = static_cast<int>(tok.encode(render(""), true, false).size());
  std::vector<PasskeyCell> cells;
  const int V = cfg.n_vocab;
  std::vector<float> logits(V);
  for (int ctx : opt.ctx) {
    for (double depth : opt.depths) {
      // The same keys and haystack offsets for every format: a cell differs only in the cache.
      std::mt19937_64 rng(opt.seed * 1000003u + static_cast<uint64_t>(ctx) * 131 + static_cast<uint64_t>(depth * 1000));
      struct Trial {
        std::vector<int32_t> prompt;
        std::string key;
      };
      std::vector<Trial> trials;
      for (int t = 0; t < opt.trials; ++t) {
        const int key = 10000 + static_cast<int>(rng() % 90000);
        const std::string ks = std::to_string(key);
        const std::string needle = " The pass key is " + ks + ". Remember it. " + ks + " is the pass key. ";
        const int needle_tokens = static_cast<int>(tok.encode(needle, false, false).size());
        int h = ctx - overhead - needle_tokens - opt.max_new - 8;
        if (h < 16) throw Error(ErrorCode::InvalidArgument, "passkey: ctx " + std::to_string(ctx) + " is too small");
        if (h > static_cast<int>(hay.size())) h = static_cast<int>(hay.size());
        const int64_t start = static_cast<int64_t>(rng() % static_cast<uint64_t>(hay.size() - h + 1));
        const int cut = static_cast<int>(depth * h);
        const std::string before = tok.decode(std::span<const int32_t>(hay.data() + start, cut));
        const std::string after = tok.decode(std::span<const int32_t>(hay.data() + start + cut, h - cut));
        Trial tr;
        tr.prompt = tok.encode(render(before + needle + after), true, false);
        tr.key = ks;
        if (static_cast<int>(tr.prompt.size()) + opt.max_new > ctx) {  // re-tokenization merged differently
          const int extra = static_cast<int>(tr.prompt.size()) + opt.max_new - ctx;
          const std::string after2 =
              tok.decode(std::span<const int32_t>(hay.data() + start + cut, std::max(0, h - cut - extra - 4)));
          tr.prompt = tok.encode(render(before + needle + after2), true, false);
        }
        trials.push_back(std::move(tr));
      }
      for (const CacheSpec& s : specs) {
        PasskeyCell cell;
        cell.format = s.name;
        cell.ctx = ctx;
        cell.depth = depth;
        for (const Trial& tr : trials) {
          ContiguousCache cache = make_spec_cache(s, cfg, ctx);
          KeyCentring kc;
          kc.scale_channels = s.scale_channels;
          KeyCentring* kcp = s.centre_keys ? &kc : nullptr;
          const int n = static_cast<int>(tr.prompt.size());
          // Prefill in batches of 512 (the centring mean comes from the first one).
          for (int p = 0; p < n; p += 512) {
            const int m = std::min(512, n - p);
            model.forward(tr.prompt.data() + p, m, p, cache, logits.data(), false, kcp);
          }
          std::vector<int32_t> out;
          int64_t pos = n;
          for (int i = 0; i < opt.max_new && pos < ctx; ++i) {
            const int32_t id = argmax(logits.data(), V);
            if (tok.is_end_of_generation(id)) break;
            out.push_back(id);
            model.forward(&id, 1, pos++, cache, logits.data(), false, kcp);
          }
          const std::string said = tok.decode(out, true);
          ++cell.trials;
          cell.correct += said.find(tr.key) != std::string::npos;
          cell.answers.push_back(tr.key + " -> " + said);
        }
        if (on_cell) on_cell(cell);
        cells.push_back(std::move(cell));
      }
    }
  }
  return cells;
}

}  // namespace tqkv::engine
