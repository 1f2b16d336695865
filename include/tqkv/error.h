// One exception type for bad input (and refused or failed work) anywhere in tqkv. Every operation that throws it has
// changed nothing (caches, buffers and outputs are left as they were).
#pragma once
#include <stdexcept>
#include <string>

namespace tqkv {

enum class ErrorCode : int {
  Ok = 0,
  InvalidArgument = 1,  // wrong shape, unknown name, bad size
  NonFinite = 2,        // NaN or Inf in an input vector
  OutOfRange = 3,       // layer / head / position / sequence outside what exists
  Capacity = 4,         // cache or block pool exhausted
  Overflow = 5,         // a norm or scale beyond what fp16 metadata can hold
  Format = 6,           // corrupt or unsupported file contents
  Busy = 7,             // cannot take the work now (shutting down); the same call may succeed later
  Device = 8,           // the device runtime failed (a CUDA or cuBLAS call, no device present)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace tqkv
