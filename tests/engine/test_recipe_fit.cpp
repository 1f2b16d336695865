// Fitting recipes (recipe_fit.h) and how the named budgets resolve (model_recipes.h): the rule's
// and the allocator's specs stay within their budgets at every head_dim and context (sliding-
// window layers included), a calibrated recipe wins over the rule, another model's layer list
// never applies, and a budget that cannot apply says why in one line. Synthetic configs only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <unistd.h>

#include "engine/cache/cache_spec.h"
#include "engine/gguf/gguf.h"
#include "engine/model/model.h"
#include "engine/cache/model_recipes.h"
#include "engine/cache/recipe.h"
#include "engine/cache/recipe_fit.h"
#include "real_models.h"
#include "tqkv/codebook.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

namespace fs = std::filesystem;

ModelConfig config(int n_layers, int head_dim, int n_kv_heads = 2, bool sliding = false) {
  ModelConfig c;
  c.arch = sliding ? "gemma3" : "qwen2";
  c.n_layers = n_layers;
  c.n_heads = n_kv_heads * 4;
  c.n_kv_heads = n_kv_heads;
  c.head_dim = head_dim;
  c.ctx_train = 32768;
  if (sliding) {  // Gemma 3's pattern: five local layers of 512, then a global one
    c.layer_window.assign(static_cast<size_t>(n_layers), 512);
    for (int l = 5; l < n_layers; l += 6) c.layer_window[static_cast<size_t>(l)] = 0;
  }
  return c;
}

KeyStats stats_for(const ModelConfig& c) {
  KeyStats s;
  s.source = "test";
  s.tokens = 1;
  s.n_layers = c.n_layers;
  s.n_kv_heads = c.n_kv_heads;
  s.head_dim = c.head_dim;
  s.key_mean.assign(s.size(), 0.0f);
  s.key_sq.assign(s.size(), 1.0f);
  s.query_sq.assign(s.size(), 1.0f);
  return s;
}

TEST(RecipeFit, NamedBudgetsAreThePresetSizesAtEveryHeadDim) {
  for (int d : {64, 128, 256}) {
    EXPECT_DOUBLE_EQ(*named_budget_bits("tq-4.375", d), find_format("turboquant_4bit_nc").bits_per_element(d)) << d;
    EXPECT_DOUBLE_EQ(*named_budget_bits("tq-3.375", d), find_format("turboquant_3bit_nc").bits_per_element(d)) << d;
  }
  EXPECT_DOUBLE_EQ(*named_budget_bits("tq-2.5", 64), 2.5);
  EXPECT_FALSE(named_budget_bits("tq-4.36", 64).has_value());
  EXPECT_DOUBLE_EQ(kv_slot_bits(4, 4, 128), find_format("tq-k4v4").bits_per_element(128));
  EXPECT_DOUBLE_EQ(kv_slot_bits(3, 2, 64), find_format("tq-k3v2").bits_per_element(64));
}

TEST(RecipeFit, RuleRespectsEveryBudgetAtEveryHeadDimAndContext) {
  for (int d : {64, 128, 256}) {
    for (bool sliding : {false, true}) {
      for (const NamedBudget& nb : named_budgets()) {
        const ModelConfig c = config(sliding ? 18 : 24, d, sliding ? 1 : 2, sliding);
        const double budget = *named_budget_bits(nb.name, d);
        std::string why;
        const std::optional<FitResult> r = rule_recipe(c, budget, false, &why);
        ASSERT_TRUE(r.has_value()) << nb.name << " d=" << d << ": " << why;
        const CacheSpec s = resolve_cache_spec(r->spec, c);
        for (int ctx : {128, 512, 1000, 4096, 32768}) {
          EXPECT_LE(budget_bits_at(s, ctx), budget + 1e-9) << r->spec << " d=" << d << " ctx=" << ctx;
        }
        // Not far under either: the rule spends the budget (to within one bit of one layer,
        // plus the copies' reserve).
        EXPECT_GE(s.bits, budget - kCopyReserve - 1.0 / (c.n_layers - 4) - 1e-9) << r->spec;
        // Copies everywhere; with sliding-window layers the window copy is no longer than
        // theirs, and they keep their rings.
        EXPECT_EQ(s.sinks, 1) << r->spec;
        if (sliding) {
          EXPECT_LE(s.window_at(32768), 512) << r->spec;
          EXPECT_GT(s.ring_positions(0, 32768), 0) << r->spec;
        }
        EXPECT_EQ(r->spec.find("+c"), std::string::npos);
        // Keys lead values by at most one bit, and the outer layers are never narrower.
        for (const auto& [l, kv] : r->widths) {
          EXPECT_GE(kv.first, kv.second) << r->spec;
          EXPECT_LE(kv.first - kv.second, 1) << r->spec;
        }
        const auto& w = r->widths;
        const int outer = w.front().second.first + w.front().second.second;
        const int middle = w[w.size() / 2].second.first + w[w.size() / 2].second.second;
        EXPECT_GE(outer, middle) << r->spec;
      }
    }
  }
}

TEST(RecipeFit, SlidingWindowLayersCountTheirRing) {
  const ModelConfig c = config(18, 256, 1, true);
  const CacheSpec s = resolve_cache_spec("k4v4", c);
  // At 512 positions every layer holds all of them; at 32K the 11 local layers of 14 hold 767.
  EXPECT_NEAR(budget_bits_at(s, 512), s.bits, 1e-12);
  EXPECT_LT(budget_bits_at(s, 32768), s.bits * 0.5);
  EXPECT_NEAR(budget_bits(s), s.bits, 1e-12);
}

TEST(RecipeFit, AllocatorFollowsTheScanWithinTheBudget) {
  for (int d : {64, 256}) {  // (solving the wide codebooks is what takes time here)
    const ModelConfig c = config(12, d);
    std::vector<LayerSensitivity> scan;
    for (int l : compressed_layers(c)) scan.push_back({l, l == 5 ? 0.5 : 0.01, l == 7 ? 0.3 : 0.005});
    ASSERT_EQ(scan.size(), 8u);
    const double budget = *named_budget_bits("tq-3.375", d);
    const FitResult r = allocate_bits(c, scan, 4, 3, budget, true);
    SpecSources src;
    src.key_stats = std::make_shared<KeyStats>(stats_for(c));
    const CacheSpec s = resolve_cache_spec(r.spec, c, src);
    EXPECT_TRUE(s.centre_keys);
    EXPECT_LE(budget_bits(s), budget + 1e-9) << r.spec;
    EXPECT_NEAR(r.bits, budget_bits(s), 1e-12);
    int k5 = 0, v7 = 0, kmax = 0, vmax = 0;
    for (const auto& [l, kv] : r.widths) {
      if (l == 5) k5 = kv.first;
      if (l == 7) v7 = kv.second;
      if (l != 5) kmax = std::max(kmax, kv.first);
      if (l != 7) vmax = std::max(vmax, kv.second);
    }
    EXPECT_GT(k5, kmax) << r.spec;  // the sensitive layer's keys get the most bits
    EXPECT_GT(v7, vmax) << r.spec;
    EXPECT_GT(r.predicted_kl, 0);
  }
}

// A cap on the distinct (key, value) pairs: the capped answer keeps to the cap and the budget, is
// never predicted better than the uncapped greedy (optimal without a cap), improves as the cap
// loosens, and is the best assignment there is: checked by brute force over every assignment of
// the 49 pairs to four layers.
TEST(RecipeFit, AllocatorCapsTheDistinctPairs) {
  const ModelConfig c = config(8, 64);
  std::vector<LayerSensitivity> scan;
  const double key_kl[] = {0.4, 0.02, 0.05, 0.01}, value_kl[] = {0.01, 0.2, 0.03, 0.005};
  for (int l : compressed_layers(c)) scan.push_back({l, key_kl[scan.size()], value_kl[scan.size()]});
  ASSERT_EQ(scan.size(), 4u);
  const double budget = *named_budget_bits("tq-4.375", 64);
  const FitResult free = allocate_bits(c, scan, 4, 3, budget, true);
  ASSERT_GT(distinct_pairs(free.widths), 2) << free.spec;  // else the cap has nothing to do
  double previous = std::numeric_limits<double>::infinity();
  for (int cap = 1; cap <= 3; ++cap) {
    const FitResult r = allocate_bits(c, scan, 4, 3, budget, true, false, cap);
    EXPECT_LE(distinct_pairs(r.widths), cap) << r.spec;
    EXPECT_LE(r.bits, budget + 1e-9) << r.spec;
    EXPECT_GE(r.predicted_kl, free.predicted_kl - 1e-12) << r.spec;
    EXPECT_LE(r.predicted_kl, previous + 1e-12) << r.spec;
    previous = r.predicted_kl;
    // Brute force: every assignment of pairs within the cap and the budget, by the additive model.
    // (The fitter's widths: those with a GPU decode kernel, tqkv/format.h.)
    std::vector<double> D(9);
    for (int b = 2; b <= 8; ++b) D[b] = get_codebook(Law::Sphere, 64, b).mse;
    double slot[9][9];
    for (int k = 2; k <= 8; ++k)
      for (int v = 2; v <= 8; ++v) slot[k][v] = kv_slot_bits(k, v, 64);
    const double target = budget - kCopyReserve;
    double brute = std::numeric_limits<double>::infinity();
    int ks[4], vs[4];
    std::function<void(size_t)> walk = [&](size_t i) {
      if (i == 4) {
        int distinct = 0;
        double bits = 0, kl = 0;
        for (size_t j = 0; j < 4; ++j) {
          bool seen = false;
          for (size_t m = 0; m < j; ++m) seen = seen || (ks[m] == ks[j] && vs[m] == vs[j]);
          distinct += seen ? 0 : 1;
          bits += slot[ks[j]][vs[j]] / 4;
          kl += scan[j].key_kl * D[ks[j]] / D[4] + scan[j].value_kl * D[vs[j]] / D[3];
        }
        if (distinct <= cap && bits <= target + 1e-9) brute = std::min(brute, kl);
        return;
      }
      for (ks[i] = kKernelMinBits; ks[i] <= kKernelMaxKeyBits; ++ks[i])
        for (vs[i] = kKernelMinBits; vs[i] <= kKernelMaxValueBits; ++vs[i]) walk(i + 1);
    };
    walk(0);
    EXPECT_NEAR(r.predicted_kl, brute, 1e-12) << "cap " << cap << ": " << r.spec;
  }
  // A cap the greedy already meets changes nothing; a cap out of range says so.
  const FitResult same = allocate_bits(c, scan, 4, 3, budget, true, false, kMaxPairsCap);
  if (distinct_pairs(free.widths) <= kMaxPairsCap) {
    EXPECT_EQ(same.spec, free.spec);
  }
  EXPECT_THROW(allocate_bits(c, scan, 4, 3, budget, true, false, kMaxPairsCap + 1), Error);
}

// The copies' reserve: a larger one leaves the slots fewer bits and fill<B> a longer window,
// within the same budget; one outside (0, budget) is refused.
TEST(RecipeFit, CopyReserveTradesSlotsForWindow) {
  const ModelConfig c = config(18, 256, 1, true);
  std::vector<LayerSensitivity> scan;
  for (int l : compressed_layers(c, true)) scan.push_back({l, 0.001 * (l % 4 + 1), 0.002});
  const double budget = *named_budget_bits("tq-3.375", 256);
  int last_window = -1;
  double last_slots = 1e9;
  for (double reserve : {kCopyReserve, 0.375, 0.625}) {
    const FitResult r = allocate_bits(c, scan, 4, 3, budget, false, false, 0, reserve);
    const CacheSpec s = resolve_cache_spec(r.spec, c);
    EXPECT_LE(budget_bits(s), budget + 1e-9) << r.spec;
    EXPECT_LE(s.bits, budget - reserve + 1e-9) << r.spec;
    EXPECT_LT(s.bits, last_slots) << r.spec;
    EXPECT_GT(s.window_at(512), last_window) << r.spec;
    last_slots = s.bits;
    last_window = s.window_at(512);
  }
  EXPECT_THROW(allocate_bits(c, scan, 4, 3, budget, false, false, 0, 0.0), Error);
  EXPECT_THROW(allocate_bits(c, scan, 4, 3, budget, false, false, 0, budget), Error);
}

TEST(RecipeFit, BudgetRequests) {
  const std::vector<BudgetRequest> b = parse_budgets({"tq-4.375", "3.2", "tq-2.5"}, "", 256);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].name, "tq-4.375");
  EXPECT_DOUBLE_EQ(b[0].bits, 4.09375);
  EXPECT_EQ(b[1].name, "tq-3.2");
  EXPECT_DOUBLE_EQ(b[1].bits, 3.2);
  EXPECT_EQ(parse_budgets({"3"}, "tq-mine", 64)[0].name, "tq-mine");
  EXPECT_EQ(parse_budgets({"3.375"}, "tq-3.375", 64)[0].name, "tq-3.375");
  auto message = [](const std::vector<std::string>& items, const std::string& name, int d) {
    try {
      parse_budgets(items, name, d);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({"four"}, "", 64).find("--budget 'four' is neither a number"), std::string::npos);
  EXPECT_NE(message({"0"}, "", 64).find("neither a number of bits in (0, 16]"), std::string::npos);
  EXPECT_NE(message({"3", "4"}, "tq-x", 64).find("--name names one recipe"), std::string::npos);
  EXPECT_NE(message({"3"}, "mine", 64).find("is not a recipe name"), std::string::npos);
  // 4.375 bits is over tq-4.375's size at head_dim 256: the name would not keep its promise.
  EXPECT_NE(message({"4.375"}, "", 256).find("must fit in 4.09375 bits at head_dim 256"), std::string::npos);
}

TEST(RecipeFit, WidthsSpecRoundTrips) {
  const LayerWidths w = {{2, {4, 3}}, {3, {4, 3}}, {4, {5, 4}}, {5, {4, 3}}, {6, {2, 2}}, {7, {5, 4}}};
  EXPECT_EQ(widths_spec(w, true, "+sink1"), "k4v3+c+L6=k2v2+L4.7=k5v4+sink1");
  EXPECT_EQ(widths_spec(w, true, "", false, true), "k4v3+s+L6=k2v2+L4.7=k5v4");
  const ModelConfig c = config(10, 64);
  const CacheSpec s = resolve_cache_spec(widths_spec(w, false, ""), c);
  for (const auto& [l, kv] : w) {
    EXPECT_EQ(s.layers[static_cast<size_t>(l)].key_bits, kv.first) << l;
    EXPECT_EQ(s.layers[static_cast<size_t>(l)].value_bits, kv.second) << l;
  }
}

TEST(RecipeFit, AllLayersSpecCompressesTheBoundary) {
  const ModelConfig c = config(8, 64);
  EXPECT_EQ(compressed_layers(c), (std::vector<int>{2, 3, 4, 5}));
  EXPECT_EQ(compressed_layers(c, true), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  LayerWidths w;
  for (int l = 0; l < 8; ++l) w.push_back({l, l == 0 ? std::pair{8, 4} : std::pair{4, 3}});
  const std::string spec = widths_spec(w, false, "+sink1", true);
  EXPECT_EQ(spec, "k4v3+skip0+L0=k8v4+sink1");
  const CacheSpec s = resolve_cache_spec(spec, c);
  for (int l = 0; l < 8; ++l) {
    EXPECT_TRUE(s.layers[static_cast<size_t>(l)].compressed()) << l;
    EXPECT_EQ(s.layers[static_cast<size_t>(l)].key_bits, l == 0 ? 8 : 4) << l;
  }
  // Without +skip0 the override of a boundary layer would not apply: it stays f16.
  EXPECT_FALSE(resolve_cache_spec(widths_spec(w, false, ""), c).layers[0].compressed());
}

TEST(RecipeFit, AllocatorOverEveryLayerCountsTheWholeCache) {
  const ModelConfig c = config(12, 64, 3);
  std::vector<LayerSensitivity> scan;
  // Layer 0's keys are the most sensitive of all (as SmolLM2's first layer can be).
  for (int l : compressed_layers(c, true)) scan.push_back({l, l == 0 ? 2.0 : 0.01 * (l % 3 + 1), 0.01});
  ASSERT_EQ(scan.size(), 12u);
  for (const char* name : {"tq-4.375", "tq-3.375"}) {
    const double budget = *named_budget_bits(name, 64);
    const FitResult r = allocate_bits(c, scan, 4, 3, budget, true);
    EXPECT_NE(r.spec.find("+c+skip0"), std::string::npos) << r.spec;
    SpecSources src;
    src.key_stats = std::make_shared<KeyStats>(stats_for(c));
    const CacheSpec s = resolve_cache_spec(r.spec, c, src);
    ASSERT_EQ(r.widths.size(), 12u);
    for (size_t l = 0; l < s.layers.size(); ++l) {
      EXPECT_TRUE(s.layers[l].compressed()) << r.spec << " layer " << l;
      EXPECT_EQ(s.layers[l].key_bits, r.widths[l].second.first) << r.spec << " layer " << l;
      EXPECT_EQ(s.layers[l].value_bits, r.widths[l].second.second) << r.spec << " layer " << l;
    }
    EXPECT_GT(r.widths[0].second.first, r.widths[5].second.first) << r.spec;
    // The budget is that of the whole cache: every layer's bytes, copies included, at every context.
    EXPECT_NEAR(r.bits, budget_bits(s), 1e-12);
    EXPECT_LE(r.bits, budget + 1e-9) << r.spec;
    const double elements_per_position = 12.0 * 3 * 2 * 64;
    for (int ctx : {128, 512, 4096, 32768}) {
      const CacheBytes b = s.bytes(ctx, ctx);
      EXPECT_LE(static_cast<double>(b.total()) * 8 / (elements_per_position * ctx), budget + 1e-9) << r.spec << " ctx " << ctx;
    }
    // ... and the slots spend it: within one bit of one layer and the copies' reserve.
    EXPECT_GE(s.bits, budget - kCopyReserve - 1.0 / 12 - 1e-9) << r.spec;
  }
}

TEST(RecipeFit, AllocatorRejectsAScanOfSomeBoundaryLayers) {
  const ModelConfig c = config(12, 64);
  std::vector<LayerSensitivity> scan;
  for (int l = 0; l < 10; ++l) scan.push_back({l, 0.1, 0.1});  // layers 0-9: 10 and 11 missing
  try {
    allocate_bits(c, scan, 4, 3, 4.375, true);
    FAIL() << "a scan of layers 0-9 was allocated";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("or every layer"), std::string::npos) << e.what();
  }
  scan.clear();
  for (int l : compressed_layers(c)) scan.push_back({l, 0.1, 0.1});
  scan.push_back(scan.back());  // a layer twice
  EXPECT_THROW(allocate_bits(c, scan, 4, 3, 4.375, true), Error);
}

class NamedBudgetResolution : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tqkv_recipe_fit_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  RecipeFile file_for(const ModelKey& k, const ModelConfig& c, std::vector<Recipe> recipes) const {
    RecipeFile f;
    f.model_name = "model-" + k.arch;
    f.model = k;
    f.recipes = std::move(recipes);
    f.key_stats = stats_for(c);
    return f;
  }
  fs::path dir_;
};

TEST_F(NamedBudgetResolution, CalibratedFirstThenTheRuleNeverAnotherModels) {
  const ModelConfig qc = config(24, 64), oc = config(30, 64, 3);
  const ModelKey qwen{"qwen2", 24, 2, 64, "xxh3-64:00000000000000aa"};
  const ModelKey other{"llama", 30, 3, 64, "xxh3-64:00000000000000bb"};
  // Another model has all three budgets; this one has a calibrated tq-3.375 only.
  save_recipe_file(file_for(other, oc, {{"tq-4.375", "k5v3+c+L4.5.6.7.8.24.25=k4v3", "", ""},
                                        {"tq-2.5", "k2v2+c+L29=k3v2", "", ""}}),
                   (dir_ / "a.json").string());
  save_recipe_file(file_for(qwen, qc, {{"tq-3.375", "k3v3+c+L21=k4v3", "scan", ""}}), (dir_ / "b.json").string());
  const RecipeBook book({dir_.string()});
  const SpecSources src = spec_sources(book, qwen, qc);
  const CacheSpec calibrated = resolve_cache_spec("tq-3.375", qc, src);
  EXPECT_EQ(calibrated.layers[21].key_bits, 4);
  EXPECT_FALSE(src.is_rule_based("tq-3.375"));
  for (const char* name : {"tq-4.375", "tq-2.5"}) {
    EXPECT_TRUE(src.is_rule_based(name)) << name;
    const CacheSpec s = resolve_cache_spec(name, qc, src);  // no layer-range error: the rule's own layers
    EXPECT_TRUE(s.centre_keys) << name;  // the model has key statistics
    EXPECT_LE(budget_bits(s), *named_budget_bits(name, 64) + 1e-9) << name;
  }
  // Without key statistics the rule does not centre.
  RecipeFile bare = file_for(qwen, qc, {});
  bare.key_stats.reset();
  RecipeBook book2;
  book2.add_file(bare);
  const CacheSpec s = resolve_cache_spec("tq-4.375", qc, spec_sources(book2, qwen, qc));
  EXPECT_FALSE(s.centre_keys);
  // The other model keeps its own recipe.
  EXPECT_EQ(resolve_cache_spec("tq-4.375", oc, spec_sources(book, other, oc)).layers[4].key_bits, 4);
  // Names that are neither a budget nor a recipe are still unknown.
  EXPECT_THROW(resolve_cache_spec("tq-2.5x", qc, spec_sources(book, qwen, qc)), Error);
}

TEST_F(NamedBudgetResolution, ABudgetThatCannotApplySaysWhyInOneLine) {
  const RecipeBook book;
  // 2.2 bits leave the slots 2.075 after the copies' reserve: not even k2v2 (2.25 at d = 64).
  std::string why;
  EXPECT_FALSE(rule_recipe(config(12, 64), 2.2, false, &why).has_value());
  EXPECT_NE(why.find("cannot apply to this model"), std::string::npos) << why;
  EXPECT_NE(why.find("its slots take 2.25 bits per element at head_dim 64, and its f16 sink"), std::string::npos) << why;
  EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  std::vector<LayerSensitivity> inner;
  for (int l : compressed_layers(config(12, 64))) inner.push_back({l, 1, 1});
  try {
    allocate_bits(config(12, 64), inner, 4, 3, 2.2, false);
    FAIL() << "2.2 bits held k2v2";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot apply to this model"), std::string::npos) << e.what();
  }
  // Four layers: the boundary keeps them all f16.
  const ModelConfig tiny = config(4, 64);
  const ModelKey k2{"qwen2", 4, 2, 64, "xxh3-64:00000000000000dd"};
  try {
    resolve_cache_spec("tq-3.375", tiny, spec_sources(book, k2, tiny));
    FAIL() << "tq-3.375 on 4 layers resolved";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("all kept f16"), std::string::npos) << e.what();
  }
}

TEST_F(NamedBudgetResolution, FittedRecipesRoundTripThroughTheFile) {
  const ModelConfig c = config(18, 256, 1, true);
  const ModelKey key{"gemma3", 18, 1, 256, "xxh3-64:00000000000000ee"};
  std::vector<LayerSensitivity> scan;
  for (int l : compressed_layers(c)) scan.push_back({l, 0.1 * (l % 3 + 1), 0.02});
  const FitResult r = allocate_bits(c, scan, 4, 3, *named_budget_bits("tq-4.375", 256), true);
  const std::string path = (dir_ / "g.json").string();
  save_recipe_file(file_for(key, c, {{"tq-4.375", r.spec, "scan", "note"}}), path);
  const RecipeFile back = load_recipe_file(path);
  ASSERT_EQ(back.recipes.size(), 1u);
  EXPECT_EQ(back.recipes[0].spec, r.spec);
  const SpecSources src = spec_sources(RecipeBook({dir_.string()}), key, c);
  EXPECT_FALSE(src.is_rule_based("tq-4.375"));
  EXPECT_TRUE(src.is_rule_based("tq-3.375"));
  const CacheSpec s = resolve_cache_spec("tq-4.375", c, src);
  EXPECT_EQ(s.sinks, 1);  // copies on a model with sliding-window layers too, which keeps its rings
  EXPECT_LE(s.window_at(32768), 512);
  EXPECT_GT(s.ring_positions(0, 32768), 0);
  EXPECT_LE(budget_bits(s), *named_budget_bits("tq-4.375", 256) + 1e-9);
}

// The two Qwen2.5-Coder files in recipes/ (same arch, 2 kv heads each) never answer for each
// other: each model key picks its own file, its named budgets resolve to that file's specs
// within its own layers and budget, and a key mixing one's shape with the other's hash gets no
// file at all (the rule then). Needs no model file: the keys are the shipped files' own.
TEST(ShippedRecipes, EachQwenSizePicksItsOwnFile) {
  const std::string dir = std::string(TQKV_REPO_DIR) + "/recipes";
  const RecipeBook book({dir});
  const RecipeFile q05 = load_recipe_file(dir + "/qwen2.5-coder-0.5b-instruct.json");
  const RecipeFile q15 = load_recipe_file(dir + "/qwen2.5-coder-1.5b-instruct.json");
  EXPECT_EQ(q05.model.n_layers, 24);
  EXPECT_EQ(q05.model.head_dim, 64);
  EXPECT_EQ(q15.model.n_layers, 28);
  EXPECT_EQ(q15.model.head_dim, 128);
  EXPECT_EQ(q15.model.arch, q05.model.arch);
  EXPECT_EQ(q15.model.n_kv_heads, q05.model.n_kv_heads);
  EXPECT_NE(q15.model.weights_hash, q05.model.weights_hash);
  // Every shipped file is found by its own key and by no other file's.
  for (const RecipeFile& f : book.files()) {
    const RecipeFile* mine = book.for_model(f.model);
    ASSERT_NE(mine, nullptr) << f.path;
    EXPECT_TRUE(fs::equivalent(mine->path, f.path)) << f.path << " found " << mine->path;
  }
  ModelConfig c05 = config(24, 64), c15 = config(28, 128);
  c05.n_heads = 14;
  c15.n_heads = 12;
  struct Case {
    const RecipeFile& file;
    const ModelConfig& cfg;
  };
  for (const Case& k : {Case{q05, c05}, Case{q15, c15}}) {
    const SpecSources src = spec_sources(book, k.file.model, k.cfg);
    ASSERT_NE(src.key_stats, nullptr) << k.file.model_name;
    EXPECT_EQ(src.key_stats->n_layers, k.cfg.n_layers) << k.file.model_name;
    EXPECT_EQ(src.key_stats->head_dim, k.cfg.head_dim) << k.file.model_name;
    for (const NamedBudget& nb : named_budgets()) {
      EXPECT_FALSE(src.is_rule_based(nb.name)) << k.file.model_name << " " << nb.name;
      const auto own = std::find_if(k.file.recipes.begin(), k.file.recipes.end(), [&](const Recipe& r) { return r.name == nb.name; });
      ASSERT_NE(own, k.file.recipes.end()) << k.file.model_name << " " << nb.name;
      const auto got = std::find_if(src.recipes.begin(), src.recipes.end(), [&](const auto& p) { return p.first == nb.name; });
      ASSERT_NE(got, src.recipes.end()) << k.file.model_name << " " << nb.name;
      EXPECT_EQ(got->second, own->spec) << k.file.model_name << " " << nb.name;
      const CacheSpec s = resolve_cache_spec(nb.name, k.cfg, src);
      EXPECT_EQ(s.layers.size(), static_cast<size_t>(k.cfg.n_layers)) << k.file.model_name << " " << nb.name;
      EXPECT_TRUE(s.centre_keys) << k.file.model_name << " " << nb.name;
      EXPECT_LE(budget_bits(s), *named_budget_bits(nb.name, k.cfg.head_dim) + 1e-9) << k.file.model_name << " " << nb.name;
    }
  }
  // One's shape with the other's weights: another model, so neither file and the rule's recipe.
  ModelKey mixed = q15.model;
  mixed.weights_hash = q05.model.weights_hash;
  EXPECT_EQ(book.for_model(mixed), nullptr);
  const SpecSources rule = spec_sources(book, mixed, c15);
  EXPECT_EQ(rule.key_stats, nullptr);
  EXPECT_TRUE(rule.is_rule_based("tq-4.375"));
  mixed = q05.model;
  mixed.weights_hash = q15.model.weights_hash;
  EXPECT_EQ(book.for_model(mixed), nullptr);
}

// The shipped calibrated recipes are the models' own, and within their budgets.
void expect_calibrated(const Model& m, const GgufFile& f, const std::string& recipe_file) {
  const RecipeFile shipped = load_recipe_file(std::string(TQKV_REPO_DIR) + "/recipes/" + recipe_file);
  EXPECT_EQ(model_key(f), shipped.model);
  for (const NamedBudget& nb : named_budgets()) {
    EXPECT_FALSE(m.spec_sources().is_rule_based(nb.name)) << nb.name;
    const CacheSpec s = m.resolve(nb.name);
    EXPECT_TRUE(s.centre_keys) << nb.name;
    EXPECT_LE(budget_bits(s), *named_budget_bits(nb.name, m.config().head_dim) + 1e-9) << nb.name;
  }
}

class ShippedQwen05 : public testing_util::Qwen05ModelTest {};
TEST_F(ShippedQwen05, NamedBudgetsAreCalibrated) { expect_calibrated(*model_, *file_, "qwen2.5-coder-0.5b-instruct.json"); }
class ShippedGemma3 : public testing_util::Gemma3ModelTest {};
TEST_F(ShippedGemma3, NamedBudgetsAreCalibrated) { expect_calibrated(*model_, *file_, "gemma-3-270m.json"); }

}  // namespace
}  // namespace tqkv::engine
