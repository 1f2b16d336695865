// The real SmolLM2 model shared by the engine suites: loaded once per test suite; every test
// skips cleanly when models/ has no model (run scripts/fetch_model.sh).
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "engine/gguf.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

namespace tqkv::engine::testing_util {

inline const std::string kSmolModel = std::string(TQKV_REPO_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";

class SmolModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(kSmolModel)) return;
    file_ = new GgufFile(GgufFile::open(kSmolModel));
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
    if (!model_) GTEST_SKIP() << "model not found at " << kSmolModel << " (run scripts/fetch_model.sh)";
  }
  inline static GgufFile* file_ = nullptr;
  inline static Tokenizer* tok_ = nullptr;
  inline static Model* model_ = nullptr;
};

}  // namespace tqkv::engine::testing_util
