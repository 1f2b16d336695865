#include "tqkv/page_pool.h"

#include <cstring>
#include <string>
#include <vector>

#include "tqkv/error.h"
#include "tqkv/slot_encoder.h"

namespace tqkv {

void place_slot(const PageGeometry& g, uint8_t* page, int t, int head, const uint8_t* in) {
  if (g.layout == PageLayout::Slot) {
    std::memcpy(page + g.slot_offset(t, head), in, g.slot_bytes);
    return;
  }
  const int kcb = g.key_code_bytes, kb = kcb + g.key_meta_bytes, vcb = g.value_code_bytes;
  std::memcpy(page + g.key_codes(t, head), in, kcb);
  std::memcpy(page + g.value_codes(t, head), in + kb, vcb);
  for (int j = 0; j < g.key_meta_bytes / 2; ++j) std::memcpy(page + g.key_meta(t, head, j), in + kcb + 2 * j, 2);
  for (int j = 0; j < g.value_meta_bytes / 2; ++j)
    std::memcpy(page + g.value_meta(t, head, j), in + kb + vcb + 2 * j, 2);
}

void gather_slot(const PageGeometry& g, const uint8_t* page, int t, int head, uint8_t* out) {
  if (g.layout == PageLayout::Slot) {
    std::memcpy(out, page + g.slot_offset(t, head), g.slot_bytes);
    return;
  }
  const int kcb = g.key_code_bytes, kb = kcb + g.key_meta_bytes, vcb = g.value_code_bytes;
  std::memset(out, 0, g.slot_bytes);
  std::memcpy(out, page + g.key_codes(t, head), kcb);
  std::memcpy(out + kb, page + g.value_codes(t, head), vcb);
  for (int j = 0; j < g.key_meta_bytes / 2; ++j) std::memcpy(out + kcb + 2 * j, page + g.key_meta(t, head, j), 2);
  for (int j = 0; j < g.value_meta_bytes / 2; ++j)
    std::memcpy(out + kb + vcb + 2 * j, page + g.value_meta(t, head, j), 2);
}

void pool_store(const SlotCodec& c, const PagePool& pool, std::span<const int64_t> slot_mapping, const float* k,
                const float* v) {
  const PageGeometry& g = pool.geometry;
  const int64_t n_slots = static_cast<int64_t>(pool.num_blocks) * g.block_size;
  for (size_t i = 0; i < slot_mapping.size(); ++i)
    if (slot_mapping[i] >= n_slots)
      throw Error(ErrorCode::OutOfRange, "store: slot " + std::to_string(slot_mapping[i]) + " of token " +
                                             std::to_string(i) + " is past the pool (" + std::to_string(n_slots) +
                                             " slots)");
  // Encode everything first: a bad token must leave every page as it was.
  const int H = g.n_kv_heads, d = c.dim();
  const size_t sb = c.slot_bytes();
  std::vector<uint8_t> scratch(slot_mapping.size() * H * sb);
  for (size_t i = 0; i < slot_mapping.size(); ++i) {
    if (slot_mapping[i] < 0) continue;
    for (int h = 0; h < H; ++h) {
      const size_t at = i * H + h;
      encode_slot(c, k + at * d, v + at * d, scratch.data() + at * sb);
    }
  }
  const int bs = g.block_size;
  const auto pb = static_cast<size_t>(g.page_bytes());
  for (size_t i = 0; i < slot_mapping.size(); ++i) {
    const int64_t s = slot_mapping[i];
    if (s < 0) continue;
    uint8_t* page = pool.pages + static_cast<size_t>(s / bs) * pb;
    for (int h = 0; h < H; ++h) place_slot(g, page, static_cast<int>(s % bs), h, scratch.data() + (i * H + h) * sb);
  }
}

void pool_decode(const SlotCodec& c, const PagePool& pool, const PagedSeq& seq, int64_t start, int count, bool keys,
                 float* out) {
  const PageGeometry& g = pool.geometry;
  const int bs = g.block_size;
  if (count < 0 || start < 0 || start + count > seq.len)
    throw Error(ErrorCode::OutOfRange, "decode range [" + std::to_string(start) + ", " +
                                           std::to_string(start + count) + ") past the end of the sequence (length " +
                                           std::to_string(seq.len) + ")");
  if (count == 0) return;
  const int64_t last_block = (start + count - 1) / bs;
  if (last_block >= static_cast<int64_t>(seq.blocks.size()))
    throw Error(ErrorCode::OutOfRange, "decode: the block table holds " + std::to_string(seq.blocks.size()) +
                                           " pages, position " + std::to_string(start + count - 1) + " needs " +
                                           std::to_string(last_block + 1));
  for (int64_t b = start / bs; b <= last_block; ++b)
    if (seq.blocks[b] < 0 || seq.blocks[b] >= pool.num_blocks)
      throw Error(ErrorCode::OutOfRange, "decode: block " + std::to_string(seq.blocks[b]) + " outside the pool of " +
                                             std::to_string(pool.num_blocks));
  const int H = g.n_kv_heads, d = c.dim();
  const auto pb = static_cast<size_t>(g.page_bytes());
  std::vector<uint8_t> slot(c.slot_bytes());
  for (int t = 0; t < count; ++t) {
    const int64_t pos = start + t;
    const uint8_t* page = pool.pages + static_cast<size_t>(seq.blocks[pos / bs]) * pb;
    for (int h = 0; h < H; ++h) {
      gather_slot(g, page, static_cast<int>(pos % bs), h, slot.data());
      float* o = out + (static_cast<size_t>(t) * H + h) * d;
      if (keys)
        c.decode_key(slot.data(), o);
      else
        c.decode_value(slot.data() + c.key_bytes(), o);
    }
  }
}

}  // namespace tqkv
