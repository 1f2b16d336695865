// torch.ops.tqkv_vllm: store, decode, dequant over vLLM's own TurboQuant cache tensor (the
// [num_blocks, block_size, num_kv_heads, slot_bytes] uint8 view vLLM's backend hands its Triton
// kernels), on the tensors' device and torch's current stream. Nothing here allocates or waits
// for the device, so the decode can be captured in a CUDA graph; the fake implementations for
// torch.compile live in tqkv_vllm/ops.py.
#include <ATen/cuda/CUDAContext.h>
#include <Python.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "ops.h"

namespace tqkv_vllm {
namespace {

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    default: TORCH_CHECK(false, "tqkv_vllm: float32, float16 or bfloat16 expected, got ", t.scalar_type());
  }
}

Rows rows_of(const at::Tensor& t) {
  Rows r;
  r.data = t.data_ptr();
  r.dtype = dtype_of(t);
  r.stride_row = t.stride(0);
  r.stride_head = t.stride(1);
  return r;
}

Preset preset_of(int64_t key_bits, int64_t value_bits, int64_t head_dim, bool nc) {
  Preset p;
  p.key_bits = static_cast<int>(key_bits);
  p.value_bits = static_cast<int>(value_bits);
  p.head_dim = static_cast<int>(head_dim);
  p.norm_correction = nc;
  return p;
}

int64_t slot_bytes_of(const Preset& p) {
  int64_t n = 0;
  dispatch_preset(p, [&](auto kb, auto vb, auto d) { n = Slot<decltype(kb)::value, decltype(vb)::value, decltype(d)::value>::kAligned; });
  return n;
}

// The cache view: uint8 [num_blocks, block_size, num_kv_heads, slot_bytes], slots contiguous,
// every stride even (a slot's fp16 fields are read as 16-bit words).
CacheView cache_view(const at::Tensor& c, const Preset& p, const at::Tensor& like) {
  TORCH_CHECK(c.scalar_type() == at::kByte && c.dim() == 4, "tqkv_vllm: kv_cache must be a 4-d uint8 tensor "
              "[num_blocks, block_size, num_kv_heads, slot_bytes], got ", c.sizes(), " ", c.scalar_type());
  TORCH_CHECK(c.device() == like.device(), "tqkv_vllm: kv_cache on ", c.device(), ", inputs on ", like.device());
  TORCH_CHECK(c.size(3) == slot_bytes_of(p), "tqkv_vllm: slot of ", c.size(3), " bytes; the preset (K", p.key_bits,
              "/V", p.value_bits, ", head dim ", p.head_dim, ") takes ", slot_bytes_of(p));
  TORCH_CHECK(c.stride(3) == 1 && c.stride(0) % 2 == 0 && c.stride(1) % 2 == 0 && c.stride(2) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(c.data_ptr()) % 2 == 0,
              "tqkv_vllm: kv_cache slots must be contiguous with even strides, got strides ", c.strides());
  const int64_t bs = c.size(1);
  TORCH_CHECK(bs % 16 == 0, "tqkv_vllm: block size ", bs, " (a multiple of 16)");
  CacheView v;
  v.base = c.data_ptr<uint8_t>();
  v.stride_block = c.stride(0);
  v.stride_pos = c.stride(1);
  v.stride_head = c.stride(2);
  v.block_size = static_cast<int>(bs);
  v.n_kv_heads = static_cast<int>(c.size(2));
  return v;
}

// vLLM's centroids (layer._tq_centroids) for MSE keys; none for FP8 keys.
const float* centroids_of(const std::optional<at::Tensor>& c, int64_t key_bits, const char* op) {
  if (key_bits == 8) return nullptr;
  TORCH_CHECK(c && c->scalar_type() == at::kFloat && c->is_contiguous() && c->numel() == (int64_t{1} << key_bits),
              "tqkv_vllm.", op, ": MSE keys need centroids, contiguous float32 [2^key_bits]");
  return c->data_ptr<float>();
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "tqkv_vllm: ", name, " must be a CUDA tensor");
}

void store_op(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
              const std::optional<at::Tensor>& y, const std::optional<at::Tensor>& norms,
              const std::optional<at::Tensor>& midpoints, int64_t key_bits, int64_t value_bits) {
  check_cuda(key, "key");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              "tqkv_vllm.store: key and value [n_tokens, n_kv_heads, head_dim] with contiguous rows, got ",
              key.sizes(), " and ", value.sizes());
  const c10::cuda::CUDAGuard guard(key.device());
  const Preset preset = preset_of(key_bits, value_bits, key.size(2), true);
  StoreParams p;
  p.cache = cache_view(kv_cache, preset, key);
  TORCH_CHECK(key.size(1) == p.cache.n_kv_heads, "tqkv_vllm.store: ", key.size(1), " heads, the cache has ",
              p.cache.n_kv_heads);
  p.n_tokens = static_cast<int>(slot_mapping.size(0));
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous() && key.size(0) >= p.n_tokens &&
                  (slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt),
              "tqkv_vllm.store: slot_mapping must be a contiguous int64/int32 vector no longer than the tokens");
  p.slot_mapping = slot_mapping.data_ptr();
  p.slot_mapping_i64 = slot_mapping.scalar_type() == at::kLong;
  p.k = rows_of(key);
  p.v = rows_of(value);
  if (key_bits != 8) {
    TORCH_CHECK(y && norms && midpoints, "tqkv_vllm.store: MSE keys need y, norms and midpoints");
    const int64_t rows = static_cast<int64_t>(p.n_tokens) * p.cache.n_kv_heads;
    TORCH_CHECK(y->scalar_type() == at::kFloat && y->is_contiguous() && y->numel() >= rows * key.size(2),
                "tqkv_vllm.store: y must be contiguous float32 [n_tokens * n_kv_heads, head_dim]");
    TORCH_CHECK(norms->scalar_type() == at::kFloat && norms->is_contiguous() && norms->numel() >= rows,
                "tqkv_vllm.store: norms must be contiguous float32 [n_tokens * n_kv_heads]");
    TORCH_CHECK(midpoints->scalar_type() == at::kFloat && midpoints->is_contiguous() &&
                    midpoints->numel() == (int64_t{1} << key_bits) - 1,
                "tqkv_vllm.store: midpoints must be contiguous float32 [2^key_bits - 1]");
    p.y = y->data_ptr<float>();
    p.norms = norms->data_ptr<float>();
    p.midpoints = midpoints->data_ptr<float>();
  }
  store(p, preset, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void decode_op(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
               const at::Tensor& seq_lens, const std::optional<at::Tensor>& centroids, at::Tensor& out,
               at::Tensor& workspace, int64_t key_bits, int64_t value_bits, bool norm_correction, double scale,
               int64_t num_splits, int64_t kernel) {
  check_cuda(query, "query");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "tqkv_vllm.decode: query [batch, n_q_heads, head_dim]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1, "tqkv_vllm.decode: out ", out.sizes(),
              " for query ", query.sizes());
  const c10::cuda::CUDAGuard guard(query.device());
  const Preset preset = preset_of(key_bits, value_bits, query.size(2), norm_correction);
  DecodeParams p;
  p.cache = cache_view(kv_cache, preset, query);
  p.batch = static_cast<int>(query.size(0));
  p.n_q_heads = static_cast<int>(query.size(1));
  p.q = rows_of(query);
  p.out = rows_of(out);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1 &&
                  block_table.size(0) >= p.batch,
              "tqkv_vllm.decode: block_table int32 [batch, max_blocks] with contiguous rows");
  p.block_table = block_table.data_ptr<int32_t>();
  p.bt_stride = block_table.stride(0);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.is_contiguous() &&
                  seq_lens.size(0) >= p.batch,
              "tqkv_vllm.decode: seq_lens contiguous int32 [batch]");
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.centroids = centroids_of(centroids, key_bits, "decode");
  p.num_splits = static_cast<int>(num_splits);
  if (p.num_splits > 1) {
    TORCH_CHECK(workspace.scalar_type() == at::kFloat && workspace.is_contiguous() &&
                    workspace.numel() >= int64_t{p.batch} * p.n_q_heads * p.num_splits * (query.size(2) + 1),
                "tqkv_vllm.decode: workspace must be contiguous float32 with at least batch * n_q_heads * ",
                "num_splits * (head_dim + 1) elements");
    p.workspace = workspace.data_ptr<float>();
  }
  p.scale = static_cast<float>(scale);
  p.norm_correction = norm_correction;
  TORCH_CHECK(kernel >= 0 && kernel <= 2, "tqkv_vllm.decode: kernel 0 (auto), 1 (CUDA cores) or 2 (tensor cores)");
  p.kernel = static_cast<DecodeKernel>(kernel);
  p.contiguous_tiles = p.cache.stride_pos == kv_cache.size(3) && p.cache.stride_block % 16 == 0 &&
                       p.cache.stride_head % 16 == 0 && reinterpret_cast<uintptr_t>(p.cache.base) % 16 == 0;
  decode(p, preset, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequant_op(const at::Tensor& kv_cache, const at::Tensor& block_table, const std::optional<at::Tensor>& centroids,
                at::Tensor& k_out, at::Tensor& v_out, int64_t n_tokens, int64_t key_bits, int64_t value_bits,
                bool norm_correction) {
  check_cuda(k_out, "k_out");
  TORCH_CHECK(k_out.dim() == 3 && v_out.sizes() == k_out.sizes() && k_out.stride(2) == 1 && v_out.stride(2) == 1 &&
                  k_out.size(0) >= n_tokens && k_out.scalar_type() == v_out.scalar_type(),
              "tqkv_vllm.dequant: k_out, v_out [>= n_tokens, n_kv_heads, head_dim] of one dtype with contiguous rows");
  const c10::cuda::CUDAGuard guard(k_out.device());
  const Preset preset = preset_of(key_bits, value_bits, k_out.size(2), norm_correction);
  DequantParams p;
  p.cache = cache_view(kv_cache, preset, k_out);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() &&
                  block_table.numel() * p.cache.block_size >= n_tokens,
              "tqkv_vllm.dequant: block_table: the sequence's pages, contiguous int32");
  p.block_table = block_table.data_ptr<int32_t>();
  p.centroids = centroids_of(centroids, key_bits, "dequant");
  p.n_tokens = static_cast<int>(n_tokens);
  p.norm_correction = norm_correction;
  p.k_out = rows_of(k_out);
  p.v_out = rows_of(v_out);
  dequant(p, preset, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace tqkv_vllm

TORCH_LIBRARY(tqkv_vllm, m) {
  m.def(
      "store(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor? y, Tensor? norms, "
      "Tensor? midpoints, int key_bits, int value_bits) -> ()");
  m.def(
      "decode(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor? centroids, "
      "Tensor(a!) out, Tensor(b!) workspace, int key_bits, int value_bits, bool norm_correction, float scale, "
      "int num_splits, int kernel=0) -> ()");
  m.def(
      "dequant(Tensor kv_cache, Tensor block_table, Tensor? centroids, Tensor(a!) k_out, Tensor(b!) v_out, "
      "int n_tokens, int key_bits, int value_bits, bool norm_correction) -> ()");
  m.def("max_splits() -> int", [] { return static_cast<int64_t>(tqkv_vllm::max_splits()); });
  // The slot bytes the kernels assume for a preset (vLLM's slot_size_aligned), for the tests.
  m.def("slot_bytes(int key_bits, int value_bits, int head_dim) -> int", [](int64_t kb, int64_t vb, int64_t d) {
    return tqkv_vllm::slot_bytes_of(tqkv_vllm::preset_of(kb, vb, d, true));
  });
}

TORCH_LIBRARY_IMPL(tqkv_vllm, CUDA, m) {
  m.impl("store", &tqkv_vllm::store_op);
  m.impl("decode", &tqkv_vllm::decode_op);
  m.impl("dequant", &tqkv_vllm::dequant_op);
}

// `import tqkv_vllm._C` loads the library, which registers the ops above.
extern "C" PyObject* PyInit__C() {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "tqkv_vllm CUDA ops (torch.ops.tqkv_vllm)", -1, nullptr};
  return PyModule_Create(&def);
}
