#include "tqkv/paged_cache.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "checked_size.h"
#include "page_buffer.h"
#include "tqkv/error.h"

namespace tqkv {

PagedCache::PagedCache(const PagedCacheConfig& config) : config_(config) {
  const int bs = config_.block_size;
  if (bs != 16 && bs != 32 && bs != 64 && bs != 128)
    throw Error(ErrorCode::InvalidArgument, "block_size must be 16, 32, 64 or 128, got " + std::to_string(bs));
  if (config_.n_layers < 1 || config_.n_kv_heads < 1 || config_.head_dim < 2 || config_.num_blocks < 1)
    throw Error(ErrorCode::InvalidArgument,
                "paged cache needs n_layers >= 1, n_kv_heads >= 1, head_dim >= 2, num_blocks >= 1");
  if (config_.layer_formats.empty()) config_.layer_formats.assign(config_.n_layers, find_format(kDefaultFormat));
  if (static_cast<int>(config_.layer_formats.size()) != config_.n_layers)
    throw Error(ErrorCode::InvalidArgument, "layer_formats has " + std::to_string(config_.layer_formats.size()) +
                                                " entries for " + std::to_string(config_.n_layers) + " layers");
  // Every layer's pool size checked before anything is allocated; the page geometry's fields
  // (page_geometry.h), from which every page offset is computed, are ints.
  std::vector<size_t> pool_bytes;
  for (int l = 0; l < config_.n_layers; ++l) {
    const std::string what = "paged cache layer " + std::to_string(l);
    if (slot_bytes(l) > static_cast<size_t>(std::numeric_limits<int>::max()))
      throw Error(ErrorCode::InvalidArgument, what + ": a slot of " + std::to_string(slot_bytes(l)) +
                                                  " bytes (head_dim " + std::to_string(config_.head_dim) +
                                                  ") is past the page geometry's int fields");
    pool_bytes.push_back(cpu::checked_size(what, {{static_cast<size_t>(bs), "tokens per page"},
                                                  {config_.n_kv_heads, "kv heads"},
                                                  {slot_bytes(l), "bytes per slot"},
                                                  {config_.num_blocks, "pages"}}));
  }
  for (int l = 0; l < config_.n_layers; ++l) {
    codecs_.push_back(std::make_unique<SlotCodec>(config_.layer_formats[l], config_.head_dim, config_.seed));
    pools_.push_back(std::make_unique<cpu::PageBuffer>(pool_bytes[l]));
  }
  refs_.assign(config_.num_blocks, 0);
  for (int32_t b = config_.num_blocks - 1; b >= 0; --b) free_.push_back(b);  // block 0 first
}

PagedCache::~PagedCache() = default;
PagedCache::PagedCache(PagedCache&&) noexcept = default;
PagedCache& PagedCache::operator=(PagedCache&&) noexcept = default;

void PagedCache::check_layer(int layer) const {
  if (layer < 0 || layer >= config_.n_layers)
    throw Error(ErrorCode::OutOfRange, "layer " + std::to_string(layer) + " out of range [0, " +
                                           std::to_string(config_.n_layers) + ")");
}

const Format& PagedCache::format(int layer) const {
  check_layer(layer);
  return config_.layer_formats[layer];
}

const SlotCodec& PagedCache::codec(int layer) const {
  check_layer(layer);
  return *codecs_[layer];
}

int PagedCache::ref_count(int32_t block) const {
  if (block < 0 || block >= config_.num_blocks) throw Error(ErrorCode::OutOfRange, "block id out of range");
  return refs_[block];
}

const PagedCache::Sequence& PagedCache::seq_at(int64_t seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw Error(ErrorCode::OutOfRange, "unknown sequence " + std::to_string(seq));
  return it->second;
}

int64_t PagedCache::add_sequence() {
  seqs_.emplace(next_id_, Sequence{});
  return next_id_++;
}

int64_t PagedCache::fork(int64_t parent) {
  const int64_t n = seq_len(parent);
  const int64_t child = add_sequence();
  share_prefix(parent, child, n);
  return child;
}

void PagedCache::share_prefix(int64_t src, int64_t dst, int64_t n) {
  const Sequence& a = seq_at(src);
  seq_at(dst);
  Sequence& b = seqs_[dst];
  if (b.len != 0 || !b.blocks.empty())
    throw Error(ErrorCode::OutOfRange, "share_prefix: sequence " + std::to_string(dst) + " is not empty");
  if (n < 0 || n > a.len)
    throw Error(ErrorCode::OutOfRange, "share_prefix: " + std::to_string(n) + " positions asked, sequence " +
                                           std::to_string(src) + " holds " + std::to_string(a.len));
  const int bs = config_.block_size;
  b.blocks.assign(a.blocks.begin(), a.blocks.begin() + (n + bs - 1) / bs);
  for (int32_t blk : b.blocks) ++refs_[blk];
  b.len = n;
}

void PagedCache::free_sequence(int64_t seq) {
  const Sequence& s = seq_at(seq);
  for (int32_t b : s.blocks)
    if (--refs_[b] == 0) free_.push_back(b);
  seqs_.erase(seq);
}

int64_t PagedCache::seq_len(int64_t seq) const { return seq_at(seq).len; }

std::span<const int32_t> PagedCache::block_table(int64_t seq) const { return seq_at(seq).blocks; }

std::vector<int64_t> PagedCache::append_slots(int64_t seq, int n) {
  if (n < 0) throw Error(ErrorCode::InvalidArgument, "negative token count");
  seq_at(seq);
  Sequence& s = seqs_[seq];
  const int bs = config_.block_size;
  const int64_t have = static_cast<int64_t>(s.blocks.size());
  const int64_t need_total = (s.len + n + bs - 1) / bs;
  const bool cow = n > 0 && s.len % bs != 0 && refs_[s.blocks.back()] > 1;
  const int64_t need = need_total - have + (cow ? 1 : 0);
  if (need > static_cast<int64_t>(free_.size()))
    throw Error(ErrorCode::Capacity, "block pool exhausted: " + std::to_string(n) + " tokens need " +
                                         std::to_string(need) + " free blocks, " + std::to_string(free_.size()) +
                                         " left");
  if (cow) {  // copy the shared partly filled last page (every layer), then write to the copy
    const int32_t old = s.blocks.back(), fresh = free_.back();
    free_.pop_back();
    for (int l = 0; l < config_.n_layers; ++l) {
      const size_t pb = page_bytes(l);
      std::memcpy(pools_[l]->data() + fresh * pb, pools_[l]->data() + old * pb, pb);
    }
    --refs_[old];
    refs_[fresh] = 1;
    s.blocks.back() = fresh;
  }
  while (static_cast<int64_t>(s.blocks.size()) < need_total) {
    const int32_t b = free_.back();
    free_.pop_back();
    refs_[b] = 1;
    for (int l = 0; l < config_.n_layers; ++l)  // fresh pages read as zeros (padding included)
      std::memset(pools_[l]->data() + b * page_bytes(l), 0, page_bytes(l));
    s.blocks.push_back(b);
  }
  std::vector<int64_t> slots(n);
  for (int i = 0; i < n; ++i) {
    const int64_t pos = s.len + i;
    slots[i] = static_cast<int64_t>(s.blocks[pos / bs]) * bs + pos % bs;
  }
  s.len += n;
  return slots;
}

PagePool PagedCache::page_pool(int layer) const {
  check_layer(layer);
  return {pools_[layer]->data(), config_.num_blocks, geometry(layer)};
}

void PagedCache::store(int layer, std::span<const int64_t> slot_mapping, const float* k, const float* v,
                       int n_kv_heads, int head_dim) {
  check_layer(layer);
  if (n_kv_heads != config_.n_kv_heads || head_dim != config_.head_dim)
    throw Error(ErrorCode::InvalidArgument,
                "store: K/V shape [*, " + std::to_string(n_kv_heads) + ", " + std::to_string(head_dim) +
                    "] does not match the cache [*, " + std::to_string(config_.n_kv_heads) + ", " +
                    std::to_string(config_.head_dim) + "]");
  pool_store(*codecs_[layer], page_pool(layer), slot_mapping, k, v);
}

void PagedCache::read_slot(int layer, int64_t seq, int64_t pos, int head, uint8_t* out) const {
  check_layer(layer);
  const Sequence& s = seq_at(seq);
  if (pos < 0 || pos >= s.len)
    throw Error(ErrorCode::OutOfRange, "position " + std::to_string(pos) + " past the end of sequence " +
                                           std::to_string(seq) + " (length " + std::to_string(s.len) + ")");
  if (head < 0 || head >= config_.n_kv_heads) throw Error(ErrorCode::OutOfRange, "kv head out of range");
  const int bs = config_.block_size;
  gather_slot(geometry(layer), pools_[layer]->data() + s.blocks[pos / bs] * page_bytes(layer),
              static_cast<int>(pos % bs), head, out);
}

void PagedCache::decode(int layer, int64_t seq, int64_t start, int count, bool keys, float* out) const {
  check_layer(layer);
  pool_decode(*codecs_[layer], page_pool(layer), paged_seq(seq), start, count, keys, out);
}

const uint8_t* PagedCache::pool(int layer) const {
  check_layer(layer);
  return pools_[layer]->data();
}

uint8_t* PagedCache::pool_mut(int layer) {
  check_layer(layer);
  return pools_[layer]->data();
}

size_t PagedCache::bytes() const {
  size_t total = 0;
  for (const auto& p : pools_) total += p->size();
  return total;
}

}  // namespace tqkv
