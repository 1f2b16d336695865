// Where the commands look for the default model and evaluation text that
// scripts/fetch_model.sh and scripts/fetch_text.sh install.
#pragma once
#include <string>

namespace tqkv::engine {

inline constexpr const char* kDefaultModelFile = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
inline constexpr const char* kDefaultTextFile = "data/kjv-genesis.txt";
// Calibration and fitting text (recipes, key statistics): never the evaluation text.
inline constexpr const char* kCalibrationTextFile = "data/kjv-exodus.txt";

// $TQKV_MODEL if set, else models/... under the current directory, else under the source
// tree tqkv was built from. Returns the last candidate when none exists, so the error names it.
std::string default_model_path();
// $TQKV_TEXT if set, else data/... found the same way.
std::string default_text_path();
// $TQKV_CALIBRATION_TEXT if set, else data/kjv-exodus.txt found the same way.
std::string default_calibration_text_path();

}  // namespace tqkv::engine
