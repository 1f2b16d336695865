// GGUF reader and dequantizers: values against the PyPI gguf package's dequantizer (fixture
// made by tests/integration/make_quant_fixture.py), and corrupt input of every kind giving
// tqkv::Error(Format), never a crash (this suite also runs under ASan/UBSan).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <cstring>
#include <random>

#include "engine/weights/dequant.h"
#include "engine/gguf/gguf.h"
#include "engine/gguf/tokenizer.h"
#include "gguf_builder.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

const std::string kFixture = std::string(TQKV_ENGINE_TEST_DATA) + "/quant_types.gguf";

// Parses bytes and, when that works, touches everything a loader would: every tensor's data
// and the tokenizer. Returns true when parsing succeeded; lets only tqkv::Error escape.
bool parse_and_use(const std::vector<uint8_t>& bytes) {
  try {
    GgufFile f = GgufFile::parse(bytes);
    std::vector<float> buf;
    for (const GgufTensor& t : f.tensors()) {
      buf.resize(static_cast<size_t>(t.n_elements()));
      dequantize_tensor(t, buf.data());
    }
    try {
      Tokenizer::from_gguf(f);
    } catch (const Error&) {
    }
    return true;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Format) << e.what();
    EXPECT_NE(std::string(e.what()).find("GGUF"), std::string::npos) << e.what();
    return false;
  }
}

TEST(Gguf, ReadsFixtureMetadata) {
  GgufFile f = GgufFile::open(kFixture);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.get_int("fixture.answer"), 42);
  EXPECT_EQ(f.get_string("fixture.greeting"), "h\xc3\xa9llo");
  EXPECT_EQ(f.get_int_array("fixture.list"), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(f.get_string("general.architecture"), "fixture");
  EXPECT_THROW(f.get_string("fixture.answer"), Error);  // wrong type
  EXPECT_THROW(f.get_int("no.such.key"), Error);
  EXPECT_EQ(f.get_int("no.such.key", 7), 7);
  EXPECT_THROW(f.tensor("no.such.tensor"), Error);
}

TEST(Gguf, DequantizeMatchesGgufPackage) {
  GgufFile f = GgufFile::open(kFixture);
  const std::vector<std::pair<std::string, std::string>> types = {
      {"f32", "F32"},   {"f16", "F16"},   {"bf16", "BF16"}, {"q4_0", "Q4_0"}, {"q4_1", "Q4_1"},
      {"q5_0", "Q5_0"}, {"q5_1", "Q5_1"}, {"q8_0", "Q8_0"}, {"q4_k", "Q4_K"}, {"q6_k", "Q6_K"}};
  for (const auto& [name, type] : types) {
    SCOPED_TRACE(name);
    const GgufTensor& t = f.tensor(name);
    const GgufTensor& e = f.tensor(name + ".expected");
    EXPECT_EQ(tensor_type_name(t.type), type);
    ASSERT_EQ(t.n_elements(), e.n_elements());
    ASSERT_EQ(t.shape, (std::vector<int64_t>{512, 3}));
    std::vector<float> got(t.n_elements()), want(e.n_elements());
    dequantize_tensor(t, got.data());
    dequantize_tensor(e, want.data());
    double max_err = 0, max_abs = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      max_err = std::max(max_err, static_cast<double>(std::fabs(got[i] - want[i])));
      max_abs = std::max(max_abs, static_cast<double>(std::fabs(want[i])));
    }
    EXPECT_GT(max_abs, 0.1);
    // Only float rounding order may differ from NumPy's.
    EXPECT_LE(max_err, 1e-6 * max_abs) << "max error " << max_err;
  }
}

TEST(Gguf, EveryTruncationIsAFormatError) {
  const std::vector<uint8_t> full = read_file(kFixture);
  ASSERT_GT(full.size(), 1000u);
  ASSERT_TRUE(parse_and_use(full));
  // Every cut inside the tables, then a stride through the tensor data, up to the end of the
  // last tensor (trailing alignment padding is not needed by anything).
  const GgufFile f = GgufFile::parse(full);
  const size_t data_start = static_cast<size_t>(f.tensors().front().data - full.data());
  size_t data_end = 0;
  for (const GgufTensor& t : f.tensors())
    data_end = std::max(data_end, static_cast<size_t>(t.data - full.data()) + t.nbytes);
  for (size_t n = 0; n < data_end; n += n < data_start + 64 ? 1 : 97) {
    std::vector<uint8_t> cut(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_FALSE(parse_and_use(cut)) << "prefix of " << n << " bytes parsed";
  }
}

TEST(Gguf, RandomCorruptionNeverCrashes) {
  const std::vector<uint8_t> full = read_file(kFixture);
  const size_t tables = static_cast<size_t>(GgufFile::parse(full).tensors().front().data - full.data());
  std::mt19937 rng(7);
  int parsed = 0;
  for (int it = 0; it < 3000; ++it) {
    std::vector<uint8_t> b = full;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      const size_t at = rng() % tables;
      switch (rng() % 3) {
        case 0: b[at] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;
        case 1: b[at] = static_cast<uint8_t>(rng()); break;
        default: b[at] = 0xff; break;
      }
    }
    parsed += parse_and_use(b);
  }
  // Most single-bit changes land in names or values and still parse; many do not.
  EXPECT_GT(parsed, 0);
  EXPECT_LT(parsed, 3000);
}

TEST(Gguf, ClearErrors) {
  auto message = [](const std::vector<uint8_t>& b) -> std::string {
    try {
      GgufFile::parse(b);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Format);
      return e.what();
    }
    return "parsed";
  };
  using test::GgufBuilder;
  EXPECT_NE(message({'G', 'G', 'M', 'L', 0, 0, 0, 0}).find("bad magic"), std::string::npos);
  EXPECT_NE(message(GgufBuilder(1).build()).find("unsupported version 1"), std::string::npos);
  EXPECT_NE(message(GgufBuilder(4).build()).find("unsupported version 4"), std::string::npos);
  EXPECT_EQ(message(GgufBuilder(2).u32("a", 1).build()), "parsed");

  const std::vector<uint8_t> q2k(84, 0);
  EXPECT_NE(message(GgufBuilder().tensor("w", {256}, 10, q2k).build()).find("type Q2_K, which tqkv cannot load"),
            std::string::npos);
  EXPECT_NE(message(GgufBuilder().tensor("w", {32}, 99, q2k).build()).find("type#99"), std::string::npos);
  EXPECT_NE(message(GgufBuilder().tensor("w", {48}, 2, std::vector<uint8_t>(36)).build()).find("not a multiple"),
            std::string::npos);
  EXPECT_NE(message(GgufBuilder().tensor("w", {64}, 0, std::vector<uint8_t>(100)).build()).find("runs past the end"),
            std::string::npos);
  EXPECT_NE(message(GgufBuilder().u32("k", 1).u32("k", 2).build()).find("duplicate metadata key 'k'"),
            std::string::npos);
  EXPECT_NE(message(GgufBuilder().u32("general.alignment", 24).build()).find("power of two"), std::string::npos);

  // A header that claims 2^60 tensors or keys must fail fast, without trying to allocate.
  std::vector<uint8_t> huge = GgufBuilder().build();
  const uint64_t big = uint64_t{1} << 60;
  std::memcpy(huge.data() + 8, &big, 8);
  EXPECT_NE(message(huge).find("tensor count"), std::string::npos);
  huge = GgufBuilder().build();
  std::memcpy(huge.data() + 16, &big, 8);
  EXPECT_NE(message(huge).find("metadata count"), std::string::npos);
}

TEST(Gguf, OpenReportsMissingFile) {
  try {
    GgufFile::open("/nonexistent/model.gguf");
    FAIL() << "opened a missing file";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/model.gguf"), std::string::npos);
  }
}

// Everything the fuzzer ever found interesting, plus the seeds, replayed in the normal build
// (and so under ASan in the sanitizer CI job).
TEST(Gguf, FuzzCorpusRegression) {
  namespace fs = std::filesystem;
  int n = 0;
  for (const auto& e : fs::directory_iterator(TQKV_ENGINE_FUZZ_CORPUS)) {
    if (!e.is_regular_file()) continue;
    SCOPED_TRACE(e.path().string());
    parse_and_use(read_file(e.path().string()));
    ++n;
  }
  EXPECT_GE(n, 5);
}

}  // namespace
}  // namespace tqkv::engine
