// The CPU side of the torch ops (python/tqkv/torch.py): a page pool in a caller's uint8 tensor
// [num_blocks, page_bytes] (tqkv/page_pool.h), written through a slot mapping and read through
// block tables, as a vLLM-style attention backend calls it. tqkv.torch checks dtypes, shapes
// and devices first and hands over CPU tensors (DLPack, no copy); the typed ndarrays here are a
// second guard, and the pool functions check slot and block ids against the pool.
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include "bindings.h"
#include "tqkv/codec.h"
#include "tqkv/error.h"
#include "tqkv/page_pool.h"

namespace tqkv::python {
namespace {

namespace nb = nanobind;

using Pages = nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
template <typename T, size_t N>
using In = nb::ndarray<const T, nb::ndim<N>, nb::c_contig, nb::device::cpu>;
using Out3 = nb::ndarray<float, nb::ndim<3>, nb::c_contig, nb::device::cpu>;

// One codec per (format, head dim, seed), built on first use (codebooks, rotation) and kept.
const SlotCodec& codec_for(const std::string& format, int head_dim, uint64_t seed) {
  static std::map<std::tuple<std::string, int, uint64_t>, std::unique_ptr<SlotCodec>> codecs;
  const Format f = Format::parse(format);
  auto key = std::make_tuple(f.name(), head_dim, seed);
  auto it = codecs.find(key);
  if (it == codecs.end()) it = codecs.emplace(key, std::make_unique<SlotCodec>(f, head_dim, seed)).first;
  return *it->second;
}

PagePool pool_of(const Pages& cache, const SlotCodec& codec, int n_kv_heads, int block_size, const std::string& layout) {
  if (block_size != 16 && block_size != 32 && block_size != 64 && block_size != 128)
    throw Error(ErrorCode::InvalidArgument, "block_size must be 16, 32, 64 or 128, got " + std::to_string(block_size));
  PagePool pool;
  pool.geometry = page_geometry(codec.format(), codec.dim(), block_size, n_kv_heads, parse_layout(layout));
  if (static_cast<int64_t>(cache.shape(1)) != pool.geometry.page_bytes())
    throw Error(ErrorCode::InvalidArgument, "cache: pages of " + std::to_string(cache.shape(1)) + " bytes, expected " +
                                                std::to_string(pool.geometry.page_bytes()) + " (block_size " +
                                                std::to_string(block_size) + " x n_kv_heads " +
                                                std::to_string(n_kv_heads) + " x slot_bytes " +
                                                std::to_string(pool.geometry.slot_bytes) + ")");
  pool.pages = cache.data();
  pool.num_blocks = static_cast<int>(cache.shape(0));
  return pool;
}

void store(Pages cache, In<int64_t, 1> slot_mapping, In<float, 3> k, In<float, 3> v, const std::string& format,
           int block_size, const std::string& layout, uint64_t seed) {
  const int n = static_cast<int>(k.shape(0)), H = static_cast<int>(k.shape(1)), d = static_cast<int>(k.shape(2));
  if (slot_mapping.shape(0) != k.shape(0) || v.shape(0) != k.shape(0) || v.shape(1) != k.shape(1) ||
      v.shape(2) != k.shape(2))
    throw Error(ErrorCode::InvalidArgument, "store: key, value and slot_mapping disagree on their shapes");
  const SlotCodec& codec = codec_for(format, d, seed);
  const PagePool pool = pool_of(cache, codec, H, block_size, layout);
  nb::gil_scoped_release unlocked;
  pool_store(codec, pool, {slot_mapping.data(), static_cast<size_t>(n)}, k.data(), v.data());
}

void attention(Pages cache, In<int32_t, 2> block_tables, In<int32_t, 1> seq_lens, In<float, 3> q, Out3 out,
               const std::string& format, int block_size, int n_kv_heads, const std::string& layout, uint64_t seed,
               float scale, int window, bool reference) {
  const size_t batch = q.shape(0);
  if (block_tables.shape(0) != batch || seq_lens.shape(0) != batch || out.shape(0) != batch ||
      out.shape(1) != q.shape(1) || out.shape(2) != q.shape(2))
    throw Error(ErrorCode::InvalidArgument, "decode: query, out, block_tables and seq_lens disagree on their shapes");
  const SlotCodec& codec = codec_for(format, static_cast<int>(q.shape(2)), seed);
  const PagePool pool = pool_of(cache, codec, n_kv_heads, block_size, layout);
  const size_t width = block_tables.shape(1);
  std::vector<PagedSeq> seqs(batch);
  for (size_t b = 0; b < batch; ++b) seqs[b] = {{block_tables.data() + b * width, width}, seq_lens.data()[b]};
  AttentionParams params;
  params.n_q_heads = static_cast<int>(q.shape(1));
  params.scale = scale;
  params.window = window;
  nb::gil_scoped_release unlocked;
  if (reference)
    pool_attention_reference(codec, pool, seqs, q.data(), params, out.data());
  else
    pool_attention(codec, pool, seqs, q.data(), params, out.data());
}

void dequantize(Pages cache, In<int32_t, 1> block_table, int64_t start, Out3 k_out, Out3 v_out,
                const std::string& format, int block_size, const std::string& layout, uint64_t seed) {
  if (k_out.shape(0) != v_out.shape(0) || k_out.shape(1) != v_out.shape(1) || k_out.shape(2) != v_out.shape(2))
    throw Error(ErrorCode::InvalidArgument, "dequantize: k_out and v_out differ in shape");
  const int n = static_cast<int>(k_out.shape(0));
  const SlotCodec& codec = codec_for(format, static_cast<int>(k_out.shape(2)), seed);
  const PagePool pool = pool_of(cache, codec, static_cast<int>(k_out.shape(1)), block_size, layout);
  const PagedSeq seq{{block_table.data(), block_table.shape(0)}, start + n};
  nb::gil_scoped_release unlocked;
  pool_decode(codec, pool, seq, start, n, true, k_out.data());
  pool_decode(codec, pool, seq, start, n, false, v_out.data());
}

}  // namespace

void bind_pool_ops(nb::module_& m) {
  m.def("_pool_store", &store, nb::arg("cache"), nb::arg("slot_mapping"), nb::arg("k"), nb::arg("v"),
        nb::arg("format"), nb::arg("block_size"), nb::arg("layout"), nb::arg("seed"),
        "Internal (tqkv.torch.store on the CPU): encodes k, v [n, n_kv_heads, head_dim] float32 into the pages "
        "cache [num_blocks, page_bytes] uint8 at slot_mapping [n] int64 (negative: skipped).");
  m.def("_pool_attention", &attention, nb::arg("cache"), nb::arg("block_tables"), nb::arg("seq_lens"), nb::arg("q"),
        nb::arg("out"), nb::arg("format"), nb::arg("block_size"), nb::arg("n_kv_heads"), nb::arg("layout"),
        nb::arg("seed"), nb::arg("scale"), nb::arg("window"), nb::arg("reference"),
        "Internal (tqkv.torch.decode on the CPU): decode attention of q [batch, n_q_heads, head_dim] float32 over "
        "the pages through block_tables [batch, width] int32 and seq_lens [batch] int32 into out (same shape).");
  m.def("_pool_dequantize", &dequantize, nb::arg("cache"), nb::arg("block_table"), nb::arg("start"), nb::arg("k_out"),
        nb::arg("v_out"), nb::arg("format"), nb::arg("block_size"), nb::arg("layout"), nb::arg("seed"),
        "Internal (tqkv.torch.dequantize on the CPU): positions [start, start + n) of one sequence "
        "(block_table [width] int32) into k_out, v_out [n, n_kv_heads, head_dim] float32.");
}

}  // namespace tqkv::python
