#include "engine/model/architecture.h"

#include <atomic>
#include <cstdlib>
#include <string>
#include <string_view>

#include "engine/weights/dequant.h"
#include "engine/gguf/gguf.h"
#include "tqkv/error.h"
#include "tqkv/options.h"

namespace tqkv::engine {
namespace {

[[noreturn]] void bad(const std::string& what) { throw Error(ErrorCode::Format, "model: " + what); }

// general.architecture -> definition.
struct Entry {
  const char* arch;
  const Architecture* def;
};
const Entry kArchitectures[] = {
    {"llama", &kLlamaArchitecture},
    {"mistral", &kLlamaArchitecture},
    {"qwen2", &kLlamaArchitecture},
    {"gemma3", &kGemma3Architecture},
};

// Architectures whose GGUFs look like a supported family but need what no definition here
// does: refused by name rather than run with silently wrong output.
struct Refused {
  const char* arch;
  const char* why;
};
constexpr Refused kRefused[] = {
    {"granite", "its embedding, residual, attention and logit scales"},
    {"smollm3", "its NoPE layers (no RoPE on every fourth layer)"},
    {"gemma2", "its attention and final logit soft-capping"},
};

}  // namespace

const Architecture& find_architecture(const std::string& arch) {
  for (const Refused& r : kRefused)
    if (arch == r.arch) bad("architecture '" + arch + "' is not supported yet: the engine does not implement " + r.why);
  std::string known;
  for (const Entry& e : kArchitectures) {
    if (arch == e.arch) return *e.def;
    known += known.empty() ? "" : ", ";
    known += e.arch;
  }
  bad("architecture '" + arch + "' is not supported (" + known + " are)");
}

size_t ModelWeights::bytes() const {
  auto mb = [](const std::unique_ptr<DeviceMatrix>& w) { return w ? w->bytes() : 0; };
  auto vb = [](const DeviceBuffer& b) { return b.size() * sizeof(float); };
  size_t n = mb(tok_embd) + vb(out_norm) + mb(output);
  for (const LayerWeights& L : layers) {
    for (const auto* v : {&L.attn_norm, &L.bq, &L.bk, &L.bv, &L.ffn_norm, &L.q_norm, &L.k_norm, &L.post_attn_norm,
                          &L.post_ffn_norm})
      n += vb(*v);
    for (const auto* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) n += mb(*w);
  }
  return n;
}

bool WeightLoader::has(const std::string& name) const { return f_.find_tensor(name) != nullptr; }

std::unique_ptr<DeviceMatrix> WeightLoader::matrix(const std::string& name, int cols, int rows) const {
  used_.insert(name);
  const GgufTensor& t = f_.tensor(name);
  check_tensor_finite(t);
  return dev_.load_matrix(t, rows, cols);
}

DeviceBuffer WeightLoader::vec(const std::string& name, int n) const {
  used_.insert(name);
  const GgufTensor& t = f_.tensor(name);
  check_tensor_finite(t);
  const std::vector<float> v = expand_tensor(t, n);
  return dev_.load_vector(v.data(), v.size());
}

void WeightLoader::check_all_used(const std::string& arch) const {
  for (const GgufTensor& t : f_.tensors())
    if (t.name != "rope_freqs.weight" && !used_.contains(t.name))
      bad("tensor '" + t.name + "' is not used by the engine's " + arch +
          " (a weight it does not know how to apply): not supported");
}

StepProducts::StepProducts(Device& dev, const Batch& batch) : dev_(dev), batch_(batch) {
  const std::vector<Batch::Run> runs = batch.runs();
  per_run_ = runs.size() > 1 && dev.row_count_changes_products();
  if (!per_run_) return;
  int row = 0;  // each run's logit rows together: the product that run gets alone
  for (const Batch::Run& r : runs) {
    runs_.push_back({r.begin, r.count});
    int m = 0;
    for (int t = r.begin; t < r.begin + r.count; ++t) m += batch.logits[t] != 0;
    if (m > 0) logit_runs_.push_back({row, m});
    row += m;
  }
}

void StepProducts::matmul(const float* x, const DeviceMatrix& w, float* y, const float* bias) const {
  if (!per_run_) return dev_.matmul(x, batch_.size(), w, y, bias);
  dev_.matmul_runs(x, runs_.data(), static_cast<int>(runs_.size()), w, y, bias);
}

void StepProducts::matmul_group(const float* x, const GroupProduct* products, int count) const {
  if (!per_run_ && group_products()) return dev_.matmul_group(x, batch_.size(), products, count);
  for (int i = 0; i < count; ++i) matmul(x, *products[i].w, products[i].y, products[i].bias);
}

void StepProducts::qkv(const float* x, const LayerWeights& L, float* q, float* k, float* v) const {
  const GroupProduct g[3] = {{L.wq.get(), q, L.bq.data()}, {L.wk.get(), k, L.bk.data()}, {L.wv.get(), v, L.bv.data()}};
  matmul_group(x, g, 3);
}

void StepProducts::gate_up(const float* x, const LayerWeights& L, float* gate, float* up) const {
  const GroupProduct g[2] = {{L.w_gate.get(), gate}, {L.w_up.get(), up}};
  matmul_group(x, g, 2);
}

void StepProducts::gate_up_glu(Device::Glu kind, const float* x, const LayerWeights& L, float* gate, float* up) const {
  if (!per_run_ && group_products())
    return dev_.matmul_glu(kind, x, batch_.size(), *L.w_gate, *L.w_up, gate, up, true);
  gate_up(x, L, gate, up);
  dev_.glu(kind, gate, up, static_cast<size_t>(batch_.size()) * L.w_gate->rows(), true);
}

namespace {
std::atomic<bool>& group_slot() {
  static std::atomic<bool> on{env_bool("TQKV_GROUP_PRODUCTS")};  // set_group_products overrides
  return on;
}
}  // namespace

bool group_products() { return group_slot().load(std::memory_order_relaxed); }

void set_group_products(bool on) { group_slot().store(on, std::memory_order_relaxed); }

void StepProducts::matmul_logit_rows(const float* x, const DeviceMatrix& w, float* y) const {
  if (!per_run_) return dev_.matmul(x, batch_.n_logits(), w, y);
  dev_.matmul_runs(x, logit_runs_.data(), static_cast<int>(logit_runs_.size()), w, y);
}

void output_logits(const ModelConfig& c, const ModelWeights& w, Device& dev, const StepProducts& products,
                   const Batch& batch, float* x, float* tmp, const LogitsOut& logits) {
  // Logits only for the rows that want them (usually the last token of each sequence).
  std::vector<int32_t> rows;
  const int n = batch.size(), d = c.d_model;
  for (int t = 0; t < n; ++t)
    if (batch.logits[t]) rows.push_back(t);
  if (rows.empty()) return;
  const int r = static_cast<int>(rows.size());
  if (r < n) dev.gather_rows(x, d, rows.data(), r, tmp);
  dev.rmsnorm(r < n ? tmp : x, w.out_norm.data(), r, d, c.rms_eps, tmp);
  const DeviceMatrix& head = c.tied_embeddings ? *w.tok_embd : *w.output;
  DeviceBuffer out = dev.alloc(static_cast<size_t>(r) * c.n_vocab);
  products.matmul_logit_rows(tmp, head, out.data());
  dev.logits_out(out.data(), r, c.n_vocab, logits);
}

}  // namespace tqkv::engine
