// Builds GGUF files in memory for tests and fuzz seeds: any metadata, any tensor table,
// including deliberately wrong ones.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace tqkv::engine::test {

class GgufBuilder {
 public:
  explicit GgufBuilder(uint32_t version = 3) : version_(version) {}

  GgufBuilder& u32(const std::string& k, uint32_t v) { key(k, 4); put(v); ++n_kv_; return *this; }
  GgufBuilder& i32(const std::string& k, int32_t v) { key(k, 5); put(v); ++n_kv_; return *this; }
  GgufBuilder& f32(const std::string& k, float v) { key(k, 6); put(v); ++n_kv_; return *this; }
  GgufBuilder& boolean(const std::string& k, bool v) { key(k, 7); put(static_cast<uint8_t>(v)); ++n_kv_; return *this; }
  GgufBuilder& str(const std::string& k, const std::string& v) { key(k, 8); put_str(kv_, v); ++n_kv_; return *this; }
  GgufBuilder& strs(const std::string& k, const std::vector<std::string>& v) {
    key(k, 9);
    put(uint32_t{8});
    put(static_cast<uint64_t>(v.size()));
    for (const auto& s : v) put_str(kv_, s);
    ++n_kv_;
    return *this;
  }
  GgufBuilder& i32s(const std::string& k, const std::vector<int32_t>& v) {
    key(k, 9);
    put(uint32_t{5});
    put(static_cast<uint64_t>(v.size()));
    for (int32_t x : v) put(x);
    ++n_kv_;
    return *this;
  }
  GgufBuilder& f32s(const std::string& k, const std::vector<float>& v) {
    key(k, 9);
    put(uint32_t{6});
    put(static_cast<uint64_t>(v.size()));
    for (float x : v) put(x);
    ++n_kv_;
    return *this;
  }
  // A tensor whose data is `bytes`, placed at the next 32-byte aligned data offset.
  GgufBuilder& tensor(const std::string& name, const std::vector<uint64_t>& shape, uint32_t type,
                      const std::vector<uint8_t>& bytes) {
    put_str(ti_, name);
    append(ti_, static_cast<uint32_t>(shape.size()));
    for (uint64_t d : shape) append(ti_, d);
    append(ti_, type);
    while (data_.size() % 32) data_.push_back(0);
    append(ti_, static_cast<uint64_t>(data_.size()));
    data_.insert(data_.end(), bytes.begin(), bytes.end());
    ++n_t_;
    return *this;
  }
  GgufBuilder& f32_tensor(const std::string& name, const std::vector<uint64_t>& shape, const std::vector<float>& v) {
    std::vector<uint8_t> b(v.size() * 4);
    std::memcpy(b.data(), v.data(), b.size());
    return tensor(name, shape, 0, b);
  }

  std::vector<uint8_t> build() const {
    std::vector<uint8_t> out = {'G', 'G', 'U', 'F'};
    append(out, version_);
    append(out, n_t_);
    append(out, n_kv_);
    out.insert(out.end(), kv_.begin(), kv_.end());
    out.insert(out.end(), ti_.begin(), ti_.end());
    while (out.size() % 32) out.push_back(0);
    out.insert(out.end(), data_.begin(), data_.end());
    return out;
  }

 private:
  template <typename T>
  static void append(std::vector<uint8_t>& b, T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  static void put_str(std::vector<uint8_t>& b, const std::string& s) {
    append(b, static_cast<uint64_t>(s.size()));
    b.insert(b.end(), s.begin(), s.end());
  }
  template <typename T>
  void put(T v) { append(kv_, v); }
  void key(const std::string& k, uint32_t type) {
    put_str(kv_, k);
    put(type);
  }

  uint32_t version_;
  uint64_t n_kv_ = 0, n_t_ = 0;
  std::vector<uint8_t> kv_, ti_, data_;
};

}  // namespace tqkv::engine::test
