#include "cuda_device.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda_kv_cache.h"
#include "dequant.h"
#include "gguf.h"
#include "tqkv/cuda_ops.h"
#include "tqkv/error.h"
#include "tqkv/half.h"

namespace tqkv::engine {
namespace {

[[noreturn]] void fail(const std::string& what, cudaError_t e) {
  throw Error(ErrorCode::InvalidArgument, "cuda: " + what + ": " + cudaGetErrorString(e));
}
void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(what, e);
}
void ck_blas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw Error(ErrorCode::InvalidArgument, std::string("cuda: cuBLAS ") + what + " failed (status " +
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
  ck(cudaMalloc(reinterpret_cast<void**>(&w_), std::max<size_t>(n, 1) * 2), "allocating a weight matrix");
  ck(cudaMemcpy(w_, b.data(), n * 2, cudaMemcpyHostToDevice), "uploading a weight matrix");
}

CudaMatrix::~CudaMatrix() { cudaFree(w_); }

struct CudaDevice::Impl {
  std::shared_ptr<CUstream_st> owner;  // shared with the caches, which may outlive the device
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  uint16_t* xb = nullptr;  // bf16 copy of a product's input
  size_t xb_n = 0;
  void* ints = nullptr;  // uploaded host metadata (token ids, positions, rows)
  size_t ints_bytes = 0;

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
    throw Error(ErrorCode::InvalidArgument, "device 'cuda': no CUDA device is present (use --device cpu)");
  ck(cudaSetDevice(ordinal), "selecting the device");
  ck(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking), "creating a stream");
  impl_->owner = std::shared_ptr<CUstream_st>(impl_->stream, [](cudaStream_t s) { cudaStreamDestroy(s); });
  ck_blas(cublasCreate(&impl_->blas), "create");
  ck_blas(cublasSetStream(impl_->blas, impl_->stream), "set stream");
}

CudaDevice::~CudaDevice() {
  if (impl_->stream) cudaStreamSynchronize(impl_->stream);
  cudaFree(impl_->xb);
  cudaFree(impl_->ints);
  if (impl_->blas) cublasDestroy(impl_->blas);
}

cudaStream_t CudaDevice::stream() const { return impl_->stream; }

DeviceBuffer CudaDevice::alloc(size_t n) {
  if (n == 0) return DeviceBuffer();
  return DeviceBuffer(BufferPool::get().take(n), n, [](float* p) { BufferPool::get().give(p); });
}

void CudaDevice::to_device(const float* host, size_t n, float* dst) {
  if (n) ck(cudaMemcpyAsync(dst, host, n * sizeof(float), cudaMemcpyHostToDevice, impl_->stream), "to_device");
}

void CudaDevice::to_host(const float* src, size_t n, float* host) {
  if (n) ck(cudaMemcpyAsync(host, src, n * sizeof(float), cudaMemcpyDeviceToHost, impl_->stream), "to_host");
  ck(cudaStreamSynchronize(impl_->stream), "to_host");
}

std::unique_ptr<DeviceMatrix> CudaDevice::load_matrix(const GgufTensor& t, int rows, int cols) {
  const std::vector<float> f = expand_tensor(t, cols, rows);
  return std::make_unique<CudaMatrix>(rows, cols, f.data());
}

void CudaDevice::embed(const DeviceMatrix& table, const int32_t* tokens, int n, float scale, float* x) {
  const auto& m = static_cast<const CudaMatrix&>(table);
  const auto* d_tokens = static_cast<const int32_t*>(impl_->upload(tokens, static_cast<size_t>(n) * sizeof(int32_t)));
  cuda::embed_rows(m.bf16(), m.cols(), d_tokens, n, scale, x, impl_->stream);
}

// y[n, out] = x[n, in] * W[out, in]^T: in cuBLAS's column-major terms y^T = W^T(op T) * x^T.
void CudaDevice::matmul(const float* x, int n, const DeviceMatrix& wm, float* y, const float* bias) {
  if (n <= 0) return;
  const auto& w = static_cast<const CudaMatrix&>(wm);
  const int in = w.cols(), out = w.rows();
  const size_t nx = static_cast<size_t>(n) * in;
  if (nx > impl_->xb_n) {
    if (impl_->xb) cudaStreamSynchronize(impl_->stream);  // the old buffer may still be read
    cudaFree(impl_->xb);
    impl_->xb = nullptr;
    impl_->xb_n = 0;
    ck(cudaMalloc(reinterpret_cast<void**>(&impl_->xb), nx * 2), "allocating the product's input");
    impl_->xb_n = nx;
  }
  cuda::f32_to_bf16(x, impl_->xb, nx, impl_->stream);
  const float one = 1.0f, zero = 0.0f;
  ck_blas(cublasGemmEx(impl_->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, w.bf16(), CUDA_R_16BF, in, impl_->xb,
                       CUDA_R_16BF, in, &zero, y, CUDA_R_32F, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "GemmEx");
  if (bias) cuda::add_bias(y, bias, n, out, impl_->stream);
}

void CudaDevice::rmsnorm(const float* x, const float* w, int n, int d, float eps, float* y) {
  cuda::rmsnorm(x, w, n, d, eps, y, impl_->stream);
}

void CudaDevice::rope(float* x, int n, int heads, int head_dim, const int64_t* positions, const RopeParams& p) {
  if (n <= 0 || p.n_rot == 0) return;
  std::vector<float> inv_freq(p.n_rot / 2);
  for (int i = 0; i < p.n_rot / 2; ++i)
    inv_freq[i] = static_cast<float>(std::pow(static_cast<double>(p.base), -2.0 * i / p.n_rot));
  const auto* d_pos = static_cast<const int64_t*>(impl_->upload(positions, static_cast<size_t>(n) * sizeof(int64_t)));
  cuda::rope(x, n, heads, head_dim, d_pos, p.n_rot, inv_freq.data(), p.layout == RopeLayout::Halves, impl_->stream);
}

void CudaDevice::swiglu(float* gate, const float* up, size_t n) { cuda::swiglu(gate, up, n, impl_->stream); }
void CudaDevice::gelu_glu(float* gate, const float* up, size_t n) { cuda::gelu_glu(gate, up, n, impl_->stream); }

void CudaDevice::add(float* x, const float* y, size_t n) { cuda::add(x, y, n, impl_->stream); }

void CudaDevice::gather_rows(const float* x, int d, const int32_t* rows, int n, float* y) {
  if (n <= 0) return;
  const auto* d_rows = static_cast<const int32_t*>(impl_->upload(rows, static_cast<size_t>(n) * sizeof(int32_t)));
  cuda::gather_rows(x, d, d_rows, n, y, impl_->stream);
}

std::unique_ptr<KvCache> CudaDevice::make_cache(const CacheSpec& spec, const CacheShape& shape) {
  return std::make_unique<CudaKvCache>(spec, shape, impl_->owner);
}

std::shared_ptr<Device> make_cuda_device() { return std::make_shared<CudaDevice>(); }

}  // namespace tqkv::engine
