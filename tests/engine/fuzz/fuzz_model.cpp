// libFuzzer target for model loading: arbitrary bytes as a GGUF, then Model::load as the engine
// does it (architecture, config and its range checks, RoPE scaling, layer windows, every
// weight's shape, type and finiteness, unused tensors) and the tokenizer. Only tqkv::Error may
// come out; anything else (a crash, an ASan/UBSan report, another exception type, a loaded
// config that breaks its own invariants) is a finding. Run: tests/engine/fuzz/run_fuzz.sh
//
// The weights go to a device that only holds them (LoadOnlyDevice below): the CPU device's
// kernels do not build with clang, and computing with fuzzed weights is not loading.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/device/device.h"
#include "engine/gguf/gguf.h"
#include "engine/gguf/tokenizer.h"
#include "engine/model/model.h"
#include "engine/weights/dequant.h"
#include "tqkv/error.h"

namespace {

using namespace tqkv::engine;

class HeldMatrix final : public DeviceMatrix {
 public:
  HeldMatrix(int rows, int cols, size_t bytes) : DeviceMatrix(rows, cols), bytes_(bytes) {}
  size_t bytes() const override { return bytes_; }

 private:
  size_t bytes_;
};

// Loads as a device does (the shape checked, the blocks read), and refuses to compute.
class LoadOnlyDevice final : public Device {
 public:
  std::string name() const override { return "load-only"; }
  DeviceBuffer alloc(size_t n) override {
    return DeviceBuffer(new float[n], n, [](float* p) { delete[] p; });
  }
  void to_device(const float* host, size_t n, float* dst) override { std::copy(host, host + n, dst); }
  void to_host(const float* src, size_t n, float* host) override { std::copy(src, src + n, host); }
  std::unique_ptr<DeviceMatrix> load_matrix(const GgufTensor& t, int rows, int cols) override {
    if (static_cast<int64_t>(rows) * cols <= (1 << 20)) {
      const std::vector<float> v = expand_tensor(t, cols, rows);  // checks the shape, reads every block
      for (float x : v)
        if (!std::isfinite(x)) std::abort();  // the loader's finiteness check let it through
    } else {
      check_tensor_shape(t, cols, rows);
    }
    return std::make_unique<HeldMatrix>(rows, cols, t.nbytes);
  }
  void embed(const DeviceMatrix&, const int32_t*, int, float, float*) override { no(); }
  void matmul(const float*, int, const DeviceMatrix&, float*, const float*) override { no(); }
  void rmsnorm(const float*, const float*, int, int, float, float*) override { no(); }
  void rope(float*, int, int, int, const int64_t*, const RopeParams&) override { no(); }
  void swiglu(float*, const float*, size_t) override { no(); }
  void gelu_glu(float*, const float*, size_t) override { no(); }
  void add(float*, const float*, size_t) override { no(); }
  void gather_rows(const float*, int, const int32_t*, int, float*) override { no(); }
  std::unique_ptr<KvCache> make_cache(const CacheSpec&, const CacheShape&) override { no(); }

 private:
  [[noreturn]] static void no() { throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "load-only device"); }
};

// What a loaded config promises the forward pass (model.cpp's checks); a break is a finding.
void check_config(const ModelConfig& c) {
  const bool ok = c.n_layers > 0 && c.d_model > 0 && c.n_heads > 0 && c.n_kv_heads > 0 && c.n_heads % c.n_kv_heads == 0 &&
                  c.head_dim > 0 && c.n_vocab > 0 && c.rope.n_rot <= c.head_dim && c.rope.n_rot % 2 == 0 &&
                  static_cast<int>(c.layer_window.size()) == c.n_layers && c.rms_eps > 0;
  if (!ok) std::abort();
}

}  // namespace

// Link seams: Model::load names the default device and Model::resolve the cache specs; the real
// make_device and resolve_cache_spec bring in every kernel and the CPU caches (which do not build
// with clang). This target calls neither.
namespace tqkv::engine {
std::shared_ptr<Device> make_device(std::string_view) { std::abort(); }
CacheSpec resolve_cache_spec(const std::string&, const ModelConfig&, const SpecSources&) { std::abort(); }
}  // namespace tqkv::engine

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    GgufFile f = GgufFile::parse(std::span<const uint8_t>(data, size));
    const Model m = Model::load(f, std::make_shared<LoadOnlyDevice>());
    check_config(m.config());
    Tokenizer tok = Tokenizer::from_gguf(f);
    tok.decode(tok.encode("ab a h\xc3\xa9 12", true, true));
  } catch (const tqkv::Error&) {
  }
  return 0;
}
