#include "calibrate.h"

#include <algorithm>

#include "eval.h"
#include "tqkv/error.h"

namespace tqkv::eval {

engine::KeyStats calibrate_keys(const engine::Model& model, const std::vector<int32_t>& tokens,
                                const CalibrateOptions& opt, const std::function<void(int, int)>& progress) {
  const engine::ModelConfig& c = model.config();
  if (opt.ctx < 2 || opt.batch < 1) throw Error(ErrorCode::InvalidArgument, "calibrate: bad ctx or batch");
  // The key hook hands over the device's own memory (kv_cache.h): these sums read host memory.
  if (model.device().name() != "cpu")
    throw Error(ErrorCode::InvalidArgument, "calibrate: the key statistics run on the CPU only (--device cpu), not on " +
                                                model.device().name());
  const int64_t avail = static_cast<int64_t>(tokens.size()) / opt.ctx;
  const int n_chunks = static_cast<int>(std::min<int64_t>(avail, std::max(1, opt.max_tokens / opt.ctx)));
  if (n_chunks == 0)
    throw Error(ErrorCode::InvalidArgument, "calibrate: the text has " + std::to_string(tokens.size()) +
                                                " tokens, fewer than one chunk of " + std::to_string(opt.ctx));
  const int H = c.n_kv_heads, hd = c.head_dim, group = c.n_heads / c.n_kv_heads;
  const size_t per_layer = static_cast<size_t>(H) * hd, total = per_layer * c.n_layers;
  std::vector<double> k1(total, 0.0), k2(total, 0.0), q2(total, 0.0);
  int64_t seen = 0;
  const engine::CacheSpec f32 = model.resolve("f32");
  std::vector<float> logits(static_cast<size_t>(c.n_vocab));
  std::vector<int32_t> chunk(opt.ctx);
  for (int ch = 0; ch < n_chunks; ++ch) {
    std::copy_n(tokens.begin() + static_cast<int64_t>(ch) * opt.ctx, opt.ctx, chunk.begin());
    if (opt.bos >= 0) chunk[0] = opt.bos;
    std::unique_ptr<engine::KvCache> cache = model.make_cache(f32, opt.ctx);
    const int64_t seq = cache->add_sequence();
    // The hook sees host memory on the CPU device, which is where calibration runs.
    cache->set_key_hook([&](int layer, int n, float* k, const float* q) {
      double* s1 = k1.data() + per_layer * layer;
      double* s2 = k2.data() + per_layer * layer;
      double* sq = q2.data() + per_layer * layer;
      for (int t = 0; t < n; ++t)
        for (size_t i = 0; i < per_layer; ++i) {
          const double x = k[t * per_layer + i];
          s1[i] += x;
          s2[i] += x * x;
          for (int g = 0; g < group; ++g) {
            const double y = q[(static_cast<size_t>(t) * H * group + (i / hd) * group + g) * hd + i % hd];
            sq[i] += y * y / group;
          }
        }
      if (layer == 0) seen += n;
    });
    for (int p = 0; p < opt.ctx; p += opt.batch) {
      const int m = std::min(opt.batch, opt.ctx - p);
      model.forward(seq, chunk.data() + p, m, *cache, logits.data(), false);
    }
    if (progress) progress(ch + 1, n_chunks);
  }
  engine::KeyStats ks;
  ks.source = opt.source;
  ks.tokens = seen;
  ks.n_layers = c.n_layers;
  ks.n_kv_heads = H;
  ks.head_dim = hd;
  ks.key_mean.resize(total);
  ks.key_sq.resize(total);
  ks.query_sq.resize(total);
  for (size_t i = 0; i < total; ++i) {
    ks.key_mean[i] = static_cast<float>(k1[i] / seen);
    ks.key_sq[i] = static_cast<float>(k2[i] / seen);
    ks.query_sq[i] = static_cast<float>(q2[i] / seen);
  }
  return ks;
}

std::vector<std::string> scan_specs(const engine::ModelConfig& cfg, const ScanOptions& opt) {
  std::vector<std::string> out;
  for (int l : engine::compressed_layers(cfg, opt.all_layers)) {
    const std::string only =
        std::string(opt.balance ? "+s" : "+c").append(opt.all_layers ? "+skip0+only" : "+only").append(std::to_string(l)).append(opt.suffix);
    out.push_back(std::string("k").append(std::to_string(opt.key_bits)).append("v8").append(only));
    out.push_back(std::string("k8v").append(std::to_string(opt.value_bits)).append(only));
  }
  return out;
}

std::vector<engine::LayerSensitivity> scan_layers(const engine::Model& model, const std::vector<int32_t>& tokens,
                                                  const ScanOptions& opt,
                                                  const std::function<void(int64_t, int64_t)>& progress) {
  const std::vector<int> layers = engine::compressed_layers(model.config(), opt.all_layers);
  if (layers.empty())
    throw Error(ErrorCode::InvalidArgument, "calibrate: the model has " + std::to_string(model.config().n_layers) +
                                                " layers, all kept f16 at the boundary: nothing to scan");
  std::vector<engine::CacheSpec> specs;
  for (const std::string& s : scan_specs(model.config(), opt)) specs.push_back(model.resolve(s));
  EvalOptions eo;
  eo.ctx = opt.ctx;
  eo.max_tokens = opt.max_tokens;
  eo.batch = opt.ctx;
  eo.bos = opt.bos;
  eo.on_pass = progress;
  const std::vector<EvalRow> rows = evaluate(model, tokens, specs, eo);
  std::vector<engine::LayerSensitivity> out;
  for (size_t i = 0; i < layers.size(); ++i)
    out.push_back({layers[i], rows[1 + 2 * i].kld, rows[2 + 2 * i].kld});
  return out;
}

}  // namespace tqkv::eval
