// The fa_tq_* C API over tqkv::ContiguousCache and tqkv::attention.
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "tqkv/attention.h"
#include "tqkv/contiguous_cache.h"
#include "tqkv/error.h"
#include "tqkv/format.h"
#include "tqkv/tqkv.h"

struct fa_tq_state {
  int head_dim;
  fa_tq_config config;
  uint64_t seed;
  tqkv::Format format;
};

struct fa_tq_cache {
  fa_tq_state* state;
  std::unique_ptr<tqkv::ContiguousCache> cache;
};

namespace {

thread_local fa_tq_status g_status = FA_TQ_OK;
thread_local std::string g_message;

void set_ok() {
  g_status = FA_TQ_OK;
  g_message.clear();
}

void set_error(fa_tq_status s, const std::string& msg) {
  g_status = s;
  g_message = msg;
}

// tqkv::ErrorCode -> the C status, one entry per code.
fa_tq_status status_of(tqkv::ErrorCode c) {
  switch (c) {
    case tqkv::ErrorCode::Ok: return FA_TQ_OK;
    case tqkv::ErrorCode::InvalidArgument: return FA_TQ_ERR_INVALID_ARGUMENT;
    case tqkv::ErrorCode::NonFinite: return FA_TQ_ERR_NON_FINITE;
    case tqkv::ErrorCode::OutOfRange: return FA_TQ_ERR_OUT_OF_RANGE;
    case tqkv::ErrorCode::Capacity: return FA_TQ_ERR_CAPACITY;
    case tqkv::ErrorCode::Overflow: return FA_TQ_ERR_OVERFLOW;
    case tqkv::ErrorCode::Format: return FA_TQ_ERR_INVALID_ARGUMENT;
    case tqkv::ErrorCode::Busy: return FA_TQ_ERR_CAPACITY;
    case tqkv::ErrorCode::Device: return FA_TQ_ERR_DEVICE;
  }
  return FA_TQ_ERR_INVALID_ARGUMENT;
}

// Runs f, turning exceptions into the thread's error status. Returns true on success.
template <typename F>
bool guarded(F&& f) {
  try {
    f();
    set_ok();
    return true;
  } catch (const tqkv::Error& e) {
    set_error(status_of(e.code()), e.what());
  } catch (const std::bad_alloc&) {
    set_error(FA_TQ_ERR_CAPACITY, "out of memory");
  } catch (const std::exception& e) {
    set_error(FA_TQ_ERR_INVALID_ARGUMENT, e.what());
  }
  return false;
}

bool check_cache(const fa_tq_cache* cache) {
  if (!cache || !cache->cache) {
    set_error(FA_TQ_ERR_INVALID_ARGUMENT, "null cache");
    return false;
  }
  return true;
}

// A call that takes a state needs the one its cache was made with: another state may differ in
// head_dim, bits or seed (codes read with another rotation are silently wrong), and a null one
// is a caller's slip the cache could hide.
bool check_cache(const fa_tq_state* state, const fa_tq_cache* cache) {
  if (!check_cache(cache)) return false;
  if (!state) {
    set_error(FA_TQ_ERR_INVALID_ARGUMENT, "null state");
    return false;
  }
  if (state != cache->state) {
    set_error(FA_TQ_ERR_INVALID_ARGUMENT, "cache was created with a different state");
    return false;
  }
  return true;
}

}  // namespace

extern "C" {

fa_tq_config fa_tq_config_default(void) { return fa_tq_config{4, 2}; }

fa_tq_state* fa_tq_init(int head_dim, fa_tq_config config, uint64_t seed) {
  fa_tq_state* out = nullptr;
  guarded([&] {
    if (head_dim < 2) throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "head_dim must be >= 2");
    // The C API keeps the spec's range (tqkv.h); the C++ pairs go from 1 to 8 bits.
    if (config.key_bits < 2 || config.key_bits > 4 || config.value_bits < 2 || config.value_bits > 4)
      throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "key_bits and value_bits must be in 2..4, got K" +
                                                              std::to_string(config.key_bits) + "/V" +
                                                              std::to_string(config.value_bits));
    const tqkv::Format f = tqkv::mse_pair_format(config.key_bits, config.value_bits);
    // Build a codec once so that codebooks and the rotation are ready before the first call.
    tqkv::SlotCodec probe(f, head_dim, seed);
    out = new fa_tq_state{head_dim, config, seed, f};
  });
  return out;
}

void fa_tq_free(fa_tq_state* state) { delete state; }

fa_tq_cache* fa_tq_cache_new(fa_tq_state* state, int num_layers, int num_heads, int max_seq_len) {
  fa_tq_cache* out = nullptr;
  guarded([&] {
    if (!state) throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "null state");
    tqkv::ContiguousCacheConfig cfg;
    cfg.n_layers = num_layers;
    cfg.n_kv_heads = num_heads;
    cfg.head_dim = state->head_dim;
    cfg.capacity = max_seq_len;
    cfg.seed = state->seed;
    if (num_layers > 0) cfg.layer_formats.assign(num_layers, state->format);
    out = new fa_tq_cache{state, std::make_unique<tqkv::ContiguousCache>(cfg)};
  });
  return out;
}

void fa_tq_cache_free(fa_tq_cache* cache) { delete cache; }

void fa_tq_cache_clear(fa_tq_cache* cache) {
  if (check_cache(cache)) guarded([&] { cache->cache->clear(); });
}

int fa_tq_cache_seq_len(fa_tq_cache* cache) {
  if (!check_cache(cache)) return -1;
  set_ok();
  return static_cast<int>(cache->cache->seq_len());
}

int fa_tq_cache_first_pos(fa_tq_cache* cache) {
  if (!check_cache(cache)) return -1;
  set_ok();
  return static_cast<int>(cache->cache->first_pos());
}

int fa_tq_cache_bytes_per_token(fa_tq_cache* cache) {
  if (!check_cache(cache)) return -1;
  set_ok();
  return static_cast<int>(cache->cache->bytes_per_token());
}

void fa_tq_quantize(fa_tq_state* state, fa_tq_cache* cache, int layer, int pos, const float* vec, bool is_key) {
  if (!check_cache(state, cache)) return;
  guarded([&] {
    if (!vec) throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "null vector");
    if (is_key)
      cache->cache->write_keys(layer, pos, 1, vec);
    else
      cache->cache->write_values(layer, pos, 1, vec);
  });
}

float* fa_tq_dequantize(fa_tq_state* state, fa_tq_cache* cache, int layer, int start, int count, bool is_key,
                        float* out) {
  if (!check_cache(state, cache)) return nullptr;
  const bool ok = guarded([&] {
    if (!out) throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "null output");
    cache->cache->decode(layer, start, count, is_key, out);
  });
  return ok ? out : nullptr;
}

fa_tq_status fa_tq_last_error(void) { return g_status; }
const char* fa_tq_last_error_message(void) { return g_message.c_str(); }

int fa_tq_cache_evict(fa_tq_cache* cache, int n) {
  if (!check_cache(cache)) return -1;
  return guarded([&] { cache->cache->evict_oldest(n); }) ? 0 : -1;
}

int fa_tq_attention(fa_tq_state* state, fa_tq_cache* cache, int layer, int pos, const float* q, int num_q_heads,
                    float scale, float* out) {
  if (!check_cache(state, cache)) return -1;
  const bool ok = guarded([&] {
    if (!q || !out) throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "null query or output");
    const tqkv::ContiguousCache& c = *cache->cache;
    std::vector<float> tmp(static_cast<size_t>(num_q_heads > 0 ? num_q_heads : 0) * c.head_dim());
    tqkv::AttentionParams p;
    p.n_q_heads = num_q_heads;
    p.scale = scale;
    tqkv::attention(c, layer, q, 1, pos, p, tmp.data());
    std::memcpy(out, tmp.data(), tmp.size() * sizeof(float));
  });
  return ok ? 0 : -1;
}

}  // extern "C"
