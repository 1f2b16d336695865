// The saved sensitivity scan (eval/scan_file.h): it round-trips exactly, and a file of another
// model, text or option, a corrupt file or a malformed layer is refused with one line naming why.
#include "eval/scan_file.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <unistd.h>

#include "tqkv/error.h"

namespace tqkv::eval {
namespace {

namespace fs = std::filesystem;

class ScanFile : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = (fs::temp_directory_path() / ("tqkv_scan_" + std::to_string(::getpid()) + ".json")).string();
    header_ = {"xxh3-64:0123456789abcdef", 30, "kjv-exodus.txt", 512, 2, 4, 3, "+sink1+w8", true, false};
    layers_ = {{0, 1e-5, 3.3e-4}, {1, 0.1234567890123, 0.0}, {2, 5e-5, 8e-5}};
  }
  void TearDown() override { fs::remove(path_); }
  std::string error_of(const ScanHeader& expect) {
    try {
      load_scan(path_, expect);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
      return e.what();
    }
    return "";
  }
  void write(const std::string& text) { std::ofstream(path_) << text; }
  std::string path_;
  ScanHeader header_;
  std::vector<engine::LayerSensitivity> layers_;
};

TEST_F(ScanFile, RoundTripsExactly) {
  save_scan(path_, header_, layers_);
  const std::vector<engine::LayerSensitivity> back = load_scan(path_, header_);
  ASSERT_EQ(back.size(), layers_.size());
  for (size_t i = 0; i < back.size(); ++i) {
    EXPECT_EQ(back[i].layer, layers_[i].layer);
    EXPECT_EQ(back[i].key_kl, layers_[i].key_kl);  // bit for bit: the fit must not move
    EXPECT_EQ(back[i].value_kl, layers_[i].value_kl);
  }
}

TEST_F(ScanFile, AnotherRunsScanIsRefusedByField) {
  save_scan(path_, header_, layers_);
  struct Case {
    const char* field;
    void (*change)(ScanHeader&);
  };
  const Case cases[] = {
      {"weights_hash", [](ScanHeader& h) { h.weights_hash = "xxh3-64:ffffffffffffffff"; }},
      {"n_layers", [](ScanHeader& h) { h.n_layers = 24; }},
      {"text", [](ScanHeader& h) { h.text = "kjv-genesis.txt"; }},
      {"ctx", [](ScanHeader& h) { h.ctx = 256; }},
      {"chunks", [](ScanHeader& h) { h.chunks = 16; }},
      {"key_bits", [](ScanHeader& h) { h.key_bits = 3; }},
      {"value_bits", [](ScanHeader& h) { h.value_bits = 2; }},
      {"suffix", [](ScanHeader& h) { h.suffix = ""; }},
      {"all_layers", [](ScanHeader& h) { h.all_layers = false; }},
      {"balance", [](ScanHeader& h) { h.balance = true; }},
  };
  for (const Case& c : cases) {
    ScanHeader other = header_;
    c.change(other);
    const std::string e = error_of(other);
    EXPECT_NE(e.find(std::string("scanned with ") + c.field + " = "), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

TEST_F(ScanFile, CorruptFilesAreRefused) {
  EXPECT_NE(error_of(header_).find("cannot read"), std::string::npos);  // no file yet
  write("{\"tqkv_scan_file\": 1,");
  EXPECT_NE(error_of(header_).find("not a JSON object"), std::string::npos);
  write("[1, 2]");
  EXPECT_NE(error_of(header_).find("not a JSON object"), std::string::npos);
  write("{}");
  EXPECT_NE(error_of(header_).find(" = (none), this run has "), std::string::npos);
  // Malformed layers: none, a missing field, a string, a negative KL.
  save_scan(path_, header_, {});
  EXPECT_NE(error_of(header_).find("no layers"), std::string::npos);
  auto with_layer = [&](const std::string& layer) {
    save_scan(path_, header_, layers_);
    std::ifstream in(path_);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t at = text.find("\"layers\": [") + std::string("\"layers\": [").size();
    write(text.substr(0, at) + layer + "," + text.substr(at));
  };
  with_layer("{\"layer\": 3, \"key_kl\": 0.1}");
  EXPECT_NE(error_of(header_).find("a layer entry needs"), std::string::npos);
  with_layer("{\"layer\": \"3\", \"key_kl\": 0.1, \"value_kl\": 0.1}");
  EXPECT_NE(error_of(header_).find("a layer entry needs"), std::string::npos);
  with_layer("{\"layer\": 3, \"key_kl\": -0.1, \"value_kl\": 0.1}");
  EXPECT_NE(error_of(header_).find("layer 3 has a KL that is negative"), std::string::npos);
}

TEST_F(ScanFile, UnwritablePathIsAnError) {
  EXPECT_THROW(save_scan("/nonexistent-dir/scan.json", header_, layers_), Error);
}

}  // namespace
}  // namespace tqkv::eval
