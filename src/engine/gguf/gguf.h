// A reader for GGUF model files (versions 2 and 3): the metadata key/value table and the
// tensor table, over a read-only memory map (or any caller-owned byte buffer, which is what
// the fuzzer and the corruption tests use).
//
// Every offset, length and count read from the file is checked against the buffer before it
// is used, so a corrupt or truncated file throws tqkv::Error(ErrorCode::Format) with a message
// that says what is wrong and where; it never reads out of bounds.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "tqkv/gguf_blocks.h"

namespace tqkv::engine {

// GGUF metadata value types, numbered as in the file.
enum class GgufType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, Bool = 7, String = 8,
  Array = 9, U64 = 10, I64 = 11, F64 = 12,
};

// Tensor element types (ggml_type numbering). Only the ones listed in tensor_type_traits()
// can be loaded; the others are rejected with a clear error naming the type.
// The type ids, with the block layouts the CPU and GPU decode (tqkv/gguf_blocks.h).
using TensorType = gguf::TensorType;

struct TensorTypeTraits {
  const char* name;
  int block_elems;   // elements per block
  int block_bytes;   // bytes per block
};

// Traits of a tensor type this reader can dequantize; nullptr for any other type id.
const TensorTypeTraits* tensor_type_traits(uint32_t type);
std::string tensor_type_name(uint32_t type);

// One metadata value. Arrays keep their element type; arrays of strings become
// vector<string>, numeric arrays are widened to int64/double/bool vectors as fits.
struct GgufValue {
  GgufType type = GgufType::U8;
  GgufType elem_type = GgufType::U8;  // for arrays
  std::variant<int64_t, uint64_t, double, bool, std::string, std::vector<std::string>, std::vector<int64_t>,
               std::vector<double>>
      v;
};

struct GgufTensor {
  std::string name;
  std::vector<int64_t> shape;  // ne[0] first: ne[0] is the contiguous (row) dimension
  uint32_t type = 0;
  uint64_t offset = 0;         // from the start of the data section
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  int64_t n_elements() const;
  int64_t rows() const { return shape.empty() ? 1 : n_elements() / shape[0]; }
};

class GgufFile {
 public:
  // Maps `path` read-only and parses it. Throws tqkv::Error (Format for bad contents,
  // InvalidArgument when the file cannot be opened).
  static GgufFile open(const std::string& path);
  // Parses a caller-owned buffer that must outlive the returned object.
  static GgufFile parse(std::span<const uint8_t> bytes);

  GgufFile(GgufFile&&) noexcept;
  GgufFile& operator=(GgufFile&&) noexcept;
  ~GgufFile();

  uint32_t version() const { return version_; }
  size_t alignment() const { return alignment_; }
  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }

  bool has(std::string_view key) const;
  const GgufValue* find(std::string_view key) const;
  // Typed getters: throw Error(Format) when the key is missing or has another type.
  int64_t get_int(std::string_view key) const;
  int64_t get_int(std::string_view key, int64_t fallback) const;
  double get_float(std::string_view key) const;
  double get_float(std::string_view key, double fallback) const;
  bool get_bool(std::string_view key, bool fallback) const;
  std::string get_string(std::string_view key) const;
  std::string get_string(std::string_view key, const std::string& fallback) const;
  const std::vector<std::string>& get_string_array(std::string_view key) const;
  const std::vector<int64_t>& get_int_array(std::string_view key) const;
  const std::vector<double>& get_float_array(std::string_view key) const;

  // Drops the mapped file's pages from this process's resident memory (they come back from
  // the file if read again): after a device copied the weights, RSS then counts the copies
  // only. No effect on a parsed buffer.
  void drop_resident_pages() const;

  const GgufTensor* find_tensor(std::string_view name) const;
  const GgufTensor& tensor(std::string_view name) const;  // throws Error(Format) when absent

 private:
  GgufFile() = default;
  struct Mapping;
  std::unique_ptr<Mapping> map_;
  uint32_t version_ = 0;
  size_t alignment_ = 32;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

}  // namespace tqkv::engine
