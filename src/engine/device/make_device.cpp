// make_device (device.h): the devices by name. Apart from the interface's shared defaults
// (device.cpp) so that code written against the interface links without every device's kernels
// (the model-loading fuzz target, tests/engine/fuzz/fuzz_model.cpp, loads onto a device of its own).
#include <memory>
#include <string>
#include <string_view>

#include "engine/device/cpu_device.h"
#include "engine/device/device.h"
#include "tqkv/error.h"
#ifdef TQKV_HAS_CUDA
#include "engine/device/cuda_device.h"
#endif

namespace tqkv::engine {

std::shared_ptr<Device> make_device(std::string_view name) {
  if (name == "cpu") return std::make_shared<CpuDevice>();
#ifdef TQKV_HAS_CUDA
  if (name == "cuda") return make_cuda_device();  // throws when no GPU is present
  if (name == "auto") return cuda_device_present() ? make_cuda_device() : std::make_shared<CpuDevice>();
#else
  if (name == "auto") return std::make_shared<CpuDevice>();
  if (name == "cuda")
    throw Error(ErrorCode::InvalidArgument, "device 'cuda': this build has no CUDA (configure with -DTQKV_CUDA=ON on a "
                                            "machine with nvcc); use --device cpu");
#endif
  throw Error(ErrorCode::InvalidArgument, "unknown device '" + std::string(name) + "' (cpu, cuda, auto)");
}

}  // namespace tqkv::engine
