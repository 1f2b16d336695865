// The independent references the real-model tests compare against, run as Python scripts
// (tests/integration/): reference_forward.py (NumPy + the PyPI gguf package) for logits and
// reference_tokenize.py (Hugging Face tokenizers, sentencepiece) for token ids. Without the Python packages the
// tests skip, unless TQKV_REQUIRE_REFERENCE=1 (CI), where a missing package fails.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace tqkv::engine::testing_util {

inline bool have_python(const std::string& modules) {
  if (std::system(("python3 -c 'import " + modules + "' >/dev/null 2>&1").c_str()) == 0) return true;
  const char* req = std::getenv("TQKV_REQUIRE_REFERENCE");
  if (req && std::string(req) == "1")
    ADD_FAILURE() << "python3 with " << modules << " is required (scripts/install-deps.sh installs them)";
  return false;
}
inline bool have_python_reference() { return have_python("numpy, gguf"); }

inline std::string temp_path(const std::string& stem) {
  return (std::filesystem::temp_directory_path() / (stem + "_" + std::to_string(::getpid()))).string();
}

template <class T>
std::vector<T> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  std::vector<T> v(static_cast<size_t>(in.tellg()) / sizeof(T));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  return v;
}

// Logits of every position (or of the last `tail`), [rows, vocab], from reference_forward.py.
inline std::vector<float> reference_logits(const std::string& model, const std::vector<int32_t>& ids, int vocab,
                                           int tail = 0) {
  const size_t rows = tail > 0 ? static_cast<size_t>(tail) : ids.size();
  const std::string out = temp_path("tqkv_ref") + ".f32";
  std::string cmd = "python3 " + std::string(TQKV_REPO_DIR) + "/tests/integration/reference_forward.py " + model;
  for (int32_t id : ids) {
    cmd += ' ';
    cmd += std::to_string(id);  // appended piecewise: GCC 12 warns falsely (-Wrestrict) on " " + s
  }
  cmd += " -o ";
  cmd += out;
  if (tail > 0) cmd += " --tail " + std::to_string(tail);
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::vector<float> ref = read_all<float>(out);
  EXPECT_EQ(ref.size(), rows * vocab) << "short reference output";
  ref.resize(rows * vocab);
  std::remove(out.c_str());
  return ref;
}

// Ids of each text file's plain text from reference_tokenize.py.
inline std::vector<std::vector<int32_t>> reference_token_ids(const std::string& model, const std::vector<std::string>& texts) {
  const std::string out = temp_path("tqkv_ref_ids");
  std::string cmd = "python3 " + std::string(TQKV_REPO_DIR) + "/tests/integration/reference_tokenize.py " + model;
  for (const std::string& t : texts) {
    cmd += ' ';
    cmd += t;
  }
  cmd += " -o ";
  cmd += out;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::vector<std::vector<int32_t>> ids;
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::string f = out + "." + std::to_string(i);
    ids.push_back(std::filesystem::exists(f) ? read_all<int32_t>(f) : std::vector<int32_t>{});
    std::remove(f.c_str());
  }
  return ids;
}

// Largest |a - b| and largest |b| over n values.
struct MaxErr {
  double err = 0, mag = 0;
};
inline MaxErr max_err(const float* a, const float* b, size_t n) {
  MaxErr m;
  for (size_t i = 0; i < n; ++i) {
    m.err = std::max(m.err, std::abs(static_cast<double>(a[i]) - b[i]));
    m.mag = std::max(m.mag, std::abs(static_cast<double>(b[i])));
  }
  return m;
}

}  // namespace tqkv::engine::testing_util
