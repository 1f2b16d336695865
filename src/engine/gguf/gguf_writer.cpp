#include "engine/gguf/gguf_writer.h"

#include <cstdio>
#include <cstring>
#include <memory>

#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

constexpr size_t kAlignment = 32;

template <class T>
void put(std::vector<uint8_t>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof v);
  std::memcpy(out.data() + at, &v, sizeof v);
}

void put_str(std::vector<uint8_t>& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}

void key(std::vector<uint8_t>& out, const std::string& k, GgufType t) {
  put_str(out, k);
  put<uint32_t>(out, static_cast<uint32_t>(t));
}

}  // namespace

GgufWriter& GgufWriter::u32(const std::string& k, uint32_t v) {
  key(kv_, k, GgufType::U32);
  put(kv_, v);
  ++n_kv_;
  return *this;
}

GgufWriter& GgufWriter::f32(const std::string& k, float v) {
  key(kv_, k, GgufType::F32);
  put(kv_, v);
  ++n_kv_;
  return *this;
}

GgufWriter& GgufWriter::boolean(const std::string& k, bool v) {
  key(kv_, k, GgufType::Bool);
  put<uint8_t>(kv_, v ? 1 : 0);
  ++n_kv_;
  return *this;
}

GgufWriter& GgufWriter::str(const std::string& k, const std::string& v) {
  key(kv_, k, GgufType::String);
  put_str(kv_, v);
  ++n_kv_;
  return *this;
}

GgufWriter& GgufWriter::strs(const std::string& k, const std::vector<std::string>& v) {
  key(kv_, k, GgufType::Array);
  put<uint32_t>(kv_, static_cast<uint32_t>(GgufType::String));
  put<uint64_t>(kv_, v.size());
  for (const std::string& s : v) put_str(kv_, s);
  ++n_kv_;
  return *this;
}

GgufWriter& GgufWriter::i32s(const std::string& k, const std::vector<int32_t>& v) {
  key(kv_, k, GgufType::Array);
  put<uint32_t>(kv_, static_cast<uint32_t>(GgufType::I32));
  put<uint64_t>(kv_, v.size());
  for (int32_t x : v) put(kv_, x);
  ++n_kv_;
  return *this;
}

GgufWriter& GgufWriter::f32s(const std::string& k, const std::vector<float>& v) {
  key(kv_, k, GgufType::Array);
  put<uint32_t>(kv_, static_cast<uint32_t>(GgufType::F32));
  put<uint64_t>(kv_, v.size());
  for (float x : v) put(kv_, x);
  ++n_kv_;
  return *this;
}

GgufWriter& GgufWriter::tensor(const std::string& name, const std::vector<int64_t>& shape, TensorType type) {
  const TensorTypeTraits* t = tensor_type_traits(static_cast<uint32_t>(type));
  if (!t) throw Error(ErrorCode::InvalidArgument, "gguf writer: tensor " + name + ": unsupported type");
  if (shape.empty() || shape[0] % t->block_elems != 0)
    throw Error(ErrorCode::InvalidArgument, "gguf writer: tensor " + name + ": rows are not whole " + t->name + " blocks");
  size_t elems = 1;
  for (int64_t d : shape) {
    if (d <= 0) throw Error(ErrorCode::InvalidArgument, "gguf writer: tensor " + name + ": a dimension is not positive");
    elems *= static_cast<size_t>(d);
  }
  const size_t bytes = elems / t->block_elems * t->block_bytes;
  tensors_.push_back({name, shape, type, bytes, data_bytes_});
  data_bytes_ += (bytes + kAlignment - 1) / kAlignment * kAlignment;
  return *this;
}

void GgufWriter::write(const std::string& path, const std::function<void(size_t, std::span<uint8_t>)>& fill) const {
  std::vector<uint8_t> head;
  put<uint32_t>(head, 0x46554747);  // "GGUF"
  put<uint32_t>(head, 3);
  put<uint64_t>(head, tensors_.size());
  put<uint64_t>(head, n_kv_);
  head.insert(head.end(), kv_.begin(), kv_.end());
  for (const Tensor& t : tensors_) {
    put_str(head, t.name);
    put<uint32_t>(head, static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) put<uint64_t>(head, static_cast<uint64_t>(d));
    put<uint32_t>(head, static_cast<uint32_t>(t.type));
    put<uint64_t>(head, t.offset);
  }
  head.resize((head.size() + kAlignment - 1) / kAlignment * kAlignment, 0);
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "wb"), &std::fclose);
  auto fail = [&] { throw Error(ErrorCode::InvalidArgument, "gguf writer: cannot write '" + path + "'"); };
  if (!f || std::fwrite(head.data(), 1, head.size(), f.get()) != head.size()) fail();
  std::vector<uint8_t> buf;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const size_t padded = (tensors_[i].bytes + kAlignment - 1) / kAlignment * kAlignment;
    buf.assign(padded, 0);
    fill(i, std::span<uint8_t>(buf.data(), tensors_[i].bytes));
    if (std::fwrite(buf.data(), 1, padded, f.get()) != padded) fail();
  }
  if (std::fclose(f.release()) != 0) fail();
}

}  // namespace tqkv::engine
