// Weights that are NaN or infinite (a damaged file) are refused at load, naming the tensor and
// the element, in every type the engine reads: such a model would give NaN logits, which greedy
// decoding reads as token 0 and sampling cannot order.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "engine/gguf/gguf.h"
#include "engine/model/model.h"
#include "engine/weights/dequant.h"
#include "tiny_model.h"
#include "tqkv/error.h"
#include "tqkv/half.h"

namespace tqkv::engine {
namespace {

constexpr uint16_t kHalfInf = 0x7c00, kHalfNaN = 0x7e00, kBf16NaN = 0x7fc0, kHalfOne = 0x3c00;

void put16(std::vector<uint8_t>& b, size_t at, uint16_t v) { std::memcpy(&b[at], &v, 2); }

// n elements of `type` whose blocks all have scale 1 (and minimum 1 where the type has one).
std::vector<uint8_t> blocks(TensorType type, int64_t n) {
  const TensorTypeTraits* tr = tensor_type_traits(static_cast<uint32_t>(type));
  const size_t nb = static_cast<size_t>(n / tr->block_elems), bb = static_cast<size_t>(tr->block_bytes);
  std::vector<uint8_t> b(nb * bb, 0x11);
  for (size_t i = 0; i < nb; ++i) {
    if (type == TensorType::F16 || type == TensorType::BF16) {
      put16(b, i * 2, type == TensorType::F16 ? kHalfOne : 0x3f80);
    } else if (type == TensorType::Q6_K) {
      put16(b, i * bb + 208, kHalfOne);
    } else {
      put16(b, i * bb, kHalfOne);
      if (type == TensorType::Q4_1 || type == TensorType::Q5_1 || type == TensorType::Q4_K) put16(b, i * bb + 2, kHalfOne);
    }
  }
  return b;
}

std::string load_error(const std::vector<uint8_t>& bytes) {
  GgufFile f = GgufFile::parse(bytes);
  try {
    Model::load(f);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Format) << e.what();
    return e.what();
  }
  return "";
}

TEST(NonFiniteWeights, FirstNonFiniteInEveryType) {
  struct Case {
    TensorType type;
    size_t at;        // byte of the field made non-finite
    uint16_t value;   // (F32: the element's index, made NaN)
    int64_t element;  // what first_non_finite reports
  };
  const int64_t n = 512;  // two super-blocks, 16 blocks of 32
  const std::vector<Case> cases = {
      {TensorType::F32, 300, 0, 300},           {TensorType::F16, 2 * 7, kHalfInf, 7},
      {TensorType::F16, 2 * 9, kHalfNaN, 9},    {TensorType::BF16, 2 * 511, kBf16NaN, 511},
      {TensorType::Q4_0, 18 * 3, kHalfNaN, 96}, {TensorType::Q4_1, 20 * 2 + 2, kHalfInf, 64},
      {TensorType::Q5_0, 22 * 15, kHalfInf, 480}, {TensorType::Q5_1, 24 * 1 + 2, kHalfNaN, 32},
      {TensorType::Q8_0, 34 * 4, kHalfInf, 128}, {TensorType::Q4_K, 144 + 2, kHalfNaN, 256},
      {TensorType::Q4_K, 0, kHalfInf, 0},       {TensorType::Q6_K, 210 + 208, kHalfInf, 256}};
  for (const Case& c : cases) {
    SCOPED_TRACE(tensor_type_name(static_cast<uint32_t>(c.type)) + " at byte " + std::to_string(c.at));
    const uint32_t type = static_cast<uint32_t>(c.type);
    std::vector<uint8_t> b;
    if (c.type == TensorType::F32) {
      std::vector<float> v(n, 0.5f);
      v[c.at] = std::numeric_limits<float>::quiet_NaN();
      b.resize(n * 4);
      std::memcpy(b.data(), v.data(), b.size());
    } else {
      b = blocks(c.type, n);
    }
    EXPECT_EQ(first_non_finite(type, b.data(), n), c.type == TensorType::F32 ? c.element : -1);
    if (c.type == TensorType::F32) continue;
    put16(b, c.at, c.value);
    EXPECT_EQ(first_non_finite(type, b.data(), n), c.element);
    // The check agrees with what dequantization gives (a finite scale: finite weights).
    std::vector<float> y(n);
    dequantize(type, b.data(), y.data(), n);
    int64_t first = -1;
    for (int64_t i = 0; i < n && first < 0; ++i)
      if (!std::isfinite(y[i])) first = i;
    const int block = tensor_type_traits(type)->block_elems;
    EXPECT_EQ(first / block, c.element / block);
  }
}

TEST(NonFiniteWeights, ModelLoadNamesTheTensorAndElement) {
  using test::TinyTensor;
  ASSERT_EQ(load_error(test::tiny_llama_gguf()), "");  // the model loads as it is

  std::vector<uint8_t> nan_norm = test::tiny_f32(test::kTinyDim);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::memcpy(&nan_norm[4 * 5], &nan, 4);
  std::string e = load_error(test::tiny_llama_gguf({{"blk.0.ffn_norm.weight", TinyTensor{0, nan_norm}}}));
  EXPECT_NE(e.find("'blk.0.ffn_norm.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("element 5"), std::string::npos) << e;

  // The very first element too (a part's first element is index 0 of its scan).
  std::vector<uint8_t> nan_first = test::tiny_f32(test::kTinyDim);
  std::memcpy(&nan_first[0], &nan, 4);
  e = load_error(test::tiny_llama_gguf({{"output_norm.weight", TinyTensor{0, nan_first}}}));
  EXPECT_NE(e.find("'output_norm.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("element 0)"), std::string::npos) << e;

  const int64_t n = int64_t{test::kTinyDim} * test::kTinyFf;
  std::vector<uint8_t> inf_matrix = test::tiny_f32(static_cast<size_t>(n));
  std::memcpy(&inf_matrix[4 * 1000], &inf, 4);
  e = load_error(test::tiny_llama_gguf({{"blk.0.ffn_up.weight", TinyTensor{0, inf_matrix}}}));
  EXPECT_NE(e.find("'blk.0.ffn_up.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("element 1000"), std::string::npos) << e;

  // Quantized: the kept blocks (the CPU's quantized products) and the expanded ones.
  for (TensorType t : {TensorType::Q8_0, TensorType::Q4_0, TensorType::F16}) {
    SCOPED_TRACE(tensor_type_name(static_cast<uint32_t>(t)));
    std::vector<uint8_t> q = blocks(t, n);
    ASSERT_EQ(load_error(test::tiny_llama_gguf({{"blk.0.ffn_gate.weight", TinyTensor{static_cast<uint32_t>(t), q}}})),
              "");
    put16(q, t == TensorType::F16 ? 2 * 40 : static_cast<size_t>(tensor_type_traits(static_cast<uint32_t>(t))->block_bytes),
          kHalfNaN);
    e = load_error(test::tiny_llama_gguf({{"blk.0.ffn_gate.weight", TinyTensor{static_cast<uint32_t>(t), q}}}));
    EXPECT_NE(e.find("'blk.0.ffn_gate.weight'"), std::string::npos) << e;
    EXPECT_NE(e.find(t == TensorType::F16 ? "element 40" : "element 32"), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace tqkv::engine
