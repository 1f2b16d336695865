// Fitting a recipe to a model: per-layer key/value bit widths under a bit budget, either from a
// sensitivity scan (tqkv calibrate) or by a rule that needs none (the named budgets tq-4.375,
// tq-3.375, tq-2.5 on a model without a calibrated recipe). Both count bits with one accounting,
// CacheSpec::bytes at the model's head_dim, so a fitted spec is within its budget at every
// context. docs/FORMAT.md, "Recipe files" and "Named recipes".
#pragma once
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/cache/cache_spec.h"
#include "engine/core/model_config.h"

namespace tqkv::engine {

// The named budgets: vLLM's preset sizes at the model's head_dim. At d = 64 they are 4.375
// (turboquant_4bit_nc), 3.375 (turboquant_3bit_nc) and 2.5 bits per element; the metadata share
// (0.375 bits at d = 64) scales with 1/head_dim as the presets' does (4.1875 / 3.1875 / 2.3125 at
// d = 128, 4.09375 / 3.09375 / 2.21875 at d = 256).
struct NamedBudget {
  const char* name;   // "tq-4.375"
  double code_bits;   // bits per element of codes alone (4, 3, 2.125)
};
const std::vector<NamedBudget>& named_budgets();
// The budget of a named budget at head_dim d, or nullopt when `name` is not one.
std::optional<double> named_budget_bits(const std::string& name, int head_dim);

// A budget to fit a recipe to, as `tqkv calibrate --budget` takes it: a named budget
// ("tq-4.375": its size at head_dim) or a number of bits in (0, 16] (named "tq-<bits>"), renamed
// to `name` when given (one budget only; "tq-" + letters, digits, '.', '_', '-'). A recipe named
// like a named budget must fit in it. Throws Error(InvalidArgument), one line, otherwise.
struct BudgetRequest {
  std::string name;
  double bits = 0;
};
std::vector<BudgetRequest> parse_budgets(const std::vector<std::string>& items, const std::string& name, int head_dim);

// Bits per element of a spec's compressed layers over a full cache of ctx positions: their
// slots and the copies (sinks, window), from CacheSpec::bytes(ctx, ctx), over
// ctx · (compressed layers) · n_kv_heads · 2 · head_dim elements. A sliding-window layer that
// keeps only a ring holds fewer positions, so it counts less than its slot width.
double budget_bits_at(const CacheSpec& spec, int ctx);
// The largest budget_bits_at over ctx = kMinBudgetCtx, 512, 4096, 32768 and the model's
// ctx_train. Below kMinBudgetCtx positions a recipe's f16 sink alone outgrows its copies'
// share (16 bits over ctx positions), so budgets hold from there on.
constexpr int kMinBudgetCtx = 128;
double budget_bits(const CacheSpec& spec);

// Widths of the compressed layers: (key bits, value bits) per layer, in layer order.
using LayerWidths = std::vector<std::pair<int, std::pair<int, int>>>;

// The layers a model compresses (those the presets' boundary rule leaves compressed: every
// layer but the first and last 2), or every layer when all_layers (a recipe whose budget counts
// the boundary layers too: they get widths of their own, and its spec says +skip0).
std::vector<int> compressed_layers(const ModelConfig& cfg, bool all_layers = false);
// Every fitted recipe keeps copies next to the cache (an f16 sink and a 6-bit recent window,
// sink1+wq6+fill<B>; on a model with sliding-window layers the window is no longer than theirs
// and their rings stay, CacheSpec::ring_positions). Their share of a budget: the slots get
// budget - kCopyReserve bits.
constexpr double kCopyReserve = 0.125;
// Bits per element of one k<K>v<V> slot (Mse keys and values, two fp16 norms) at head_dim d.
double kv_slot_bits(int key_bits, int value_bits, int head_dim);

// The cache spec of per-layer widths: the most common width as the base, then "+c" when
// centre ("+s" with balance: centred keys and balanced key/query channel scales), "+skip0" when all_layers (no layer left f16 by the boundary rule), the others as
// L<i>.<j>=k<K>v<V> overrides, then `suffix` ("+sink1+wq6+fill4.375").
std::string widths_spec(const LayerWidths& widths, bool centre, const std::string& suffix, bool all_layers = false,
                        bool balance = false);

// Per-layer sensitivity from a scan: the KL that layer l's keys cause at scan_key_bits (values
// near-exact) and that its values cause at scan_value_bits (keys near-exact).
struct LayerSensitivity {
  int layer = 0;
  double key_kl = 0, value_kl = 0;
};
struct FitResult {
  std::string spec;       // resolvable for the model (with key statistics when centre)
  double bits = 0;        // budget_bits of the resolved spec
  double predicted_kl = 0;  // the additive model's KL (0 for the rule)
  LayerWidths widths;
};

// Greedy allocation over a scan (optimal under the additive model: KL adds over layers and
// keys/values, each term scales with the Lloyd-Max distortion D(b) of its width, D convex):
// every layer starts at 2/2 bits and one bit at a time goes where it lowers the predicted KL
// the most, while the slots fit in budget (less kCopyReserve when the recipe keeps copies).
// The scan names the layers the budget counts: compressed_layers(cfg) — the boundary layers
// stay f16 outside it — or every layer (compressed_layers(cfg, true)), when the spec compresses
// all of them (+skip0) and the budget is that of the whole cache. Throws Error(InvalidArgument)
// with one line when the budget cannot hold 2/2 bits everywhere, or when the scan names a
// boundary layer without naming every layer, or a layer twice or out of range. With balance
// (and centre) the spec says +s instead of +c (the scan should have used +s too).
//
// max_pairs > 0 caps the distinct (key bits, value bits) pairs among the layers: each pair is its
// own decode kernel on the GPU, and at batch 1 a step's kernels compete for the instruction cache
// (docs/journal/RESULTS-journal.md, "What the nine pairs cost"). The capped answer is the best
// under the same additive model: every set of at most max_pairs pairs is tried, each with an exact
// assignment of the layers to its pairs under the budget (a knapsack over the layers' bit sums).
// The greedy's answer is kept where it already has few enough pairs.
// 1 <= max_pairs <= kMaxPairsCap.
constexpr int kMaxPairsCap = 4;
//
// copy_reserve: the bits per element the slots leave to the copies (the sink and the window that
// fill<B> sizes); kCopyReserve by default. A model whose recent tokens matter most (Gemma 3's
// local layers) may do better with a longer window and narrower slots.
FitResult allocate_bits(const ModelConfig& cfg, const std::vector<LayerSensitivity>& scan, int scan_key_bits,
                        int scan_value_bits, double budget, bool centre, bool balance = false, int max_pairs = 0,
                        double copy_reserve = kCopyReserve);
// The number of distinct (key bits, value bits) pairs in widths.
int distinct_pairs(const LayerWidths& widths);

// The rule for a model without a scan: every compressed layer at 2/2 bits, then sweeps of one
// more bit — keys before values, the layers nearest the f16 boundary first — while the slots
// fit (so keys lead values by at most one bit and the leftover goes to the outer layers), plus
// sink1+wq6+fill<B> where the model has no sliding-window layers. Returns nullopt and sets
// *why (one line) when the budget cannot apply to the model.
std::optional<FitResult> rule_recipe(const ModelConfig& cfg, double budget, bool centre, std::string* why);

}  // namespace tqkv::engine
