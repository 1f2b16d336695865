// Absurd cache sizes are refused with tqkv::Error before anything is allocated: a size_t product
// that wraps would otherwise map a short buffer that the first writes overrun.
#include <gtest/gtest.h>

#include <climits>
#include <cstdint>
#include <new>
#include <string>

#include "page_buffer.h"  // src/cpu (white box)
#include "tqkv/contiguous_cache.h"
#include "tqkv/error.h"
#include "tqkv/paged_cache.h"

namespace tqkv {
namespace {

// Runs make(), which must throw tqkv::Error(InvalidArgument) whose message names `words`.
template <class Make>
void expect_size_error(Make make, const std::string& words) {
  try {
    make();
    ADD_FAILURE() << "no error: the cache was made";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

// 2^27 heads x 2^27 positions x 1,024-byte f32 slots (d = 128): 2^64 bytes, which wraps to 0,
// a cache without storage.
TEST(CacheSizes, ContiguousCacheRefusesAProductPastSizeT) {
  ContiguousCacheConfig cfg;
  cfg.n_kv_heads = 1 << 27;
  cfg.capacity = 1 << 27;
  cfg.head_dim = 128;
  cfg.layer_formats = {find_format("f32")};
  expect_size_error([&] { ContiguousCache c(cfg); }, "overflows");
  cfg.n_kv_heads = INT_MAX;  // and a product that wraps to a huge one
  cfg.capacity = INT_MAX;
  expect_size_error([&] { ContiguousCache c(cfg); }, "overflows");
}

// 128 tokens x 2^27 heads x 1,024 bytes per page (2^44) x 2^20 pages: 2^64 bytes, wrapping to 0.
TEST(CacheSizes, PagedCacheRefusesAPoolPastSizeT) {
  PagedCacheConfig cfg;
  cfg.block_size = 128;
  cfg.n_kv_heads = 1 << 27;
  cfg.num_blocks = 1 << 20;
  cfg.head_dim = 128;
  cfg.layer_formats = {find_format("f32")};
  expect_size_error([&] { PagedCache c(cfg); }, "overflows");
}

// A slot of 2^31 bytes (f32 keys and values of 2^28 dims) does not fit the page geometry's int
// fields (page_geometry.h), which every page offset is computed from.
TEST(CacheSizes, PagedCacheRefusesASlotPastThePageGeometry) {
  PagedCacheConfig cfg;
  cfg.head_dim = 1 << 28;
  cfg.num_blocks = 1;
  cfg.layer_formats = {find_format("f32")};
  expect_size_error([&] { PagedCache c(cfg); }, "slot");
}

// Within 4 MiB of SIZE_MAX the 2 MiB rounding of a huge-page buffer would wrap to a small mapping.
TEST(CacheSizes, PageBufferRefusesWhatItCannotRound) {
  EXPECT_THROW(cpu::PageBuffer(SIZE_MAX - 10), std::bad_alloc);
  EXPECT_THROW(cpu::PageBuffer(SIZE_MAX - (size_t{3} << 20)), std::bad_alloc);
}

}  // namespace
}  // namespace tqkv
