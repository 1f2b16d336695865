// tqkv env [--json]: every TQKV_* variable tqkv reads (include/tqkv/options.h), its current value
// and whether the environment set it, its default and what it changes; then any TQKV_* variable
// set here that tqkv does not read. A malformed value is shown and then fails the command with
// the error the reader would give, naming the variable.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "tqkv/error.h"
#include "tqkv/options.h"

extern char** environ;

namespace {

// Names of the TQKV_* variables set in this process that the registry does not list.
std::vector<std::string> unread_variables() {
  std::vector<std::string> out;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    if (kv.rfind("TQKV_", 0) != 0) continue;
    const std::string name = kv.substr(0, kv.find('='));
    try {
      tqkv::option_info(name);
    } catch (const tqkv::Error&) {
      out.push_back(name);
    }
  }
  return out;
}

}  // namespace

void register_env(CLI::App& app) {
  auto* cmd = app.add_subcommand("env", "List every TQKV_* environment variable with its current value and default");
  static bool json = false;
  cmd->add_flag("--json", json, "print a JSON object");
  cmd->callback([] {
    nlohmann::json rows = nlohmann::json::array();
    std::string errors;
    for (const tqkv::OptionInfo& o : tqkv::option_registry()) {
      bool from_env = false;
      std::string value, error;
      try {
        value = tqkv::option_value(o, &from_env);
      } catch (const tqkv::Error& e) {
        value = tqkv::env_raw(o.name).value_or("");
        from_env = true;
        error = e.what();
        errors += std::string(errors.empty() ? "" : "\n") + error;
      }
      if (json) {
        nlohmann::json r = {{"name", o.name},         {"value", value},     {"from_environment", from_env},
                            {"default", o.fallback},  {"allowed", tqkv::option_allowed(o)},
                            {"area", o.area},         {"description", o.description}};
        if (!error.empty()) r["error"] = error;
        rows.push_back(r);
      } else {
        // NAME=value (environment|default; default: D; takes: A)
        //     what it changes
        const std::string from = !error.empty() ? "INVALID, from the environment"
                                 : from_env     ? std::string("from the environment; default: ") + o.fallback
                                                : std::string("the default");
        std::printf("%s=%s (%s; %s)\n    %s\n", o.name, value.c_str(), from.c_str(), tqkv::option_allowed(o).c_str(),
                    o.description);
      }
    }
    const std::vector<std::string> unread = unread_variables();
    if (json) {
      std::cout << nlohmann::json{{"variables", rows}, {"not_read", unread}}.dump(2) << "\n";
    } else {
      for (const std::string& n : unread) std::printf("%s is set but tqkv does not read it\n", n.c_str());
    }
    if (!errors.empty()) throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, errors);
  });
}
