#include "engine/device/cuda_device.h"

#include <cublas_v2.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/core/batch.h"
#include "engine/device/cuda_graphs.h"
#include "engine/device/cuda_kv_cache.h"
#include "engine/weights/dequant.h"
#include "engine/gguf/gguf.h"
#include "tqkv/cuda_ops.h"
#include "tqkv/error.h"
#include "tqkv/options.h"
#include "tqkv/half.h"

namespace tqkv::engine {
namespace {

[[noreturn]] void fail(const std::string& what, cudaError_t e) {
  throw Error(ErrorCode::Device, "cuda: " + what + ": " + cudaGetErrorString(e));
}
void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(what, e);
}
void ck_blas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw Error(ErrorCode::Device, std::string("cuda: cuBLAS ") + what + " failed (status " +
                                                std::to_string(static_cast<int>(s)) + ")");
}

// Activations: freed buffers are kept by size class (a power of two) and handed out again.
// DeviceBuffer's release is a plain function, so the pool is one per process. Work is ordered on
// one stream, so memory freed by a step may be reused by the next without synchronising.
class BufferPool {
 public:
  static BufferPool& get() {
    static BufferPool* p = new BufferPool;  // never destroyed: the driver may be gone at exit
    return *p;
  }
  float* take(size_t n) {
    const size_t bytes = size_class(n * sizeof(float));
    std::lock_guard<std::mutex> lock(mu_);
    auto& list = free_[bytes];
    if (!list.empty()) {
      float* p = list.back();
      list.pop_back();
      return p;
    }
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      release_all_locked();
      e = cudaMalloc(&p, bytes);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        throw Error(ErrorCode::Capacity, "cuda: out of memory allocating " + std::to_string(bytes) + " bytes");
      }
    }
    size_[p] = bytes;
    return static_cast<float*>(p);
  }
  // The device bytes of p (its size class).
  size_t bytes_of(float* p) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = size_.find(p);
    return it == size_.end() ? 0 : it->second;
  }
  void give(float* p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = size_.find(p);
    if (it != size_.end()) free_[it->second].push_back(p);
  }

 private:
  static size_t size_class(size_t bytes) {
    size_t c = 256;
    while (c < bytes) c <<= 1;
    return c;
  }
  void release_all_locked() {
    cudaDeviceSynchronize();
    for (auto& [bytes, list] : free_)
      for (float* p : list) {
        cudaFree(p);
        size_.erase(p);
      }
    free_.clear();
  }
  std::mutex mu_;
  std::map<size_t, std::vector<float*>> free_;
  std::unordered_map<void*, size_t> size_;
};

}  // namespace

bool cuda_device_present() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

CudaMatrix::CudaMatrix(int rows, int cols, const float* host) : DeviceMatrix(rows, cols) {
  const size_t n = static_cast<size_t>(rows) * cols;
  std::vector<uint16_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = float_to_bf16(host[i]);
  bytes_ = n * 2;
  ck(cudaMalloc(reinterpret_cast<void**>(&w_), std::max<size_t>(n, 1) * 2), "allocating a weight matrix");
  ck(cudaMemcpy(w_, b.data(), n * 2, cudaMemcpyHostToDevice), "uploading a weight matrix");
}

CudaMatrix::CudaMatrix(int rows, int cols, uint32_t type, const void* blocks, size_t bytes)
    : DeviceMatrix(rows, cols), type_(type), bytes_(bytes) {
  if (!cuda::dequant_weights_supports(type) || bytes == 0)
    throw Error(ErrorCode::InvalidArgument, "cuda: weights of GGUF type " + std::to_string(type) + " cannot stay quantized");
  ck(cudaMalloc(&blocks_, bytes), "allocating a quantized weight matrix");
  ck(cudaMemcpy(blocks_, blocks, bytes, cudaMemcpyHostToDevice), "uploading a quantized weight matrix");
}

CudaMatrix::~CudaMatrix() {
  cudaFree(w_);
  cudaFree(blocks_);
}

// cuBLAS's workspace, fixed so that a recorded product uses the one it will replay with.
constexpr size_t kBlasWorkspace = size_t{32} << 20;

// Products of up to this many rows (a decode step's batch) run as skinny products by default:
// on the H200 the skinny Q/K/V group beat cuBLAS at every row count to 64, the rest of a layer's
// products to about 16 rows on SmolLM2 and 4-8 on Qwen2.5-1.5B (docs/journal/RESULTS-journal.md,
// "Skinny products"; the large products' own limit is below).
constexpr int kSkinnyDefault = 16;
// Single products beyond these sizes stay with cuBLAS (CudaDevice::skinny_single).
constexpr int kSkinnyLongCols = 4096;
constexpr int kSkinnyWideRows = 16384;
// A large single product or gate/up pair (at least this many weights) goes skinny only up to
// kSkinnyLargeMaxRows rows: every block of the skinny kernel reads the input rows again, which
// cost it the race from ~8 rows on Qwen2.5-1.5B's output projection (1,536 x 1,536: 0.179 vs
// cuBLAS 0.221 ms a step at 1 row, 0.185 vs 0.188 at 8, 0.223 vs 0.189 at 16) and gate/up pair
// (2 x 8,960 x 1,536: 0.603 vs 0.661, 0.703 vs 0.675, 0.815 vs 0.677). Groups with biases
// (Q/K/V) won at every row count; SmolLM2's matrices (< 1.8M weights) won to 16 rows.
constexpr size_t kSkinnyLargeWeights = size_t{1} << 21;
constexpr int kSkinnyLargeMaxRows = 4;
// Whether n rows of products holding `weights` weights in all are within that limit.
constexpr bool skinny_size_allows(int n, size_t weights) { return n <= kSkinnyLargeMaxRows || weights < kSkinnyLargeWeights; }

struct CudaDevice::Impl {
  std::shared_ptr<CUstream_st> owner;  // shared with the caches, which may outlive the device
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  void* blas_workspace = nullptr;
  uint16_t* xb = nullptr;  // bf16 copy of a product's input
  size_t xb_n = 0;
  uint16_t* xb_alt = nullptr;  // a second one: a fused product that reads xb writes its output's copy here
  size_t xb_alt_n = 0;         // (matmul_glu swaps the two)
  std::vector<uint16_t*> old_xb;  // outgrown copies: recorded graphs may still read them
  // Quantized weights (TQKV_CUDA_WEIGHTS=quantized): bf16 scratch slots a product's matrices are
  // expanded into, each of the largest quantized matrix's elements, sized as the model loads (a
  // recorded graph reads them where it read them).
  bool quantized_weights = false;
  uint16_t* wscratch[cuda::kMaxSkinnyProducts] = {};
  size_t wscratch_n = 0;
  void* ints = nullptr;  // uploaded host metadata (token ids, positions, rows)
  size_t ints_bytes = 0;
  int32_t* picks = nullptr;  // argmax ids of a step's rows (logits_out, run_step)
  int picks_n = 0;
  bool graphs = true;
  bool fused = true;
  // Products of at most this many rows run as skinny products (cuda::skinny_gemm) rather than
  // cuBLAS GEMMs: TQKV_CUDA_SKINNY_MAX (0 = always cuBLAS), else kSkinnyDefault.
  int skinny_max = 0;
  // The product input a fused operation wrote (its float output and size): the next product
  // over exactly that finds xb ready. Any other operation clears it.
  const float* staged = nullptr;
  size_t staged_n = 0;
  void unstage() { staged = nullptr; }
  // RoPE's inverse frequencies on the device, one array per distinct table (base, n_rot and
  // scaling decide it), made at first use.
  std::map<std::vector<float>, float*> inv_freq;
  // Attention timing (Device::set_attention_timing): event pairs recorded around each attend of
  // steps run op by op, reused from one measurement to the next; `timed` pairs are in use.
  bool timing = false;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> attention_events;
  size_t timed = 0;
  bool capturing() const {
    cudaStreamCaptureStatus s = cudaStreamCaptureStatusNone;
    return cudaStreamIsCapturing(stream, &s) == cudaSuccess && s != cudaStreamCaptureStatusNone;
  }

  // A decode step being warmed up or recorded by run_step (in_step).
  struct Step {
    const int32_t* tokens_host = nullptr;  // the padded batch's arrays ...
    const int64_t* positions_host = nullptr;
    const int32_t* tokens = nullptr;  // ... and the bucket's device copies of them
    const int64_t* positions = nullptr;
    bool recording = false;
    StepActivations* acts = nullptr;  // the bucket's activations, handed out again in order ...
    size_t next_act = 0;              // ... from this one on
    std::vector<std::pair<float*, size_t>> allocs;  // new activations handed out (kept until the step ends)
    const float* logits = nullptr;                  // what logits_out was asked to copy
    size_t logit_floats = 0;
  };
  bool in_step = false;
  Step step;

  // rows' argmax ids of logits [rows, cols] (device) to the host.
  void argmax_to_host(const float* logits, int rows, int cols, int32_t* host) {
    if (rows > picks_n) {
      if (picks) cudaStreamSynchronize(stream);  // the old buffer may still be written
      cudaFree(picks);
      picks = nullptr;
      picks_n = 0;
      ck(cudaMalloc(reinterpret_cast<void**>(&picks), static_cast<size_t>(rows) * 2 * sizeof(int32_t)), "allocating argmax ids");
      picks_n = rows * 2;
    }
    cuda::argmax_rows(logits, rows, cols, picks, stream);
    ck(cudaMemcpyAsync(host, picks, static_cast<size_t>(rows) * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
       "copying argmax ids");
  }

  void release_step_allocs() {
    for (auto& [p, n] : step.allocs) BufferPool::get().give(p);
    step.allocs.clear();
  }

  // Device memory holding `bytes` of host metadata: a step's bound inputs as they are, anything
  // else uploaded (not while recording: a graph would read the upload's source again).
  const void* input(const void* host, size_t bytes) {
    if (in_step && host == step.tokens_host) return step.tokens;
    if (in_step && host == step.positions_host) return step.positions;
    if (in_step && step.recording)
      throw Error(ErrorCode::InvalidArgument, "cuda graphs: a recorded step uploads host data that is not its input");
    return upload(host, bytes);
  }

  void* upload(const void* host, size_t bytes) {
    if (bytes > ints_bytes) {
      if (ints) cudaStreamSynchronize(stream);  // the old buffer may still be read
      cudaFree(ints);
      ints = nullptr;
      ints_bytes = 0;
      ck(cudaMalloc(&ints, bytes * 2), "allocating metadata");
      ints_bytes = bytes * 2;
    }
    ck(cudaMemcpyAsync(ints, host, bytes, cudaMemcpyHostToDevice, stream), "uploading metadata");
    return ints;
  }
};

CudaDevice::CudaDevice(int ordinal) : impl_(std::make_unique<Impl>()) {
  if (!cuda_device_present())
    throw Error(ErrorCode::Device, "device 'cuda': no CUDA device is present (use --device cpu)");
  ck(cudaSetDevice(ordinal), "selecting the device");
  ck(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking), "creating a stream");
  impl_->owner = std::shared_ptr<CUstream_st>(impl_->stream, [](cudaStream_t s) { cudaStreamDestroy(s); });
  ck_blas(cublasCreate(&impl_->blas), "create");
  ck_blas(cublasSetStream(impl_->blas, impl_->stream), "set stream");
  ck(cudaMalloc(&impl_->blas_workspace, kBlasWorkspace), "allocating cuBLAS's workspace");
  ck_blas(cublasSetWorkspace(impl_->blas, impl_->blas_workspace, kBlasWorkspace), "set workspace");
  impl_->graphs = env_bool("TQKV_CUDA_GRAPHS");  // 0: every step op by op
  impl_->fused = env_bool("TQKV_FUSE_OPS");      // 0: the fused operations as their plain ones
  impl_->skinny_max = static_cast<int>(env_count("TQKV_CUDA_SKINNY_MAX", kSkinnyDefault));
  impl_->quantized_weights = env_choice("TQKV_CUDA_WEIGHTS") == "quantized";
}

CudaDevice::~CudaDevice() {
  if (impl_->stream) cudaStreamSynchronize(impl_->stream);
  cudaFree(impl_->xb);
  cudaFree(impl_->xb_alt);
  for (uint16_t* p : impl_->wscratch) cudaFree(p);
  for (uint16_t* p : impl_->old_xb) cudaFree(p);
  cudaFree(impl_->ints);
  cudaFree(impl_->picks);
  for (auto& [key, p] : impl_->inv_freq) cudaFree(p);
  for (auto& [a, b] : impl_->attention_events) {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  if (impl_->blas) cublasDestroy(impl_->blas);
  cudaFree(impl_->blas_workspace);
}

cudaStream_t CudaDevice::stream() const { return impl_->stream; }

DeviceBuffer CudaDevice::alloc(size_t n) {
  if (n == 0) return DeviceBuffer();
  if (impl_->in_step) {  // kept past the step's end: its graph reads and writes them
    Impl::Step& st = impl_->step;
    if (st.acts && st.next_act < st.acts->held.size() && st.acts->held[st.next_act].size() >= n)
      return DeviceBuffer(st.acts->held[st.next_act++].data(), n, [](float*) {});
    float* p = BufferPool::get().take(n);
    st.allocs.emplace_back(p, n);
    return DeviceBuffer(p, n, [](float*) {});
  }
  return DeviceBuffer(BufferPool::get().take(n), n, [](float* q) { BufferPool::get().give(q); });
}

void CudaDevice::to_device(const float* host, size_t n, float* dst) {
  impl_->unstage();
  if (n) ck(cudaMemcpyAsync(dst, host, n * sizeof(float), cudaMemcpyHostToDevice, impl_->stream), "to_device");
}

void CudaDevice::to_host(const float* src, size_t n, float* host) {
  if (impl_->in_step && impl_->step.recording)
    throw Error(ErrorCode::InvalidArgument, "cuda graphs: a recorded step copies to the host");
  if (n) ck(cudaMemcpyAsync(host, src, n * sizeof(float), cudaMemcpyDeviceToHost, impl_->stream), "to_host");
  ck(cudaStreamSynchronize(impl_->stream), "to_host");
}

void CudaDevice::logits_out(const float* src, int rows, int cols, const LogitsOut& out) {
  if (impl_->in_step) {  // the step's logits: run_step copies (or picks from) the rows that are not padding
    impl_->step.logits = src;
    impl_->step.logit_floats = static_cast<size_t>(rows) * static_cast<size_t>(cols);
    return;
  }
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  if (out.logits && n)
    ck(cudaMemcpyAsync(out.logits, src, n * sizeof(float), cudaMemcpyDeviceToHost, impl_->stream), "copying logits");
  if (out.argmax) impl_->argmax_to_host(src, rows, cols, out.argmax);
  ck(cudaStreamSynchronize(impl_->stream), "copying logits");
}

// With TQKV_CUDA_WEIGHTS=quantized the layers' matrices stay in their GGUF blocks (those of a
// type the GPU decodes); the token embedding and the output head stay bf16 (the embedding's rows
// are gathered as bf16, and a tied head is the same matrix).
std::unique_ptr<DeviceMatrix> CudaDevice::load_matrix(const GgufTensor& t, int rows, int cols) {
  const TensorTypeTraits* tr = tensor_type_traits(t.type);
  if (impl_->quantized_weights && t.name.rfind("blk.", 0) == 0 && cuda::dequant_weights_supports(t.type) && tr &&
      cols % tr->block_elems == 0) {
    check_tensor_shape(t, cols, rows);  // (WeightLoader::matrix checked its values)
    const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(cols);
    if (n > impl_->wscratch_n) {  // at load, before any step: no graph reads the old slots yet
      ck(cudaDeviceSynchronize(), "growing the weights' scratch");
      for (uint16_t*& p : impl_->wscratch) {
        cudaFree(p);
        p = nullptr;
        ck(cudaMalloc(reinterpret_cast<void**>(&p), n * 2), "allocating the weights' scratch");
      }
      impl_->wscratch_n = n;
    }
    const size_t bytes = n / tr->block_elems * tr->block_bytes;
    return std::make_unique<CudaMatrix>(rows, cols, t.type, t.data, bytes);
  }
  const std::vector<float> f = expand_tensor(t, cols, rows);
  return std::make_unique<CudaMatrix>(rows, cols, f.data());
}

bool CudaDevice::quantized_product(const DeviceMatrix& dm, int n, const float* x, bool staged, float* y,
                                   const float* bias) {
  const auto& m = static_cast<const CudaMatrix&>(dm);
  if (!m.quantized() || !cuda::qgemv_supports(m.type(), n, m.cols())) return false;
  cuda::qgemv(m.type(), m.blocks(), m.rows(), m.cols(), staged ? nullptr : x, staged ? impl_->xb : nullptr, n, y, bias,
              impl_->stream);
  return true;
}

const uint16_t* CudaDevice::weights(const DeviceMatrix& dm, int slot) {
  const auto& m = static_cast<const CudaMatrix&>(dm);
  if (!m.quantized()) return m.bf16();
  const size_t n = static_cast<size_t>(m.rows()) * static_cast<size_t>(m.cols());
  if (slot < 0 || slot >= cuda::kMaxSkinnyProducts || n > impl_->wscratch_n)
    throw Error(ErrorCode::InvalidArgument, "cuda: no scratch slot for a quantized matrix");
  cuda::dequant_weights_bf16(m.type(), m.blocks(), n, impl_->wscratch[slot], impl_->stream);
  return impl_->wscratch[slot];
}

void CudaDevice::embed(const DeviceMatrix& table, const int32_t* tokens, int n, float scale, float* x) {
  impl_->unstage();
  const auto* d_tokens = static_cast<const int32_t*>(impl_->input(tokens, static_cast<size_t>(n) * sizeof(int32_t)));
  cuda::embed_rows(weights(table, 0), table.cols(), d_tokens, n, scale, x, impl_->stream);
}

// The products' bf16 input buffer, grown to at least nx elements.
uint16_t* CudaDevice::product_input(size_t nx) {
  if (nx > impl_->xb_n) {  // the old copy is kept: a recorded graph may read it
    if (impl_->xb) impl_->old_xb.push_back(impl_->xb);
    impl_->xb = nullptr;
    const size_t want = std::max(nx, 2 * impl_->xb_n);
    impl_->xb_n = 0;
    ck(cudaMalloc(reinterpret_cast<void**>(&impl_->xb), want * 2), "allocating the product's input");
    impl_->xb_n = want;
  }
  return impl_->xb;
}

// The products' bf16 input: x[n, in] converted once into the device's input buffer, unless a
// fused operation has just written it there.
void CudaDevice::stage_input(const float* x, size_t nx) {
  const bool ready = impl_->staged == x && impl_->staged_n == nx;
  impl_->unstage();
  if (ready) return;
  cuda::f32_to_bf16(x, product_input(nx), nx, impl_->stream);
}

// y[n, out] = staged x[n, in] * W[out, in]^T: in cuBLAS's column-major terms y^T = W^T(op T) * x^T.
void CudaDevice::gemm_staged(int n, const DeviceMatrix& wm, float* y, const float* bias) {
  if (quantized_product(wm, n, nullptr, true, y, bias)) return;
  const int in = wm.cols(), out = wm.rows();
  const uint16_t* w = weights(wm, 0);
  if (skinny_single(n, out, in)) {
    const cuda::SkinnyProduct p{w, out, y, bias};
    return cuda::skinny_gemm(impl_->xb, nullptr, n, in, &p, 1, impl_->stream);
  }
  const float one = 1.0f, zero = 0.0f;
  ck_blas(cublasGemmEx(impl_->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, w, CUDA_R_16BF, in, impl_->xb,
                       CUDA_R_16BF, in, &zero, y, CUDA_R_32F, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "GemmEx");
  if (bias) cuda::add_bias(y, bias, n, out, impl_->stream);
}

bool CudaDevice::skinny(int n, int cols) const {
  return n <= impl_->skinny_max && cuda::skinny_gemm_supports(n, cols);
}

// A product alone (not a group, not gate/up with the GLU) goes skinny only where the skinny
// kernel measured faster than cuBLAS: not for long columns (the down projection of a wide
// feed-forward, 8,960 columns on Qwen2.5-1.5B, where cuBLAS's split-K read 2.4 TB/s against the
// clusters' 1.8) nor for very many rows (the output head, where cuBLAS was 5-10% faster); the
// H200 figures are in docs/journal/RESULTS-journal.md ("Skinny products").
bool CudaDevice::skinny_single(int n, int rows, int cols) const {
  return skinny(n, cols) && cols <= kSkinnyLongCols && rows <= kSkinnyWideRows &&
         skinny_size_allows(n, static_cast<size_t>(rows) * static_cast<size_t>(cols));
}

void CudaDevice::matmul(const float* x, int n, const DeviceMatrix& w, float* y, const float* bias) {
  if (n <= 0) return;
  const size_t nx = static_cast<size_t>(n) * w.cols();
  if (static_cast<const CudaMatrix&>(w).quantized()) {  // decode's rows on the blocks, else expanded + GEMM
    const bool staged = impl_->staged == x && impl_->staged_n == nx;
    if (!staged && quantized_product(w, n, x, false, y, bias)) return impl_->unstage();
    stage_input(x, nx);
    return gemm_staged(n, w, y, bias);
  }
  if (skinny_single(n, w.rows(), w.cols()) && !(impl_->staged == x && impl_->staged_n == nx)) {  // reads x as it is
    impl_->unstage();
    const cuda::SkinnyProduct p{weights(w, 0), w.rows(), y, bias};
    return cuda::skinny_gemm(nullptr, x, n, w.cols(), &p, 1, impl_->stream);
  }
  stage_input(x, nx);
  gemm_staged(n, w, y, bias);
}

// One conversion for the whole group (Q, K, V; gate, up): the same bf16 input, the same
// GEMMs, so each output equals its own matmul bit for bit.
void CudaDevice::matmul_group(const float* x, int n, const GroupProduct* products, int count) {
  if (n <= 0 || count <= 0) return;
  const int in = products[0].w->cols();
  for (int i = 1; i < count; ++i)
    if (products[i].w->cols() != in)
      throw Error(ErrorCode::InvalidArgument, "matmul_group: products over inputs of different widths");
  bool any_quantized = false;
  for (int i = 0; i < count; ++i) any_quantized = any_quantized || static_cast<const CudaMatrix*>(products[i].w)->quantized();
  if (any_quantized) {  // each product on its own (cuda::qgemv at decode's rows), the one staged input
    stage_input(x, static_cast<size_t>(n) * in);
    for (int i = 0; i < count; ++i) gemm_staged(n, *products[i].w, products[i].y, products[i].bias);
    return;
  }
  if (impl_->fused && count <= cuda::kMaxSkinnyProducts && skinny(n, in)) {  // one launch, biases included
    const size_t nx = static_cast<size_t>(n) * in;
    const bool staged = impl_->staged == x && impl_->staged_n == nx;
    impl_->unstage();
    cuda::SkinnyProduct ps[cuda::kMaxSkinnyProducts];
    for (int i = 0; i < count; ++i)
      ps[i] = {weights(*products[i].w, i), products[i].w->rows(), products[i].y, products[i].bias};
    return cuda::skinny_gemm(staged ? impl_->xb : nullptr, staged ? nullptr : x, n, in, ps, count, impl_->stream);
  }
  stage_input(x, static_cast<size_t>(n) * in);
  if (!impl_->fused || count > cuda::kMaxBiases) {
    for (int i = 0; i < count; ++i) gemm_staged(n, *products[i].w, products[i].y, products[i].bias);
    return;
  }
  // Fused: the group's biases (Qwen2's Q, K, V) added by one launch after its GEMMs.
  float* ys[cuda::kMaxBiases];
  const float* bs[cuda::kMaxBiases];
  int cols[cuda::kMaxBiases];
  int biased = 0;
  for (int i = 0; i < count; ++i) {
    gemm_staged(n, *products[i].w, products[i].y, nullptr);
    if (!products[i].bias) continue;
    ys[biased] = products[i].y;
    bs[biased] = products[i].bias;
    cols[biased++] = products[i].w->rows();
  }
  cuda::add_biases(ys, bs, cols, biased, n, impl_->stream);
}

// Gate, up and the GLU in one skinny launch where the rows allow (bit for bit the group and the
// glu it stands for: the same sums, the same expression), else the default's two operations.
void CudaDevice::matmul_glu(Glu kind, const float* x, int n, const DeviceMatrix& w_gate, const DeviceMatrix& w_up,
                            float* gate, float* up, bool product_input) {
  const int in = w_gate.cols();
  const bool quantized = static_cast<const CudaMatrix&>(w_gate).quantized() || static_cast<const CudaMatrix&>(w_up).quantized();
  if (quantized || !impl_->fused || n <= 0 || w_up.cols() != in || w_up.rows() != w_gate.rows() || !skinny(n, in))
    return Device::matmul_glu(kind, x, n, w_gate, w_up, gate, up, product_input);
  const size_t nx = static_cast<size_t>(n) * in, ny = static_cast<size_t>(n) * w_gate.rows();
  if (!skinny_size_allows(n, 2 * static_cast<size_t>(w_gate.rows()) * static_cast<size_t>(in))) {
    // a large pair at more rows: cuBLAS's two products, then the GLU
    stage_input(x, nx);
    gemm_staged(n, w_gate, gate, nullptr);
    gemm_staged(n, w_up, up, nullptr);
    return glu(kind, gate, up, ny, product_input);
  }
  const bool staged = impl_->staged == x && impl_->staged_n == nx;
  impl_->unstage();
  // The output's bf16 copy goes to the input buffer the next product reads: it may not be the
  // buffer this product reads from, so a staged input is read from a second buffer.
  const uint16_t* xb = nullptr;
  if (staged) {
    std::swap(impl_->xb, impl_->xb_alt);
    std::swap(impl_->xb_n, impl_->xb_alt_n);
    xb = impl_->xb_alt;
  }
  uint16_t* yb = product_input ? this->product_input(ny) : nullptr;
  cuda::skinny_gemm_glu(kind == Glu::Gelu, xb, xb ? nullptr : x, n, in, weights(w_gate, 0), weights(w_up, 1),
                        w_gate.rows(), gate, yb, impl_->stream);
  if (yb) {
    impl_->staged = gate;
    impl_->staged_n = ny;
  }
}

void CudaDevice::rmsnorm(const float* x, const float* w, int n, int d, float eps, float* y) {
  impl_->unstage();
  cuda::rmsnorm(x, w, n, d, eps, y, impl_->stream);
}

void CudaDevice::rope(float* x, int n, int heads, int head_dim, const int64_t* positions, const RopeParams& p) {
  impl_->unstage();
  if (n <= 0 || p.n_rot == 0) return;
  const std::vector<float> inv_freq = p.inv_freq();
  const auto* d_pos = static_cast<const int64_t*>(impl_->input(positions, static_cast<size_t>(n) * sizeof(int64_t)));
  cuda::rope(x, n, heads, head_dim, d_pos, p.n_rot, inv_freq.data(), p.mscale(), p.layout == RopeLayout::Halves,
             impl_->stream);
}

void CudaDevice::swiglu(float* gate, const float* up, size_t n) {
  impl_->unstage();
  cuda::swiglu(gate, up, n, impl_->stream);
}
void CudaDevice::gelu_glu(float* gate, const float* up, size_t n) {
  impl_->unstage();
  cuda::gelu_glu(gate, up, n, impl_->stream);
}

void CudaDevice::add(float* x, const float* y, size_t n) {
  impl_->unstage();
  cuda::add(x, y, n, impl_->stream);
}

void CudaDevice::set_skinny_max(int rows) { impl_->skinny_max = std::clamp(rows, 0, cuda::kSkinnyMaxRows); }
int CudaDevice::skinny_max() const { return impl_->skinny_max; }

void CudaDevice::set_fused_ops(bool on) { impl_->fused = on; }
bool CudaDevice::fused_ops() const { return impl_->fused; }

void CudaDevice::add_rmsnorm(float* x, const float* delta, const float* w, int n, int d, float eps, float* y,
                             bool product_input) {
  if (!impl_->fused) return Device::add_rmsnorm(x, delta, w, n, d, eps, y, product_input);
  impl_->unstage();
  if (n <= 0) return;
  const size_t ny = static_cast<size_t>(n) * d;
  uint16_t* yb = product_input ? this->product_input(ny) : nullptr;
  cuda::add_rmsnorm(x, delta, w, n, d, eps, y, yb, impl_->stream);
  if (yb) {
    impl_->staged = y;
    impl_->staged_n = ny;
  }
}

void CudaDevice::glu(Glu kind, float* gate, const float* up, size_t n, bool product_input) {
  if (!impl_->fused) return Device::glu(kind, gate, up, n, product_input);
  impl_->unstage();
  if (n == 0) return;
  uint16_t* gb = product_input ? this->product_input(n) : nullptr;
  cuda::glu(kind == Glu::Gelu, gate, up, n, gb, impl_->stream);
  if (gb) {
    impl_->staged = gate;
    impl_->staged_n = n;
  }
}

// The inverse frequencies are the CPU's (RopeParams::inv_freq: scaling applied, rounded to float),
// computed on the host once per distinct table and kept on the device.
void CudaDevice::rope_qk(float* q, int q_heads, float* k, int k_heads, int n, int head_dim,
                         const int64_t* positions, const RopeParams& p) {
  if (!impl_->fused) return Device::rope_qk(q, q_heads, k, k_heads, n, head_dim, positions, p);
  impl_->unstage();
  if (n <= 0 || p.n_rot == 0) return;
  const std::vector<float> inv_freq = p.inv_freq();
  float*& table = impl_->inv_freq[inv_freq];
  if (!table) {
    if (impl_->capturing())
      throw Error(ErrorCode::InvalidArgument, "cuda graphs: RoPE's frequencies were first needed while recording");
    float* dst = nullptr;
    ck(cudaMalloc(reinterpret_cast<void**>(&dst), inv_freq.size() * sizeof(float)), "allocating RoPE's frequencies");
    const cudaError_t e = cudaMemcpy(dst, inv_freq.data(), inv_freq.size() * sizeof(float), cudaMemcpyHostToDevice);
    if (e != cudaSuccess) cudaFree(dst);
    ck(e, "uploading RoPE's frequencies");
    table = dst;
  }
  const auto* d_pos = static_cast<const int64_t*>(impl_->input(positions, static_cast<size_t>(n) * sizeof(int64_t)));
  cuda::rope_qk(q, q_heads, k, k_heads, n, head_dim, d_pos, p.n_rot, table, p.mscale(),
                p.layout == RopeLayout::Halves, impl_->stream);
}

void CudaDevice::gather_rows(const float* x, int d, const int32_t* rows, int n, float* y) {
  impl_->unstage();
  if (n <= 0) return;
  const auto* d_rows = static_cast<const int32_t*>(impl_->input(rows, static_cast<size_t>(n) * sizeof(int32_t)));
  cuda::gather_rows(x, d, d_rows, n, y, impl_->stream);
}

std::unique_ptr<KvCache> CudaDevice::make_cache(const CacheSpec& spec, const CacheShape& shape) {
  return std::make_unique<CudaKvCache>(spec, shape, impl_->owner);
}

void CudaDevice::set_step_graphs(bool on) { impl_->graphs = on; }
bool CudaDevice::step_graphs() const { return impl_->graphs; }

void CudaDevice::set_attention_timing(bool on) {
  impl_->timing = on;
  impl_->timed = 0;
}

void CudaDevice::profile_range(bool on) {
  ck(on ? cudaProfilerStart() : cudaProfilerStop(), "marking the profiled range");
}

void CudaDevice::attention_begin() {
  Impl& I = *impl_;
  if (!I.timing || I.capturing()) return;
  if (I.timed == I.attention_events.size()) {
    cudaEvent_t a = nullptr, b = nullptr;
    ck(cudaEventCreate(&a), "creating a timing event");
    if (cudaEventCreate(&b) != cudaSuccess) {
      cudaEventDestroy(a);
      ck(cudaErrorMemoryAllocation, "creating a timing event");
    }
    I.attention_events.emplace_back(a, b);
  }
  ck(cudaEventRecord(I.attention_events[I.timed].first, I.stream), "recording a timing event");
}

void CudaDevice::attention_end() {
  Impl& I = *impl_;
  if (!I.timing || I.capturing() || I.timed == I.attention_events.size()) return;
  ck(cudaEventRecord(I.attention_events[I.timed].second, I.stream), "recording a timing event");
  ++I.timed;
}

double CudaDevice::attention_seconds() {
  Impl& I = *impl_;
  ck(cudaStreamSynchronize(I.stream), "waiting for the stream");
  double s = 0;
  for (size_t i = 0; i < I.timed; ++i) {
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, I.attention_events[i].first, I.attention_events[i].second), "reading a timing event");
    s += ms / 1e3;
  }
  return s;
}

// A decode step through its bucket's graph (cuda_graphs.h): warmed up op by op at the bucket's
// first step, recorded at its second, replayed from then on. The warm-up and the recording of
// every length class run over the bucket's activations (StepActivations), so a new class adds
// none unless the step asks for more than the set holds.
void CudaDevice::run_step(const Batch& batch, KvCache& cache, const void* model, const LogitsOut& logits, const StepFn& step) {
  StepRecorder* cc = impl_->graphs ? cache.step_recorder() : nullptr;
  const int n = batch.size();
  bool decode = cc && batch.n_logits() == n;
  // (A fresh sequence's first token attends to itself through the tiled kernel, not as a row.)
  if (decode)
    for (const Batch::Run& r : batch.runs()) decode = decode && r.count == 1 && r.pos0 > 0;
  const int bucket = decode ? graph_bucket(n) : 0;
  if (bucket == 0) return step(batch, logits);

  Impl& I = *impl_;
  int64_t longest = 0;
  for (const Batch::Run& r : batch.runs()) longest = std::max<int64_t>(longest, r.pos0 + r.count);
  StepGraph& g = cc->step_graph(model, bucket, longest);
  Batch padded = batch;  // padding rows: token 0 at position 0 of sequences that are not there
  const int32_t pad_token = 0;
  for (int i = n; i < bucket; ++i) padded.add(-1 - i, &pad_token, 1, 0, true);
  std::vector<uint8_t> in(static_cast<size_t>(bucket) * (sizeof(int64_t) + sizeof(int32_t)));
  std::memcpy(in.data(), padded.positions.data(), static_cast<size_t>(bucket) * sizeof(int64_t));
  std::memcpy(in.data() + static_cast<size_t>(bucket) * sizeof(int64_t), padded.tokens.data(),
              static_cast<size_t>(bucket) * sizeof(int32_t));
  ck(cudaMemcpyAsync(g.positions, in.data(), in.size(), cudaMemcpyHostToDevice, I.stream), "uploading a step's inputs");
  cc->prepare_bucket(batch, bucket);

  const bool warm = !g.exec && g.warm_runs == 0, record = !g.exec && !warm;
  if (!g.exec) {
    I.step = Impl::Step{};
    I.step.tokens_host = padded.tokens.data();
    I.step.positions_host = padded.positions.data();
    I.step.tokens = g.tokens;
    I.step.positions = g.positions;
    I.step.recording = record;
    I.step.acts = g.acts.get();  // warm-up and recording both run over the bucket's activations
    I.in_step = true;
    try {
      if (record) ck(cudaStreamBeginCapture(I.stream, cudaStreamCaptureModeRelaxed), "beginning a step's capture");
      try {
        step(padded, logits);
      } catch (...) {
        cudaGraph_t broken = nullptr;
        if (record && cudaStreamEndCapture(I.stream, &broken) == cudaSuccess && broken) cudaGraphDestroy(broken);
        (void)cudaGetLastError();
        throw;
      }
      if (record) {
        cudaGraph_t graph = nullptr;
        ck(cudaStreamEndCapture(I.stream, &graph), "ending a step's capture");
        const cudaError_t e = cudaGraphInstantiate(&g.exec, graph, 0);
        cudaGraphDestroy(graph);
        ck(e, "instantiating a step's graph");
      }
      if (!I.step.logits || I.step.logit_floats % bucket)
        throw Error(ErrorCode::InvalidArgument, "cuda graphs: the step copied no logits of its rows");
    } catch (...) {
      I.in_step = false;
      I.release_step_allocs();
      if (g.exec) cudaGraphExecDestroy(g.exec);
      g.exec = nullptr;
      cc->cancel_bucket();
      throw;
    }
    I.in_step = false;
    if (record) {
      for (auto& [p, count] : I.step.allocs) {  // what the bucket's set lacked joins it
        g.acts->bytes += BufferPool::get().bytes_of(p);
        g.acts->held.emplace_back(p, count, [](float* q) { BufferPool::get().give(q); });
      }
      I.step.allocs.clear();
      g.logits = I.step.logits;
      g.logit_floats = I.step.logit_floats;
    } else {
      ++g.warm_runs;
    }
  }
  cc->cancel_bucket();  // a replay runs no attend() to take the prepared bucket
  if (g.exec) ck(cudaGraphLaunch(g.exec, I.stream), "launching a step's graph");
  const float* src = g.exec ? g.logits : I.step.logits;
  const size_t row_floats = (g.exec ? g.logit_floats : I.step.logit_floats) / bucket;
  cudaError_t e = cudaSuccess;
  if (logits.logits)
    e = cudaMemcpyAsync(logits.logits, src, row_floats * n * sizeof(float), cudaMemcpyDeviceToHost, I.stream);
  if (logits.argmax && e == cudaSuccess) {
    try {
      I.argmax_to_host(src, n, static_cast<int>(row_floats), logits.argmax);
    } catch (...) {
      cudaStreamSynchronize(I.stream);
      if (warm) I.release_step_allocs();
      throw;
    }
  }
  const cudaError_t s = cudaStreamSynchronize(I.stream);
  if (warm) I.release_step_allocs();
  ck(e, "copying a step's logits");
  ck(s, "running a step");
}

std::shared_ptr<Device> make_cuda_device() { return std::make_shared<CudaDevice>(); }

}  // namespace tqkv::engine
