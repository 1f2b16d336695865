// tqkv quality --format NAME --dim D [--n N] [--seed S] [--json]
// Round-trips N random Gaussian keys and values through a format and runs softmax attention
// over them with the compressed cache and with the exact one.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "commands.h"
#include "tqkv/codec.h"
#include "tqkv/format.h"
#include "tqkv/reference_attention.h"

namespace {

double cosine(const float* a, const float* b, int n) {
  double ab = 0, aa = 0, bb = 0;
  for (int i = 0; i < n; ++i) {
    ab += static_cast<double>(a[i]) * b[i];
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
  }
  return ab / std::sqrt(aa * bb + 1e-300);
}

}  // namespace

void register_quality(CLI::App& app) {
  auto* cmd = app.add_subcommand("quality", "Measure a format's error on random data");
  static std::string format{tqkv::kDefaultFormat};
  static int dim = 128, n = 4096, queries = 16;
  static uint64_t seed = 1;
  static bool json = false;
  cmd->add_option("--format", format, "cache format (see `tqkv formats`)");
  cmd->add_option("--dim", dim, "head dimension")->check(CLI::Range(2, 4096));
  cmd->add_option("--n", n, "number of random key/value vectors")->check(CLI::Range(1, 10000000));
  cmd->add_option("--queries", queries, "number of random queries for the attention check")->check(CLI::Range(1, 4096));
  cmd->add_option("--seed", seed, "random seed");
  cmd->add_flag("--json", json, "print a JSON object");
  cmd->callback([] {
    const tqkv::Format f = tqkv::find_format(format);
    const tqkv::SlotCodec codec(f, dim);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> gauss(0.0f, 1.0f);
    const size_t sb = codec.slot_bytes();
    std::vector<float> k(static_cast<size_t>(n) * dim), v(k.size()), kd(dim), vd(dim);
    for (auto& x : k) x = gauss(rng);
    for (auto& x : v) x = gauss(rng);
    std::vector<uint8_t> slots(static_cast<size_t>(n) * sb);
    double kerr = 0, kref = 0, verr = 0, vref = 0;
    for (int t = 0; t < n; ++t) {
      const float* kt = &k[static_cast<size_t>(t) * dim];
      const float* vt = &v[static_cast<size_t>(t) * dim];
      uint8_t* s = &slots[static_cast<size_t>(t) * sb];
      codec.encode(kt, vt, s);
      codec.decode_key(s, kd.data());
      codec.decode_value(s + codec.key_bytes(), vd.data());
      for (int i = 0; i < dim; ++i) {
        kerr += std::pow(kt[i] - kd[i], 2.0);
        kref += static_cast<double>(kt[i]) * kt[i];
        verr += std::pow(vt[i] - vd[i], 2.0);
        vref += static_cast<double>(vt[i]) * vt[i];
      }
    }
    // Exact attention as the f32 format's reference attention on the same vectors.
    const tqkv::SlotCodec exact(tqkv::find_format("f32"), dim);
    std::vector<uint8_t> exact_slots(static_cast<size_t>(n) * exact.slot_bytes());
    std::vector<const uint8_t*> ptr(n), exact_ptr(n);
    for (int t = 0; t < n; ++t) {
      exact.encode(&k[static_cast<size_t>(t) * dim], &v[static_cast<size_t>(t) * dim],
                   &exact_slots[static_cast<size_t>(t) * exact.slot_bytes()]);
      ptr[t] = &slots[static_cast<size_t>(t) * sb];
      exact_ptr[t] = &exact_slots[static_cast<size_t>(t) * exact.slot_bytes()];
    }
    std::vector<float> q(static_cast<size_t>(queries) * dim), o(q.size()), oe(q.size());
    for (auto& x : q) x = gauss(rng);
    const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
    tqkv::reference_attention(codec, ptr.data(), n, q.data(), queries, scale, o.data());
    tqkv::reference_attention(exact, exact_ptr.data(), n, q.data(), queries, scale, oe.data());
    double cos_sum = 0;
    for (int h = 0; h < queries; ++h)
      cos_sum += cosine(&o[static_cast<size_t>(h) * dim], &oe[static_cast<size_t>(h) * dim], dim);
    const double key_nmse = kerr / kref, value_nmse = verr / vref, attn_cos = cos_sum / queries;
    if (json) {
      nlohmann::json j = {{"format", format},
                          {"dim", dim},
                          {"n", n},
                          {"bits_per_element", f.bits_per_element(dim)},
                          {"key_nmse", key_nmse},
                          {"value_nmse", value_nmse},
                          {"attn_output_cosine", attn_cos}};
      std::cout << j.dump(2) << "\n";
    } else {
      std::printf("format %s, dim %d, n %d (%.4g bits/element)\n", format.c_str(), dim, n, f.bits_per_element(dim));
      std::printf("key_nmse            %.6g\nvalue_nmse          %.6g\nattn_output_cosine  %.6f\n", key_nmse,
                  value_nmse, attn_cos);
    }
  });
}
