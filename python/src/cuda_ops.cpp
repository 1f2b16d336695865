// The CUDA side of the torch ops (python/tqkv/torch.py) over tqkv/cuda.h: tensors arrive as
// device pointers (torch's data_ptr()), the stream as torch's cudaStream_t (an integer), and
// every call only enqueues work on that stream (no synchronisation, no allocation), so decode
// can be captured in a CUDA graph. tqkv.torch checks dtypes, shapes and devices first and keeps
// the codecs, plans and workspaces; built only where the extension is built with CUDA.
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "bindings.h"
#include "tqkv/cuda.h"
#include "tqkv/error.h"

namespace tqkv::python {
namespace {

namespace nb = nanobind;

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

cudaStream_t stream_of(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// torch's dtypes as cuda::DType: 0 float32, 1 float16, 2 bfloat16 (tqkv.torch maps them).
cuda::DType dtype_of(int code) {
  if (code < 0 || code > 2) throw Error(ErrorCode::InvalidArgument, "dtype code must be 0, 1 or 2");
  return static_cast<cuda::DType>(code);
}

// The kernels run on the caller's device (torch tensors may live on any GPU).
void use_device(int device) {
  const cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess)
    throw Error(ErrorCode::InvalidArgument, std::string("cudaSetDevice: ") + cudaGetErrorString(err));
}

cuda::PagedKv paged_kv(uintptr_t pages, int num_blocks, int block_size, int n_kv_heads, const std::string& layout) {
  cuda::PagedKv kv;
  kv.pages = ptr<uint8_t>(pages);
  kv.num_blocks = num_blocks;
  kv.block_size = block_size;
  kv.n_kv_heads = n_kv_heads;
  kv.layout = parse_layout(layout);
  return kv;
}

}  // namespace

void bind_cuda_ops(nb::module_& m) {
  nb::class_<cuda::CacheCodec>(m, "_CudaCodec", "Internal: a format at one head dim for the CUDA kernels.")
      .def(
          "__init__",
          [](cuda::CacheCodec* c, nb::handle format, int head_dim, uint64_t seed) {
            new (c) cuda::CacheCodec(to_format(format), head_dim, seed);
          },
          nb::arg("format"), nb::arg("head_dim"), nb::arg("seed"))
      .def_prop_ro("decode_supported", &cuda::CacheCodec::decode_supported)
      .def_prop_ro("slot_bytes", &cuda::CacheCodec::slot_bytes);

  nb::class_<cuda::DecodePlan>(m, "_CudaDecodePlan", "Internal: the host decisions of one decode shape.")
      .def_ro("num_splits", &cuda::DecodePlan::num_splits)
      .def_ro("batch", &cuda::DecodePlan::batch)
      .def_ro("n_q_heads", &cuda::DecodePlan::n_q_heads)
      .def_ro("max_seq_len", &cuda::DecodePlan::max_seq_len)
      .def_ro("workspace_bytes", &cuda::DecodePlan::workspace_bytes)
      .def_ro("cluster_merge", &cuda::DecodePlan::cluster_merge);

  m.def(
      "_cuda_store",
      [](const cuda::CacheCodec& codec, uintptr_t pages, int num_blocks, int block_size, int n_kv_heads,
         const std::string& layout, uintptr_t k, uintptr_t v, int dtype, int64_t token_stride, uintptr_t slot_mapping,
         int n_tokens, int device, uintptr_t stream) {
        use_device(device);
        cuda::StoreArgs a;
        a.k = ptr<const void>(k);
        a.v = ptr<const void>(v);
        a.dtype = dtype_of(dtype);
        a.token_stride = token_stride;
        a.slot_mapping = ptr<const int64_t>(slot_mapping);
        a.n_tokens = n_tokens;
        cuda::store(codec, paged_kv(pages, num_blocks, block_size, n_kv_heads, layout), a, stream_of(stream));
      },
      nb::arg("codec"), nb::arg("pages"), nb::arg("num_blocks"), nb::arg("block_size"), nb::arg("n_kv_heads"),
      nb::arg("layout"), nb::arg("k"), nb::arg("v"), nb::arg("dtype"), nb::arg("token_stride"),
      nb::arg("slot_mapping"), nb::arg("n_tokens"), nb::arg("device"), nb::arg("stream"),
      "Internal (tqkv.torch.store on CUDA): tqkv::cuda::store on device pointers.");

  m.def(
      "_cuda_plan_decode",
      [](const cuda::CacheCodec& codec, int num_blocks, int block_size, int n_kv_heads, int batch, int n_q_heads,
         int max_seq_len, int device) {
        use_device(device);
        // plan_decode reads only the geometry; the pool pointer is not touched.
        return cuda::plan_decode(codec, paged_kv(1, num_blocks, block_size, n_kv_heads, "page"), batch, n_q_heads,
                                 max_seq_len);
      },
      nb::arg("codec"), nb::arg("num_blocks"), nb::arg("block_size"), nb::arg("n_kv_heads"), nb::arg("batch"),
      nb::arg("n_q_heads"), nb::arg("max_seq_len"), nb::arg("device"),
      "Internal: tqkv::cuda::plan_decode (host only; the workspace is the caller's).");

  m.def(
      "_cuda_init_workspace",
      [](const cuda::CacheCodec& codec, const cuda::DecodePlan& plan, int n_kv_heads, uintptr_t workspace, int device,
         uintptr_t stream) {
        use_device(device);
        cuda::init_decode_workspace(codec, paged_kv(1, 1, 16, n_kv_heads, "page"), plan, ptr<void>(workspace),
                                    stream_of(stream));
      },
      nb::arg("codec"), nb::arg("plan"), nb::arg("n_kv_heads"), nb::arg("workspace"), nb::arg("device"),
      nb::arg("stream"), "Internal: tqkv::cuda::init_decode_workspace.");

  m.def(
      "_cuda_decode",
      [](const cuda::CacheCodec& codec, const cuda::DecodePlan& plan, uintptr_t pages, int num_blocks,
         int block_size, int n_kv_heads, const std::string& layout, uintptr_t q, int q_dtype, uintptr_t out,
         int out_dtype, uintptr_t block_tables, int block_table_stride, uintptr_t seq_lens, int batch, int n_q_heads,
         float scale, int window, uintptr_t workspace, int device, uintptr_t stream) {
        use_device(device);
        cuda::DecodeArgs a;
        a.q = ptr<const void>(q);
        a.q_dtype = dtype_of(q_dtype);
        a.out = ptr<void>(out);
        a.out_dtype = dtype_of(out_dtype);
        a.block_tables = ptr<const int32_t>(block_tables);
        a.block_table_stride = block_table_stride;
        a.seq_lens = ptr<const int32_t>(seq_lens);
        a.batch = batch;
        a.params.n_q_heads = n_q_heads;
        a.params.scale = scale;
        a.params.window = window;
        cuda::run_decode(codec, paged_kv(pages, num_blocks, block_size, n_kv_heads, layout), a, plan,
                         ptr<void>(workspace), stream_of(stream));
      },
      nb::arg("codec"), nb::arg("plan"), nb::arg("pages"), nb::arg("num_blocks"), nb::arg("block_size"),
      nb::arg("n_kv_heads"), nb::arg("layout"), nb::arg("q"), nb::arg("q_dtype"), nb::arg("out"),
      nb::arg("out_dtype"), nb::arg("block_tables"), nb::arg("block_table_stride"), nb::arg("seq_lens"),
      nb::arg("batch"), nb::arg("n_q_heads"), nb::arg("scale"), nb::arg("window"), nb::arg("workspace"),
      nb::arg("device"), nb::arg("stream"), "Internal (tqkv.torch.decode on CUDA): tqkv::cuda::run_decode.");

  m.def(
      "_cuda_dequantize",
      [](const cuda::CacheCodec& codec, uintptr_t pages, int num_blocks, int block_size, int n_kv_heads,
         const std::string& layout, uintptr_t block_table, int start, int n_tokens, uintptr_t k_out, uintptr_t v_out,
         int dtype, int device, uintptr_t stream) {
        use_device(device);
        cuda::DequantArgs a;
        a.block_table = ptr<const int32_t>(block_table);
        a.start = start;
        a.n_tokens = n_tokens;
        a.k_out = ptr<void>(k_out);
        a.v_out = ptr<void>(v_out);
        a.out_dtype = dtype_of(dtype);
        cuda::dequantize(codec, paged_kv(pages, num_blocks, block_size, n_kv_heads, layout), a, stream_of(stream));
      },
      nb::arg("codec"), nb::arg("pages"), nb::arg("num_blocks"), nb::arg("block_size"), nb::arg("n_kv_heads"),
      nb::arg("layout"), nb::arg("block_table"), nb::arg("start"), nb::arg("n_tokens"), nb::arg("k_out"),
      nb::arg("v_out"), nb::arg("dtype"), nb::arg("device"), nb::arg("stream"),
      "Internal (tqkv.torch.dequantize on CUDA): tqkv::cuda::dequantize.");
}

}  // namespace tqkv::python
