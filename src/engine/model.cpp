#include "model.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dequant.h"
#include "gguf.h"
#include "qgemv.h"
#include "outlier_keys.h"
#include "recent_window.h"
#include "thread_pool.h"
#include "tqkv/attention.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

[[noreturn]] void bad(const std::string& what) { throw Error(ErrorCode::Format, "model: " + what); }

// Expands a tensor after checking it has the shape [cols (contiguous), rows].
std::vector<float> load(const GgufFile& f, const std::string& name, int64_t cols, int64_t rows = 1) {
  const GgufTensor& t = f.tensor(name);
  const int64_t want = cols * rows;
  const bool ok = t.shape[0] == cols && t.n_elements() == want;
  if (!ok) {
    std::string s;
    for (int64_t d : t.shape) s += (s.empty() ? "" : " x ") + std::to_string(d);
    bad("tensor '" + name + "' has shape [" + s + "], expected [" + std::to_string(cols) +
        (rows > 1 ? " x " + std::to_string(rows) : "") + "]");
  }
  std::vector<float> v(static_cast<size_t>(want));
  const TensorTypeTraits* tr = tensor_type_traits(t.type);
  const size_t row_bytes = static_cast<size_t>(cols / tr->block_elems * tr->block_bytes);
  const int parts = rows >= 256 ? pool_threads() : 1;
  parallel_for(parts, [&](int p) {
    for (int64_t r = rows * p / parts; r < rows * (p + 1) / parts; ++r)
      dequantize(t.type, t.data + r * row_bytes, v.data() + r * cols, cols);
  });
  return v;
}

Weight load_weight(const GgufFile& f, const std::string& name, int64_t cols, int64_t rows) {
  Weight w;
  w.rows = static_cast<int>(rows);
  w.cols = static_cast<int>(cols);
  w.f32 = load(f, name, cols, rows);
  const GgufTensor& t = f.tensor(name);
  if (qgemv_supported(t.type)) {
    w.qtype = t.type;
    w.q.assign(t.data, t.data + t.nbytes);
  }
  return w;
}

std::vector<float> load_optional(const GgufFile& f, const std::string& name, int64_t cols) {
  return f.find_tensor(name) ? load(f, name, cols) : std::vector<float>{};
}

void rmsnorm(const float* x, const float* w, int n, int d, float eps, float* y) {
  for (int t = 0; t < n; ++t) {
    const float* xi = x + static_cast<size_t>(t) * d;
    float* yi = y + static_cast<size_t>(t) * d;
    double ss = 0;
    for (int i = 0; i < d; ++i) ss += static_cast<double>(xi[i]) * xi[i];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / d + eps));
    for (int i = 0; i < d; ++i) yi[i] = xi[i] * r * w[i];
  }
}

// Rotates each head of x [n, heads, head_dim] in place for positions pos0 + t.
void rope(float* x, int n, int heads, int head_dim, int n_rot, int64_t pos0, float base, RopeLayout layout) {
  const int half = n_rot / 2;
  std::vector<float> inv_freq(half);
  for (int i = 0; i < half; ++i)
    inv_freq[i] = static_cast<float>(std::pow(static_cast<double>(base), -2.0 * i / n_rot));
  for (int t = 0; t < n; ++t) {
    const double pos = static_cast<double>(pos0 + t);
    for (int i = 0; i < half; ++i) {
      // Angles in double: at positions in the thousands float loses the low bits of pos*freq.
      const double a = pos * inv_freq[i];
      const float c = static_cast<float>(std::cos(a)), s = static_cast<float>(std::sin(a));
      for (int h = 0; h < heads; ++h) {
        float* v = x + (static_cast<size_t>(t) * heads + h) * head_dim;
        const int i0 = layout == RopeLayout::Adjacent ? 2 * i : i;
        const int i1 = layout == RopeLayout::Adjacent ? 2 * i + 1 : i + half;
        const float a0 = v[i0], a1 = v[i1];
        v[i0] = a0 * c - a1 * s;
        v[i1] = a0 * s + a1 * c;
      }
    }
  }
}

// RoPE partner of channel j of a head and the angle its pair turns per position (0 for the
// channels RoPE leaves alone, which have no partner: returns j).
int rope_partner(const ModelConfig& c, int j, double* theta) {
  *theta = 0;
  if (j >= c.n_rot) return j;
  const int half = c.n_rot / 2;
  const int i = c.rope == RopeLayout::Adjacent ? j / 2 : j % half;
  *theta = std::pow(static_cast<double>(c.rope_base), -2.0 * i / c.n_rot);
  if (c.rope == RopeLayout::Adjacent) return j ^ 1;
  return j < half ? j + half : j - half;
}

// Subtracts the (layer, kv head) key mean (and applies the channel scales), estimating them
// from these n tokens the first time. q: [n, heads * group, hd]. Keys are centred after RoPE,
// so a pair of channels that RoPE turns by more than a radian over the cache's capacity has
// no stable mean: those pairs keep mu = 0. Scales are shared by the two channels of a pair
// (RoPE moves energy between them, not out of the pair), so they hold at every position.
void centre_keys(KeyCentring& kc, const ModelConfig& c, int layer, int capacity, int n, float* k, float* q) {
  const int heads = c.n_kv_heads, group = c.n_heads / c.n_kv_heads, hd = c.head_dim, n_layers = c.n_layers;
  const size_t per_layer = static_cast<size_t>(heads) * hd;
  if (kc.mean.size() != per_layer * n_layers) {
    kc.mean.assign(per_layer * n_layers, 0.0f);
    kc.scale.assign(per_layer * n_layers, 1.0f);
    kc.estimated.assign(n_layers, 0);
  }
  float* mu = kc.mean.data() + per_layer * layer;
  float* sc = kc.scale.data() + per_layer * layer;
  const size_t q_row = per_layer * group;
  if (!kc.estimated[layer]) {
    std::vector<double> acc(per_layer, 0.0);
    for (int t = 0; t < n; ++t)
      for (size_t i = 0; i < per_layer; ++i) acc[i] += k[t * per_layer + i];
    for (size_t i = 0; i < per_layer; ++i) {
      double theta = 0;
      rope_partner(c, static_cast<int>(i % hd), &theta);
      mu[i] = kc.centre && theta * capacity <= 1.0 ? static_cast<float>(acc[i] / n) : 0.0f;
    }
    if (kc.scale_channels) {
      std::vector<double> kk(per_layer, 0.0), qq(per_layer, 0.0);
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < heads; ++h)
          for (int i = 0; i < hd; ++i) {
            const size_t ch = static_cast<size_t>(h) * hd + i;
            const double dk = k[t * per_layer + ch] - mu[ch];
            kk[ch] += dk * dk;
            for (int g = 0; g < group; ++g) {
              const double qv = q[t * q_row + (static_cast<size_t>(h) * group + g) * hd + i];
              qq[ch] += qv * qv;
            }
          }
      for (int h = 0; h < heads; ++h) {
        double log_sum = 0;
        const size_t base = static_cast<size_t>(h) * hd;
        for (int i = 0; i < hd; ++i) {
          double theta = 0;
          const int p = rope_partner(c, i, &theta);
          const double ek = (kk[base + i] + kk[base + p]) / (p == i ? 1.0 : 2.0);
          const double eq = (qq[base + i] + qq[base + p]) / (p == i ? 1.0 : 2.0);
          const double rk = std::sqrt(ek / n) + 1e-6, rq = std::sqrt(eq / (static_cast<double>(n) * group)) + 1e-6;
          sc[base + i] = static_cast<float>(std::sqrt(rk / rq));
          log_sum += std::log(sc[base + i]);
        }
        const float norm = static_cast<float>(std::exp(-log_sum / hd));
        for (int i = 0; i < hd; ++i) sc[base + i] *= norm;
      }
    }
    kc.estimated[layer] = 1;
  }
  for (int t = 0; t < n; ++t)
    for (size_t i = 0; i < per_layer; ++i) k[t * per_layer + i] = (k[t * per_layer + i] - mu[i]) / sc[i];
  if (kc.scale_channels)
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < heads; ++h)
        for (int g = 0; g < group; ++g)
          for (int i = 0; i < hd; ++i) q[t * q_row + (static_cast<size_t>(h) * group + g) * hd + i] *= sc[static_cast<size_t>(h) * hd + i];
}

}  // namespace

void set_num_threads(int n) { set_pool_threads(n); }

// OpenBLAS runs single-threaded inside our blocking pool (thread_pool.h), whose workers
// split the output features: OpenBLAS's own spinning threads next to anyone else's spinning
// OpenMP workers made prefill 5x slower on two cores.
void matmul(const float* x, int n, const Weight& w, float* y, const float* bias) {
  static const bool once = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)once;
  const int in = w.cols, out = w.rows;
  const bool quantized = n <= kQuantizedMaxTokens && !w.q.empty();
  // Slices of at least 64 output rows, so small matrices are not split into tiny products.
  const int parts = std::max(1, std::min(pool_threads(), out / 64));
  parallel_for(parts, [&](int p) {
    const int o0 = static_cast<int>(static_cast<int64_t>(out) * p / parts);
    const int o1 = static_cast<int>(static_cast<int64_t>(out) * (p + 1) / parts);
    const int m = o1 - o0;
    if (m <= 0) return;
    if (quantized) {
      for (int t = 0; t < n; ++t)
        qgemv(w.qtype, w.q.data(), in, o0, o1, x + static_cast<size_t>(t) * in, y + static_cast<size_t>(t) * out + o0);
    } else {
      const float* wp = w.f32.data() + static_cast<size_t>(o0) * in;
      if (n == 1) {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, m, in, 1.0f, wp, in, x, 1, 0.0f, y + o0, 1);
      } else {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, in, 1.0f, x, in, wp, in, 0.0f, y + o0, out);
      }
    }
    if (bias)
      for (int t = 0; t < n; ++t)
        for (int o = o0; o < o1; ++o) y[static_cast<size_t>(t) * out + o] += bias[o];
  });
}

Model Model::load(const GgufFile& f) {
  Model m;
  ModelConfig& c = m.cfg_;
  c.arch = f.get_string("general.architecture");
  const std::string& a = c.arch;
  if (a != "llama" && a != "qwen2" && a != "mistral" && a != "granite" && a != "smollm3")
    bad("architecture '" + a + "' is not supported (llama, qwen2 and mistral are)");
  auto cfg_int = [&](const std::string& key) {
    const int64_t v = f.get_int(a + "." + key);
    if (v <= 0 || v > (1 << 24)) bad("metadata " + a + "." + key + " = " + std::to_string(v) + " is out of range");
    return static_cast<int>(v);
  };
  c.n_layers = cfg_int("block_count");
  c.d_model = cfg_int("embedding_length");
  c.n_heads = cfg_int("attention.head_count");
  c.n_kv_heads = f.has(a + ".attention.head_count_kv") ? cfg_int("attention.head_count_kv") : c.n_heads;
  c.d_ff = cfg_int("feed_forward_length");
  c.ctx_train = cfg_int("context_length");
  c.head_dim = f.has(a + ".attention.key_length") ? cfg_int("attention.key_length") : c.d_model / c.n_heads;
  c.n_rot = f.has(a + ".rope.dimension_count") ? cfg_int("rope.dimension_count") : c.head_dim;
  c.rms_eps = static_cast<float>(f.get_float(a + ".attention.layer_norm_rms_epsilon", 1e-5));
  c.rope_base = static_cast<float>(f.get_float(a + ".rope.freq_base", 10000.0));
  c.rope = a == "qwen2" ? RopeLayout::Halves : RopeLayout::Adjacent;
  if (c.n_heads % c.n_kv_heads != 0) bad("head_count is not a multiple of head_count_kv");
  if (c.n_rot > c.head_dim || c.n_rot % 2 != 0) bad("rope.dimension_count must be even and <= head_dim");
  const GgufTensor& emb = f.tensor("token_embd.weight");
  if (emb.shape.size() != 2) bad("token_embd.weight is not a matrix");
  c.n_vocab = static_cast<int>(emb.shape[1]);

  const int d = c.d_model, hd = c.head_dim, q_dim = c.n_heads * hd, kv_dim = c.n_kv_heads * hd;
  m.tok_embd_ = load_weight(f, "token_embd.weight", d, c.n_vocab);
  m.out_norm_ = engine::load(f, "output_norm.weight", d);
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  if (!c.tied_embeddings) m.output_ = load_weight(f, "output.weight", d, c.n_vocab);
  m.layers_.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer& L = m.layers_[l];
    L.attn_norm = engine::load(f, p + "attn_norm.weight", d);
    L.wq = load_weight(f, p + "attn_q.weight", d, q_dim);
    L.wk = load_weight(f, p + "attn_k.weight", d, kv_dim);
    L.wv = load_weight(f, p + "attn_v.weight", d, kv_dim);
    L.wo = load_weight(f, p + "attn_output.weight", q_dim, d);
    L.bq = load_optional(f, p + "attn_q.bias", q_dim);
    L.bk = load_optional(f, p + "attn_k.bias", kv_dim);
    L.bv = load_optional(f, p + "attn_v.bias", kv_dim);
    if (!L.bq.empty()) c.qkv_bias = true;
    L.ffn_norm = engine::load(f, p + "ffn_norm.weight", d);
    L.w_gate = load_weight(f, p + "ffn_gate.weight", d, c.d_ff);
    L.w_up = load_weight(f, p + "ffn_up.weight", d, c.d_ff);
    L.w_down = load_weight(f, p + "ffn_down.weight", c.d_ff, d);
  }
  return m;
}

size_t Model::weight_bytes() const {
  auto wb = [](const Weight& w) { return w.f32.size() * sizeof(float) + w.q.size(); };
  size_t n = wb(tok_embd_) + out_norm_.size() * sizeof(float) + wb(output_);
  for (const Layer& L : layers_) {
    for (const auto* v : {&L.attn_norm, &L.bq, &L.bk, &L.bv, &L.ffn_norm}) n += v->size() * sizeof(float);
    for (const auto* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) n += wb(*w);
  }
  return n;
}

ContiguousCache Model::make_cache(const std::string& format, int capacity, int skip_layers) const {
  const Format inner = find_format(format);  // throws tqkv::Error listing valid names
  ContiguousCacheConfig cc;
  cc.n_layers = cfg_.n_layers;
  cc.n_kv_heads = cfg_.n_kv_heads;
  cc.head_dim = cfg_.head_dim;
  cc.capacity = capacity;
  cc.layer_formats = boundary_layer_formats(cfg_.n_layers, inner, skip_layers);
  return ContiguousCache(cc);
}

void Model::forward(const int32_t* tokens, int n, int64_t pos0, ContiguousCache& cache, float* logits,
                    bool all_logits, KeyCentring* centring, RecentWindow* recent) const {
  const ModelConfig& c = cfg_;
  if (n <= 0) throw Error(ErrorCode::InvalidArgument, "forward: no tokens");
  if (recent && n > recent->max_batch()) {  // its ring holds max_batch new tokens at a time
    const int b = recent->max_batch();
    for (int t = 0; t < n; t += b) {
      const int m = std::min(b, n - t);
      float* lg = all_logits ? logits + static_cast<size_t>(t) * c.n_vocab : logits;
      forward(tokens + t, m, pos0 + t, cache, lg, all_logits, centring, recent);
    }
    return;
  }
  if (pos0 != cache.seq_len())
    throw Error(ErrorCode::OutOfRange, "forward: position " + std::to_string(pos0) + " does not follow the cache (" +
                                           std::to_string(cache.seq_len()) + " tokens held)");
  if (n > cache.capacity())
    throw Error(ErrorCode::Capacity, "forward: " + std::to_string(n) + " tokens exceed the cache capacity of " +
                                         std::to_string(cache.capacity()));
  for (int t = 0; t < n; ++t)
    if (tokens[t] < 0 || tokens[t] >= c.n_vocab)
      throw Error(ErrorCode::OutOfRange, "forward: token id " + std::to_string(tokens[t]) + " out of range");

  const int d = c.d_model, hd = c.head_dim, q_dim = c.n_heads * hd, kv_dim = c.n_kv_heads * hd, ff = c.d_ff;
  const size_t N = static_cast<size_t>(n);
  std::vector<float> x(N * d), xn(N * d), q(N * q_dim), k(N * kv_dim), v(N * kv_dim), att(N * q_dim),
      gate(N * ff), up(N * ff);
  for (int t = 0; t < n; ++t)
    std::memcpy(&x[t * static_cast<size_t>(d)], &tok_embd_.f32[static_cast<size_t>(tokens[t]) * d], d * sizeof(float));

  AttentionParams ap;
  ap.n_q_heads = c.n_heads;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int l = 0; l < c.n_layers; ++l) {
    const Layer& L = layers_[l];
    rmsnorm(x.data(), L.attn_norm.data(), n, d, c.rms_eps, xn.data());
    matmul(xn.data(), n, L.wq, q.data(), L.bq.empty() ? nullptr : L.bq.data());
    matmul(xn.data(), n, L.wk, k.data(), L.bk.empty() ? nullptr : L.bk.data());
    matmul(xn.data(), n, L.wv, v.data(), L.bv.empty() ? nullptr : L.bv.data());
    rope(q.data(), n, c.n_heads, hd, c.n_rot, pos0, c.rope_base, c.rope);
    rope(k.data(), n, c.n_kv_heads, hd, c.n_rot, pos0, c.rope_base, c.rope);
    if (centring)
      centre_keys(*centring, c, l, cache.capacity(), n, k.data(), q.data());
    // The new keys/values go into the (possibly compressed) cache first; attention then reads
    // every position, the new ones included, from the cache, exactly as decode will later.
    if (centring && centring->outliers) {  // the study's split codec: its reconstruction is cached,
      std::vector<float> split(k);          // the exact keys still go to the f16 copies below
      centring->outliers->apply(l, n, split.data());
      cache.write(l, pos0, n, split.data(), v.data());
    } else {
      cache.write(l, pos0, n, k.data(), v.data());
    }
    if (recent && recent->covers(l)) {
      recent->write(l, pos0, n, k.data(), v.data());
      recent->attention(cache, l, q.data(), n, pos0, ap, att.data());
    } else {
      tqkv::attention(cache, l, q.data(), n, pos0, ap, att.data());
    }
    matmul(att.data(), n, L.wo, xn.data());
    for (size_t i = 0; i < N * d; ++i) x[i] += xn[i];

    rmsnorm(x.data(), L.ffn_norm.data(), n, d, c.rms_eps, xn.data());
    matmul(xn.data(), n, L.w_gate, gate.data());
    matmul(xn.data(), n, L.w_up, up.data());
    for (size_t i = 0; i < N * ff; ++i) {
      const float g = gate[i];
      gate[i] = g / (1.0f + std::exp(-g)) * up[i];  // SwiGLU: silu(gate) * up
    }
    matmul(gate.data(), n, L.w_down, xn.data());
    for (size_t i = 0; i < N * d; ++i) x[i] += xn[i];
  }

  const Weight& head = c.tied_embeddings ? tok_embd_ : output_;
  if (all_logits) {
    rmsnorm(x.data(), out_norm_.data(), n, d, c.rms_eps, xn.data());
    matmul(xn.data(), n, head, logits);
  } else {
    rmsnorm(x.data() + (N - 1) * d, out_norm_.data(), 1, d, c.rms_eps, xn.data());
    matmul(xn.data(), 1, head, logits);
  }
}

}  // namespace tqkv::engine
