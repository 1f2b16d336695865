// A GGUF (version 3) writer: metadata, the tensor table, then each tensor's bytes streamed from a
// callback, so that a file of tens of gigabytes is written without holding it in memory. The
// reader (gguf.h) reads what it writes; `tqkv synth` makes models of real shapes with it.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "engine/gguf/gguf.h"

namespace tqkv::engine {

class GgufWriter {
 public:
  GgufWriter& u32(const std::string& key, uint32_t v);
  GgufWriter& f32(const std::string& key, float v);
  GgufWriter& boolean(const std::string& key, bool v);
  GgufWriter& str(const std::string& key, const std::string& v);
  GgufWriter& strs(const std::string& key, const std::vector<std::string>& v);
  GgufWriter& i32s(const std::string& key, const std::vector<int32_t>& v);
  GgufWriter& f32s(const std::string& key, const std::vector<float>& v);
  // A tensor of `type` (TensorType) and shape (ne[0], the row, first). Throws
  // tqkv::Error(InvalidArgument) for a type the reader cannot load or a row that is not a whole
  // number of blocks.
  GgufWriter& tensor(const std::string& name, const std::vector<int64_t>& shape, TensorType type);

  // Bytes of the i-th tensor added.
  size_t tensor_bytes(size_t i) const { return tensors_[i].bytes; }
  size_t tensor_count() const { return tensors_.size(); }
  const std::string& tensor_name(size_t i) const { return tensors_[i].name; }

  // Writes the file; fill(i, bytes) writes tensor i's bytes (tensor_bytes(i) of them). Throws
  // tqkv::Error(InvalidArgument) when the file cannot be written.
  void write(const std::string& path, const std::function<void(size_t, std::span<uint8_t>)>& fill) const;

 private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;
    TensorType type;
    size_t bytes, offset;
  };
  std::vector<uint8_t> kv_;
  uint64_t n_kv_ = 0;
  std::vector<Tensor> tensors_;
  size_t data_bytes_ = 0;
};

}  // namespace tqkv::engine
