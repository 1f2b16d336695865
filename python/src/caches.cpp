// The contiguous and paged caches (tqkv/contiguous_cache.h, tqkv/paged_cache.h) and attention
// on them (tqkv/attention.h, tqkv::paged_attention), over NumPy arrays.
#include <optional>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "arrays.h"
#include "bindings.h"
#include "tqkv/attention.h"
#include "tqkv/contiguous_cache.h"
#include "tqkv/error.h"
#include "tqkv/paged_cache.h"

namespace tqkv::python {
namespace {

using FloatArray = nb::ndarray<nb::numpy, float>;
using ByteView = nb::ndarray<nb::numpy, const uint8_t>;
constexpr const char* kKvDims = "[n_tokens, n_kv_heads, head_dim]";

// Runs one attention call: q [rows, n_q_heads, head_dim] -> out of the same shape and, when
// asked, lse [rows, n_q_heads].
template <typename Run>
nb::object attend(const AnyArray& q, int head_dim, float scale, int window, bool return_lse, const char* q_dims,
                  Run run) {
  const Floats qf = float_input(q, "q", {kAny, kAny, head_dim}, q_dims);
  AttentionParams params;
  params.n_q_heads = static_cast<int>(qf.shape[1]);
  params.head_dim = head_dim;
  params.scale = scale;
  params.window = window;
  FloatArray out = new_array<float>(qf.shape);
  std::optional<FloatArray> lse;
  if (return_lse) {
    lse = new_array<float>({qf.shape[0], qf.shape[1]});
    params.lse = lse->data();
  }
  run(qf, params, out.data());
  if (!lse) return nb::cast(out);
  return nb::make_tuple(out, *lse);
}

// The keyword arguments both attention methods share, for their docstrings.
#define TQKV_ATTENTION_ARGS                                                                         \
  "scale: softmax scale (0: 1/sqrt(head_dim)); window: sliding window (0: none); reference: use "  \
  "the scalar reference (double-precision softmax) instead of the SIMD kernels; return_lse: also " \
  "return lse [rows, n_q_heads], the natural log of each row's softmax denominator."

void bind_contiguous(nb::module_& m) {
  nb::class_<ContiguousCache>(
      m, "ContiguousCache",
      "The contiguous cache: per layer, n_kv_heads rings of `capacity` slots addressed by absolute position\n"
      "(slot = pos % capacity). Positions [first_pos, seq_len) are held; writing at seq_len appends and, once\n"
      "full, evicts the oldest. A call that raises has changed nothing.")
      .def(
          "__init__",
          [](ContiguousCache* c, int n_layers, int n_kv_heads, int head_dim, int capacity, nb::handle formats,
             uint64_t seed) {
            ContiguousCacheConfig cfg;
            cfg.n_layers = n_layers;
            cfg.n_kv_heads = n_kv_heads;
            cfg.head_dim = head_dim;
            cfg.capacity = capacity;
            if (!formats.is_none()) cfg.layer_formats = to_layer_formats(formats, n_layers);
            cfg.seed = seed;
            new (c) ContiguousCache(cfg);
          },
          nb::arg("n_layers"), nb::arg("n_kv_heads"), nb::arg("head_dim"), nb::arg("capacity"),
          nb::arg("formats") = nb::none(), nb::arg("seed") = kDefaultSeed,
          nb::sig("def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, "
                  "formats: Format | str | typing.Sequence[Format | str] | None = None, "
                  "seed: int = DEFAULT_SEED) -> None"),
          "formats: one format (or name) for every layer, or one per layer; None: DEFAULT_FORMAT everywhere.")
      .def_prop_ro("n_layers", &ContiguousCache::n_layers)
      .def_prop_ro("n_kv_heads", &ContiguousCache::n_kv_heads)
      .def_prop_ro("head_dim", &ContiguousCache::head_dim)
      .def_prop_ro("capacity", &ContiguousCache::capacity)
      .def_prop_ro("seq_len", &ContiguousCache::seq_len, "One past the last position written (the next to append).")
      .def_prop_ro("first_pos", &ContiguousCache::first_pos, "The oldest position still held.")
      .def_prop_ro("bytes", &ContiguousCache::bytes, "Memory held by the slots of every layer.")
      .def_prop_ro("bytes_per_token", &ContiguousCache::bytes_per_token, "Slot bytes of one position, all layers and heads.")
      .def("format", &ContiguousCache::format, nb::arg("layer"))
      .def("slot_bytes", &ContiguousCache::slot_bytes, nb::arg("layer"))
      .def(
          "write",
          [](ContiguousCache& c, int layer, int64_t pos, const AnyArray& k, const AnyArray& v) {
            const Floats kf = float_input(k, "k", {kAny, c.n_kv_heads(), c.head_dim()}, kKvDims);
            const Floats vf = float_input(v, "v", {static_cast<int64_t>(kf.shape[0]), c.n_kv_heads(), c.head_dim()},
                                          kKvDims);
            c.write(layer, pos, static_cast<int>(kf.shape[0]), kf.data, vf.data);
          },
          nb::arg("layer"), nb::arg("pos"), nb::arg("k"), nb::arg("v"),
          "Writes k, v [n_tokens, n_kv_heads, head_dim] (float32/float16) at positions pos .. pos + n_tokens - 1 "
          "of one layer; pos in [first_pos, seq_len] (pos = seq_len appends). Write every layer of a position "
          "before reading it.")
      .def(
          "decode",
          [](const ContiguousCache& c, int layer, int64_t start, int count, bool keys) {
            if (count < 0) throw Error(ErrorCode::InvalidArgument, "count: must be >= 0");
            FloatArray out = new_array<float>(
                {static_cast<size_t>(count), static_cast<size_t>(c.n_kv_heads()), static_cast<size_t>(c.head_dim())});
            c.decode(layer, start, count, keys, out.data());
            return out;
          },
          nb::arg("layer"), nb::arg("start"), nb::arg("count"), nb::arg("keys") = true,
          "Keys (or values) of positions [start, start + count) -> [count, n_kv_heads, head_dim] float32.")
      .def(
          "ring",
          [](nb::pointer_and_handle<ContiguousCache> self, int layer, int head) {
            const ContiguousCache& c = *self.p;
            if (head < 0 || head >= c.n_kv_heads()) throw Error(ErrorCode::OutOfRange, "head out of range");
            return byte_view(c.ring(layer, head), {static_cast<size_t>(c.capacity()), c.slot_bytes(layer)}, self.h);
          },
          nb::arg("layer"), nb::arg("head"),
          "A read-only view (no copy) of the slots of (layer, head): [capacity, slot_bytes] uint8; position p is "
          "row p % capacity.")
      .def(
          "attention",
          [](const ContiguousCache& c, int layer, const AnyArray& q, int64_t q_pos, float scale, int window,
             bool reference, bool return_lse) {
            return attend(q, c.head_dim(), scale, window, return_lse, "[n_q, n_q_heads, head_dim]",
                          [&](const Floats& qf, const AttentionParams& p, float* out) {
                            const int n_q = static_cast<int>(qf.shape[0]);
                            if (reference)
                              attention_reference(c, layer, qf.data, n_q, q_pos, p, out);
                            else
                              tqkv::attention(c, layer, qf.data, n_q, q_pos, p, out);
                          });
          },
          nb::arg("layer"), nb::arg("q"), nb::arg("q_pos"), nb::kw_only(), nb::arg("scale") = 0.0f,
          nb::arg("window") = 0, nb::arg("reference") = false, nb::arg("return_lse") = false,
          ("Causal attention on the compressed cache of the queries q [n_q, n_q_heads, head_dim] at "
                       "positions q_pos .. q_pos + n_q - 1 (their keys and values already written); n_q_heads a "
                       "multiple of n_kv_heads (GQA: query head i reads kv head i // (n_q_heads // n_kv_heads)). "
                       "Returns [n_q, n_q_heads, head_dim] float32. " TQKV_ATTENTION_ARGS))
      .def("evict_oldest", &ContiguousCache::evict_oldest, nb::arg("n"), "Drops the n oldest positions.")
      .def("clear", &ContiguousCache::clear, "Empties the cache.");
}

void bind_paged(nb::module_& m) {
  nb::class_<PagedCache>(
      m, "PagedCache",
      "The paged cache (vLLM's model): a pool of pages of block_size tokens shared by sequences through block\n"
      "tables. fork() shares pages copy-on-write. Writing is two steps: append_slots(seq, n) reserves positions\n"
      "and returns their slot ids, store(layer, slot_mapping, k, v) writes a batch of tokens of any sequences\n"
      "(call it for every layer). A call that raises has changed nothing.")
      .def(
          "__init__",
          [](PagedCache* c, int n_layers, int n_kv_heads, int head_dim, int num_blocks, int block_size,
             nb::handle formats, const std::string& layout, uint64_t seed) {
            PagedCacheConfig cfg;
            cfg.n_layers = n_layers;
            cfg.n_kv_heads = n_kv_heads;
            cfg.head_dim = head_dim;
            cfg.num_blocks = num_blocks;
            cfg.block_size = block_size;
            cfg.layout = parse_layout(layout);
            if (!formats.is_none()) cfg.layer_formats = to_layer_formats(formats, n_layers);
            cfg.seed = seed;
            new (c) PagedCache(cfg);
          },
          nb::arg("n_layers"), nb::arg("n_kv_heads"), nb::arg("head_dim"), nb::arg("num_blocks") = 256,
          nb::arg("block_size") = 16, nb::arg("formats") = nb::none(), nb::arg("layout") = "slot",
          nb::arg("seed") = kDefaultSeed,
          nb::sig("def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int = 256, "
                  "block_size: int = 16, formats: Format | str | typing.Sequence[Format | str] | None = None, "
                  "layout: str = 'slot', seed: int = DEFAULT_SEED) -> None"),
          "block_size: 16, 32, 64 or 128 tokens per page; layout: 'slot' (vLLM's) or 'page' (docs/FORMAT.md).")
      .def_prop_ro("n_layers", &PagedCache::n_layers)
      .def_prop_ro("n_kv_heads", &PagedCache::n_kv_heads)
      .def_prop_ro("head_dim", &PagedCache::head_dim)
      .def_prop_ro("block_size", &PagedCache::block_size)
      .def_prop_ro("num_blocks", &PagedCache::num_blocks)
      .def_prop_ro("free_blocks", &PagedCache::free_blocks)
      .def_prop_ro("bytes", &PagedCache::bytes, "Memory held by the pools of every layer.")
      .def("format", &PagedCache::format, nb::arg("layer"))
      .def("slot_bytes", &PagedCache::slot_bytes, nb::arg("layer"))
      .def("page_bytes", &PagedCache::page_bytes, nb::arg("layer"))
      .def("ref_count", &PagedCache::ref_count, nb::arg("block"), "Sequences sharing a block.")
      .def("add_sequence", &PagedCache::add_sequence, "A new, empty sequence; returns its id.")
      .def("fork", &PagedCache::fork, nb::arg("parent"), "A new sequence sharing every page of the parent.")
      .def("free_sequence", &PagedCache::free_sequence, nb::arg("seq"), "Frees a sequence (its pages when unshared).")
      .def("has_sequence", &PagedCache::has_sequence, nb::arg("seq"))
      .def("seq_len", &PagedCache::seq_len, nb::arg("seq"))
      .def(
          "block_table",
          [](const PagedCache& c, int64_t seq) {
            const auto table = c.block_table(seq);
            auto out = new_array<int32_t>({table.size()});
            std::copy(table.begin(), table.end(), out.data());
            return out;
          },
          nb::arg("seq"), "The sequence's page ids, [n_pages] int32 (a copy).")
      .def(
          "append_slots",
          [](PagedCache& c, int64_t seq, int n) {
            const std::vector<int64_t> slots = c.append_slots(seq, n);
            auto out = new_array<int64_t>({slots.size()});
            std::copy(slots.begin(), slots.end(), out.data());
            return out;
          },
          nb::arg("seq"), nb::arg("n"),
          "Reserves the next n positions of a sequence: their slot ids [n] int64 (page * block_size + offset). "
          "Raises Error(code='capacity') when the pool cannot hold them.")
      .def(
          "store",
          [](PagedCache& c, int layer, const AnyArray& slot_mapping, const AnyArray& k, const AnyArray& v) {
            const std::vector<int64_t> slots = int_input(slot_mapping, "slot_mapping");
            const auto n = static_cast<int64_t>(slots.size());
            const Floats kf = float_input(k, "k", {n, c.n_kv_heads(), c.head_dim()}, kKvDims);
            const Floats vf = float_input(v, "v", {n, c.n_kv_heads(), c.head_dim()}, kKvDims);
            c.store(layer, slots, kf.data, vf.data, c.n_kv_heads(), c.head_dim());
          },
          nb::arg("layer"), nb::arg("slot_mapping"), nb::arg("k"), nb::arg("v"),
          "Writes token i of k, v [n_tokens, n_kv_heads, head_dim] into slot slot_mapping[i] ([n_tokens] int32/int64; "
          "negative: skipped) of one layer.")
      .def(
          "decode",
          [](const PagedCache& c, int layer, int64_t seq, int64_t start, int count, bool keys) {
            if (count < 0) throw Error(ErrorCode::InvalidArgument, "count: must be >= 0");
            FloatArray out = new_array<float>(
                {static_cast<size_t>(count), static_cast<size_t>(c.n_kv_heads()), static_cast<size_t>(c.head_dim())});
            c.decode(layer, seq, start, count, keys, out.data());
            return out;
          },
          nb::arg("layer"), nb::arg("seq"), nb::arg("start"), nb::arg("count"), nb::arg("keys") = true,
          "Keys (or values) of positions [start, start + count) of a sequence -> [count, n_kv_heads, head_dim].")
      .def(
          "pool",
          [](nb::pointer_and_handle<PagedCache> self, int layer) {
            const PagedCache& c = *self.p;
            return byte_view(c.pool(layer), {static_cast<size_t>(c.num_blocks()), c.page_bytes(layer)}, self.h);
          },
          nb::arg("layer"), "A read-only view (no copy) of one layer's pages: [num_blocks, page_bytes] uint8.")
      .def(
          "attention",
          [](const PagedCache& c, int layer, const AnyArray& seqs, const AnyArray& q, float scale, int window,
             bool reference, bool return_lse) {
            const std::vector<int64_t> ids = int_input(seqs, "seqs");
            return attend(q, c.head_dim(), scale, window, return_lse, "[n_seqs, n_q_heads, head_dim]",
                          [&](const Floats& qf, const AttentionParams& p, float* out) {
                            if (qf.shape[0] != ids.size())
                              throw Error(ErrorCode::InvalidArgument, "q: expected one row per sequence of seqs");
                            if (reference)
                              paged_attention_reference(c, layer, ids, qf.data, p, out);
                            else
                              paged_attention(c, layer, ids, qf.data, p, out);
                          });
          },
          nb::arg("layer"), nb::arg("seqs"), nb::arg("q"), nb::kw_only(), nb::arg("scale") = 0.0f,
          nb::arg("window") = 0, nb::arg("reference") = false, nb::arg("return_lse") = false,
          ("Decode attention for a batch: sequence seqs[b] ([n_seqs] int32/int64) attends with the "
                       "query q[b] ([n_seqs, n_q_heads, head_dim]) at its last position over its tokens. Returns "
                       "[n_seqs, n_q_heads, head_dim] float32. " TQKV_ATTENTION_ARGS));
}

}  // namespace

void bind_caches(nb::module_& m) {
  bind_contiguous(m);
  bind_paged(m);
}

}  // namespace tqkv::python
