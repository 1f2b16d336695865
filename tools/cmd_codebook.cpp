// tqkv codebook --dim D --bits B [--law sphere|gauss] [--json]
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "tqkv/codebook.h"

void register_codebook(CLI::App& app) {
  auto* cmd = app.add_subcommand("codebook", "Print a Lloyd-Max codebook (levels, thresholds, expected error)");
  static int dim = 128, bits = 4;
  static std::string law = "sphere";
  static bool json = false;
  cmd->add_option("--dim", dim, "vector dimension")->required()->check(CLI::Range(2, 65536));
  cmd->add_option("--bits", bits, "bits per coordinate")->required()->check(CLI::Range(1, 8));
  cmd->add_option("--law", law, "coordinate law: sphere (exact) or gauss (N(0,1/d))")
      ->check(CLI::IsMember({"sphere", "gauss"}));
  cmd->add_flag("--json", json, "print a JSON object");
  cmd->callback([] {
    const tqkv::Codebook& cb = tqkv::get_codebook(tqkv::parse_law(law), dim, bits);
    if (json) {
      nlohmann::json j = {{"law", law},          {"dim", dim}, {"bits", bits}, {"levels", cb.levels},
                          {"thresholds", cb.thresholds}, {"mse", cb.mse}};
      std::cout << j.dump(2) << "\n";
      return;
    }
    std::printf("law %s, dim %d, bits %d: E|u - u_hat|^2 = %.6g (%d Lloyd iterations)\n", law.c_str(), dim, bits,
                cb.mse, cb.iterations);
    std::printf("levels (x sqrt(d) in brackets):\n");
    for (double l : cb.levels) std::printf("  % .10f  [% .6f]\n", l, l * std::sqrt(static_cast<double>(dim)));
    std::printf("thresholds:\n");
    for (double t : cb.thresholds) std::printf("  % .10f\n", t);
  });
}
