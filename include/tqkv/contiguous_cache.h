// A contiguous KV cache, the spec's model: for each layer, kv_heads x capacity fixed-size
// slots (docs/FORMAT.md), addressed as a ring buffer by absolute token position.
//
// Positions are absolute (0, 1, 2, ...). The cache holds the window of positions
// [first_pos(), seq_len()); writing position seq_len() appends; once the window is full the
// append evicts the oldest position (ring-buffer addressing: slot = pos % capacity), and
// evict_oldest(n) drops positions explicitly. Evicting never moves or re-encodes bytes, so
// the remaining tokens decode exactly as before.
//
// Each layer has its own format, so boundary layers can stay uncompressed
// (see boundary_layer_formats()). Every method that throws tqkv::Error changes nothing.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "tqkv/codec.h"
#include "tqkv/format.h"

namespace tqkv {
namespace cpu {
class PageBuffer;
}

struct ContiguousCacheConfig {
  int n_layers = 1;
  int n_kv_heads = 1;
  int head_dim = 128;
  int capacity = 4096;                      // slots per (layer, kv-head)
  std::vector<Format> layer_formats;        // [n_layers]; empty = every layer find_format(kDefaultFormat)
  uint64_t seed = kDefaultSeed;             // rotation seed, shared by all layers
};

// Formats for n_layers: the first and last `skip` layers get `boundary` (uncompressed), the
// rest get `inner`. skip < 0 means the default: 2 for compressed formats, capped at
// n_layers / 2; uncompressed formats never skip.
std::vector<Format> boundary_layer_formats(int n_layers, const Format& inner, int skip = -1,
                                           const Format& boundary = Format{});  // Format{} is f16

class ContiguousCache {
 public:
  explicit ContiguousCache(const ContiguousCacheConfig& config);
  ~ContiguousCache();
  ContiguousCache(ContiguousCache&&) noexcept;
  ContiguousCache& operator=(ContiguousCache&&) noexcept;

  const ContiguousCacheConfig& config() const { return config_; }
  int n_layers() const { return config_.n_layers; }
  int n_kv_heads() const { return config_.n_kv_heads; }
  int head_dim() const { return config_.head_dim; }
  int capacity() const { return config_.capacity; }
  // Both throw tqkv::Error(OutOfRange) for a bad layer.
  const Format& format(int layer) const {
    check_layer(layer);
    return config_.layer_formats[layer];
  }
  const SlotCodec& codec(int layer) const {
    check_layer(layer);
    return *codecs_[layer];
  }

  // Window of positions held, shared by all layers: [first_pos, seq_len).
  int64_t seq_len() const { return seq_len_; }
  int64_t first_pos() const { return first_pos_; }

  // Writes n_tokens tokens at positions pos0 .. pos0 + n_tokens - 1 of one layer.
  // k, v: [n_tokens, n_kv_heads, head_dim] floats. Positions must lie in
  // [first_pos, seq_len] (overwrite or append, no gaps); appending past capacity evicts the
  // oldest. The window is shared: the first layer to append a position extends it for all
  // layers, so write every layer of a position before reading it. Throws (changing nothing)
  // on NaN/Inf, fp16 overflow, a bad layer or a bad position.
  void write(int layer, int64_t pos0, int n_tokens, const float* k, const float* v);
  // Key-only / value-only variants (the spec's fa_tq_quantize writes one side at a time).
  void write_keys(int layer, int64_t pos0, int n_tokens, const float* k);
  void write_values(int layer, int64_t pos0, int n_tokens, const float* v);

  // The slot of (layer, head, pos) [slot_bytes]; pos must be in the window.
  const uint8_t* slot(int layer, int head, int64_t pos) const;
  size_t slot_bytes(int layer) const { return format(layer).slot_bytes(config_.head_dim); }
  // Stride in bytes between consecutive ring slots of one (layer, head).
  size_t slot_stride(int layer) const { return slot_bytes(layer); }
  // Base of the ring of (layer, head): [capacity, slot_bytes]; slot of pos is at (pos % capacity).
  const uint8_t* ring(int layer, int head) const;

  // Decodes positions [start, start + count) of one layer into out [count, n_kv_heads, head_dim]
  // (original domain). Throws OutOfRange for positions outside the window.
  void decode(int layer, int64_t start, int count, bool keys, float* out) const;

  // Makes this cache hold exactly positions [start, end) of src, their slots copied (no
  // re-encoding): prefix sharing between sequences. src must have the same layout (layers,
  // formats, heads, head_dim, capacity) and hold those positions. Throws
  // tqkv::Error(InvalidArgument, OutOfRange), changing nothing.
  void copy_positions(const ContiguousCache& src, int64_t start, int64_t end);

  void evict_oldest(int64_t n);  // drops the n oldest positions (n <= held)
  // Drops every position held and moves the window's start to pos (>= seq_len, else
  // tqkv::Error(OutOfRange)): the next write appends at pos. A ring that keeps the last positions
  // of a long run writes only those.
  void skip_to(int64_t pos);
  void clear();                  // empties the cache (bytes are zeroed)

  size_t bytes() const;                   // memory held by the slots
  size_t bytes_per_token() const;         // all layers and heads, one position

 private:
  void check_layer(int layer) const;
  void check_write(int layer, int64_t pos0, int n_tokens) const;
  void advance_window(int64_t end);
  uint8_t* slot_mut(int layer, int head, int64_t pos);
  template <typename Encode>
  void write_impl(int layer, int64_t pos0, int n_tokens, Encode encode, size_t offset, size_t bytes);

  ContiguousCacheConfig config_;
  std::vector<std::unique_ptr<SlotCodec>> codecs_;   // [n_layers]
  std::vector<std::unique_ptr<cpu::PageBuffer>> storage_;  // [n_layers] n_kv_heads * capacity * slot
  int64_t seq_len_ = 0;
  int64_t first_pos_ = 0;
};

}  // namespace tqkv
