// expand_tensor and check_tensor_finite (dequant.h): whole GGUF tensors, split over the thread pool.
// Apart from dequant.cpp so that the GGUF reader and its fuzz target need no thread pool.
#include <string>
#include <vector>

#include "cpu/thread_pool.h"
#include "engine/weights/dequant.h"
#include "tqkv/error.h"

namespace tqkv::engine {

void check_tensor_shape(const GgufTensor& t, int64_t cols, int64_t rows) {
  if (t.shape.empty() || t.shape[0] != cols || t.n_elements() != cols * rows) {
    std::string s;
    for (int64_t d : t.shape) s += (s.empty() ? "" : " x ") + std::to_string(d);
    throw Error(ErrorCode::Format, "model: tensor '" + t.name + "' has shape [" + s + "], expected [" +
                                       std::to_string(cols) + (rows > 1 ? " x " + std::to_string(rows) : "") + "]");
  }
}

void check_tensor_finite(const GgufTensor& t) {
  const TensorTypeTraits* tr = tensor_type_traits(t.type);
  if (!tr) throw Error(ErrorCode::Format, "model: tensor '" + t.name + "' has type " + tensor_type_name(t.type));
  const int64_t blocks = t.n_elements() / tr->block_elems;
  const int parts = blocks >= (int64_t{1} << 16) ? cpu::pool_threads() : 1;
  std::vector<int64_t> first(static_cast<size_t>(parts), -1);
  cpu::parallel_for(parts, [&](int p) {
    const int64_t b0 = blocks * p / parts, b1 = blocks * (p + 1) / parts;
    const int64_t i = first_non_finite(t.type, t.data + b0 * tr->block_bytes, (b1 - b0) * tr->block_elems);
    if (i >= 0) first[static_cast<size_t>(p)] = b0 * tr->block_elems + i;
  });
  for (int64_t i : first)  // the parts in order: the first one found is the tensor's first
    if (i >= 0)
      throw Error(ErrorCode::Format, "model: tensor '" + t.name + "' holds NaN or infinity (element " +
                                         std::to_string(i) + (tr->block_elems > 1 ? ", in a block's scale" : "") +
                                         "): the file is damaged");
}

std::vector<float> expand_tensor(const GgufTensor& t, int64_t cols, int64_t rows) {
  check_tensor_shape(t, cols, rows);
  const int64_t want = cols * rows;
  std::vector<float> v(static_cast<size_t>(want));
  const TensorTypeTraits* tr = tensor_type_traits(t.type);
  const size_t row_bytes = static_cast<size_t>(cols / tr->block_elems * tr->block_bytes);
  const int parts = rows >= 256 ? cpu::pool_threads() : 1;
  cpu::parallel_for(parts, [&](int p) {
    for (int64_t r = rows * p / parts; r < rows * (p + 1) / parts; ++r)
      dequantize(t.type, t.data + r * row_bytes, v.data() + r * cols, cols);
  });
  return v;
}

}  // namespace tqkv::engine
