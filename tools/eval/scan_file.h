// A saved sensitivity scan (`tqkv calibrate --save-scan` / `--load-scan`): what the scan ran with
// and each layer's KL at the scan's key and value widths, so that budgets and pair caps can be
// refitted without the scan's forward passes. A scan loads only into a run whose header is the
// same in every field (docs/FORMAT.md, "Fitting recipes").
#pragma once
#include <string>
#include <vector>

#include "engine/cache/recipe_fit.h"

namespace tqkv::eval {

struct ScanHeader {
  std::string weights_hash;  // engine::weights_hash of the model
  int n_layers = 0;
  std::string text;          // the calibration text's file name
  int ctx = 0, chunks = 0;
  int key_bits = 0, value_bits = 0;
  std::string suffix;        // the copies every scanned spec carried ("+sink1+w8" or "")
  bool all_layers = false, balance = false;
  bool operator==(const ScanHeader&) const = default;
};

// Writes header and layers as JSON. Throws Error(InvalidArgument) when the file cannot be written.
void save_scan(const std::string& path, const ScanHeader& header, const std::vector<engine::LayerSensitivity>& layers);
// Reads a scan written by save_scan whose header equals `expect`. Throws Error(InvalidArgument),
// one line naming the path and the reason (unreadable, not a scan, a field that differs from
// this run's, a layer entry malformed, negative or not finite); the layers themselves are
// checked against the model by engine::allocate_bits.
std::vector<engine::LayerSensitivity> load_scan(const std::string& path, const ScanHeader& expect);

}  // namespace tqkv::eval
