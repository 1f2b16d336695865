#include "eval/scan_file.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tqkv/error.h"

namespace tqkv::eval {
namespace {

nlohmann::json header_json(const ScanHeader& h) {
  return {{"tqkv_scan_file", 1},   {"weights_hash", h.weights_hash}, {"n_layers", h.n_layers},
          {"text", h.text},        {"ctx", h.ctx},                   {"chunks", h.chunks},
          {"key_bits", h.key_bits}, {"value_bits", h.value_bits},    {"suffix", h.suffix},
          {"all_layers", h.all_layers}, {"balance", h.balance}};
}

}  // namespace

void save_scan(const std::string& path, const ScanHeader& header, const std::vector<engine::LayerSensitivity>& layers) {
  nlohmann::json j = header_json(header);
  j["layers"] = nlohmann::json::array();
  for (const engine::LayerSensitivity& s : layers)
    j["layers"].push_back({{"layer", s.layer}, {"key_kl", s.key_kl}, {"value_kl", s.value_kl}});
  std::ofstream f(path);
  if (!(f << j.dump(1) << '\n')) throw Error(ErrorCode::InvalidArgument, "calibrate: cannot write the scan to " + path);
}

std::vector<engine::LayerSensitivity> load_scan(const std::string& path, const ScanHeader& expect) {
  auto fail = [&](const std::string& why) {
    throw Error(ErrorCode::InvalidArgument, "calibrate: --load-scan " + path + ": " + why);
  };
  std::ifstream f(path);
  if (!f) fail("cannot read it");
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
  if (j.is_discarded() || !j.is_object()) fail("not a JSON object");
  const nlohmann::json want = header_json(expect);
  for (const auto& [key, value] : want.items())
    if (!j.contains(key) || j[key] != value)
      fail("scanned with " + key + " = " + (j.contains(key) ? j[key].dump() : "(none)") + ", this run has " + value.dump());
  if (!j.contains("layers") || !j["layers"].is_array() || j["layers"].empty()) fail("no layers");
  std::vector<engine::LayerSensitivity> out;
  for (const nlohmann::json& l : j["layers"]) {
    if (!l.is_object() || !l.contains("layer") || !l["layer"].is_number_integer() || !l.contains("key_kl") ||
        !l["key_kl"].is_number() || !l.contains("value_kl") || !l["value_kl"].is_number())
      fail("a layer entry needs an integer layer and numbers key_kl, value_kl");
    const engine::LayerSensitivity s{l["layer"].get<int>(), l["key_kl"].get<double>(), l["value_kl"].get<double>()};
    if (!std::isfinite(s.key_kl) || !std::isfinite(s.value_kl) || s.key_kl < 0 || s.value_kl < 0)
      fail("layer " + std::to_string(s.layer) + " has a KL that is negative or not finite");
    out.push_back(s);
  }
  return out;
}

}  // namespace tqkv::eval
