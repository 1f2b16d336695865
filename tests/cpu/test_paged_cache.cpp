#include <gtest/gtest.h>

#include "../common/test_data.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "tqkv/attention.h"
#include "tqkv/error.h"
#include "tqkv/paged_cache.h"
#include "tqkv/simd.h"
#include "tqkv/threads.h"

namespace tqkv {
namespace {

using testing_util::gaussian;
using testing_util::LevelGuard;
using testing_util::rel_error;

PagedCacheConfig config(const char* format, int bs, PageLayout layout, int blocks = 64, int H = 2, int d = 64) {
  PagedCacheConfig c;
  c.n_layers = 2;
  c.n_kv_heads = H;
  c.head_dim = d;
  c.block_size = bs;
  c.num_blocks = blocks;
  c.layout = layout;
  c.layer_formats = {find_format(format), find_format(format)};
  return c;
}

// Appends n random tokens to a sequence in every layer; returns the K/V written.
std::pair<std::vector<float>, std::vector<float>> append(PagedCache& cache, int64_t seq, int n, uint64_t seed) {
  const int H = cache.n_kv_heads(), d = cache.head_dim();
  auto k = gaussian(static_cast<size_t>(n) * H * d, seed), v = gaussian(k.size(), seed + 1);
  const auto slots = cache.append_slots(seq, n);
  for (int l = 0; l < cache.n_layers(); ++l) cache.store(l, slots, k.data(), v.data(), H, d);
  return {k, v};
}

// The same tokens (k, v: [n, H, d]) in a one-layer contiguous cache of `format`, for comparisons.
ContiguousCache flat_copy(const char* format, int H, int d, int capacity, int n, const std::vector<float>& k,
                          const std::vector<float>& v) {
  ContiguousCacheConfig cc;
  cc.n_kv_heads = H;
  cc.head_dim = d;
  cc.capacity = capacity;
  cc.layer_formats = {find_format(format)};
  ContiguousCache flat(cc);
  flat.write(0, 0, n, k.data(), v.data());
  return flat;
}

TEST(PagedCache, PoolFreeListAndRefCounts) {
  PagedCache cache(config("tq-k4v2", 16, PageLayout::Slot, 4));
  EXPECT_EQ(cache.free_blocks(), 4);
  const int64_t a = cache.add_sequence();
  const auto slots = cache.append_slots(a, 20);  // 2 pages
  EXPECT_EQ(cache.free_blocks(), 2);
  ASSERT_EQ(cache.block_table(a).size(), 2u);
  const int32_t b0 = cache.block_table(a)[0], b1 = cache.block_table(a)[1];
  EXPECT_EQ(slots[0], b0 * 16);
  EXPECT_EQ(slots[17], b1 * 16 + 1);
  EXPECT_EQ(cache.ref_count(b0), 1);
  // Exhausting the pool fails and changes nothing.
  const int64_t b = cache.add_sequence();
  EXPECT_THROW(cache.append_slots(b, 3 * 16 + 1), Error);
  try {
    cache.append_slots(b, 100);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Capacity);
  }
  EXPECT_EQ(cache.free_blocks(), 2);
  EXPECT_EQ(cache.seq_len(b), 0);
  cache.append_slots(b, 32);
  EXPECT_EQ(cache.free_blocks(), 0);
  cache.free_sequence(a);
  EXPECT_EQ(cache.free_blocks(), 2);
  EXPECT_EQ(cache.ref_count(b0), 0);
  EXPECT_THROW(cache.seq_len(a), Error);
  EXPECT_THROW(cache.append_slots(a, 1), Error);
  EXPECT_THROW(PagedCache(config("f16", 24, PageLayout::Slot)), Error);
}

TEST(PagedCache, ForkSharesFullPagesAndCopiesThePartialLastOnWrite) {
  for (PageLayout layout : {PageLayout::Slot, PageLayout::Page}) {
    PagedCache cache(config("turboquant_k3v4_nc", 16, layout, 16));
    const int64_t parent = cache.add_sequence();
    const auto [k, v] = append(cache, parent, 40, 1);  // pages: full, full, 8 of 16
    const int64_t child = cache.fork(parent);
    const std::vector<int32_t> pt(cache.block_table(parent).begin(), cache.block_table(parent).end());
    for (int32_t blk : pt) EXPECT_EQ(cache.ref_count(blk), 2);
    const int free_before = cache.free_blocks();
    append(cache, child, 3, 7);  // writes into the shared partial page: copy it
    const auto ct = cache.block_table(child);
    EXPECT_EQ(ct[0], pt[0]);
    EXPECT_EQ(ct[1], pt[1]);
    EXPECT_NE(ct[2], pt[2]);
    EXPECT_EQ(cache.free_blocks(), free_before - 1);
    EXPECT_EQ(cache.ref_count(pt[0]), 2);
    EXPECT_EQ(cache.ref_count(pt[2]), 1);
    EXPECT_EQ(cache.seq_len(parent), 40);
    EXPECT_EQ(cache.seq_len(child), 43);
    // The shared prefix decodes identically from both, and the parent is untouched.
    for (int l = 0; l < 2; ++l) {
      std::vector<float> a(40 * 2 * 64), b(a.size());
      cache.decode(l, parent, 0, 40, false, a.data());
      cache.decode(l, child, 0, 40, false, b.data());
      EXPECT_EQ(a, b);
    }
    // Appending to the parent now writes its own page (refcount 1): no copy.
    append(cache, parent, 2, 9);
    EXPECT_EQ(cache.block_table(parent)[2], pt[2]);
    cache.free_sequence(parent);
    EXPECT_EQ(cache.ref_count(pt[0]), 1);
  }
}

// The documented bytes (FORMAT.md "Paged cache"), for both layouts, against the codec's slot.
TEST(PagedCache, LayoutsMatchFormatMdByteForByte) {
  const int H = 2, d = 128, bs = 16;
  for (PageLayout layout : {PageLayout::Slot, PageLayout::Page}) {
    PagedCache cache(config("turboquant_k3v4_nc", bs, layout, 4, H, d));
    const int64_t s = cache.add_sequence();
    const auto [k, v] = append(cache, s, 21, 3);
    const SlotCodec& codec = cache.codec(0);
    const size_t sb = 118;
    ASSERT_EQ(codec.slot_bytes(), sb);
    ASSERT_EQ(cache.page_bytes(0), static_cast<size_t>(bs) * H * sb);
    for (int pos : {0, 5, 15, 16, 20}) {
      for (int h = 0; h < H; ++h) {
        std::vector<uint8_t> want(sb);
        codec.encode(&k[(static_cast<size_t>(pos) * H + h) * d], &v[(static_cast<size_t>(pos) * H + h) * d], want.data());
        const uint8_t* page = cache.pool(0) + cache.block_table(s)[pos / bs] * cache.page_bytes(0);
        const int t = pos % bs;
        std::vector<uint8_t> got(sb);
        if (layout == PageLayout::Slot) {
          std::memcpy(got.data(), page + (t * H + h) * sb, sb);
        } else {
          // Section h: K codes (48 B/token), V codes (64 B/token), K norm plane, V scale plane,
          // V zero plane.
          const uint8_t* sec = page + h * bs * sb;
          std::memcpy(got.data(), sec + t * 48, 48);
          std::memcpy(got.data() + 48, sec + bs * 112 + 2 * t, 2);
          std::memcpy(got.data() + 50, sec + bs * 48 + t * 64, 64);
          std::memcpy(got.data() + 114, sec + bs * 112 + bs * 2 + 2 * t, 2);
          std::memcpy(got.data() + 116, sec + bs * 112 + bs * 4 + 2 * t, 2);
        }
        EXPECT_EQ(got, want) << "pos " << pos << " head " << h;
        std::vector<uint8_t> via(sb);
        cache.read_slot(0, s, pos, h, via.data());
        EXPECT_EQ(via, want);
      }
    }
  }
}


// Int8 scores and values over pages: a tile takes whole pages while they fit (kernel_impl.h
// run()), so its runs end at any key, not only at multiples of the 4-key groups of the SIMD
// scorers and value sums. Every level equals the scalar kernel: with zero queries (every
// weight the value's scale: the same integers everywhere, up to float rounding) and with random
// ones (exp's last bit may round a u8 the other way between builds).
TEST(PagedAttention, Int8TilesAcrossPagesEveryLevel) {
  LevelGuard guard;
  testing_util::ScoresGuard int8(KeyScores::Int8);
  const int H = 2, Hq = 6;
  for (int d : {64, 128})
    for (const char* name : {"turboquant_4bit_nc", "tq-k4v2", "turboquant_3bit_nc", "tq-k2v3"})
      for (PageLayout layout : {PageLayout::Slot, PageLayout::Page})
        for (int bs : {16, 64}) {
          PagedCache cache(config(name, bs, layout, 48, H, d));
          const int64_t a = cache.add_sequence(), b = cache.add_sequence();
          append(cache, a, 300, 10);
          append(cache, b, 77, 20);
          const std::vector<int64_t> seqs = {a, b};
          for (bool zero : {true, false})
            for (int window : {0, 33, 101}) {
              const auto q = zero ? std::vector<float>(seqs.size() * Hq * d, 0.0f) : gaussian(seqs.size() * Hq * d, 41);
              AttentionParams p;
              p.n_q_heads = Hq;
              p.window = window;
              std::vector<float> scalar(q.size());
              set_simd_level(SimdLevel::Scalar);
              paged_attention(cache, 1, seqs, q.data(), p, scalar.data());
              for (SimdLevel level : {SimdLevel::Avx2, SimdLevel::Avx512}) {
                if (!simd_level_supported(level)) continue;
                set_simd_level(level);
                std::vector<float> out(q.size(), NAN);
                paged_attention(cache, 1, seqs, q.data(), p, out.data());
                EXPECT_LT(rel_error(out, scalar), zero ? 1e-6 : 2e-3)
                    << name << " d " << d << " bs " << bs << " window " << window << " " << simd_level_name(level);
              }
            }
        }
}

TEST(PagedAttention, BatchMatchesReferenceAndContiguousEveryLevel) {
  LevelGuard guard;
  testing_util::ScoresGuard exact(KeyScores::Exact);
  const int H = 2, Hq = 8, d = 64;
  for (const char* name : {"f16", "fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc", "tq-k4v2",
                           "tq-k3v3"}) {
    for (PageLayout layout : {PageLayout::Slot, PageLayout::Page}) {
      for (int bs : {16, 32, 64, 128}) {
        PagedCache cache(config(name, bs, layout, 48, H, d));
        const int64_t a = cache.add_sequence(), b = cache.add_sequence();
        const auto kv_a = append(cache, a, 300, 10);
        append(cache, b, 77, 20);
        const int64_t c = cache.fork(b);  // shares b's pages, then diverges
        append(cache, c, 5, 30);
        const std::vector<int64_t> seqs = {a, b, c};
        const auto q = gaussian(seqs.size() * Hq * d, 40);
        for (int window : {0, 33}) {
          AttentionParams p;
          p.n_q_heads = Hq;
          p.window = window;
          std::vector<float> ref(q.size());
          paged_attention_reference(cache, 1, seqs, q.data(), p, ref.data());
          for (SimdLevel level : {SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512}) {
            if (!simd_level_supported(level)) continue;
            set_simd_level(level);
            for (int threads : {1, 2}) {
              set_num_threads(threads);
              std::vector<float> out(q.size(), NAN);
              paged_attention(cache, 1, seqs, q.data(), p, out.data());
              EXPECT_LT(rel_error(out, ref), 1e-5) << name << " bs " << bs << " level " << simd_level_name(level);
            }
          }
          // The same tokens in a contiguous cache give the same answer for sequence a.
          const ContiguousCache flat = flat_copy(name, H, d, 512, 300, kv_a.first, kv_a.second);
          AttentionParams ap;
          ap.n_q_heads = Hq;
          ap.window = window;
          std::vector<float> out(Hq * d), paged(Hq * d);
          attention(flat, 0, q.data(), 1, 299, ap, out.data());
          paged_attention(cache, 1, std::vector<int64_t>{a}, q.data(), p, paged.data());
          EXPECT_LT(rel_error(paged, out), 1e-6) << name;
        }
      }
    }
  }
}

// Paged attention honours the shared AttentionParams cuts and lse exactly as the contiguous
// cache does (window, min_key_pos, exclude_recent; a query that sees no key gives 0 and -inf).
TEST(PagedCache, AttentionParamsMatchContiguous) {
  testing_util::ScoresGuard exact(KeyScores::Exact);  // the reference is compared too
  const int H = 2, Hq = 4, d = 64, n = 90;
  for (PageLayout layout : {PageLayout::Slot, PageLayout::Page}) {
    PagedCache cache(config("tq-k4v2", 16, layout, 16, H, d));
    const int64_t a = cache.add_sequence();
    const auto kv = append(cache, a, n, 50);
    const ContiguousCache flat = flat_copy("tq-k4v2", H, d, 128, n, kv.first, kv.second);
    const auto q = gaussian(Hq * d, 60);
    struct Cut {
      int window;
      int64_t min_key_pos;
      int exclude_recent;
    };
    for (const Cut& c : {Cut{0, 0, 0}, Cut{20, 0, 0}, Cut{0, 17, 0}, Cut{0, 0, 9}, Cut{30, 70, 5}, Cut{0, 0, n},
                         Cut{0, n, 0}}) {
      AttentionParams p;
      p.n_q_heads = Hq;
      p.window = c.window;
      p.min_key_pos = c.min_key_pos;
      p.exclude_recent = c.exclude_recent;
      std::vector<float> want(Hq * d), got(Hq * d, NAN), ref(Hq * d, NAN), want_lse(Hq), got_lse(Hq, NAN),
          ref_lse(Hq, NAN);
      p.lse = want_lse.data();
      attention(flat, 0, q.data(), 1, n - 1, p, want.data());
      p.lse = got_lse.data();
      paged_attention(cache, 0, std::vector<int64_t>{a}, q.data(), p, got.data());
      p.lse = ref_lse.data();
      paged_attention_reference(cache, 0, std::vector<int64_t>{a}, q.data(), p, ref.data());
      const bool none = c.exclude_recent >= n || c.min_key_pos >= n;
      for (int i = 0; i < Hq * d; ++i) {
        EXPECT_NEAR(got[i], want[i], 1e-5) << c.window << "/" << c.min_key_pos << "/" << c.exclude_recent;
        EXPECT_NEAR(ref[i], want[i], 1e-4);
        if (none) {
          EXPECT_EQ(got[i], 0.0f);
        }
      }
      for (int h = 0; h < Hq; ++h) {
        if (none) {
          EXPECT_EQ(got_lse[h], -std::numeric_limits<float>::infinity());
          EXPECT_EQ(ref_lse[h], -std::numeric_limits<float>::infinity());
        } else {
          EXPECT_NEAR(got_lse[h], want_lse[h], 1e-4) << h;
          EXPECT_NEAR(ref_lse[h], want_lse[h], 1e-3) << h;
        }
      }
    }
  }
}

// A prefill chunk on the pages (paged_chunk_attention): every query of the chunk, cut causally
// and by every AttentionParams field, gives what tqkv::attention gives on a contiguous cache of
// the same tokens: the same kernel over the same slot bytes, so within float rounding of the
// tiles' order (1e-5), across formats, both layouts and block sizes that cut the chunk mid-page.
TEST(PagedCache, ChunkAttentionMatchesContiguous) {
  testing_util::ScoresGuard exact(KeyScores::Exact);  // int8 scores are rounded per tile of keys
  const int H = 2, Hq = 6, d = 64, n = 150, nq = 41;
  struct Cut {
    int window;
    int64_t min_key_pos;
    int exclude_recent;
  };
  for (const char* name : {"f32", "f16", "turboquant_k8v4", "tq-k4v2", "tq-k3v2", "tq-k4v4"}) {
    for (PageLayout layout : {PageLayout::Slot, PageLayout::Page}) {
      for (int bs : {16, 64}) {
        PagedCache cache(config(name, bs, layout, 16, H, d));
        const int64_t a = cache.add_sequence();
        const auto kv = append(cache, a, n, 70);
        const ContiguousCache flat = flat_copy(name, H, d, 256, n, kv.first, kv.second);
        const auto q = gaussian(static_cast<size_t>(nq) * Hq * d, 80);
        // Chunks from the start (rows that see no key), at a page boundary and mid-page.
        for (int q0 : {0, 64, 97})
        for (const Cut& c : {Cut{0, 0, 0}, Cut{33, 0, 0}, Cut{0, 2, 64}, Cut{512, 2, 64}, Cut{20, 90, 1}}) {
          AttentionParams p;
          p.n_q_heads = Hq;
          p.window = c.window;
          p.min_key_pos = c.min_key_pos;
          p.exclude_recent = c.exclude_recent;
          std::vector<float> want(q.size()), got(q.size(), NAN), want_lse(nq * Hq), got_lse(nq * Hq, NAN);
          p.lse = want_lse.data();
          attention(flat, 0, q.data(), nq, q0, p, want.data());
          p.lse = got_lse.data();
          paged_chunk_attention(cache, 1, a, q.data(), nq, q0, p, got.data());
          const std::string what = std::string(name) + " bs " + std::to_string(bs) + " q0 " + std::to_string(q0) + " window " +
                                   std::to_string(c.window) + " min " + std::to_string(c.min_key_pos) + " excl " +
                                   std::to_string(c.exclude_recent);
          for (size_t i = 0; i < q.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5) << what << " at " << i;
          for (size_t i = 0; i < want_lse.size(); ++i) {
            if (std::isinf(want_lse[i])) ASSERT_EQ(got_lse[i], want_lse[i]) << what;  // saw no key
            else ASSERT_NEAR(got_lse[i], want_lse[i], 1e-5) << what;
          }
        }
        // Positions the sequence does not hold are refused, changing nothing.
        std::vector<float> out(q.size());
        AttentionParams p;
        p.n_q_heads = Hq;
        EXPECT_THROW(paged_chunk_attention(cache, 1, a, q.data(), nq, n - nq + 1, p, out.data()), Error);
        EXPECT_THROW(paged_chunk_attention(cache, 1, a, q.data(), nq, -1, p, out.data()), Error);
        EXPECT_THROW(paged_chunk_attention(cache, 2, a, q.data(), nq, 0, p, out.data()), Error);
        EXPECT_THROW(paged_chunk_attention(cache, 1, a + 1, q.data(), nq, 0, p, out.data()), Error);
      }
    }
  }
}

// share_prefix gives an empty sequence the first n positions of another by sharing pages; the
// first write to a shared, partly filled page copies it, so neither sequence sees the other's.
TEST(PagedCache, SharePrefixSharesPagesAndCopiesOnWrite) {
  const int H = 2, d = 64, bs = 16;
  PagedCache cache(config("tq-k4v2", bs, PageLayout::Page, 16, H, d));
  const int64_t a = cache.add_sequence(), b = cache.add_sequence();
  append(cache, a, 40, 1);  // pages 0, 1 full, 2 holds 8
  std::vector<float> before(static_cast<size_t>(40) * H * d), after(before.size());
  cache.decode(0, a, 0, 40, true, before.data());
  cache.share_prefix(a, b, 37);
  EXPECT_EQ(cache.seq_len(b), 37);
  EXPECT_EQ(cache.free_blocks(), 13);  // nothing taken
  for (int32_t blk : cache.block_table(b)) EXPECT_EQ(cache.ref_count(blk), 2);
  const auto kv_b = append(cache, b, 5, 2);  // b writes 37..41: its copy of page 2, then page 3
  EXPECT_NE(cache.block_table(b)[2], cache.block_table(a)[2]);
  EXPECT_EQ(cache.block_table(b)[1], cache.block_table(a)[1]);
  cache.decode(0, a, 0, 40, true, after.data());
  EXPECT_EQ(before, after) << "a's positions 37..39 are its own";
  std::vector<float> mine(static_cast<size_t>(5) * H * d);
  cache.decode(0, b, 37, 5, true, mine.data());
  std::vector<float> want(mine.size());
  {  // the same keys through a sequence of its own
    const int64_t c = cache.add_sequence();
    const auto slots = cache.append_slots(c, 5);
    cache.store(0, slots, kv_b.first.data(), kv_b.second.data(), H, d);
    cache.decode(0, c, 0, 5, true, want.data());
    cache.free_sequence(c);
  }
  EXPECT_EQ(mine, want);
  EXPECT_THROW(cache.share_prefix(a, b, 1), Error) << "b is not empty";
  const int64_t e = cache.add_sequence();
  EXPECT_THROW(cache.share_prefix(a, e, 41), Error) << "a holds 40";
  EXPECT_THROW(cache.share_prefix(a + 100, e, 1), Error);
  EXPECT_EQ(cache.seq_len(e), 0);
  cache.free_sequence(a);
  cache.free_sequence(b);
  EXPECT_EQ(cache.free_blocks(), 16);
}

TEST(PagedCache, BadInputThrowsAndWritesNothing) {
  PagedCache cache(config("tq-k4v2", 16, PageLayout::Page, 4));
  const int64_t s = cache.add_sequence();
  append(cache, s, 5, 1);
  const std::vector<uint8_t> before(cache.pool(0), cache.pool(0) + cache.page_bytes(0) * 4);
  auto k = gaussian(3 * 2 * 64, 5), v = gaussian(3 * 2 * 64, 6);
  const auto slots = cache.append_slots(s, 3);
  // Mismatched head dim / head count.
  EXPECT_THROW(cache.store(0, slots, k.data(), v.data(), 2, 32), Error);
  EXPECT_THROW(cache.store(0, slots, k.data(), v.data(), 1, 64), Error);
  // A slot past the pool.
  std::vector<int64_t> bad = slots;
  bad[2] = 4 * 16;
  EXPECT_THROW(cache.store(0, bad, k.data(), v.data(), 2, 64), Error);
  // NaN in the last token.
  k[2 * 2 * 64 + 3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(cache.store(0, slots, k.data(), v.data(), 2, 64), Error);
  EXPECT_THROW(cache.store(2, slots, k.data(), v.data(), 2, 64), Error);
  const std::vector<uint8_t> after(cache.pool(0), cache.pool(0) + cache.page_bytes(0) * 4);
  EXPECT_EQ(before, after);
  // Unknown sequence, position past the end, bad attention arguments.
  std::vector<float> out(64 * 6, 7.0f), q(64 * 6, 0.5f);
  EXPECT_THROW(cache.decode(0, s, 7, 2, true, out.data()), Error);
  EXPECT_THROW(cache.decode(0, 99, 0, 1, true, out.data()), Error);
  EXPECT_THROW(cache.fork(99), Error);
  AttentionParams p;
  p.n_q_heads = 6;
  EXPECT_THROW(paged_attention(cache, 0, std::vector<int64_t>{99}, q.data(), p, out.data()), Error);
  p.head_dim = 128;
  EXPECT_THROW(paged_attention(cache, 0, std::vector<int64_t>{s}, q.data(), p, out.data()), Error);
  p.head_dim = 64;
  p.n_q_heads = 3;
  EXPECT_THROW(paged_attention(cache, 0, std::vector<int64_t>{s}, q.data(), p, out.data()), Error);
  p.n_q_heads = 6;
  p.exclude_recent = -1;
  EXPECT_THROW(paged_attention(cache, 0, std::vector<int64_t>{s}, q.data(), p, out.data()), Error);
  p.exclude_recent = 0;
  const int64_t empty = cache.add_sequence();
  EXPECT_THROW(paged_attention(cache, 0, std::vector<int64_t>{s, empty}, q.data(), p, out.data()), Error);
  EXPECT_THROW(paged_attention(cache, 5, std::vector<int64_t>{s}, q.data(), p, out.data()), Error);
  EXPECT_EQ(out[0], 7.0f);
}

TEST(PagedCache, NegativeSlotsAreSkipped) {
  PagedCache cache(config("f32", 16, PageLayout::Slot, 2));
  const int64_t s = cache.add_sequence();
  const auto slots = cache.append_slots(s, 2);
  const auto k = gaussian(2 * 2 * 64, 1), v = gaussian(2 * 2 * 64, 2);
  const std::vector<int64_t> mapping = {slots[0], -1};
  cache.store(0, mapping, k.data(), v.data(), 2, 64);
  std::vector<float> out(2 * 2 * 64);
  cache.decode(0, s, 0, 2, true, out.data());
  for (int i = 0; i < 128; ++i) EXPECT_EQ(out[i], k[i]);
  for (int i = 128; i < 256; ++i) EXPECT_EQ(out[i], 0.0f);
}

}  // namespace
}  // namespace tqkv
