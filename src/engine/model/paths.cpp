#include "engine/model/paths.h"

#include <filesystem>

#include "tqkv/options.h"

namespace tqkv::engine {
namespace {

std::string find(const char* env, const char* rel) {
  if (std::string e = env_text(env); !e.empty()) return e;
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(rel, ec)) return rel;
  const fs::path src = fs::path(TQKV_SOURCE_DIR) / rel;  // set by src/engine/CMakeLists.txt
  return src.string();
}

}  // namespace

std::string default_model_path() { return find("TQKV_MODEL", kDefaultModelFile); }
std::string default_text_path() { return find("TQKV_TEXT", kDefaultTextFile); }
std::string default_calibration_text_path() { return find("TQKV_CALIBRATION_TEXT", kCalibrationTextFile); }

}  // namespace tqkv::engine
