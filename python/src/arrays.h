// NumPy arrays at the boundary: inputs are checked (dtype, shape, C order, CPU) and read in
// place where they are float32; float16 inputs are widened into a buffer the call owns.
// Outputs are new NumPy arrays whose memory the array owns.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

namespace tqkv::python {

namespace nb = nanobind;

// Any array from any framework that speaks DLPack or the buffer protocol; checked by hand so
// that every mismatch raises tqkv.Error with a message naming the argument.
using AnyArray = nb::ndarray<nb::ro>;

// A dimension of an expected shape: a fixed size, or kAny (any size; the size found is
// returned in Floats::shape).
inline constexpr int64_t kAny = -1;

struct Floats {
  const float* data = nullptr;
  std::vector<size_t> shape;
  std::vector<float> widened;  // holds float16 input converted to float32
  size_t size() const;
};

// `name` is the argument's name and `dims` its dimension names, for the message, e.g.
// float_input(k, "k", {kAny, 2, 64}, "[n_tokens, n_kv_heads, head_dim]").
// Accepts float32 and float16, C-contiguous, on the CPU; raises tqkv.Error otherwise.
Floats float_input(const AnyArray& a, const char* name, std::initializer_list<int64_t> shape, const char* dims);

// Slot bytes: a uint8 array [n, row_bytes], C order, on the CPU; returns n.
size_t slot_input(const AnyArray& a, const char* name, size_t row_bytes);

// An integer vector (int32 or int64, 1-D, C order) as int64 values.
std::vector<int64_t> int_input(const AnyArray& a, const char* name);

// A new, zeroed C-order array of the given shape owned by Python.
template <typename T>
nb::ndarray<nb::numpy, T> new_array(const std::vector<size_t>& shape) {
  size_t n = 1;
  for (size_t s : shape) n *= s;
  T* data = new T[n == 0 ? 1 : n]();
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T>(data, shape.size(), shape.data(), owner);
}

// A read-only view of memory owned by `owner` (a bound C++ object), shape in C order.
nb::ndarray<nb::numpy, const uint8_t> byte_view(const uint8_t* data, std::vector<size_t> shape, nb::handle owner);

}  // namespace tqkv::python
