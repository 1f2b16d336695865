#include "engine/cache/recipe_fit.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "tqkv/codebook.h"
#include "tqkv/format.h"
#include "tqkv/contiguous_cache.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

// The widths fitted are those with a GPU decode kernel (tqkv/format.h): a recipe never sends a
// layer down the generic path.
constexpr int kMinBits = kKernelMinBits, kMaxKeyBits = kKernelMaxKeyBits, kMaxValueBits = kKernelMaxValueBits;
constexpr int max_bits(int side) { return side == 0 ? kMaxKeyBits : kMaxValueBits; }

std::string number_text(double x) {
  std::ostringstream os;
  os.precision(10);
  os << x;
  return os.str();
}

// The bits of a candidate, resolved for the model (centring does not change bytes, so the
// spec is resolved without it and needs no key statistics).
double widths_bits(const ModelConfig& cfg, const LayerWidths& w, const std::string& suffix, bool all_layers) {
  return budget_bits(resolve_cache_spec(widths_spec(w, false, suffix, all_layers), cfg));
}

// Whether widths cover every layer (the budget counts the boundary layers), after checking that
// they name either exactly compressed_layers(cfg) or exactly every layer, each once, in order.
bool covers_all_layers(const ModelConfig& cfg, const LayerWidths& w) {
  std::vector<int> layers;
  for (const auto& [l, kv] : w) layers.push_back(l);
  if (layers == compressed_layers(cfg, true)) return true;
  if (layers == compressed_layers(cfg, false)) return false;
  throw Error(ErrorCode::InvalidArgument,
              "allocate_bits: the scan must name the layers the boundary rule compresses (" +
                  std::to_string(compressed_layers(cfg).size()) + " of " + std::to_string(cfg.n_layers) +
                  ") or every layer, each once in order; it names " + std::to_string(layers.size()));
}

std::string copies_suffix(double budget) { return "+sink1+wq6+fill" + number_text(budget); }

// The slots' share of the budget: all but the copies' reserve.
double slot_target(double budget, double reserve = kCopyReserve) { return budget - reserve; }

double mean_slot_bits(const LayerWidths& w, int d) {
  double s = 0;
  std::map<std::pair<int, int>, double> memo;
  for (const auto& [l, kv] : w) {
    auto it = memo.find(kv);
    if (it == memo.end()) it = memo.emplace(kv, kv_slot_bits(kv.first, kv.second, d)).first;
    s += it->second;
  }
  return w.empty() ? 0 : s / static_cast<double>(w.size());
}

// Checks that 2/2 bits fit and fills the result's spec and bits; one line in *why otherwise.
std::optional<FitResult> finish(const ModelConfig& cfg, double budget, bool centre, LayerWidths widths,
                                double predicted, std::string* why, bool balance = false,
                                double reserve = kCopyReserve) {
  const std::string suffix = copies_suffix(budget);
  const bool all_layers = covers_all_layers(cfg, widths);
  FitResult r;
  // fill<B> needs room for its window: slots of B bits or more do not even resolve.
  const bool fits = mean_slot_bits(widths, cfg.head_dim) < slot_target(budget, reserve) + 1e-9 &&
                    (r.bits = widths_bits(cfg, widths, suffix, all_layers)) <= budget + 1e-9;
  if (!fits) {
    if (why) {
      LayerWidths narrowest = widths;
      for (auto& [l, kv] : narrowest) kv = {kMinBits, kMinBits};
      std::ostringstream os;
      os << "a " << budget << "-bit budget cannot apply to this model: with every layer's keys and values at " << kMinBits
         << " bits its slots take " << mean_slot_bits(narrowest, cfg.head_dim) << " bits per element at head_dim "
         << cfg.head_dim;
      os << ", and its f16 sink and recent window need " << reserve << " more";
      *why = os.str();
    }
    return std::nullopt;
  }
  r.spec = widths_spec(widths, centre, suffix, all_layers, balance);
  r.predicted_kl = predicted;
  r.widths = std::move(widths);
  return r;
}

// The best widths with at most max_pairs distinct (key, value) pairs under the additive model:
// every set of pairs is tried, the layers assigned to its pairs exactly by a knapsack over their
// bit sums. A slot's bits grow by half a bit per element with each key or value bit (the codes;
// the norms are the same at every width), so the budget is a cap on the sum of k + v over the
// layers. Writes the widths into w (its layers kept) and returns their predicted KL.
template <class Term>
double capped_widths(LayerWidths& w, const Term& term, int d, double target, int max_pairs) {
  const size_t n = w.size();
  std::vector<std::pair<int, int>> pairs;
  for (int k = kMinBits; k <= kMaxKeyBits; ++k)
    for (int v = kMinBits; v <= kMaxValueBits; ++v) pairs.push_back({k, v});
  const double base = kv_slot_bits(kMinBits, kMinBits, d) - kMinBits;
  for (const auto& [k, v] : pairs)
    if (std::abs(kv_slot_bits(k, v, d) - (base + 0.5 * (k + v))) > 1e-9)
      throw Error(ErrorCode::InvalidArgument, "allocate_bits: at head_dim " + std::to_string(d) +
                                                  " the slots do not grow by half a bit per code bit; cannot cap the pairs");
  const double room = 2.0 * static_cast<double>(n) * (target - base) + 1e-9;
  if (room < 2.0 * kMinBits * static_cast<double>(n)) return 0;  // not even 2/2 bits fit: finish() says why
  const int cap = static_cast<int>(std::min(room, double{kMaxKeyBits + kMaxValueBits} * static_cast<double>(n)));
  const size_t np = pairs.size();
  std::vector<double> cost(n * np);  // cost[i * np + j]: layer i's predicted KL at pairs[j]
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < np; ++j) cost[i * np + j] = term(i, 0, pairs[j].first) + term(i, 1, pairs[j].second);

  constexpr double kInf = std::numeric_limits<double>::infinity();
  const size_t width = static_cast<size_t>(cap) + 1;
  std::vector<double> dp((n + 1) * width);
  std::vector<uint8_t> pick(n * width), best_pick;
  std::vector<size_t> set, best_set;
  double best = kInf;
  size_t best_u = 0;  // the best set's bit sum
  // The knapsack for one set of pairs: dp[i][u] is the least KL of the first i layers at u bits.
  auto solve = [&] {
    std::fill(dp.begin(), dp.end(), kInf);
    dp[0] = 0;
    for (size_t i = 0; i < n; ++i) {
      const double* from = &dp[i * width];
      double* to = &dp[(i + 1) * width];
      for (size_t u = 0; u < width; ++u) {
        if (from[u] == kInf) continue;
        for (size_t s = 0; s < set.size(); ++s) {
          const size_t j = set[s];
          const size_t v = u + static_cast<size_t>(pairs[j].first + pairs[j].second);
          if (v >= width) continue;
          const double c = from[u] + cost[i * np + j];
          if (c < to[v]) to[v] = c, pick[i * width + v] = static_cast<uint8_t>(s);
        }
      }
    }
    const double* last = &dp[n * width];
    const size_t u = static_cast<size_t>(std::min_element(last, last + width) - last);
    if (last[u] < best) best = last[u], best_u = u, best_pick = pick, best_set = set;
  };
  // Every set of 1 .. max_pairs pairs, in lexicographic order (ties keep the first).
  std::function<void(size_t)> sets = [&](size_t from) {
    if (!set.empty()) solve();
    if (static_cast<int>(set.size()) == max_pairs) return;
    for (size_t j = from; j < np; ++j) {
      set.push_back(j);
      sets(j + 1);
      set.pop_back();
    }
  };
  sets(0);
  if (best == kInf) return 0;
  for (size_t i = n, u = best_u; i-- > 0;) {
    const size_t j = best_set[best_pick[i * width + u]];
    w[i].second = pairs[j];
    u -= static_cast<size_t>(pairs[j].first + pairs[j].second);
  }
  return best;
}

}  // namespace

const std::vector<NamedBudget>& named_budgets() {
  static const std::vector<NamedBudget> b = {{"tq-4.375", 4.0}, {"tq-3.375", 3.0}, {"tq-2.5", 2.125}};
  return b;
}

std::optional<double> named_budget_bits(const std::string& name, int head_dim) {
  for (const NamedBudget& b : named_budgets())
    if (name == b.name) return b.code_bits + 24.0 / head_dim;  // turboquant_4bit_nc: 4 + 24/d
  return std::nullopt;
}

std::vector<BudgetRequest> parse_budgets(const std::vector<std::string>& items, const std::string& name, int head_dim) {
  auto fail = [](const std::string& why) { throw Error(ErrorCode::InvalidArgument, "calibrate: " + why); };
  if (!name.empty() && items.size() != 1) fail("--name names one recipe; give one --budget with it");
  const bool valid_name = name.size() > 3 && name.rfind("tq-", 0) == 0 &&
                          std::all_of(name.begin() + 3, name.end(), [](char c) {
                            return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
                          });
  if (!name.empty() && !valid_name)
    fail("--name '" + name + "' is not a recipe name (tq- followed by letters, digits, '.', '_' or '-')");
  std::vector<BudgetRequest> out;
  for (const std::string& item : items) {
    BudgetRequest b;
    if (const std::optional<double> nb = named_budget_bits(item, head_dim)) {
      b = {item, *nb};
    } else {
      size_t used = 0;
      try {
        b.bits = std::stod(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != item.size() || !(b.bits > 0 && b.bits <= 16))
        fail("--budget '" + item + "' is neither a number of bits in (0, 16] nor a named budget (tq-4.375, tq-3.375, tq-2.5)");
      b.name = std::string("tq-").append(number_text(b.bits));
    }
    if (!name.empty()) b.name = name;
    if (const std::optional<double> nb = named_budget_bits(b.name, head_dim); nb && b.bits > *nb + 1e-9)
      fail("a recipe named " + b.name + " must fit in " + number_text(*nb) + " bits at head_dim " +
           std::to_string(head_dim) + " (the vLLM preset's size there), not " + number_text(b.bits) + ": use --budget " +
           b.name + " or another --name");
    out.push_back(b);
  }
  return out;
}

double budget_bits_at(const CacheSpec& spec, int ctx) {
  const ModelConfig& m = spec.model;
  const CacheBytes all = spec.bytes(ctx, ctx);
  size_t boundary = 0;  // the uncompressed layers' slots (they have no copies)
  int compressed = 0;
  for (size_t l = 0; l < spec.layers.size(); ++l) {
    const Format& f = spec.layers[l];
    if (f.compressed()) {
      ++compressed;
      continue;
    }
    const int64_t ring = spec.ring_positions(static_cast<int>(l), ctx);
    boundary += f.slot_bytes(m.head_dim) * static_cast<size_t>(m.n_kv_heads) * static_cast<size_t>(ring > 0 ? std::min<int64_t>(ctx, ring) : ctx);
  }
  if (compressed == 0) return 0;
  const double elements = static_cast<double>(ctx) * compressed * m.n_kv_heads * 2.0 * m.head_dim;
  return static_cast<double>(all.total() - boundary) * 8.0 / elements;
}

double budget_bits(const CacheSpec& spec) {
  double worst = 0;
  for (int ctx : {kMinBudgetCtx, 512, 4096, 32768, spec.model.ctx_train})
    if (ctx > 0) worst = std::max(worst, budget_bits_at(spec, ctx));
  return worst;
}

std::vector<int> compressed_layers(const ModelConfig& cfg, bool all_layers) {
  const std::vector<Format> f = boundary_layer_formats(cfg.n_layers, find_format("tq-k4v4"), all_layers ? 0 : -1);
  std::vector<int> out;
  for (int l = 0; l < cfg.n_layers; ++l)
    if (f[l].compressed()) out.push_back(l);
  return out;
}

double kv_slot_bits(int key_bits, int value_bits, int head_dim) {
  // The format's own slot bytes (codes are padded at small head_dims), through the spec grammar.
  ModelConfig one;
  one.n_layers = 1;
  one.n_kv_heads = 1;
  one.head_dim = head_dim;
  std::string spec = "k";
  spec.append(std::to_string(key_bits)).append("v").append(std::to_string(value_bits)).append("+skip0");
  return resolve_cache_spec(spec, one).layers[0].bits_per_element(head_dim);
}

std::string widths_spec(const LayerWidths& widths, bool centre, const std::string& suffix, bool all_layers,
                        bool balance) {
  std::map<std::pair<int, int>, std::vector<int>> groups;
  for (const auto& [l, kv] : widths) groups[kv].push_back(l);
  if (groups.empty()) return "f16";
  auto base = groups.begin();
  for (auto it = groups.begin(); it != groups.end(); ++it)
    if (it->second.size() > base->second.size()) base = it;
  std::string spec = "k";
  spec.append(std::to_string(base->first.first)).append("v").append(std::to_string(base->first.second));
  if (centre) spec += balance ? "+s" : "+c";
  if (all_layers) spec += "+skip0";
  for (const auto& [kv, ls] : groups) {
    if (kv == base->first) continue;
    spec += "+L";
    for (size_t i = 0; i < ls.size(); ++i) spec.append(i ? "." : "").append(std::to_string(ls[i]));
    spec.append("=k").append(std::to_string(kv.first)).append("v").append(std::to_string(kv.second));
  }
  return spec + suffix;
}

int distinct_pairs(const LayerWidths& widths) {
  std::set<std::pair<int, int>> pairs;
  for (const auto& [l, kv] : widths) pairs.insert(kv);
  return static_cast<int>(pairs.size());
}

FitResult allocate_bits(const ModelConfig& cfg, const std::vector<LayerSensitivity>& scan, int scan_key_bits,
                        int scan_value_bits, double budget, bool centre, bool balance, int max_pairs,
                        double copy_reserve) {
  if (scan.empty()) throw Error(ErrorCode::InvalidArgument, "allocate_bits: the scan has no layers");
  if (!(copy_reserve > 0 && copy_reserve < budget))
    throw Error(ErrorCode::InvalidArgument, "allocate_bits: the copies' reserve must be more than 0 and less than the budget");
  if (max_pairs < 0 || max_pairs > kMaxPairsCap)
    throw Error(ErrorCode::InvalidArgument, "allocate_bits: at most " + std::to_string(kMaxPairsCap) +
                                                " distinct key/value pairs can be asked for, not " + std::to_string(max_pairs));
  const int d = cfg.head_dim;
  // Lloyd-Max distortion per width, solved only for the widths the greedy reaches (the wide
  // codebooks are the slow ones to solve).
  std::vector<double> memo(std::max(kMaxKeyBits, kMaxValueBits) + 1, -1.0);
  auto D = [&](int b) {
    if (memo[b] < 0) memo[b] = get_codebook(Law::Sphere, d, b).mse;
    return memo[b];
  };
  LayerWidths w;
  for (const LayerSensitivity& s : scan) w.push_back({s.layer, {kMinBits, kMinBits}});
  auto term = [&](size_t i, int side, int b) {
    return side == 0 ? std::max(scan[i].key_kl, 1e-6) * D(b) / D(scan_key_bits)
                     : std::max(scan[i].value_kl, 1e-6) * D(b) / D(scan_value_bits);
  };
  const double target = slot_target(budget, copy_reserve);
  // One more bit costs the same bytes anywhere (head_dim / 8 per slot), so the best gain per
  // bit is the best gain; stop at the first step that does not fit.
  while (true) {
    size_t best = 0;
    int side = -1;
    double gain = 0;
    for (size_t i = 0; i < w.size(); ++i)
      for (int s = 0; s < 2; ++s) {
        const int b = s == 0 ? w[i].second.first : w[i].second.second;
        if (b >= max_bits(s)) continue;
        const double g = term(i, s, b) - term(i, s, b + 1);
        if (g > gain) best = i, side = s, gain = g;
      }
    if (side < 0) break;
    int& b = side == 0 ? w[best].second.first : w[best].second.second;
    ++b;
    if (mean_slot_bits(w, d) > target + 1e-9) {
      --b;
      break;
    }
  }
  double kl = 0;
  for (size_t i = 0; i < w.size(); ++i) kl += term(i, 0, w[i].second.first) + term(i, 1, w[i].second.second);
  if (max_pairs > 0 && distinct_pairs(w) > max_pairs) kl = capped_widths(w, term, d, target, max_pairs);
  std::string why;
  std::optional<FitResult> r = finish(cfg, budget, centre, std::move(w), kl, &why, balance, copy_reserve);
  if (!r) throw Error(ErrorCode::InvalidArgument, why);
  return *r;
}

std::optional<FitResult> rule_recipe(const ModelConfig& cfg, double budget, bool centre, std::string* why) {
  const std::vector<int> layers = compressed_layers(cfg);
  if (layers.empty()) {
    if (why)
      *why = std::string("the model has ").append(std::to_string(cfg.n_layers)).append(" layers, all kept f16 at the boundary: no layer to fit a budget to");
    return std::nullopt;
  }
  // The order of a sweep: the layers nearest the f16 boundary first, alternating ends.
  std::vector<size_t> order;
  for (size_t lo = 0, hi = layers.size(); lo < hi;) {
    order.push_back(lo++);
    if (lo < hi) order.push_back(--hi);
  }
  LayerWidths w;
  for (int l : layers) w.push_back({l, {kMinBits, kMinBits}});
  const double target = slot_target(budget);
  for (bool grew = true; grew;) {
    grew = false;
    for (int side = 0; side < 2; ++side)
      for (size_t i : order) {
        int& b = side == 0 ? w[i].second.first : w[i].second.second;
        if (b >= max_bits(side)) continue;
        ++b;
        if (mean_slot_bits(w, cfg.head_dim) > target + 1e-9) {
          --b;
          continue;
        }
        grew = true;
      }
  }
  return finish(cfg, budget, centre, std::move(w), 0.0, why);
}

}  // namespace tqkv::engine
