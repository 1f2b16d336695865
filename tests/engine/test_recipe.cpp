// Recipe files (recipe.h): the shipped file against the recipes the engine holds, save/load
// round trips, every kind of corruption giving tqkv::Error(Format) that names the field, the
// weights hash against its documented byte layout, and RecipeBook's lookups and messages.
#include <gtest/gtest.h>
#include <unistd.h>
#include <xxhash.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "engine/cache/cache_spec.h"
#include "engine/gguf/gguf.h"
#include "engine/cache/recipe.h"
#include "gguf_builder.h"
#include "real_models.h"
#include "tqkv/error.h"

namespace tqkv::engine {

void PrintTo(const ModelKey& k, std::ostream* os) { *os << k.describe(); }

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kShipped = std::string(TQKV_REPO_DIR) + "/recipes/smollm2-135m-instruct.json";

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("tqkv_recipe_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A valid file for another model, with key statistics.
RecipeFile other_model_file(int n_layers = 2, int n_kv = 2, int d = 4) {
  RecipeFile f;
  f.model_name = "Tiny-Qwen";
  f.model_file = "tiny.gguf";
  f.model = ModelKey{"qwen2", n_layers, n_kv, d, "xxh3-64:0123456789abcdef"};
  f.recipes = {{"tq-3.5", "k4v3+c+L1=k3v3", "a scan", "a note"}, {"tq-q.x_y-z", "k3v2", "", ""}};
  KeyStats s;
  s.source = "data/kjv-exodus.txt, ctx 512";
  s.tokens = 1536;
  s.n_layers = n_layers;
  s.n_kv_heads = n_kv;
  s.head_dim = d;
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 3.0f);
  for (size_t i = 0; i < s.size(); ++i) {
    s.key_mean.push_back(g(rng));
    s.key_sq.push_back(std::fabs(g(rng)) * 1e-3f);
    s.query_sq.push_back(std::fabs(g(rng)) * 1e4f);
  }
  s.key_sq[0] = 0.0f;
  f.key_stats = s;
  return f;
}

void expect_same(const RecipeFile& a, const RecipeFile& b) {
  EXPECT_EQ(a.version, b.version);
  EXPECT_EQ(a.model_name, b.model_name);
  EXPECT_EQ(a.model_file, b.model_file);
  EXPECT_EQ(a.model, b.model);
  EXPECT_EQ(a.recipes, b.recipes);
  ASSERT_EQ(a.key_stats.has_value(), b.key_stats.has_value());
  if (!a.key_stats) return;
  const KeyStats &x = *a.key_stats, &y = *b.key_stats;
  EXPECT_EQ(x.source, y.source);
  EXPECT_EQ(x.tokens, y.tokens);
  EXPECT_EQ(x.n_layers, y.n_layers);
  EXPECT_EQ(x.n_kv_heads, y.n_kv_heads);
  EXPECT_EQ(x.head_dim, y.head_dim);
  EXPECT_EQ(x.key_mean, y.key_mean);  // bit-exact: floats are written in shortest round-trip form
  EXPECT_EQ(x.key_sq, y.key_sq);
  EXPECT_EQ(x.query_sq, y.query_sq);
}

TEST(RecipeFile, ShippedFileHoldsTheEngineRecipes) {
  const RecipeFile f = load_recipe_file(kShipped);
  EXPECT_EQ(f.version, 1);
  EXPECT_EQ(f.path, kShipped);
  EXPECT_EQ(f.model_name, "SmolLM2-135M-Instruct");
  EXPECT_EQ(f.model_file, "SmolLM2-135M-Instruct.Q4_1.gguf");
  EXPECT_EQ(f.model.arch, "llama");
  EXPECT_EQ(f.model.n_layers, 30);
  EXPECT_EQ(f.model.n_kv_heads, 3);
  EXPECT_EQ(f.model.head_dim, 64);
  // Key statistics from `tqkv calibrate` on Exodus (the recipes centre their keys).
  ASSERT_TRUE(f.key_stats.has_value());
  EXPECT_GT(f.key_stats->tokens, 10000);
  // The recipes measured in docs/journal/RESULTS-journal.md, as the engine held them before they
  // became data.
  const std::vector<std::pair<std::string, std::string>> engine = {
      {"tq-4.36", "k5v4+c+L4.6.7.8.24.25=k4v3+L3.11=k4v4+L14.15.20.22.26.27=k5v3+L17=k6v3"},
      {"tq-3.36", "k3v3+c+L19.18.13.25.17.23=k4v3"},
      {"tq-4.25", "k5v3+c+L4.5.6.7.8.24.25=k4v3+L3.10.11=k4v4+L2.12.13.16.19.23=k5v4+L17=k6v3"},
      {"tq-3.12", "k4v2+c+L4.5.6.7.8.9.24.25.26=k3v2+L3.10.11=k3v3+L2=k4v3+L17=k5v2"},
      {"tq-2.75", "k3v2+c"},
      {"tq-4.375-b16", "k5v3+c+L4.5.6.7.8.24.25=k4v3+L3.10.11=k4v4+L2.12.13.16.19.23=k5v4+L17=k6v3+sink1+wq6+fill4.375"},
      {"tq-3.375-b16", "k3v2+c+L11=k2v2+L5.7.8.9.16.18.20.26=k4v2+L14.15.17.21.23.24=k4v3+sink1+wq6+fill3.375"},
      {"tq-2.5", "k2v2+c+L5.8.9.14.20.23=k3v2+sink1+wq6+fill2.5"},
      // tqkv calibrate --boundary-in-budget: every layer compressed, the budget over the whole cache.
      {"tq-4.375",
       "k5v4+c+skip0+L11.29=k3v2+L0.1=k3v4+L27=k4v2+L2.7.10.28=k4v3+L3.4=k4v4+L9.13.16.19.22.25.26=k5v3+L23=k6v5+sink1+wq6+"
       "fill4.375"},
      // The same scan with --max-pairs 1, 2, 3 (fewer fused decode kernels at batch 1).
      {"tq-4.375-p1", "k5v3+c+skip0+sink1+wq6+fill4.375"},
      {"tq-4.375-p2", "k4v3+c+skip0+L0.5.6.8.9.14.15.16.17.18.20.21.22.23.24=k5v4+sink1+wq6+fill4.375"},
      {"tq-4.375-p3", "k5v4+c+skip0+L0.1=k3v4+L2.3.4.7.10.11.13.19.25.26.27.28.29=k4v3+sink1+wq6+fill4.375"},
      {"tq-3.375",
       "k4v2+c+skip0+L11.29=k2v2+L0.1=k2v3+L2.12.19.25.27.28=k3v2+L4.8.14.15.17.18.20.21.24=k4v3+L23=k5v4+sink1+wq6+"
       "fill3.375"},
  };
  SpecSources sources;
  sources.key_stats = std::make_shared<KeyStats>(*f.key_stats);
  ASSERT_EQ(f.recipes.size(), engine.size());
  for (size_t i = 0; i < engine.size(); ++i) {
    EXPECT_EQ(f.recipes[i].name, engine[i].first);
    EXPECT_EQ(f.recipes[i].spec, engine[i].second) << f.recipes[i].name;
    EXPECT_FALSE(f.recipes[i].fitted_on.empty()) << f.recipes[i].name;
    EXPECT_FALSE(f.recipes[i].note.empty()) << f.recipes[i].name;
    // Every spec resolves for the model it names.
    ModelConfig cfg;
    cfg.n_layers = f.model.n_layers;
    cfg.n_kv_heads = f.model.n_kv_heads;
    cfg.head_dim = f.model.head_dim;
    cfg.n_heads = 9;
    EXPECT_NO_THROW(resolve_cache_spec(f.recipes[i].spec, cfg, sources)) << f.recipes[i].name;
  }
}

TEST(RecipeFile, RoundTripsWithStats) {
  TempDir dir;
  const RecipeFile a = other_model_file(3, 2, 8);
  const std::string p = dir.file("tiny.json");
  save_recipe_file(a, p);
  const RecipeFile b = load_recipe_file(p);
  expect_same(a, b);
  EXPECT_EQ(b.path, p);
  // Stable: saving what was loaded gives the same bytes, and no temporary file is left.
  const std::string p2 = dir.file("again.json");
  save_recipe_file(b, p2);
  EXPECT_EQ(read_text(p), read_text(p2));
  int n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.str())) ++n;
  EXPECT_EQ(n, 2);
  // Overwrites in place.
  RecipeFile c = a;
  c.recipes.pop_back();
  c.key_stats.reset();
  save_recipe_file(c, p);
  expect_same(c, load_recipe_file(p));
  EXPECT_NE(read_text(p).find("\"key_stats\": null"), std::string::npos);
}

TEST(RecipeFile, ShippedFileRoundTrips) {
  TempDir dir;
  const RecipeFile a = load_recipe_file(kShipped);
  save_recipe_file(a, dir.file("s.json"));
  expect_same(a, load_recipe_file(dir.file("s.json")));
}

TEST(RecipeFile, SaveRejectsWhatLoadWould) {
  TempDir dir;
  RecipeFile f = other_model_file();
  f.key_stats->key_sq[1] = std::nanf("");
  try {
    save_recipe_file(f, dir.file("x.json"));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Format);
    EXPECT_NE(std::string(e.what()).find("key_stats.key_sq[1]"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir.file("x.json")));
}

TEST(RecipeFile, MissingFileIsAClearError) {
  try {
    load_recipe_file("/nonexistent/r.json");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/r.json"), std::string::npos) << e.what();
  }
}

// Every corruption: the error is Format and names the path and the field.
struct Corruption {
  const char* what;
  std::function<void(json&)> apply;
  const char* field;  // must appear in the message
};

TEST(RecipeFile, EveryCorruptionNamesTheField) {
  TempDir dir;
  // A base with key statistics, so that their checks are reachable.
  save_recipe_file(other_model_file(), dir.file("base.json"));
  const json base = json::parse(read_text(dir.file("base.json")));
  const std::vector<Corruption> cases = {
      {"version missing", [](json& j) { j.erase("tqkv_recipe_file"); }, "tqkv_recipe_file: missing"},
      {"version 2", [](json& j) { j["tqkv_recipe_file"] = 2; }, "tqkv_recipe_file: version 2 is not supported"},
      {"version as string", [](json& j) { j["tqkv_recipe_file"] = "1"; }, "tqkv_recipe_file: is a string"},
      {"version fractional", [](json& j) { j["tqkv_recipe_file"] = 1.5; }, "tqkv_recipe_file: is a fractional"},
      {"model missing", [](json& j) { j.erase("model"); }, "model: missing"},
      {"model not an object", [](json& j) { j["model"] = json::array(); }, "model: is an array"},
      {"model name missing", [](json& j) { j["model"].erase("name"); }, "model.name: missing"},
      {"arch empty", [](json& j) { j["model"]["arch"] = ""; }, "model.arch: is empty"},
      {"arch a number", [](json& j) { j["model"]["arch"] = 3; }, "model.arch: is a number"},
      {"n_layers a string", [](json& j) { j["model"]["n_layers"] = "30"; }, "model.n_layers: is a string"},
      {"n_layers zero", [](json& j) { j["model"]["n_layers"] = 0; }, "model.n_layers: 0 is out of range"},
      {"n_layers beyond int64", [](json& j) { j["model"]["n_layers"] = 18446744073709551615ull; },
       "model.n_layers: 18446744073709551615 is out of range"},
      {"tokens beyond int64", [](json& j) { j["key_stats"]["tokens"] = 18446744073709551615ull; }, "key_stats.tokens: 18446744073709551615"},
      {"n_kv_heads negative", [](json& j) { j["model"]["n_kv_heads"] = -3; }, "model.n_kv_heads: -3 is out of range"},
      {"head_dim null", [](json& j) { j["model"]["head_dim"] = nullptr; }, "model.head_dim: is null"},
      {"head_dim huge", [](json& j) { j["model"]["head_dim"] = 1e300; }, "model.head_dim: is a fractional"},
      {"hash missing", [](json& j) { j["model"].erase("weights_hash"); }, "model.weights_hash: missing"},
      {"hash malformed", [](json& j) { j["model"]["weights_hash"] = "xxh3-64:XYZ"; }, "model.weights_hash"},
      {"hash upper case", [](json& j) { j["model"]["weights_hash"] = "xxh3-64:0123456789ABCDEF"; }, "model.weights_hash"},
      {"unknown top-level field", [](json& j) { j["recipies"] = json::array(); }, "recipies: unknown field"},
      {"unknown model field", [](json& j) { j["model"]["layers"] = 30; }, "model.layers: unknown field"},
      {"recipes missing", [](json& j) { j.erase("recipes"); }, "recipes: missing"},
      {"recipes an object", [](json& j) { j["recipes"] = json::object(); }, "recipes: is an object"},
      {"recipe a string", [](json& j) { j["recipes"][1] = "tq-4"; }, "recipes[1]: is a string"},
      {"recipe name missing", [](json& j) { j["recipes"][0].erase("name"); }, "recipes[0].name: missing"},
      {"recipe name malformed", [](json& j) { j["recipes"][0]["name"] = "q-4.36"; }, "recipes[0].name: 'q-4.36' is not"},
      {"recipe name bare", [](json& j) { j["recipes"][0]["name"] = "tq-"; }, "recipes[0].name"},
      {"recipe name with space", [](json& j) { j["recipes"][0]["name"] = "tq-4 36"; }, "recipes[0].name"},
      {"duplicate names", [](json& j) { j["recipes"][1]["name"] = j["recipes"][0]["name"]; }, "recipes[1].name: 'tq-3.5' appears twice"},
      {"spec empty", [](json& j) { j["recipes"][0]["spec"] = ""; }, "recipes[0].spec: is empty"},
      {"spec missing", [](json& j) { j["recipes"][1].erase("spec"); }, "recipes[1].spec: missing"},
      {"spec with space", [](json& j) { j["recipes"][0]["spec"] = "k4v3 +c"; }, "recipes[0].spec"},
      {"note a number", [](json& j) { j["recipes"][0]["note"] = 1; }, "recipes[0].note: is a number"},
      {"unknown recipe field", [](json& j) { j["recipes"][0]["bits"] = 4; }, "recipes[0].bits: unknown field"},
      {"stats an array", [](json& j) { j["key_stats"] = json::array(); }, "key_stats: is an array"},
      {"stats tokens zero", [](json& j) { j["key_stats"]["tokens"] = 0; }, "key_stats.tokens"},
      {"stats layers mismatch", [](json& j) { j["key_stats"]["n_layers"] = 3; }, "key_stats.n_layers: 3 differs"},
      {"stats head_dim mismatch", [](json& j) { j["key_stats"]["head_dim"] = 8; }, "key_stats.head_dim"},
      {"stats too short", [](json& j) { j["key_stats"]["key_sq"].erase(0); }, "key_stats.key_sq: has 15 values"},
      {"stats too long", [](json& j) { j["key_stats"]["query_sq"].push_back(1.0); }, "key_stats.query_sq: has 17 values"},
      {"stats missing", [](json& j) { j["key_stats"].erase("key_mean"); }, "key_stats.key_mean: missing"},
      {"stats null value (NaN as JSON writes it)", [](json& j) { j["key_stats"]["key_mean"][3] = nullptr; }, "key_stats.key_mean[3]: is null"},
      {"stats \"nan\" string", [](json& j) { j["key_stats"]["query_sq"][0] = "nan"; }, "key_stats.query_sq[0]: is a string"},
      {"stats beyond float", [](json& j) { j["key_stats"]["key_mean"][2] = 1e39; }, "key_stats.key_mean[2]: is not a finite float"},
      {"negative key_sq", [](json& j) { j["key_stats"]["key_sq"][5] = -0.5; }, "key_stats.key_sq[5]: -0.5"},
      {"negative query_sq", [](json& j) { j["key_stats"]["query_sq"][15] = -1; }, "key_stats.query_sq[15]"},
      {"top level an array", [](json& j) { j = json::array({1, 2}); }, "top level: is an array"},
  };
  for (const Corruption& c : cases) {
    json j = base;
    c.apply(j);
    const std::string p = dir.file("bad.json");
    write_text(p, j.dump(2));
    try {
      load_recipe_file(p);
      ADD_FAILURE() << c.what << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Format) << c.what;
      const std::string msg = e.what();
      EXPECT_NE(msg.find(p), std::string::npos) << c.what << ": " << msg;
      EXPECT_NE(msg.find(c.field), std::string::npos) << c.what << ": " << msg;
    }
  }
  // Comments (keys starting with '_') are allowed anywhere.
  json j = base;
  j["_comment"] = "fitted by hand";
  j["recipes"][0]["_why"] = "x";
  write_text(dir.file("ok.json"), j.dump());
  EXPECT_NO_THROW(load_recipe_file(dir.file("ok.json")));
}

TEST(RecipeFile, TruncatedOrEmptyJsonIsFormat) {
  TempDir dir;
  const std::string text = read_text(kShipped);
  for (size_t len : {size_t{0}, size_t{1}, text.size() / 3, text.size() / 2, text.size() - 3}) {
    const std::string p = dir.file("t.json");
    write_text(p, text.substr(0, len));
    try {
      load_recipe_file(p);
      ADD_FAILURE() << "length " << len << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Format);
      EXPECT_NE(std::string(e.what()).find("not valid JSON"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  }
}

// A small llama-shaped GGUF with two tensors.
std::vector<uint8_t> small_gguf(const std::vector<uint8_t>& data, const std::string& name = "blk.0.attn_k.weight",
                                std::vector<uint64_t> shape = {4, 2}) {
  test::GgufBuilder b;
  b.str("general.architecture", "llama").u32("llama.block_count", 2).u32("llama.embedding_length", 16);
  b.u32("llama.attention.head_count", 4).u32("llama.attention.head_count_kv", 2);
  b.f32_tensor("token_embd.weight", {4, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  b.tensor(name, shape, 0, data);
  return b.build();
}

std::vector<uint8_t> some_bytes() {
  std::vector<uint8_t> v(32);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(i * 37 + 1);
  return v;
}

TEST(WeightsHash, StableAndSensitiveToEveryPart) {
  const std::vector<uint8_t> bytes = small_gguf(some_bytes());
  const GgufFile f = GgufFile::parse(bytes);
  const std::string h = weights_hash(f);
  ASSERT_EQ(h.size(), 8u + 16u);
  EXPECT_EQ(h.substr(0, 8), "xxh3-64:");
  EXPECT_EQ(h, weights_hash(f));
  EXPECT_EQ(h, weights_hash(GgufFile::parse(small_gguf(some_bytes()))));
  std::vector<uint8_t> d = some_bytes();
  d[17] ^= 1;  // one data bit
  const std::vector<uint8_t> b1 = small_gguf(d);
  EXPECT_NE(h, weights_hash(GgufFile::parse(b1)));
  const std::vector<uint8_t> b2 = small_gguf(some_bytes(), "blk.0.attn_v.weight");  // a name
  EXPECT_NE(h, weights_hash(GgufFile::parse(b2)));
  const std::vector<uint8_t> b3 = small_gguf(some_bytes(), "blk.0.attn_k.weight", {2, 4});  // a shape, same bytes
  EXPECT_NE(h, weights_hash(GgufFile::parse(b3)));
  // Metadata is not hashed.
  test::GgufBuilder b;
  b.str("general.architecture", "llama").str("general.name", "renamed").u32("llama.block_count", 2);
  b.f32_tensor("token_embd.weight", {4, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  b.tensor("blk.0.attn_k.weight", {4, 2}, 0, some_bytes());
  const std::vector<uint8_t> b4 = b.build();
  EXPECT_EQ(h, weights_hash(GgufFile::parse(b4)));
}

// The hash is exactly the byte layout recipe.h and docs/FORMAT.md document.
TEST(WeightsHash, MatchesTheDocumentedLayout) {
  const std::vector<uint8_t> bytes = small_gguf(some_bytes());
  const GgufFile f = GgufFile::parse(bytes);
  std::vector<uint8_t> s;
  auto le = [&](uint64_t v, int n) {
    for (int i = 0; i < n; ++i) s.push_back(static_cast<uint8_t>(v >> (8 * i)));
  };
  auto tensor = [&](const std::string& name, uint32_t type, std::vector<int64_t> shape, const void* data, size_t n) {
    le(name.size(), 8);
    s.insert(s.end(), name.begin(), name.end());
    le(type, 4);
    le(shape.size(), 4);
    for (int64_t x : shape) le(static_cast<uint64_t>(x), 8);
    le(n, 8);
    const auto* p = static_cast<const uint8_t*>(data);
    s.insert(s.end(), p, p + n);
  };
  const std::vector<float> emb = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  tensor("token_embd.weight", 0, {4, 3}, emb.data(), emb.size() * 4);
  const std::vector<uint8_t> k = some_bytes();
  tensor("blk.0.attn_k.weight", 0, {4, 2}, k.data(), k.size());
  char want[32];
  std::snprintf(want, sizeof want, "xxh3-64:%016llx", static_cast<unsigned long long>(XXH3_64bits(s.data(), s.size())));
  EXPECT_EQ(weights_hash(f), want);
}

TEST(WeightsHash, ModelKeyReadsTheShape) {
  const std::vector<uint8_t> bytes = small_gguf(some_bytes());
  const GgufFile f = GgufFile::parse(bytes);
  const ModelKey k = model_key(f);
  EXPECT_EQ(k.arch, "llama");
  EXPECT_EQ(k.n_layers, 2);
  EXPECT_EQ(k.n_kv_heads, 2);
  EXPECT_EQ(k.head_dim, 4);
  EXPECT_EQ(k.weights_hash, weights_hash(f));
  EXPECT_EQ(k.describe(), "llama, 2 layers, 2 kv heads, head_dim 4, " + k.weights_hash);
}

// A book over two directories: the shipped SmolLM2 file and a file for a tiny qwen2 model.
class RecipeBookTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(dir_.file("a"));
    fs::create_directories(dir_.file("b"));
    fs::copy_file(kShipped, dir_.file("a/smollm2.json"));
    save_recipe_file(other_model_file(), dir_.file("b/tiny.json"));
    write_text(dir_.file("b/readme.txt"), "not a recipe file");
    smol_ = load_recipe_file(kShipped).model;
    tiny_ = other_model_file().model;
  }
  TempDir dir_;
  ModelKey smol_, tiny_;
};

TEST_F(RecipeBookTest, FindsOnlyExactModels) {
  const RecipeBook book({dir_.file("a"), dir_.file("b"), dir_.file("missing")});
  ASSERT_EQ(book.files().size(), 2u);
  ASSERT_NE(book.for_model(smol_), nullptr);
  EXPECT_EQ(book.for_model(smol_)->model_name, "SmolLM2-135M-Instruct");
  EXPECT_EQ(book.for_model(tiny_)->model_name, "Tiny-Qwen");
  const std::optional<Recipe> r = book.find(smol_, "tq-4.375");
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->spec.rfind("k5v4+c+skip0+", 0), 0u) << r->spec;  // every layer in the budget
  EXPECT_EQ(book.find(smol_, "tq-4.375-b16")->spec,
            "k5v3+c+L4.5.6.7.8.24.25=k4v3+L3.10.11=k4v4+L2.12.13.16.19.23=k5v4+L17=k6v3+sink1+wq6+fill4.375");
  EXPECT_EQ(book.why_not(smol_, "tq-4.375"), "");
  EXPECT_TRUE(book.find(tiny_, "tq-3.5").has_value());
  EXPECT_FALSE(book.find(tiny_, "tq-4.375").has_value());
  EXPECT_FALSE(book.find(smol_, "tq-3.5").has_value());
  // A model that differs in any one field is another model.
  for (int field = 0; field < 5; ++field) {
    ModelKey k = smol_;
    if (field == 0) k.arch = "qwen2";
    if (field == 1) k.n_layers = 28;
    if (field == 2) k.n_kv_heads = 2;
    if (field == 3) k.head_dim = 128;
    if (field == 4) k.weights_hash = "xxh3-64:ffffffffffffffff";
    EXPECT_EQ(book.for_model(k), nullptr) << field;
    EXPECT_FALSE(book.find(k, "tq-4.36").has_value()) << field;
  }
  const std::vector<std::string> names = book.names();
  EXPECT_EQ(names.size(), 13u + 2);  // the shipped file's and the test file's
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_NE(std::find(names.begin(), names.end(), "tq-3.5"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "tq-2.5"), names.end());
}

TEST_F(RecipeBookTest, WhyNotExplains) {
  const RecipeBook book({dir_.file("a"), dir_.file("b")});
  const ModelKey qwen{"qwen2", 24, 2, 64, "xxh3-64:00000000000000aa"};
  const std::string m = book.why_not(qwen, "tq-4.375");
  EXPECT_NE(m.find("recipe 'tq-4.375' was fitted to SmolLM2-135M-Instruct (llama, 30 layers, 3 kv heads, head_dim 64, " +
                   smol_.weights_hash + "), not to this model (qwen2, 24 layers, 2 kv heads, head_dim 64, xxh3-64:00000000000000aa)"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("tqkv calibrate --budget"), std::string::npos) << m;
  EXPECT_NE(m.find("k4v3+c"), std::string::npos) << m;
  // Same shape, other weights (say another quantization of the same model).
  ModelKey requant = smol_;
  requant.weights_hash = "xxh3-64:1111111111111111";
  EXPECT_NE(book.why_not(requant, "tq-4.36").find("same shape, other weights"), std::string::npos);
  // This model has recipes, not that one.
  const std::string m2 = book.why_not(tiny_, "tq-9.9");
  EXPECT_NE(m2.find("is not among the recipes fitted to this model"), std::string::npos) << m2;
  EXPECT_NE(m2.find("tq-3.5, tq-q.x_y-z"), std::string::npos) << m2;
  // Nobody has it.
  const std::string m3 = book.why_not(qwen, "tq-9.9");
  EXPECT_NE(m3.find("no recipe file names recipe 'tq-9.9'"), std::string::npos) << m3;
  EXPECT_NE(m3.find(dir_.file("a")), std::string::npos) << m3;
}

TEST_F(RecipeBookTest, AddedFileTakesPrecedence) {
  RecipeBook book({dir_.file("a")});
  RecipeFile mine = load_recipe_file(kShipped);
  mine.model_name = "mine";
  mine.recipes = {{"tq-4.36", "k4v4+c", "", ""}};
  book.add_file(mine);
  EXPECT_EQ(book.find(smol_, "tq-4.36")->spec, "k4v4+c");
  EXPECT_EQ(book.for_model(smol_)->model_name, "mine");
  EXPECT_TRUE(book.find(smol_, "tq-3.36").has_value());  // the shipped file still answers the rest
  RecipeFile bad = mine;
  bad.recipes.push_back(bad.recipes[0]);
  EXPECT_THROW(book.add_file(bad), Error);
}

TEST_F(RecipeBookTest, CorruptFileIsNamedNotSkipped) {
  write_text(dir_.file("b/zz-broken.json"), "{ \"tqkv_recipe_file\": 1, ");
  try {
    RecipeBook book({dir_.file("a"), dir_.file("b")});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Format);
    EXPECT_NE(std::string(e.what()).find("zz-broken.json"), std::string::npos) << e.what();
  }
}

TEST_F(RecipeBookTest, RecipeDirsFromEnvironment) {
  const char* old = std::getenv("TQKV_RECIPES");
  const std::string saved = old ? old : "";
  const std::string env = dir_.file("b") + ":" + dir_.file("missing") + "::" + dir_.file("a") + ":" + dir_.file("b") + "/.";
  setenv("TQKV_RECIPES", env.c_str(), 1);
  const std::vector<std::string> dirs = recipe_dirs();
  if (old) setenv("TQKV_RECIPES", saved.c_str(), 1);
  else unsetenv("TQKV_RECIPES");
  ASSERT_GE(dirs.size(), 3u);
  EXPECT_EQ(dirs[0], dir_.file("b"));
  EXPECT_EQ(dirs[1], dir_.file("a"));  // the missing one dropped, b/. the same as b
  const fs::path shipped_dir = fs::path(kShipped).parent_path();
  int shipped = 0;
  for (const std::string& d : dirs) shipped += fs::equivalent(d, shipped_dir);
  EXPECT_EQ(shipped, 1);
  EXPECT_EQ(dirs.size(), 3u);
}

TEST(RecipeBookDefault, ShippedDirectoryLoads) {
  const RecipeBook book = RecipeBook::from_default_dirs();
  const std::vector<std::string> names = book.names();
  EXPECT_NE(std::find(names.begin(), names.end(), "tq-3.375"), names.end());
  EXPECT_NE(book.for_model(load_recipe_file(kShipped).model), nullptr);
}

// The shipped file's hash is the real model's.
class RecipeRealModel : public testing_util::SmolModelTest {};

TEST_F(RecipeRealModel, ShippedHashIsTheModels) {
  const ModelKey k = model_key(*file_);
  std::cout << "model key: " << k.describe() << "\n";
  const RecipeFile f = load_recipe_file(kShipped);
  EXPECT_EQ(k, f.model) << k.describe() << " vs " << f.model.describe();
  const RecipeBook book = RecipeBook::from_default_dirs();
  ASSERT_TRUE(book.find(k, "tq-4.36").has_value()) << book.why_not(k, "tq-4.36");
  EXPECT_EQ(k.n_layers, model_->config().n_layers);
  EXPECT_EQ(k.n_kv_heads, model_->config().n_kv_heads);
  EXPECT_EQ(k.head_dim, model_->config().head_dim);
}

}  // namespace
}  // namespace tqkv::engine
