#include "device.h"

#include <string>

#include "cpu_device.h"
#include "tqkv/error.h"

namespace tqkv::engine {

DeviceBuffer Device::load_vector(const float* host, size_t n) {
  DeviceBuffer b = alloc(n);
  to_device(host, n, b.data());
  return b;
}

std::shared_ptr<Device> make_device(std::string_view name) {
  // No CUDA device exists yet (the GPU engine implements one over src/cuda): "auto" is the CPU.
  if (name == "cpu" || name == "auto") return std::make_shared<CpuDevice>();
  if (name == "cuda")
    throw Error(ErrorCode::InvalidArgument, "device 'cuda': the engine has no CUDA device yet (only the CUDA kernels "
                                            "and their benchmark run on the GPU); use --device cpu");
  throw Error(ErrorCode::InvalidArgument, "unknown device '" + std::string(name) + "' (cpu, cuda, auto)");
}

}  // namespace tqkv::engine
