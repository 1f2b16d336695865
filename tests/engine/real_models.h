// The real models shared by the engine suites: each loaded once per test suite; every test
// skips cleanly when models/ does not have the file (scripts/fetch_model.sh installs SmolLM2,
// scripts/fetch_models.sh the others).
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "engine/gguf.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

namespace tqkv::engine::testing_util {

inline const std::string kSmolModel = std::string(TQKV_REPO_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
inline const std::string kQwen05Model = std::string(TQKV_REPO_DIR) + "/models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf";
inline const std::string kQwen15Model = std::string(TQKV_REPO_DIR) + "/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf";
inline const std::string kGemma3Model = std::string(TQKV_REPO_DIR) + "/models/gemma-3-270m-q4_k_m.gguf";

// File: a type with `static const std::string& path()` and `static const char* fetch()`.
template <class File>
class RealModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(File::path())) return;
    file_ = new GgufFile(GgufFile::open(File::path()));
    tok_ = new Tokenizer(Tokenizer::from_gguf(*file_));
    model_ = new Model(Model::load(*file_));
  }
  static void TearDownTestSuite() {
    delete model_;
    delete tok_;
    delete file_;
    model_ = nullptr;
    tok_ = nullptr;
    file_ = nullptr;
  }
  void SetUp() override {
    if (!model_) GTEST_SKIP() << "model not found at " << File::path() << " (run " << File::fetch() << ")";
  }
  inline static GgufFile* file_ = nullptr;
  inline static Tokenizer* tok_ = nullptr;
  inline static Model* model_ = nullptr;
};

struct SmolFile {
  static const std::string& path() { return kSmolModel; }
  static const char* fetch() { return "scripts/fetch_model.sh"; }
};
struct Qwen05File {
  static const std::string& path() { return kQwen05Model; }
  static const char* fetch() { return "scripts/fetch_models.sh qwen2.5-coder-0.5b"; }
};

struct Qwen15File {
  static const std::string& path() { return kQwen15Model; }
  static const char* fetch() { return "scripts/fetch_models.sh qwen2.5-coder-1.5b"; }
};
struct Gemma3File {
  static const std::string& path() { return kGemma3Model; }
  static const char* fetch() { return "scripts/fetch_models.sh gemma-3-270m"; }
};

using SmolModelTest = RealModelTest<SmolFile>;
using Qwen05ModelTest = RealModelTest<Qwen05File>;
using Qwen15ModelTest = RealModelTest<Qwen15File>;
using Gemma3ModelTest = RealModelTest<Gemma3File>;

}  // namespace tqkv::engine::testing_util
