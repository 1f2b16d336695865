#include "tqkv/contiguous_cache.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "checked_size.h"
#include "page_buffer.h"
#include "tqkv/error.h"
#include "tqkv/slot_encoder.h"

namespace tqkv {

std::vector<Format> boundary_layer_formats(int n_layers, const Format& inner, int skip, const Format& boundary) {
  if (n_layers < 1) throw Error(ErrorCode::InvalidArgument, "n_layers must be >= 1");
  if (skip < 0) skip = inner.compressed() ? 2 : 0;
  skip = std::min(skip, n_layers / 2);
  std::vector<Format> out(n_layers, inner);
  for (int i = 0; i < skip; ++i) {
    out[i] = boundary;
    out[n_layers - 1 - i] = boundary;
  }
  return out;
}

ContiguousCache::ContiguousCache(const ContiguousCacheConfig& config) : config_(config) {
  if (config_.n_layers < 1 || config_.n_kv_heads < 1 || config_.capacity < 1 || config_.head_dim < 2)
    throw Error(ErrorCode::InvalidArgument,
                "contiguous cache needs n_layers >= 1, n_kv_heads >= 1, capacity >= 1, head_dim >= 2");
  if (config_.layer_formats.empty())
    config_.layer_formats.assign(config_.n_layers, find_format(kDefaultFormat));
  if (static_cast<int>(config_.layer_formats.size()) != config_.n_layers)
    throw Error(ErrorCode::InvalidArgument, "layer_formats has " + std::to_string(config_.layer_formats.size()) +
                                                " entries for " + std::to_string(config_.n_layers) + " layers");
  std::vector<size_t> layer_bytes;  // every layer's size checked before anything is allocated
  for (int l = 0; l < config_.n_layers; ++l)
    layer_bytes.push_back(cpu::checked_size("contiguous cache layer " + std::to_string(l),
                                            {{config_.n_kv_heads, "kv heads"},
                                             {config_.capacity, "positions"},
                                             {slot_bytes(l), "bytes per slot"}}));
  for (int l = 0; l < config_.n_layers; ++l) {
    codecs_.push_back(std::make_unique<SlotCodec>(config_.layer_formats[l], config_.head_dim, config_.seed));
    storage_.push_back(std::make_unique<cpu::PageBuffer>(layer_bytes[l]));
  }
}

ContiguousCache::~ContiguousCache() = default;
ContiguousCache::ContiguousCache(ContiguousCache&&) noexcept = default;
ContiguousCache& ContiguousCache::operator=(ContiguousCache&&) noexcept = default;

void ContiguousCache::check_layer(int layer) const {
  if (layer < 0 || layer >= config_.n_layers)
    throw Error(ErrorCode::OutOfRange, "layer " + std::to_string(layer) + " out of range [0, " +
                                           std::to_string(config_.n_layers) + ")");
}

void ContiguousCache::check_write(int layer, int64_t pos0, int n_tokens) const {
  check_layer(layer);
  if (n_tokens < 0) throw Error(ErrorCode::InvalidArgument, "negative token count");
  if (pos0 < first_pos_ || pos0 > seq_len_)
    throw Error(ErrorCode::OutOfRange, "write position " + std::to_string(pos0) + " outside [" +
                                           std::to_string(first_pos_) + ", " + std::to_string(seq_len_) +
                                           "] (positions are written in order, without gaps)");
  if (n_tokens > config_.capacity)
    throw Error(ErrorCode::Capacity, "writing " + std::to_string(n_tokens) + " tokens at once exceeds capacity " +
                                         std::to_string(config_.capacity));
}

uint8_t* ContiguousCache::slot_mut(int layer, int head, int64_t pos) {
  const size_t sb = slot_bytes(layer);
  return storage_[layer]->data() + (static_cast<size_t>(head) * config_.capacity + pos % config_.capacity) * sb;
}

const uint8_t* ContiguousCache::ring(int layer, int head) const {
  check_layer(layer);
  if (head < 0 || head >= config_.n_kv_heads) throw Error(ErrorCode::OutOfRange, "kv head out of range");
  return storage_[layer]->data() + static_cast<size_t>(head) * config_.capacity * slot_bytes(layer);
}

const uint8_t* ContiguousCache::slot(int layer, int head, int64_t pos) const {
  check_layer(layer);
  if (head < 0 || head >= config_.n_kv_heads) throw Error(ErrorCode::OutOfRange, "kv head out of range");
  if (pos < first_pos_ || pos >= seq_len_)
    throw Error(ErrorCode::OutOfRange, "position " + std::to_string(pos) + " not held (window [" +
                                           std::to_string(first_pos_) + ", " + std::to_string(seq_len_) + "))");
  const size_t sb = slot_bytes(layer);
  return storage_[layer]->data() + (static_cast<size_t>(head) * config_.capacity + pos % config_.capacity) * sb;
}

void ContiguousCache::advance_window(int64_t end) {
  if (end > seq_len_) seq_len_ = end;
  if (seq_len_ - first_pos_ > config_.capacity) first_pos_ = seq_len_ - config_.capacity;
}

template <typename Encode>
void ContiguousCache::write_impl(int layer, int64_t pos0, int n_tokens, Encode encode, size_t offset,
                                 size_t bytes) {
  check_write(layer, pos0, n_tokens);
  // Encode everything into scratch first: a NaN or overflow in token 7 must not leave tokens
  // 0..6 written.
  const int H = config_.n_kv_heads;
  std::vector<uint8_t> scratch(static_cast<size_t>(n_tokens) * H * bytes);
  for (int t = 0; t < n_tokens; ++t)
    for (int h = 0; h < H; ++h) {
      const size_t i = static_cast<size_t>(t) * H + h;
      encode(i, scratch.data() + i * bytes);
    }
  for (int t = 0; t < n_tokens; ++t)
    for (int h = 0; h < H; ++h) {
      const size_t i = static_cast<size_t>(t) * H + h;
      std::memcpy(slot_mut(layer, h, pos0 + t) + offset, scratch.data() + i * bytes, bytes);
    }
  advance_window(pos0 + n_tokens);
}

void ContiguousCache::write(int layer, int64_t pos0, int n_tokens, const float* k, const float* v) {
  const SlotCodec& c = codec(layer);
  const int d = config_.head_dim;
  write_impl(
      layer, pos0, n_tokens,
      [&](size_t i, uint8_t* out) { encode_slot(c, k + i * d, v + i * d, out); }, 0, slot_bytes(layer));
}

void ContiguousCache::write_keys(int layer, int64_t pos0, int n_tokens, const float* k) {
  const SlotCodec& c = codec(layer);
  const int d = config_.head_dim;
  write_impl(
      layer, pos0, n_tokens, [&](size_t i, uint8_t* out) { c.encode_key(k + i * d, out); }, 0, c.key_bytes());
}

void ContiguousCache::write_values(int layer, int64_t pos0, int n_tokens, const float* v) {
  const SlotCodec& c = codec(layer);
  const int d = config_.head_dim;
  write_impl(
      layer, pos0, n_tokens, [&](size_t i, uint8_t* out) { c.encode_value(v + i * d, out); }, c.key_bytes(),
      c.value_bytes());
}

void ContiguousCache::decode(int layer, int64_t start, int count, bool keys, float* out) const {
  check_layer(layer);
  if (count < 0 || start < first_pos_ || start + count > seq_len_)
    throw Error(ErrorCode::OutOfRange, "decode range [" + std::to_string(start) + ", " +
                                           std::to_string(start + count) + ") outside the held window [" +
                                           std::to_string(first_pos_) + ", " + std::to_string(seq_len_) + ")");
  const SlotCodec& c = codec(layer);
  const int H = config_.n_kv_heads, d = config_.head_dim;
  for (int t = 0; t < count; ++t)
    for (int h = 0; h < H; ++h) {
      const uint8_t* s = slot(layer, h, start + t);
      float* o = out + (static_cast<size_t>(t) * H + h) * d;
      if (keys)
        c.decode_key(s, o);
      else
        c.decode_value(s + c.key_bytes(), o);
    }
}

void ContiguousCache::copy_positions(const ContiguousCache& src, int64_t start, int64_t end) {
  bool same = src.n_layers() == n_layers() && src.n_kv_heads() == n_kv_heads() && src.head_dim() == head_dim() &&
              src.capacity() == capacity();
  for (int l = 0; same && l < n_layers(); ++l) same = src.slot_bytes(l) == slot_bytes(l);
  if (!same) throw Error(ErrorCode::InvalidArgument, "copy_positions: the two caches differ in layout");
  if (start < src.first_pos_ || end > src.seq_len_ || start > end || end - start > capacity())
    throw Error(ErrorCode::OutOfRange, "copy_positions: [" + std::to_string(start) + ", " + std::to_string(end) +
                                           ") is not held (window [" + std::to_string(src.first_pos_) + ", " +
                                           std::to_string(src.seq_len_) + "))");
  for (int l = 0; l < n_layers(); ++l) {
    const size_t sb = slot_bytes(l);
    for (int h = 0; h < n_kv_heads(); ++h)
      for (int64_t p = start; p < end; ++p)
        std::memcpy(slot_mut(l, h, p), src.storage_[l]->data() + (static_cast<size_t>(h) * capacity() + p % capacity()) * sb,
                    sb);
  }
  first_pos_ = start;
  seq_len_ = end;
}

void ContiguousCache::skip_to(int64_t pos) {
  if (pos < seq_len_)
    throw Error(ErrorCode::OutOfRange, "skip_to " + std::to_string(pos) + " before the end of the held positions (" +
                                           std::to_string(seq_len_) + ")");
  first_pos_ = seq_len_ = pos;
}

void ContiguousCache::evict_oldest(int64_t n) {
  if (n < 0 || n > seq_len_ - first_pos_)
    throw Error(ErrorCode::OutOfRange, "cannot evict " + std::to_string(n) + " of " +
                                           std::to_string(seq_len_ - first_pos_) + " held positions");
  first_pos_ += n;
}

void ContiguousCache::clear() {
  for (auto& s : storage_) s->zero();
  seq_len_ = first_pos_ = 0;
}

size_t ContiguousCache::bytes() const {
  size_t total = 0;
  for (const auto& s : storage_) total += s->size();
  return total;
}

size_t ContiguousCache::bytes_per_token() const {
  size_t total = 0;
  for (int l = 0; l < config_.n_layers; ++l) total += slot_bytes(l) * config_.n_kv_heads;
  return total;
}

}  // namespace tqkv
