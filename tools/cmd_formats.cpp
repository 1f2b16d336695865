// tqkv formats [--dim D] [--json]: the traits table at one head dim.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "tqkv/format.h"

void register_formats(CLI::App& app) {
  auto* cmd = app.add_subcommand("formats", "List every KV-cache format with its bytes per (token, kv-head)");
  static int dim = 128;
  static bool json = false;
  cmd->add_option("--dim", dim, "head dimension")->check(CLI::Range(2, 4096));
  cmd->add_flag("--json", json, "print a JSON array");
  cmd->callback([] {
    nlohmann::json rows = nlohmann::json::array();
    if (!json)
      std::printf("%-20s %9s %11s %10s %16s  %s\n", "name", "key_bytes", "value_bytes", "slot_bytes",
                  "bits_per_element", "summary");
    for (const auto& [name, f, summary] : tqkv::named_formats()) {
      if (json) {
        rows.push_back({{"name", name},
                        {"key_bytes", f.key_bytes(dim)},
                        {"value_bytes", f.value_bytes(dim)},
                        {"slot_bytes", f.slot_bytes(dim)},
                        {"bits_per_element", f.bits_per_element(dim)}});
      } else {
        std::printf("%-20s %9zu %11zu %10zu %16.4g  %s\n", std::string(name).c_str(), f.key_bytes(dim), f.value_bytes(dim),
                    f.slot_bytes(dim), f.bits_per_element(dim), std::string(summary).c_str());
      }
    }
    if (json) std::cout << rows.dump(2) << "\n";
  });
}
