#include "arrays.h"

#include <algorithm>

#include "tqkv/error.h"
#include "tqkv/half.h"

namespace tqkv::python {
namespace {

std::string dtype_name(nb::dlpack::dtype t) {
  const char* kind = t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int)     ? "int"
                     : t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt)  ? "uint"
                     : t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) ? "float"
                     : t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) ? "bfloat"
                                                                                       : "other";
  std::string s = kind;
  s += std::to_string(t.bits);
  return s;
}

std::string shape_text(const AnyArray& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(a.shape(i));
  }
  s += "]";
  return s;
}

[[noreturn]] void fail(const char* name, const std::string& what) {
  std::string msg = name;
  msg += ": ";
  msg += what;
  throw Error(ErrorCode::InvalidArgument, msg);
}

void check_cpu_c_order(const AnyArray& a, const char* name) {
  if (a.device_type() != nb::device::cpu::value) fail(name, "expected an array in CPU memory");
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect)
      fail(name, "expected a C-contiguous array (use numpy.ascontiguousarray)");
    expect *= static_cast<int64_t>(a.shape(i));
  }
}

}  // namespace

size_t Floats::size() const {
  size_t n = 1;
  for (size_t s : shape) n *= s;
  return n;
}

Floats float_input(const AnyArray& a, const char* name, std::initializer_list<int64_t> shape, const char* dims) {
  const bool f32 = a.dtype() == nb::dtype<float>();
  const bool f16 = a.dtype().code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && a.dtype().bits == 16 &&
                   a.dtype().lanes == 1;
  bool shape_ok = a.ndim() == shape.size();
  for (size_t i = 0; shape_ok && i < shape.size(); ++i) {
    const int64_t want = shape.begin()[i];
    shape_ok = want == kAny || static_cast<int64_t>(a.shape(i)) == want;
  }
  if (!(f32 || f16) || !shape_ok) {
    std::string msg = "expected a float32 or float16 array of shape ";
    msg += dims;
    msg += ", got ";
    msg += dtype_name(a.dtype());
    msg += " ";
    msg += shape_text(a);
    fail(name, msg);
  }
  check_cpu_c_order(a, name);
  Floats out;
  for (size_t i = 0; i < a.ndim(); ++i) out.shape.push_back(a.shape(i));
  if (f32) {
    out.data = static_cast<const float*>(a.data());
  } else {
    const auto* h = static_cast<const uint16_t*>(a.data());
    out.widened.resize(out.size());
    std::transform(h, h + out.widened.size(), out.widened.begin(), [](uint16_t x) { return half_to_float(x); });
    out.data = out.widened.data();
  }
  return out;
}

size_t slot_input(const AnyArray& a, const char* name, size_t row_bytes) {
  if (a.dtype() != nb::dtype<uint8_t>() || a.ndim() != 2 || a.shape(1) != row_bytes) {
    std::string msg = "expected a uint8 array of shape [n, slot_bytes=";
    msg += std::to_string(row_bytes);
    msg += "], got ";
    msg += dtype_name(a.dtype());
    msg += " ";
    msg += shape_text(a);
    fail(name, msg);
  }
  check_cpu_c_order(a, name);
  return a.shape(0);
}

std::vector<int64_t> int_input(const AnyArray& a, const char* name) {
  const bool i32 = a.dtype() == nb::dtype<int32_t>(), i64 = a.dtype() == nb::dtype<int64_t>();
  if (!(i32 || i64) || a.ndim() != 1) {
    std::string msg = "expected a 1-D int32 or int64 array, got ";
    msg += dtype_name(a.dtype());
    msg += " ";
    msg += shape_text(a);
    fail(name, msg);
  }
  check_cpu_c_order(a, name);
  std::vector<int64_t> out(a.shape(0));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = i32 ? static_cast<const int32_t*>(a.data())[i] : static_cast<const int64_t*>(a.data())[i];
  return out;
}

nb::ndarray<nb::numpy, const uint8_t> byte_view(const uint8_t* data, std::vector<size_t> shape, nb::handle owner) {
  return nb::ndarray<nb::numpy, const uint8_t>(data, shape.size(), shape.data(), owner);
}

}  // namespace tqkv::python
