#include "engine/cache/recipe.h"

#include <xxhash.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <system_error>
#include <unistd.h>

#include "engine/gguf/gguf.h"
#include "tqkv/error.h"
#include "tqkv/options.h"

namespace tqkv::engine {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

constexpr int kMaxLayers = 1 << 16;
constexpr int kMaxHeads = 1 << 12;
constexpr int kMaxHeadDim = 1 << 12;

[[noreturn]] void bad(const std::string& path, const std::string& field, const std::string& why) {
  throw Error(ErrorCode::Format, "recipe file '" + path + "': " + (field.empty() ? "" : field + ": ") + why);
}

const char* type_name(const json& j) {
  switch (j.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_float: return "a fractional number";
    default: return "a number";
  }
}

// Field access with the path and field name in every error.
class Reader {
 public:
  Reader(const std::string& path, const json& obj, std::string where) : path_(path), obj_(obj), where_(std::move(where)) {
    if (!obj_.is_object()) bad(path_, where_.empty() ? "top level" : where_, std::string("is ") + type_name(obj_) + ", not an object");
  }
  std::string field(const std::string& k) const { return where_.empty() ? k : where_ + "." + k; }
  const json* get(const std::string& k) const {
    const auto it = obj_.find(k);
    return it == obj_.end() ? nullptr : &*it;
  }
  const json& need(const std::string& k) const {
    const json* j = get(k);
    if (!j) bad(path_, field(k), "missing");
    return *j;
  }
  std::string str(const std::string& k, bool required = true, bool non_empty = true) const {
    const json* j = required ? &need(k) : get(k);
    if (!j) return {};
    if (!j->is_string()) bad(path_, field(k), std::string("is ") + type_name(*j) + ", not a string");
    std::string s = j->get<std::string>();
    if (non_empty && s.empty()) bad(path_, field(k), "is empty");
    return s;
  }
  int64_t integer(const std::string& k, int64_t lo, int64_t hi) const {
    const json& j = need(k);
    if (!j.is_number_integer()) bad(path_, field(k), std::string("is ") + type_name(j) + ", not an integer");
    // Non-negative JSON integers parse as unsigned: compare those unsigned, so that none wraps.
    bool in_range = false;
    if (j.is_number_unsigned()) {
      const uint64_t u = j.get<uint64_t>();
      in_range = hi >= 0 && u <= static_cast<uint64_t>(hi) && static_cast<int64_t>(u) >= lo;
    } else {
      const int64_t v = j.get<int64_t>();
      in_range = v >= lo && v <= hi;
    }
    if (!in_range) bad(path_, field(k), j.dump() + " is out of range " + std::to_string(lo) + ".." + std::to_string(hi));
    return j.is_number_unsigned() ? static_cast<int64_t>(j.get<uint64_t>()) : j.get<int64_t>();
  }
  // Every key is known or a comment (leading '_'): a misspelt optional field is an error, not a
  // silent default.
  void only(std::initializer_list<const char*> known) const {
    for (const auto& [k, v] : obj_.items()) {
      if (!k.empty() && k[0] == '_') continue;
      if (std::none_of(known.begin(), known.end(), [&](const char* x) { return k == x; }))
        bad(path_, field(k), "unknown field");
    }
  }

 private:
  const std::string& path_;
  const json& obj_;
  std::string where_;
};

bool valid_recipe_name(const std::string& n) {
  if (n.size() < 4 || n.rfind("tq-", 0) != 0) return false;
  return std::all_of(n.begin() + 3, n.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
  });
}

bool valid_hash(const std::string& h) {
  constexpr std::string_view prefix = "xxh3-64:";
  if (h.size() != prefix.size() + 16 || h.rfind(prefix, 0) != 0) return false;
  return std::all_of(h.begin() + prefix.size(), h.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// The checks that do not depend on the JSON (shared by load and save).
void validate(const RecipeFile& f, const std::string& path) {
  if (f.version != RecipeFile::kVersion)
    bad(path, "tqkv_recipe_file",
        "version " + std::to_string(f.version) + " is not supported (this build reads version " +
            std::to_string(RecipeFile::kVersion) + ")");
  if (f.model_name.empty()) bad(path, "model.name", "is empty");
  const ModelKey& m = f.model;
  if (m.arch.empty()) bad(path, "model.arch", "is empty");
  auto range = [&](const char* field, int v, int hi) {
    if (v < 1 || v > hi) bad(path, field, std::to_string(v) + " is out of range 1.." + std::to_string(hi));
  };
  range("model.n_layers", m.n_layers, kMaxLayers);
  range("model.n_kv_heads", m.n_kv_heads, kMaxHeads);
  range("model.head_dim", m.head_dim, kMaxHeadDim);
  if (!valid_hash(m.weights_hash))
    bad(path, "model.weights_hash", "'" + m.weights_hash + "' is not \"xxh3-64:\" followed by 16 lower-case hex digits");
  std::set<std::string> seen;
  for (size_t i = 0; i < f.recipes.size(); ++i) {
    const Recipe& r = f.recipes[i];
    const std::string at = "recipes[" + std::to_string(i) + "]";
    if (!valid_recipe_name(r.name))
      bad(path, at + ".name", "'" + r.name + "' is not a recipe name (tq- followed by letters, digits, '.', '_' or '-')");
    if (!seen.insert(r.name).second) bad(path, at + ".name", "'" + r.name + "' appears twice");
    if (r.spec.empty()) bad(path, at + ".spec", "is empty");
    if (std::any_of(r.spec.begin(), r.spec.end(), [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }))
      bad(path, at + ".spec", "'" + r.spec + "' contains white space");
  }
  if (!f.key_stats) return;
  const KeyStats& s = *f.key_stats;
  if (s.tokens < 1) bad(path, "key_stats.tokens", std::to_string(s.tokens) + " is out of range (>= 1)");
  if (s.n_layers != m.n_layers) bad(path, "key_stats.n_layers", std::to_string(s.n_layers) + " differs from model.n_layers " + std::to_string(m.n_layers));
  if (s.n_kv_heads != m.n_kv_heads)
    bad(path, "key_stats.n_kv_heads", std::to_string(s.n_kv_heads) + " differs from model.n_kv_heads " + std::to_string(m.n_kv_heads));
  if (s.head_dim != m.head_dim) bad(path, "key_stats.head_dim", std::to_string(s.head_dim) + " differs from model.head_dim " + std::to_string(m.head_dim));
  const size_t n = s.size();
  auto check = [&](const char* name, const std::vector<float>& v, bool non_negative) {
    const std::string field = std::string("key_stats.") + name;
    if (v.size() != n)
      bad(path, field, "has " + std::to_string(v.size()) + " values, not n_layers * n_kv_heads * head_dim = " + std::to_string(n));
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(v[i])) bad(path, field + "[" + std::to_string(i) + "]", "is not finite");
      if (non_negative && v[i] < 0) bad(path, field + "[" + std::to_string(i) + "]", std::to_string(v[i]) + " is negative");
    }
  };
  check("key_mean", s.key_mean, false);
  check("key_sq", s.key_sq, true);
  check("query_sq", s.query_sq, true);
}

std::vector<float> read_floats(const std::string& path, const json& j, const std::string& field) {
  if (!j.is_array()) bad(path, field, std::string("is ") + type_name(j) + ", not an array of numbers");
  std::vector<float> out;
  out.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    const json& x = j[i];
    if (!x.is_number()) bad(path, field + "[" + std::to_string(i) + "]", std::string("is ") + type_name(x) + ", not a number");
    const double d = x.get<double>();
    if (!std::isfinite(d) || std::fabs(d) > std::numeric_limits<float>::max())
      bad(path, field + "[" + std::to_string(i) + "]", "is not a finite float");
    out.push_back(static_cast<float>(d));
  }
  return out;
}

RecipeFile from_json(const json& root, const std::string& path) {
  RecipeFile f;
  f.path = path;
  const Reader top(path, root, "");
  // The version first: a later schema may differ in everything else.
  f.version = static_cast<int>(top.integer("tqkv_recipe_file", std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
  if (f.version != RecipeFile::kVersion) validate(f, path);
  top.only({"tqkv_recipe_file", "model", "recipes", "key_stats"});

  const Reader m(path, top.need("model"), "model");
  m.only({"name", "file", "arch", "n_layers", "n_kv_heads", "head_dim", "weights_hash"});
  f.model_name = m.str("name");
  f.model_file = m.str("file", false, false);
  f.model.arch = m.str("arch");
  f.model.n_layers = static_cast<int>(m.integer("n_layers", 1, kMaxLayers));
  f.model.n_kv_heads = static_cast<int>(m.integer("n_kv_heads", 1, kMaxHeads));
  f.model.head_dim = static_cast<int>(m.integer("head_dim", 1, kMaxHeadDim));
  f.model.weights_hash = m.str("weights_hash");

  const json& rs = top.need("recipes");
  if (!rs.is_array()) bad(path, "recipes", std::string("is ") + type_name(rs) + ", not an array");
  for (size_t i = 0; i < rs.size(); ++i) {
    const Reader r(path, rs[i], "recipes[" + std::to_string(i) + "]");
    r.only({"name", "spec", "fitted_on", "note"});
    f.recipes.push_back(Recipe{r.str("name"), r.str("spec"), r.str("fitted_on", false, false), r.str("note", false, false)});
  }

  if (const json* ks = top.get("key_stats"); ks && !ks->is_null()) {
    const Reader s(path, *ks, "key_stats");
    s.only({"source", "tokens", "n_layers", "n_kv_heads", "head_dim", "key_mean", "key_sq", "query_sq"});
    KeyStats k;
    k.source = s.str("source", true, false);
    k.tokens = s.integer("tokens", 1, std::numeric_limits<int64_t>::max());
    k.n_layers = static_cast<int>(s.integer("n_layers", 1, kMaxLayers));
    k.n_kv_heads = static_cast<int>(s.integer("n_kv_heads", 1, kMaxHeads));
    k.head_dim = static_cast<int>(s.integer("head_dim", 1, kMaxHeadDim));
    k.key_mean = read_floats(path, s.need("key_mean"), "key_stats.key_mean");
    k.key_sq = read_floats(path, s.need("key_sq"), "key_stats.key_sq");
    k.query_sq = read_floats(path, s.need("query_sq"), "key_stats.query_sq");
    f.key_stats = std::move(k);
  }
  validate(f, path);
  return f;
}

// Shortest text that reads back as the same float (the stats are floats; a double's digits
// would only be noise).
std::string float_text(float v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

// Pretty JSON: objects one field per line in insertion order, arrays of numbers 8 per line.
void write_json(std::ostream& os, const ojson& j, int indent) {
  const std::string pad(static_cast<size_t>(indent) + 2, ' '), close(static_cast<size_t>(indent), ' ');
  if (j.is_object()) {
    if (j.empty()) {
      os << "{}";
      return;
    }
    os << "{\n";
    bool first = true;
    for (const auto& [k, v] : j.items()) {
      os << (first ? "" : ",\n") << pad << ojson(k).dump() << ": ";
      write_json(os, v, indent + 2);
      first = false;
    }
    os << "\n" << close << "}";
  } else if (j.is_array()) {
    if (j.empty()) {
      os << "[]";
      return;
    }
    const bool numbers = std::all_of(j.begin(), j.end(), [](const ojson& x) { return x.is_number(); });
    os << "[\n";
    for (size_t i = 0; i < j.size(); ++i) {
      if (!numbers || i % 8 == 0) os << (i ? ",\n" : "") << pad;
      else os << ", ";
      write_json(os, j[i], indent + 2);
    }
    os << "\n" << close << "]";
  } else if (j.is_number_float()) {
    const double d = j.get<double>();
    const float f = static_cast<float>(d);
    os << (static_cast<double>(f) == d ? float_text(f) : j.dump());
  } else {
    os << j.dump();
  }
}

ojson to_json(const RecipeFile& f) {
  ojson root;
  root["tqkv_recipe_file"] = f.version;
  ojson m;
  m["name"] = f.model_name;
  m["file"] = f.model_file;
  m["arch"] = f.model.arch;
  m["n_layers"] = f.model.n_layers;
  m["n_kv_heads"] = f.model.n_kv_heads;
  m["head_dim"] = f.model.head_dim;
  m["weights_hash"] = f.model.weights_hash;
  root["model"] = m;
  ojson rs = ojson::array();
  for (const Recipe& r : f.recipes) {
    ojson o;
    o["name"] = r.name;
    o["spec"] = r.spec;
    o["fitted_on"] = r.fitted_on;
    o["note"] = r.note;
    rs.push_back(o);
  }
  root["recipes"] = rs;
  if (f.key_stats) {
    const KeyStats& s = *f.key_stats;
    ojson k;
    k["source"] = s.source;
    k["tokens"] = s.tokens;
    k["n_layers"] = s.n_layers;
    k["n_kv_heads"] = s.n_kv_heads;
    k["head_dim"] = s.head_dim;
    auto arr = [](const std::vector<float>& v) {
      ojson a = ojson::array();
      for (float x : v) a.push_back(static_cast<double>(x));
      return a;
    };
    k["key_mean"] = arr(s.key_mean);
    k["key_sq"] = arr(s.key_sq);
    k["query_sq"] = arr(s.query_sq);
    root["key_stats"] = k;
  } else {
    root["key_stats"] = nullptr;
  }
  return root;
}

template <typename T>
void hash_int(XXH3_state_t* st, T v) {
  uint8_t b[sizeof(T)];
  for (size_t i = 0; i < sizeof(T); ++i) b[i] = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
  XXH3_64bits_update(st, b, sizeof b);
}

}  // namespace

std::string ModelKey::describe() const {
  std::ostringstream os;
  os << (arch.empty() ? "?" : arch) << ", " << n_layers << " layers, " << n_kv_heads << " kv heads, head_dim " << head_dim
     << ", " << (weights_hash.empty() ? "no weights hash" : weights_hash);
  return os.str();
}

std::string RecipeFile::describe_model() const { return model_name + " (" + model.describe() + ")"; }

std::string weights_hash(const GgufFile& f) {
  XXH3_state_t* st = XXH3_createState();
  if (!st) throw Error(ErrorCode::InvalidArgument, "weights_hash: out of memory");
  XXH3_64bits_reset(st);
  for (const GgufTensor& t : f.tensors()) {
    hash_int(st, static_cast<uint64_t>(t.name.size()));
    XXH3_64bits_update(st, t.name.data(), t.name.size());
    hash_int(st, static_cast<uint32_t>(t.type));
    hash_int(st, static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) hash_int(st, d);
    hash_int(st, static_cast<uint64_t>(t.nbytes));
    if (t.nbytes) XXH3_64bits_update(st, t.data, t.nbytes);
  }
  const XXH64_hash_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return std::string("xxh3-64:") + buf;
}

ModelKey model_key(const GgufFile& f) {
  ModelKey k;
  k.arch = f.get_string("general.architecture");
  const std::string& a = k.arch;
  auto num = [&](const std::string& key) {
    const int64_t v = f.get_int(a + "." + key);
    if (v <= 0 || v > (1 << 24))
      throw Error(ErrorCode::Format, "metadata " + a + "." + key + " = " + std::to_string(v) + " is out of range");
    return static_cast<int>(v);
  };
  k.n_layers = num("block_count");
  const int n_heads = num("attention.head_count");
  k.n_kv_heads = f.has(a + ".attention.head_count_kv") ? num("attention.head_count_kv") : n_heads;
  k.head_dim = f.has(a + ".attention.key_length") ? num("attention.key_length") : num("embedding_length") / n_heads;
  k.weights_hash = weights_hash(f);
  return k;
}

RecipeFile load_recipe_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::InvalidArgument, "recipe file '" + path + "': cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  json root;
  try {
    root = json::parse(ss.str());
  } catch (const json::parse_error& e) {
    bad(path, "", std::string("not valid JSON (") + e.what() + ")");
  }
  return from_json(root, path);
}

void save_recipe_file(const RecipeFile& f, const std::string& path) {
  validate(f, path);
  std::ostringstream os;
  write_json(os, to_json(f), 0);
  os << "\n";
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << os.str();
    out.flush();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw Error(ErrorCode::InvalidArgument, "recipe file '" + path + "': cannot write " + tmp);
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    std::error_code ec2;
    fs::remove(tmp, ec2);
    throw Error(ErrorCode::InvalidArgument, "recipe file '" + path + "': cannot rename " + tmp + " over it: " + ec.message());
  }
}

std::vector<std::string> recipe_dirs() {
  std::vector<std::string> candidates;
  if (const std::string e = env_text("TQKV_RECIPES"); !e.empty()) {
    std::string cur;
    for (const char* p = e.c_str();; ++p) {
      if (*p == ':' || *p == '\0') {
        if (!cur.empty()) candidates.push_back(cur);
        cur.clear();
        if (!*p) break;
      } else {
        cur += *p;
      }
    }
  }
  candidates.push_back("recipes");
  candidates.push_back((fs::path(TQKV_SOURCE_DIR) / "recipes").string());  // set by src/engine/CMakeLists.txt
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const std::string& c : candidates) {
    std::error_code ec;
    if (!fs::is_directory(c, ec)) continue;
    const std::string canon = fs::weakly_canonical(c, ec).string();
    if (seen.insert(ec ? c : canon).second) out.push_back(c);
  }
  return out;
}

RecipeBook::RecipeBook(const std::vector<std::string>& dirs) : dirs_(dirs) {
  for (const std::string& d : dirs) {
    std::error_code ec;
    if (!fs::is_directory(d, ec)) continue;
    std::vector<fs::path> paths;
    for (const fs::directory_entry& e : fs::directory_iterator(d, ec))
      if (e.path().extension() == ".json" && e.is_regular_file(ec)) paths.push_back(e.path());
    std::sort(paths.begin(), paths.end());
    for (const fs::path& p : paths) files_.push_back(load_recipe_file(p.string()));
  }
}

RecipeBook RecipeBook::from_default_dirs() { return RecipeBook(recipe_dirs()); }

void RecipeBook::add_file(RecipeFile f) {
  validate(f, f.path.empty() ? "(in memory)" : f.path);
  files_.insert(files_.begin(), std::move(f));
}

const RecipeFile* RecipeBook::for_model(const ModelKey& key) const {
  for (const RecipeFile& f : files_)
    if (f.model == key) return &f;
  return nullptr;
}

std::optional<Recipe> RecipeBook::find(const ModelKey& key, std::string_view name) const {
  for (const RecipeFile& f : files_) {
    if (!(f.model == key)) continue;
    for (const Recipe& r : f.recipes)
      if (r.name == name) return r;
  }
  return std::nullopt;
}

std::vector<std::string> RecipeBook::names() const {
  std::set<std::string> s;
  for (const RecipeFile& f : files_)
    for (const Recipe& r : f.recipes) s.insert(r.name);
  return {s.begin(), s.end()};
}

std::string RecipeBook::why_not(const ModelKey& key, std::string_view name) const {
  if (find(key, name)) return "";
  const std::string q = "recipe '" + std::string(name) + "'";
  const std::string fix =
      "; fit one with `tqkv calibrate --budget BITS --name NAME`, or use a format such as k4v3 (k4v3+c once "
      "`tqkv calibrate` has measured the model's key statistics)";
  std::vector<const RecipeFile*> others;
  for (const RecipeFile& f : files_)
    if (std::any_of(f.recipes.begin(), f.recipes.end(), [&](const Recipe& r) { return r.name == name; }))
      others.push_back(&f);
  if (!others.empty()) {
    std::string to;
    for (size_t i = 0; i < others.size(); ++i) to += (i ? " and to " : "") + others[i]->describe_model();
    std::string msg = q + " was fitted to " + to + ", not to this model (" + key.describe() + ")";
    const ModelKey& o = others[0]->model;
    if (o.arch == key.arch && o.n_layers == key.n_layers && o.n_kv_heads == key.n_kv_heads && o.head_dim == key.head_dim)
      msg += " — same shape, other weights (another quantization or fine-tune)";
    return msg + fix;
  }
  std::string known;
  for (const RecipeFile& f : files_)
    if (f.model == key)
      for (const Recipe& r : f.recipes) known += (known.empty() ? "" : ", ") + r.name;
  if (!known.empty()) return q + " is not among the recipes fitted to this model (" + key.describe() + "): " + known;
  std::string where;
  for (const std::string& d : dirs_) where += (where.empty() ? "" : ", ") + d;
  return "no recipe file names " + q + " (searched: " + (where.empty() ? "no directories" : where) + ")" + fix;
}

}  // namespace tqkv::engine
