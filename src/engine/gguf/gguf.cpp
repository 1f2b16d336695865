#include "engine/gguf/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

[[noreturn]] void fail(const std::string& what) { throw Error(ErrorCode::Format, "GGUF: " + what); }

// Limits that keep a hostile header from making us allocate absurd amounts before the
// bounds checks catch up: a count can never exceed the bytes left, since every entry takes
// at least one byte, but we also refuse silly dimensions outright.
constexpr uint64_t kMaxDims = 8;
constexpr uint64_t kMaxStringBytes = 1u << 30;

// A bounds-checked little-endian cursor over the file bytes.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : base_(p), size_(n) {}
  size_t pos() const { return pos_; }
  size_t left() const { return size_ - pos_; }

  void need(uint64_t n, const char* what) const {
    if (n > left())
      fail(std::string("truncated file: ") + what + " needs " + std::to_string(n) + " bytes at offset " +
           std::to_string(pos_) + ", only " + std::to_string(left()) + " left");
  }
  template <typename T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));  // the file is little-endian, like every host we build for
    pos_ += sizeof(T);
    return v;
  }
  std::string str(const char* what) {
    const uint64_t n = get<uint64_t>(what);
    if (n > kMaxStringBytes) fail(std::string(what) + ": string length " + std::to_string(n) + " is implausible");
    need(n, what);
    std::string s(reinterpret_cast<const char*>(base_ + pos_), static_cast<size_t>(n));
    pos_ += n;
    return s;
  }

 private:
  const uint8_t* base_;
  size_t size_;
  size_t pos_ = 0;
};

size_t scalar_size(GgufType t) {
  switch (t) {
    case GgufType::U8: case GgufType::I8: case GgufType::Bool: return 1;
    case GgufType::U16: case GgufType::I16: return 2;
    case GgufType::U32: case GgufType::I32: case GgufType::F32: return 4;
    case GgufType::U64: case GgufType::I64: case GgufType::F64: return 8;
    default: return 0;
  }
}

bool is_int(GgufType t) {
  return t == GgufType::U8 || t == GgufType::I8 || t == GgufType::U16 || t == GgufType::I16 ||
         t == GgufType::U32 || t == GgufType::I32 || t == GgufType::U64 || t == GgufType::I64;
}

// Reads one scalar of type t, widened: integers to int64 (u64 above INT64_MAX kept as uint64),
// floats to double.
void read_scalar(Reader& r, GgufType t, GgufValue& out, const std::string& key) {
  const char* w = "metadata value";
  switch (t) {
    case GgufType::U8: out.v = int64_t{r.get<uint8_t>(w)}; break;
    case GgufType::I8: out.v = int64_t{r.get<int8_t>(w)}; break;
    case GgufType::U16: out.v = int64_t{r.get<uint16_t>(w)}; break;
    case GgufType::I16: out.v = int64_t{r.get<int16_t>(w)}; break;
    case GgufType::U32: out.v = int64_t{r.get<uint32_t>(w)}; break;
    case GgufType::I32: out.v = int64_t{r.get<int32_t>(w)}; break;
    case GgufType::U64: {
      const uint64_t u = r.get<uint64_t>(w);
      if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) out.v = static_cast<int64_t>(u);
      else out.v = u;
      break;
    }
    case GgufType::I64: out.v = r.get<int64_t>(w); break;
    case GgufType::F32: out.v = double{r.get<float>(w)}; break;
    case GgufType::F64: out.v = r.get<double>(w); break;
    case GgufType::Bool: {
      const uint8_t b = r.get<uint8_t>(w);
      if (b > 1) fail("key '" + key + "': bool value " + std::to_string(b) + " is neither 0 nor 1");
      out.v = b != 0;
      break;
    }
    case GgufType::String: out.v = r.str(w); break;
    default: fail("key '" + key + "': unknown value type " + std::to_string(static_cast<uint32_t>(t)));
  }
}

GgufType read_type(Reader& r, const std::string& key) {
  const uint32_t t = r.get<uint32_t>("value type");
  if (t > static_cast<uint32_t>(GgufType::F64))
    fail("key '" + key + "': unknown value type " + std::to_string(t));
  return static_cast<GgufType>(t);
}

GgufValue read_value(Reader& r, GgufType t, const std::string& key) {
  GgufValue out;
  out.type = t;
  if (t != GgufType::Array) {
    read_scalar(r, t, out, key);
    return out;
  }
  const GgufType et = read_type(r, key);
  out.elem_type = et;
  const uint64_t n = r.get<uint64_t>("array length");
  if (et == GgufType::Array) fail("key '" + key + "': nested arrays are not supported");
  // Each element takes at least one byte (a string at least eight), so a count beyond the
  // bytes left is corrupt; checking first keeps reserve() from exploding.
  const uint64_t min_elem = et == GgufType::String ? 8 : scalar_size(et);
  if (n > r.left() / min_elem)
    fail("key '" + key + "': array of " + std::to_string(n) + " elements does not fit in the " +
         std::to_string(r.left()) + " bytes left");
  if (et == GgufType::String) {
    std::vector<std::string> v;
    v.reserve(n);
    for (uint64_t i = 0; i < n; ++i) v.push_back(r.str("array string"));
    out.v = std::move(v);
  } else if (is_int(et) || et == GgufType::Bool) {
    std::vector<int64_t> v;
    v.reserve(n);
    GgufValue tmp;
    for (uint64_t i = 0; i < n; ++i) {
      read_scalar(r, et, tmp, key);
      if (auto* b = std::get_if<bool>(&tmp.v)) v.push_back(*b);
      else if (auto* u = std::get_if<uint64_t>(&tmp.v)) v.push_back(static_cast<int64_t>(*u));
      else v.push_back(std::get<int64_t>(tmp.v));
    }
    out.v = std::move(v);
  } else {
    std::vector<double> v;
    v.reserve(n);
    GgufValue tmp;
    for (uint64_t i = 0; i < n; ++i) {
      read_scalar(r, et, tmp, key);
      v.push_back(std::get<double>(tmp.v));
    }
    out.v = std::move(v);
  }
  return out;
}

const char* type_name(GgufType t) {
  static const char* names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64"};
  const auto i = static_cast<uint32_t>(t);
  return i < std::size(names) ? names[i] : "?";
}

}  // namespace

const TensorTypeTraits* tensor_type_traits(uint32_t type) {
  // Block geometry as defined by ggml (the GGUF producer); docs/ENGINE.md lists the layouts.
  static const TensorTypeTraits f32{"F32", 1, 4}, f16{"F16", 1, 2}, bf16{"BF16", 1, 2}, q4_0{"Q4_0", 32, 18},
      q4_1{"Q4_1", 32, 20}, q5_0{"Q5_0", 32, 22}, q5_1{"Q5_1", 32, 24}, q8_0{"Q8_0", 32, 34},
      q4_k{"Q4_K", 256, 144}, q6_k{"Q6_K", 256, 210};
  switch (static_cast<TensorType>(type)) {
    case TensorType::F32: return &f32;
    case TensorType::F16: return &f16;
    case TensorType::BF16: return &bf16;
    case TensorType::Q4_0: return &q4_0;
    case TensorType::Q4_1: return &q4_1;
    case TensorType::Q5_0: return &q5_0;
    case TensorType::Q5_1: return &q5_1;
    case TensorType::Q8_0: return &q8_0;
    case TensorType::Q4_K: return &q4_k;
    case TensorType::Q6_K: return &q6_k;
    default: return nullptr;
  }
}

std::string tensor_type_name(uint32_t type) {
  if (const auto* t = tensor_type_traits(type)) return t->name;
  switch (static_cast<TensorType>(type)) {
    case TensorType::Q8_1: return "Q8_1";
    case TensorType::Q2_K: return "Q2_K";
    case TensorType::Q3_K: return "Q3_K";
    case TensorType::Q5_K: return "Q5_K";
    case TensorType::Q8_K: return "Q8_K";
    default: return "type#" + std::to_string(type);
  }
}

int64_t GgufTensor::n_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // shape was validated against overflow at parse time
  return n;
}

struct GgufFile::Mapping {
  void* addr = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (addr && size) munmap(addr, size);
  }
};

GgufFile::GgufFile(GgufFile&&) noexcept = default;
GgufFile& GgufFile::operator=(GgufFile&&) noexcept = default;
GgufFile::~GgufFile() = default;

GgufFile GgufFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(ErrorCode::InvalidArgument, "cannot open model '" + path + "': " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error(ErrorCode::InvalidArgument, "cannot stat '" + path + "': " + std::strerror(e));
  }
  auto m = std::make_unique<Mapping>();
  m->size = static_cast<size_t>(st.st_size);
  if (m->size == 0) {
    ::close(fd);
    throw Error(ErrorCode::Format, "GGUF: '" + path + "' is empty");
  }
  m->addr = mmap(nullptr, m->size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int e = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (m->addr == MAP_FAILED) {
    m->addr = nullptr;
    throw Error(ErrorCode::InvalidArgument, "cannot map '" + path + "': " + std::strerror(e));
  }
  try {
    GgufFile f = parse({static_cast<const uint8_t*>(m->addr), m->size});
    f.map_ = std::move(m);
    return f;
  } catch (const Error& err) {
    throw Error(err.code(), std::string(err.what()) + " (in '" + path + "')");
  }
}

void GgufFile::drop_resident_pages() const {
  if (map_ && map_->addr) madvise(map_->addr, map_->size, MADV_DONTNEED);
}

GgufFile GgufFile::parse(std::span<const uint8_t> bytes) {
  GgufFile f;
  Reader r(bytes.data(), bytes.size());
  if (bytes.size() < 4 || std::memcmp(bytes.data(), "GGUF", 4) != 0) fail("not a GGUF file (bad magic)");
  r.get<uint32_t>("magic");
  f.version_ = r.get<uint32_t>("version");
  // Version 1 used 32-bit counts and lengths; nothing current writes it.
  if (f.version_ != 2 && f.version_ != 3) fail("unsupported version " + std::to_string(f.version_) + " (need 2 or 3)");
  const uint64_t n_tensors = r.get<uint64_t>("tensor count");
  const uint64_t n_kv = r.get<uint64_t>("metadata count");
  // A key/value pair takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor entry at
  // least 8 + 4 + 4 + 8 bytes.
  if (n_kv > r.left() / 13) fail("metadata count " + std::to_string(n_kv) + " exceeds what the file can hold");
  if (n_tensors > r.left() / 24) fail("tensor count " + std::to_string(n_tensors) + " exceeds what the file can hold");

  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = r.str("metadata key");
    const GgufType t = read_type(r, key);
    GgufValue v = read_value(r, t, key);
    if (!f.kv_.emplace(key, std::move(v)).second) fail("duplicate metadata key '" + key + "'");
  }
  if (const GgufValue* a = f.find("general.alignment")) {
    const auto* av = std::get_if<int64_t>(&a->v);
    if (!av || *av <= 0 || *av > (1 << 16) || (*av & (*av - 1)) != 0)
      fail("general.alignment must be a power of two up to 65536");
    f.alignment_ = static_cast<size_t>(*av);
  }

  f.tensors_.reserve(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensor t;
    t.name = r.str("tensor name");
    const uint32_t nd = r.get<uint32_t>("tensor dimension count");
    if (nd == 0 || nd > kMaxDims) fail("tensor '" + t.name + "': " + std::to_string(nd) + " dimensions");
    uint64_t n = 1;
    for (uint32_t d = 0; d < nd; ++d) {
      const uint64_t ne = r.get<uint64_t>("tensor dimension");
      if (ne == 0 || ne > (uint64_t{1} << 40) || n > (uint64_t{1} << 48) / ne)
        fail("tensor '" + t.name + "': dimension " + std::to_string(d) + " = " + std::to_string(ne) + " is invalid");
      n *= ne;
      t.shape.push_back(static_cast<int64_t>(ne));
    }
    t.type = r.get<uint32_t>("tensor type");
    t.offset = r.get<uint64_t>("tensor offset");
    const TensorTypeTraits* tr = tensor_type_traits(t.type);
    if (!tr) fail("tensor '" + t.name + "' has type " + tensor_type_name(t.type) + ", which tqkv cannot load");
    if (t.shape[0] % tr->block_elems != 0)
      fail("tensor '" + t.name + "': row length " + std::to_string(t.shape[0]) + " is not a multiple of the " +
           tr->name + " block (" + std::to_string(tr->block_elems) + ")");
    t.nbytes = static_cast<size_t>(n / tr->block_elems * tr->block_bytes);
    if (t.offset % f.alignment_ != 0) fail("tensor '" + t.name + "': offset is not aligned");
    if (f.tensor_index_.count(t.name)) fail("duplicate tensor '" + t.name + "'");
    f.tensor_index_.emplace(t.name, f.tensors_.size());
    f.tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment after the tables.
  const size_t data_start = (r.pos() + f.alignment_ - 1) / f.alignment_ * f.alignment_;
  if (data_start > bytes.size() && !f.tensors_.empty()) fail("truncated file: no tensor data section");
  const size_t data_size = data_start <= bytes.size() ? bytes.size() - data_start : 0;
  for (GgufTensor& t : f.tensors_) {
    if (t.offset > data_size || t.nbytes > data_size - t.offset)
      fail("tensor '" + t.name + "' (" + std::to_string(t.nbytes) + " bytes at data offset " +
           std::to_string(t.offset) + ") runs past the end of the file (truncated?)");
    t.data = bytes.data() + data_start + t.offset;
  }
  return f;
}

bool GgufFile::has(std::string_view key) const { return find(key) != nullptr; }

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_.find(std::string(key));
  return it == kv_.end() ? nullptr : &it->second;
}

namespace {
[[noreturn]] void wrong_type(std::string_view key, const GgufValue& v, const char* want) {
  fail("metadata '" + std::string(key) + "' is " + type_name(v.type) + ", expected " + want);
}
}  // namespace

int64_t GgufFile::get_int(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) fail("missing metadata '" + std::string(key) + "'");
  if (auto* i = std::get_if<int64_t>(&v->v)) return *i;
  wrong_type(key, *v, "an integer");
}
int64_t GgufFile::get_int(std::string_view key, int64_t fallback) const { return has(key) ? get_int(key) : fallback; }

double GgufFile::get_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) fail("missing metadata '" + std::string(key) + "'");
  if (auto* d = std::get_if<double>(&v->v)) return *d;
  if (auto* i = std::get_if<int64_t>(&v->v)) return static_cast<double>(*i);
  wrong_type(key, *v, "a number");
}
double GgufFile::get_float(std::string_view key, double fallback) const { return has(key) ? get_float(key) : fallback; }

bool GgufFile::get_bool(std::string_view key, bool fallback) const {
  const GgufValue* v = find(key);
  if (!v) return fallback;
  if (auto* b = std::get_if<bool>(&v->v)) return *b;
  wrong_type(key, *v, "a bool");
}

std::string GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) fail("missing metadata '" + std::string(key) + "'");
  if (auto* s = std::get_if<std::string>(&v->v)) return *s;
  wrong_type(key, *v, "a string");
}
std::string GgufFile::get_string(std::string_view key, const std::string& fallback) const {
  return has(key) ? get_string(key) : fallback;
}

const std::vector<std::string>& GgufFile::get_string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) fail("missing metadata '" + std::string(key) + "'");
  if (auto* a = std::get_if<std::vector<std::string>>(&v->v)) return *a;
  wrong_type(key, *v, "an array of strings");
}

const std::vector<int64_t>& GgufFile::get_int_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) fail("missing metadata '" + std::string(key) + "'");
  if (auto* a = std::get_if<std::vector<int64_t>>(&v->v)) return *a;
  wrong_type(key, *v, "an array of integers");
}

const std::vector<double>& GgufFile::get_float_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) fail("missing metadata '" + std::string(key) + "'");
  if (auto* a = std::get_if<std::vector<double>>(&v->v)) return *a;
  wrong_type(key, *v, "an array of numbers");
}

const GgufTensor* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufTensor& GgufFile::tensor(std::string_view name) const {
  const GgufTensor* t = find_tensor(name);
  if (!t) fail("missing tensor '" + std::string(name) + "'");
  return *t;
}

}  // namespace tqkv::engine
