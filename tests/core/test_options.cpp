// The registry of TQKV_* variables (include/tqkv/options.h): strict parsing by kind, an error
// that names the variable, its value and what it takes; every entry well formed; docs/ENV.md's
// table row for row the registry's.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "../common/scoped_env.h"
#include "tqkv/error.h"
#include "tqkv/options.h"

namespace {

using tqkv::testing_util::ScopedEnv;

// The message of the Error(InvalidArgument) that `f` throws, or "" (a failure) where none.
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const tqkv::Error& e) {
    EXPECT_EQ(e.code(), tqkv::ErrorCode::InvalidArgument);
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

void expect_names(const std::string& msg, const char* name, const char* value, const char* allowed) {
  EXPECT_NE(msg.find(std::string(name) + "=" + value), std::string::npos) << msg;
  EXPECT_NE(msg.find(allowed), std::string::npos) << msg;
}

TEST(Options, UnsetOrEmptyGivesTheDefault) {
  unsetenv("TQKV_FUSE_OPS");
  EXPECT_TRUE(tqkv::env_bool("TQKV_FUSE_OPS"));
  ScopedEnv empty("TQKV_POOL_SPIN_US", "");
  EXPECT_EQ(tqkv::env_count("TQKV_POOL_SPIN_US"), 50);
  EXPECT_EQ(tqkv::env_count("TQKV_POOL_SPIN_US", 7), 7);
  unsetenv("TQKV_QDOT");
  EXPECT_EQ(tqkv::env_choice("TQKV_QDOT"), "int8");
  EXPECT_FALSE(tqkv::env_choice_if_set("TQKV_QDOT"));
  unsetenv("TQKV_MODEL");
  EXPECT_EQ(tqkv::env_text("TQKV_MODEL"), "");
}

TEST(Options, ReadsWhatEachKindTakes) {
  {
    ScopedEnv b("TQKV_FUSE_OPS", "0");
    EXPECT_FALSE(tqkv::env_bool("TQKV_FUSE_OPS"));
  }
  {
    ScopedEnv c("TQKV_POOL_SPIN_US", "1000000");
    EXPECT_EQ(tqkv::env_count("TQKV_POOL_SPIN_US"), 1000000);
  }
  {
    ScopedEnv e("TQKV_QDOT", "f32");
    EXPECT_EQ(tqkv::env_choice("TQKV_QDOT"), "f32");
  }
  {
    ScopedEnv p("TQKV_MODEL", "/some/model.gguf");
    EXPECT_EQ(tqkv::env_text("TQKV_MODEL"), "/some/model.gguf");
  }
}

TEST(Options, ABadBoolIsAnErrorNamingTheVariable) {
  for (const char* bad : {"yes", "2", "on", " 1", "true"}) {
    ScopedEnv e("TQKV_FUSE_OPS", bad);
    expect_names(error_of([] { tqkv::env_bool("TQKV_FUSE_OPS"); }), "TQKV_FUSE_OPS", bad, "0 or 1");
    expect_names(error_of([] { tqkv::check_options(); }), "TQKV_FUSE_OPS", bad, "0 or 1");
  }
}

TEST(Options, ABadCountIsAnErrorNamingTheVariable) {
  for (const char* bad : {"abc", "5x", " ", " 5", "-1", "1000001", "1e3", "99999999999999999999999"}) {
    ScopedEnv e("TQKV_POOL_SPIN_US", bad);
    const char* allowed = "a whole number from 0 to 1000000";
    expect_names(error_of([] { tqkv::env_count("TQKV_POOL_SPIN_US"); }), "TQKV_POOL_SPIN_US", bad, allowed);
    expect_names(error_of([] { tqkv::env_count("TQKV_POOL_SPIN_US", 7); }), "TQKV_POOL_SPIN_US", bad, allowed);
    expect_names(error_of([] { tqkv::check_options(); }), "TQKV_POOL_SPIN_US", bad, allowed);
  }
}

TEST(Options, ABadChoiceIsAnErrorNamingTheVariable) {
  for (const char* bad : {"int4", "F32", "f32 "}) {
    ScopedEnv e("TQKV_QDOT", bad);
    expect_names(error_of([] { tqkv::env_choice("TQKV_QDOT"); }), "TQKV_QDOT", bad, "one of int8, f32");
    expect_names(error_of([] { tqkv::env_choice_if_set("TQKV_QDOT"); }), "TQKV_QDOT", bad, "one of int8, f32");
    expect_names(error_of([] { tqkv::check_options(); }), "TQKV_QDOT", bad, "one of int8, f32");
  }
}

TEST(Options, AnUnknownNameOrAWrongKindIsRefused) {
  EXPECT_NE(error_of([] { tqkv::option_info("TQKV_NO_SUCH_THING"); }).find("TQKV_NO_SUCH_THING"), std::string::npos);
  EXPECT_THROW(tqkv::env_count("TQKV_FUSE_OPS"), std::logic_error);
  EXPECT_THROW(tqkv::env_bool("TQKV_POOL_SPIN_US"), std::logic_error);
  EXPECT_THROW(tqkv::env_count("TQKV_THREADS"), std::logic_error);  // its default is worked out by its reader
}

TEST(Options, TheRegistryIsWellFormed) {
  std::set<std::string> names;
  for (const tqkv::OptionInfo& o : tqkv::option_registry()) {
    SCOPED_TRACE(o.name);
    EXPECT_EQ(std::string(o.name).rfind("TQKV_", 0), 0u);
    EXPECT_TRUE(names.insert(o.name).second) << "listed twice";
    EXPECT_GT(std::string(o.description).size(), 10u);
    EXPECT_FALSE(std::string(o.area).empty());
    EXPECT_EQ(o.kind == tqkv::OptionKind::Count, o.min < o.max || o.max != 0);
    EXPECT_EQ(o.kind == tqkv::OptionKind::Choice, o.choices != nullptr);
    // A default that is a value is one the variable takes: read back with the variable unset.
    unsetenv(o.name);
    ScopedEnv as_default(o.name, o.fallback);
    if (o.kind == tqkv::OptionKind::Bool || o.kind == tqkv::OptionKind::Count || o.kind == tqkv::OptionKind::Choice) {
      bool words = false;
      try {
        tqkv::check_options();
      } catch (const tqkv::Error&) {
        words = true;  // a default in words: the reader works it out
      }
      if (!words) {
        unsetenv(o.name);
        bool from_env = true;
        EXPECT_EQ(tqkv::option_value(o, &from_env), o.fallback);
        EXPECT_FALSE(from_env);
      }
    }
  }
}

// docs/ENV.md: one row per registry entry in its tables, `| \`NAME\` | takes | default | what |`,
// the takes and the default as the registry says; the tests' section and the deleted switches'
// list only names the registry does not have.
TEST(Options, TheDocsTableIsTheRegistry) {
  std::ifstream in(std::string(TQKV_SOURCE_DIR) + "/docs/ENV.md");
  ASSERT_TRUE(in) << "docs/ENV.md";
  std::map<std::string, std::pair<std::string, std::string>> rows;  // name -> (takes, default)
  std::set<std::string> not_read;  // the tests' variables and the deleted switches
  bool other_section = false;
  auto cell = [](std::string s) {
    while (!s.empty() && s.front() == ' ') s.erase(0, 1);
    while (!s.empty() && s.back() == ' ') s.pop_back();
    if (s.size() >= 2 && s.front() == '`' && s.back() == '`') s = s.substr(1, s.size() - 2);
    return s;
  };
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("## ", 0) == 0)
      other_section = line.find("tests") != std::string::npos || line.find("Deleted") != std::string::npos;
    if (line.rfind("| `TQKV_", 0) != 0) continue;
    std::vector<std::string> cells;
    std::stringstream ss(line.substr(1));
    for (std::string c; std::getline(ss, c, '|');) cells.push_back(cell(c));
    if (other_section) {
      std::string names;  // "`A`, `B`" in one cell: both
      for (char ch : cells[0]) names += ch == '`' || ch == ' ' ? "" : std::string(1, ch);
      std::stringstream ns(names);
      for (std::string n; std::getline(ns, n, ',');) not_read.insert(n);
      continue;
    }
    ASSERT_GE(cells.size(), 4u) << line;
    EXPECT_TRUE(rows.emplace(cells[0], std::make_pair(cells[1], cells[2])).second) << cells[0] << " twice";
  }
  for (const tqkv::OptionInfo& o : tqkv::option_registry()) {
    const std::string want = std::string("| `") + o.name + "` | " + tqkv::option_allowed(o) + " | " + o.fallback +
                             " | " + o.description + " |";
    const auto it = rows.find(o.name);
    if (it == rows.end()) {
      ADD_FAILURE() << o.name << " has no row in docs/ENV.md; add:\n" << want;
      continue;
    }
    EXPECT_EQ(it->second.first, tqkv::option_allowed(o)) << "row of " << o.name << "; the registry's:\n" << want;
    EXPECT_EQ(it->second.second, o.fallback) << "row of " << o.name << "; the registry's:\n" << want;
    rows.erase(it);
    EXPECT_EQ(not_read.count(o.name), 0u) << o.name << " is read by the product, not only by the tests or deleted";
  }
  for (const auto& [name, r] : rows) ADD_FAILURE() << name << " is in docs/ENV.md but tqkv does not read it";
  EXPECT_TRUE(not_read.count("TQKV_TEST_SEED")) << "docs/ENV.md lists the tests' variables too";
}

}  // namespace
