// The C++ API through an installed tqkv: a format by name, a compressed cache, GQA attention.
#include <cmath>
#include <cstdio>
#include <vector>

#include <tqkv/attention.h>
#include <tqkv/contiguous_cache.h>
#include <tqkv/error.h>
#include <tqkv/format.h>

int main() {
  const tqkv::Format fmt = tqkv::Format::parse("turboquant_4bit_nc");
  tqkv::ContiguousCacheConfig cfg;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.capacity = 16;
  cfg.layer_formats = {fmt};
  tqkv::ContiguousCache cache(cfg);
  std::vector<float> k(8 * 2 * 64), q(4 * 64), out(4 * 64);
  for (size_t i = 0; i < k.size(); ++i) k[i] = std::sin(0.1f * static_cast<float>(i));
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.05f * static_cast<float>(i));
  cache.write(0, 0, 8, k.data(), k.data());
  tqkv::AttentionParams params;
  params.n_q_heads = 4;
  tqkv::attention(cache, 0, q.data(), 1, 7, params, out.data());
  try {
    tqkv::Format::parse("k9v9");
    return 1;
  } catch (const tqkv::Error& e) {
    std::printf("tqkv C++: %s, %zu bytes/slot, out[0] %.4f; bad name: %.40s...\n", fmt.name().c_str(),
                fmt.slot_bytes(64), out[0], e.what());
  }
  return std::isfinite(out[0]) ? 0 : 2;
}
