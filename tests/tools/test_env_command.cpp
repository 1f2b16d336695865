// `tqkv env`: every registered variable with its value, where it came from and its default, as
// text and as JSON; a bad value fails the command naming the variable, and fails any other
// command before it starts.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <unistd.h>

#include "tqkv/options.h"

namespace {

struct Outcome {
  std::string out;
  int status = -1;
};

// The tool run through the shell with `env_prefix` (VAR=value ...) before it and no other TQKV_*
// variable (CI sets test switches such as TQKV_REQUIRE_REFERENCE); stdout and stderr.
Outcome run_tqkv(const std::string& env_prefix, const std::string& args) {
  std::string cmd = "env";
  for (char** e = environ; *e; ++e) {
    const std::string var = *e;
    if (var.rfind("TQKV_", 0) == 0) cmd += " -u " + var.substr(0, var.find('='));
  }
  cmd += " " + env_prefix + " '" TQKV_BIN "' " + args + " 2>&1";
  Outcome r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  for (size_t n; (n = fread(buf.data(), 1, buf.size(), p)) > 0;) r.out.append(buf.data(), n);
  r.status = pclose(p);
  return r;
}

TEST(EnvCommand, PrintsEveryVariableWithItsValueAndDefault) {
  const Outcome r = run_tqkv("TQKV_QDOT=f32 TQKV_NOT_A_KNOB=1", "env");
  ASSERT_EQ(r.status, 0) << r.out;
  for (const tqkv::OptionInfo& o : tqkv::option_registry()) {
    EXPECT_NE(r.out.find(std::string(o.name) + "="), std::string::npos) << o.name;
    EXPECT_NE(r.out.find(o.description), std::string::npos) << o.name;
  }
  EXPECT_NE(r.out.find("TQKV_QDOT=f32 (from the environment; default: int8"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("TQKV_FUSE_OPS=1 (the default"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("TQKV_NOT_A_KNOB is set but tqkv does not read it"), std::string::npos) << r.out;
}

TEST(EnvCommand, Json) {
  const Outcome r = run_tqkv("TQKV_QDOT=f32 TQKV_NOT_A_KNOB=1", "env --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["variables"].size(), tqkv::option_registry().size());
  size_t i = 0;
  for (const tqkv::OptionInfo& o : tqkv::option_registry()) {
    const nlohmann::json& v = j["variables"][i++];
    EXPECT_EQ(v["name"], o.name);
    EXPECT_EQ(v["default"], o.fallback);
    EXPECT_EQ(v["description"], o.description);
    EXPECT_EQ(v["allowed"], tqkv::option_allowed(o));
    if (std::string(o.name) == "TQKV_QDOT") {
      EXPECT_EQ(v["value"], "f32");
      EXPECT_EQ(v["from_environment"], true);
    } else if (std::string(o.name) == "TQKV_FUSE_OPS") {
      EXPECT_EQ(v["value"], "1");
      EXPECT_EQ(v["from_environment"], false);
    }
  }
  EXPECT_EQ(j["not_read"], nlohmann::json::array({"TQKV_NOT_A_KNOB"}));
}

TEST(EnvCommand, ABadValueFailsNamingTheVariable) {
  const Outcome env = run_tqkv("TQKV_FUSE_OPS=yes", "env");
  EXPECT_NE(env.status, 0);
  EXPECT_NE(env.out.find("TQKV_FUSE_OPS=yes (INVALID"), std::string::npos) << env.out;
  EXPECT_NE(env.out.find("error: TQKV_FUSE_OPS=yes: give 0 or 1"), std::string::npos) << env.out;
  // Any other command fails before it starts.
  const Outcome formats = run_tqkv("TQKV_QDOT=int4", "formats --dim 64");
  EXPECT_NE(formats.status, 0);
  EXPECT_NE(formats.out.find("TQKV_QDOT=int4: give one of int8, f32"), std::string::npos) << formats.out;
  EXPECT_EQ(formats.out.find("turboquant"), std::string::npos) << formats.out;
}

}  // namespace
