// CUDA kernels vs the scalar CPU reference (SlotCodec, reference_attention), on random data
// drawn fresh each run (the seed is printed on failure; TQKV_TEST_SEED replays it), with outputs
// poisoned before every launch.
// Every test skips when no CUDA device is present (fails under TQKV_REQUIRE_CUDA=1).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../common/require_cuda.h"
#include "../common/test_seed.h"
#include "tqkv/codec.h"
#include "tqkv/error.h"
#include "tqkv/cuda.h"
#include "tqkv/format.h"
#include "tqkv/half.h"
#include "tqkv/reference_attention.h"

namespace {

using namespace tqkv;
using tqkv::cuda::DType;
using tqkv::cuda::PageLayout;

#define CK(expr) ASSERT_EQ(cudaSuccess, (expr)) << #expr << ": " << cudaGetErrorString(expr)

bool have_device() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define SKIP_WITHOUT_GPU() TQKV_SKIP_WITHOUT_CUDA(have_device())

template <typename T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) {
    if (cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(count, 1) * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  size_t bytes() const { return n * sizeof(T); }
};

// Random vectors with varied scales and a few outliers (never all zero).
void fill_vectors(std::mt19937_64& rng, std::vector<float>& x, int d) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.05f, 4.0f);
  for (size_t v = 0; v < x.size() / d; ++v) {
    const float s = ud(rng);
    const float bias = 0.3f * nd(rng);
    for (int i = 0; i < d; ++i) x[v * d + i] = s * (nd(rng) + bias);
    x[v * d + rng() % d] *= 6.0f;
  }
}

// Writes one CPU-encoded slot into a page pool, following docs/FORMAT.md "Paged cache".
void put_slot(std::vector<uint8_t>& pool, PageLayout layout, const Format& f, int d, int bs, int H, int64_t page,
              int off, int h, const uint8_t* slot) {
  const size_t sb = f.slot_bytes(d), pb = static_cast<size_t>(bs) * H * sb;
  uint8_t* base = pool.data() + page * pb;
  if (layout == PageLayout::Slot) {
    std::memcpy(base + (static_cast<size_t>(off) * H + h) * sb, slot, sb);
    return;
  }
  const size_t kcb = f.key_code_bytes(d), kmb = f.key_meta_bytes(), vcb = f.value_code_bytes(d),
               vmb = f.value_meta_bytes();
  uint8_t* sec = base + static_cast<size_t>(h) * bs * sb;
  std::memcpy(sec + off * kcb, slot, kcb);
  std::memcpy(sec + bs * kcb + off * vcb, slot + kcb + kmb, vcb);
  if (kmb) std::memcpy(sec + bs * (kcb + vcb) + off * 2, slot + kcb, 2);
  uint8_t* vm = sec + bs * (kcb + vcb + kmb);
  if (vmb) std::memcpy(vm + off * 2, slot + kcb + kmb + vcb, 2);
  if (vmb == 4) std::memcpy(vm + 2 * bs + off * 2, slot + kcb + kmb + vcb + 2, 2);
  if ((kcb + kmb + vcb + vmb) & 1) sec[bs * (kcb + kmb + vcb + vmb) + off] = 0;
}

// The inverse of put_slot: gathers one slot's bytes back from a pool.
void get_slot(const std::vector<uint8_t>& pool, PageLayout layout, const Format& f, int d, int bs, int H, int64_t page,
              int off, int h, uint8_t* slot) {
  const size_t sb = f.slot_bytes(d), pb = static_cast<size_t>(bs) * H * sb;
  const uint8_t* base = pool.data() + page * pb;
  if (layout == PageLayout::Slot) {
    std::memcpy(slot, base + (static_cast<size_t>(off) * H + h) * sb, sb);
    return;
  }
  const size_t kcb = f.key_code_bytes(d), kmb = f.key_meta_bytes(), vcb = f.value_code_bytes(d),
               vmb = f.value_meta_bytes();
  const uint8_t* sec = base + static_cast<size_t>(h) * bs * sb;
  std::memcpy(slot, sec + off * kcb, kcb);
  std::memcpy(slot + kcb + kmb, sec + bs * kcb + off * vcb, vcb);
  if (kmb) std::memcpy(slot + kcb, sec + bs * (kcb + vcb) + off * 2, 2);
  const uint8_t* vm = sec + bs * (kcb + vcb + kmb);
  if (vmb) std::memcpy(slot + kcb + kmb + vcb, vm + off * 2, 2);
  if (vmb == 4) std::memcpy(slot + kcb + kmb + vcb + 2, vm + 2 * bs + off * 2, 2);
  if ((kcb + kmb + vcb + vmb) & 1) slot[sb - 1] = sec[bs * (kcb + kmb + vcb + vmb) + off];
}

// Variants beyond the named formats, one of each width class: Mse codes of 1..8 bits (the
// pair lookups of <= 4 bits, the single lookups of 5..8), Uniform values of odd and wide widths,
// plain keys or values next to codes, Gauss/Hadamard/raw modifiers.
std::vector<Format> variant_formats() {
  std::vector<Format> v;
  for (const char* name : {"k1v1", "k5v5", "k6v6", "k7v7", "k8v8", "k2v8", "k8v2", "k5v3", "k6v3", "k5v2+vu",
                           "k8v7+vu", "k3v6+gauss+had+vu+raw", "kfp8v6", "kfp8v5+vu", "k5vf16", "kbf16v7+vu", "k6vfp8"}) {
    const auto f = Format::try_parse(name);
    if (f) v.push_back(*f);
    else ADD_FAILURE() << "not a format: " << name;
  }
  return v;
}

std::vector<Format> store_formats() {
  std::vector<Format> v;
  for (const NamedFormat& f : named_formats()) v.push_back(f.format);
  for (const Format& f : variant_formats()) v.push_back(f);
  return v;
}

// Every pair of a key side (Mse codes of 2..8 bits, fp8, f16, bf16) and a value side (Mse or
// Uniform codes of 2..8 bits, fp8, f16, bf16): 170 formats. Those without a compiled kernel at a
// head dim (src/cuda/decode_pairs.cmake) decode through the engine's generic path.
std::vector<Format> decode_formats() {
  std::vector<std::string> keys, values;
  for (int b = 2; b <= 8; ++b) keys.push_back(std::string("k") + std::to_string(b));
  for (const char* k : {"kfp8", "kf16", "kbf16"}) keys.push_back(k);
  for (int b = 2; b <= 8; ++b) values.push_back(std::string("v") + std::to_string(b));
  for (int b = 2; b <= 8; ++b) values.push_back(std::string("v") + std::to_string(b) + "+vu");
  for (const char* v : {"vfp8", "vf16", "vbf16"}) values.push_back(v);
  std::vector<Format> out;
  for (const std::string& k : keys)
    for (const std::string& v : values) out.push_back(Format::parse(k + v));
  return out;
}

uint16_t to_bf16(float x) { return float_to_bf16(x); }

// ---------------------------------------------------------------------------------------------
// Store: byte-identical to SlotCodec::encode, for every format, dim and page arrangement.

void run_store_case(const Format& f, int d, PageLayout layout, DType dtype, uint64_t seed, size_t& slots_total,
                    size_t& slots_diff) {
  std::mt19937_64 rng(seed);
  const int H = 3, bs = 16, num_blocks = 11, n_tokens = 150;
  const tqkv::cuda::CacheCodec codec(f, d);
  const SlotCodec cpu(f, d);
  const size_t sb = f.slot_bytes(d);
  const size_t pool_bytes = static_cast<size_t>(num_blocks) * bs * H * sb;

  std::vector<float> k(static_cast<size_t>(n_tokens) * H * d), v(k.size());
  fill_vectors(rng, k, d);
  fill_vectors(rng, v, d);
  std::vector<int64_t> slots(static_cast<size_t>(num_blocks) * bs);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(n_tokens);
  for (auto& s : slots)
    if (rng() % 10 == 0) s = -1;

  // Inputs as the kernel sees them, and as float for the CPU reference.
  std::vector<uint16_t> k16(k.size()), v16(v.size());
  if (dtype == DType::BF16) {
    for (size_t i = 0; i < k.size(); ++i) {
      k16[i] = to_bf16(k[i]);
      v16[i] = to_bf16(v[i]);
      k[i] = bf16_to_float(k16[i]);
      v[i] = bf16_to_float(v16[i]);
    }
  }
  std::vector<uint8_t> poison(pool_bytes);
  for (auto& b : poison) b = static_cast<uint8_t>(rng());

  DevBuf<uint8_t> pool(pool_bytes);
  DevBuf<float> dk(k.size()), dv(v.size());
  DevBuf<int64_t> dslots(slots.size());
  ASSERT_TRUE(pool.p && dk.p && dv.p && dslots.p);
  CK(cudaMemcpy(pool.p, poison.data(), pool_bytes, cudaMemcpyHostToDevice));
  if (dtype == DType::BF16) {
    CK(cudaMemcpy(dk.p, k16.data(), k16.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv.p, v16.data(), v16.size() * 2, cudaMemcpyHostToDevice));
  } else {
    CK(cudaMemcpy(dk.p, k.data(), k.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv.p, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  }
  CK(cudaMemcpy(dslots.p, slots.data(), slots.size() * 8, cudaMemcpyHostToDevice));

  tqkv::cuda::PagedKv kv{pool.p, num_blocks, bs, H, layout};
  tqkv::cuda::StoreArgs args;
  args.k = dk.p;
  args.v = dv.p;
  args.dtype = dtype;
  args.slot_mapping = dslots.p;
  args.n_tokens = n_tokens;
  tqkv::cuda::store(codec, kv, args);
  CK(cudaDeviceSynchronize());
  std::vector<uint8_t> got(pool_bytes);
  CK(cudaMemcpy(got.data(), pool.p, pool_bytes, cudaMemcpyDeviceToHost));

  std::vector<uint8_t> want = poison, slot(sb);
  for (int t = 0; t < n_tokens; ++t) {
    if (slots[t] < 0) continue;
    for (int h = 0; h < H; ++h) {
      const float* kp = &k[(static_cast<size_t>(t) * H + h) * d];
      const float* vp = &v[(static_cast<size_t>(t) * H + h) * d];
      cpu.encode(kp, vp, slot.data());
      put_slot(want, layout, f, d, bs, H, slots[t] / bs, slots[t] % bs, h, slot.data());
    }
  }
  // Compare slot by slot, each gathered back through the reference layout.
  std::vector<uint8_t> got_slot(sb), want_slot(sb);
  for (int t = 0; t < n_tokens; ++t) {
    if (slots[t] < 0) continue;
    for (int h = 0; h < H; ++h) {
      ++slots_total;
      get_slot(got, layout, f, d, bs, H, slots[t] / bs, slots[t] % bs, h, got_slot.data());
      get_slot(want, layout, f, d, bs, H, slots[t] / bs, slots[t] % bs, h, want_slot.data());
      if (got_slot != want_slot) {
        if (slots_diff == 0) {  // show the first difference of this case
          std::string msg;
          for (size_t i = 0, shown = 0; i < sb && shown < 8; ++i)
            if (got_slot[i] != want_slot[i]) {
              msg += " [" + std::to_string(i) + "] got " + std::to_string(got_slot[i]) + " want " +
                     std::to_string(want_slot[i]);
              ++shown;
            }
          std::printf("[store] %s d=%d: first differing slot (t=%d h=%d):%s\n", f.name().c_str(), d, t, h, msg.c_str());
        }
        ++slots_diff;
      }
    }
  }
  // Bytes that no stored slot covers must keep their poison.
  std::vector<uint8_t> covered(pool_bytes, 0), ones(sb, 1);
  for (int t = 0; t < n_tokens; ++t)
    if (slots[t] >= 0)
      for (int h = 0; h < H; ++h) put_slot(covered, layout, f, d, bs, H, slots[t] / bs, slots[t] % bs, h, ones.data());
  // The page layout's pad byte lies outside the slot's own fields: put_slot writes it as 0, so
  // `covered` marks it too.
  size_t untouched_bad = 0;
  for (size_t i = 0; i < pool_bytes; ++i)
    if (!covered[i] && got[i] != poison[i]) ++untouched_bad;
  EXPECT_EQ(untouched_bad, 0u) << f.name() << " d=" << d << ": bytes outside stored slots were modified";
}

TEST(CudaStore, ByteIdenticalToCpuReference) {
  SKIP_WITHOUT_GPU();
  const testing_util::TestSeed test_seed;  // TQKV_TEST_SEED replays a failure
  const uint64_t seed = test_seed.value();
  size_t total_all = 0, diff_all = 0;
  for (const Format& f : store_formats())
    for (int d : {64, 128, 256})
      for (PageLayout layout : {PageLayout::Slot, PageLayout::Page}) {
        size_t total = 0, diff = 0;
        run_store_case(f, d, layout, DType::F32, seed + d + static_cast<int>(layout), total, diff);
        if (HasFatalFailure()) return;
        total_all += total;
        diff_all += diff;
        // Every slot: the kernel does the CPU encoder's arithmetic, and 0 of ~71,000 slots differ on
        // the H200 (docs/gpu_*/cuda_tests.txt), so a single flipped code is a bug, not a tie.
        EXPECT_EQ(diff, 0u) << f.name() << " d=" << d << " layout=" << static_cast<int>(layout) << ": " << diff
                            << " of " << total << " slots differ";
      }
  std::printf("[store] %zu of %zu slots differ from the CPU reference\n", diff_all, total_all);
}

TEST(CudaStore, Bf16InputsMatchCpuReference) {
  SKIP_WITHOUT_GPU();
  const testing_util::TestSeed test_seed;  // TQKV_TEST_SEED replays a failure
  const uint64_t seed = test_seed.value();
  for (const char* name : {"turboquant_4bit_nc", "tq-k4v2", "bf16", "turboquant_k8v4"}) {
    size_t total = 0, diff = 0;
    run_store_case(find_format(name), 128, PageLayout::Page, DType::BF16, seed, total, diff);
    if (HasFatalFailure()) return;
    EXPECT_EQ(diff, 0u) << name << ": " << diff << " of " << total << " slots differ";  // as for f32 inputs
  }
}

// store_many: one launch into three page pools (a layer's compressed pages, its window ring and
// its sinks, each with its own format and slot mapping) writes the bytes three store() calls write,
// and with key_mean/key_scale the bytes store() writes from keys centred as centre_keys centres
// them; bytes outside the stored slots keep their poison.
TEST(CudaStore, ManyTargetsWriteWhatSeparateStoresWrite) {
  SKIP_WITHOUT_GPU();
  const testing_util::TestSeed test_seed;  // TQKV_TEST_SEED replays a failure
  const uint64_t seed = test_seed.value();
  std::mt19937_64 rng(seed);
  const int H = 2, bs = 16, num_blocks = 6, n_tokens = 37;
  for (int d : {64, 128, 256})
    for (bool centred : {false, true}) {
      SCOPED_TRACE("d=" + std::to_string(d) + (centred ? " centred" : ""));
      const std::vector<Format> formats = {find_format("turboquant_4bit_nc"), find_format("f16"), find_format("tq-k3v2")};
      std::vector<float> k(static_cast<size_t>(n_tokens) * H * d), v(k.size()), mean(static_cast<size_t>(H) * d),
          scale(mean.size());
      fill_vectors(rng, k, d);
      fill_vectors(rng, v, d);
      std::uniform_real_distribution<float> ud(0.5f, 2.0f), um(-1.0f, 1.0f);
      for (size_t i = 0; i < mean.size(); ++i) {
        mean[i] = um(rng);
        scale[i] = ud(rng);
      }
      std::vector<float> kc = k;  // what centre_keys leaves: (k - mean) / scale per channel
      for (size_t i = 0; i < kc.size(); ++i) kc[i] = (k[i] - mean[i % mean.size()]) / scale[i % mean.size()];
      DevBuf<float> dk(k.size()), dkc(k.size()), dv(v.size()), dmean(mean.size()), dscale(scale.size());
      ASSERT_TRUE(dk.p && dkc.p && dv.p && dmean.p && dscale.p);
      CK(cudaMemcpy(dk.p, k.data(), dk.bytes(), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dkc.p, kc.data(), dkc.bytes(), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dv.p, v.data(), dv.bytes(), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dmean.p, mean.data(), dmean.bytes(), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dscale.p, scale.data(), dscale.bytes(), cudaMemcpyHostToDevice));
      std::vector<std::unique_ptr<tqkv::cuda::CacheCodec>> codecs;
      std::vector<std::unique_ptr<DevBuf<uint8_t>>> one, sep;
      std::vector<std::unique_ptr<DevBuf<int64_t>>> slots;
      std::vector<std::vector<uint8_t>> poison;
      tqkv::cuda::StoreTarget targets[3];
      for (int i = 0; i < 3; ++i) {
        codecs.push_back(std::make_unique<tqkv::cuda::CacheCodec>(formats[i], d));
        const size_t bytes = static_cast<size_t>(num_blocks) * bs * H * formats[i].slot_bytes(d);
        std::vector<uint8_t> pz(bytes);
        for (auto& b : pz) b = static_cast<uint8_t>(rng());
        poison.push_back(pz);
        one.push_back(std::make_unique<DevBuf<uint8_t>>(bytes));
        sep.push_back(std::make_unique<DevBuf<uint8_t>>(bytes));
        CK(cudaMemcpy(one.back()->p, pz.data(), bytes, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(sep.back()->p, pz.data(), bytes, cudaMemcpyHostToDevice));
        std::vector<int64_t> sl(static_cast<size_t>(num_blocks) * bs);
        std::iota(sl.begin(), sl.end(), 0);
        std::shuffle(sl.begin(), sl.end(), rng);
        sl.resize(n_tokens);
        for (auto& x : sl)
          if (rng() % 4 == 0) x = -1;  // the copies skip most tokens
        slots.push_back(std::make_unique<DevBuf<int64_t>>(sl.size()));
        CK(cudaMemcpy(slots.back()->p, sl.data(), slots.back()->bytes(), cudaMemcpyHostToDevice));
        targets[i] = {codecs.back().get(), {one.back()->p, num_blocks, bs, H, PageLayout::Page}, slots.back()->p};
      }
      tqkv::cuda::StoreArgs args;
      args.k = dk.p;
      args.v = dv.p;
      args.dtype = DType::F32;
      args.n_tokens = n_tokens;
      tqkv::cuda::store_many(targets, 3, args, centred ? dmean.p : nullptr, centred ? dscale.p : nullptr);
      args.k = centred ? dkc.p : dk.p;
      args.split_kv = false;  // the separate stores with one warp per (token, kv head): the same bytes
      for (int i = 0; i < 3; ++i) {
        args.slot_mapping = targets[i].slot_mapping;
        tqkv::cuda::store(*codecs[i], {sep[i]->p, num_blocks, bs, H, PageLayout::Page}, args);
      }
      CK(cudaDeviceSynchronize());
      for (int i = 0; i < 3; ++i) {
        std::vector<uint8_t> a(one[i]->n), b(sep[i]->n);
        CK(cudaMemcpy(a.data(), one[i]->p, a.size(), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(b.data(), sep[i]->p, b.size(), cudaMemcpyDeviceToHost));
        EXPECT_TRUE(a == b) << formats[i].name() << ": one launch and a separate store differ";
        EXPECT_FALSE(a == poison[i]) << formats[i].name() << ": nothing was stored";
      }
      EXPECT_THROW(tqkv::cuda::store_many(targets, 0, args), Error);
      EXPECT_THROW(tqkv::cuda::store_many(targets, 4, args), Error);
      EXPECT_THROW(tqkv::cuda::store_many(targets, 3, args, dmean.p, nullptr), Error);
      tqkv::cuda::StoreTarget other = targets[1];
      tqkv::cuda::CacheCodec wrong_dim(formats[1], d == 64 ? 128 : 64);
      other.codec = &wrong_dim;
      const tqkv::cuda::StoreTarget mixed[2] = {targets[0], other};
      EXPECT_THROW(tqkv::cuda::store_many(mixed, 2, args), Error);
    }
}

// ---------------------------------------------------------------------------------------------
// Shared fixture data for decode and dequantize: a page pool filled by the CPU codec.

struct PagedCase {
  int d, H, group, bs, batch;
  std::vector<int> lens;
  std::vector<int32_t> block_tables;  // [batch, max_blocks]
  int max_blocks = 0, num_blocks = 0;
  std::vector<uint8_t> pool;
  std::vector<std::vector<uint8_t>> slots;  // [b][t * H + h] -> slot bytes
};

PagedCase make_case(const Format& f, int d, int H, int group, int bs, std::vector<int> lens, PageLayout layout,
                    std::mt19937_64& rng) {
  PagedCase c;
  c.d = d, c.H = H, c.group = group, c.bs = bs, c.batch = static_cast<int>(lens.size());
  c.lens = lens;
  for (int L : lens) c.max_blocks = std::max(c.max_blocks, (L + bs - 1) / bs);
  c.max_blocks = std::max(c.max_blocks, 1);
  int total_blocks = 0;
  for (int L : lens) total_blocks += (L + bs - 1) / bs;
  c.num_blocks = total_blocks + 3;  // a few pages nobody owns
  std::vector<int32_t> ids(c.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  c.block_tables.assign(static_cast<size_t>(c.batch) * c.max_blocks, -1);
  int next = 0;
  for (int b = 0; b < c.batch; ++b)
    for (int i = 0; i < (lens[b] + bs - 1) / bs; ++i) c.block_tables[b * c.max_blocks + i] = ids[next++];
  const size_t sb = f.slot_bytes(d);
  c.pool.resize(static_cast<size_t>(c.num_blocks) * bs * H * sb);
  for (auto& x : c.pool) x = static_cast<uint8_t>(rng());  // garbage, NaN patterns included
  const SlotCodec cpu(f, d);
  std::vector<float> k(d), v(d);
  c.slots.resize(c.batch);
  for (int b = 0; b < c.batch; ++b) {
    c.slots[b].resize(static_cast<size_t>(lens[b]) * H * sb);
    for (int t = 0; t < lens[b]; ++t)
      for (int h = 0; h < H; ++h) {
        fill_vectors(rng, k, d);
        fill_vectors(rng, v, d);
        uint8_t* s = &c.slots[b][(static_cast<size_t>(t) * H + h) * sb];
        cpu.encode(k.data(), v.data(), s);
        put_slot(c.pool, layout, f, d, bs, H, c.block_tables[b * c.max_blocks + t / bs], t % bs, h, s);
      }
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// Decode: split-KV attention vs reference_attention.

struct DecodeShape {
  int d, H, group, bs;
  std::vector<int> lens;
  int forced_splits;
  bool workspace_merge = false;  // force the workspace merge where the plan picks a cluster
  int min_key_pos = 0, window = 0, exclude_recent = 0;  // key-range cuts (AttentionParams)
};

// graph: capture run_decode in a CUDA graph and launch it `replays` times, each after fresh
// queries and a fresh NaN poison (the counters must be reset by every launch).
// prepare = false: skip init_decode_workspace (the output must then be NaN wherever a
// (sequence, kv head) has more than one CTA).
void run_decode_case(const Format& f, const DecodeShape& s, uint64_t seed, bool graph = false, int replays = 1,
                     bool prepare = true) {
  std::mt19937_64 rng(seed);
  const PagedCase c = make_case(f, s.d, s.H, s.group, s.bs, s.lens, PageLayout::Page, rng);
  const int Hq = s.H * s.group, d = s.d;
  const tqkv::cuda::CacheCodec codec(f, d);
  const SlotCodec cpu(f, d);
  std::vector<float> q(static_cast<size_t>(c.batch) * Hq * d);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& x : q) x = nd(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // A pair without a compiled kernel takes the engine's generic path (CudaKvCache::to_f16): every
  // block dequantized to f32 and stored into an f16 pool of the same blocks, which the f16 kernel
  // reads; the reference below still decodes the format's own slots.
  const bool generic = !codec.decode_supported();
  const tqkv::cuda::CacheCodec f16_codec(find_format("f16"), d);

  DevBuf<uint8_t> pool(c.pool.size());
  DevBuf<float> dq(q.size()), dout(q.size()), dlse(static_cast<size_t>(c.batch) * Hq);
  DevBuf<int32_t> dbt(c.block_tables.size()), dlens(c.batch);
  ASSERT_TRUE(pool.p && dq.p && dout.p && dlse.p && dbt.p && dlens.p);
  CK(cudaMemcpy(pool.p, c.pool.data(), c.pool.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dq.p, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dbt.p, c.block_tables.data(), c.block_tables.size() * 4, cudaMemcpyHostToDevice));
  std::vector<int32_t> lens32(c.lens.begin(), c.lens.end());
  CK(cudaMemcpy(dlens.p, lens32.data(), lens32.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dout.p, 0xff, dout.bytes()));  // NaN poison
  CK(cudaMemset(dlse.p, 0xff, dlse.bytes()));

  tqkv::cuda::PagedKv kv{pool.p, c.num_blocks, c.bs, c.H, PageLayout::Page};
  const size_t n_tokens = static_cast<size_t>(c.num_blocks) * c.bs;
  DevBuf<uint8_t> f16_pool(generic ? n_tokens * c.H * f16_codec.slot_bytes() : 1);
  if (generic) {
    std::vector<int32_t> blocks(c.num_blocks);
    std::iota(blocks.begin(), blocks.end(), 0);
    std::vector<int64_t> slots(n_tokens);
    std::iota(slots.begin(), slots.end(), int64_t{0});
    DevBuf<int32_t> dblocks(blocks.size());
    DevBuf<int64_t> dslots(slots.size());
    DevBuf<float> kf(n_tokens * c.H * d), vf(n_tokens * c.H * d);
    ASSERT_TRUE(f16_pool.p && dblocks.p && dslots.p && kf.p && vf.p);
    CK(cudaMemcpy(dblocks.p, blocks.data(), blocks.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dslots.p, slots.data(), slots.size() * 8, cudaMemcpyHostToDevice));
    tqkv::cuda::DequantArgs da;
    da.block_table = dblocks.p;
    da.n_tokens = static_cast<int>(n_tokens);
    da.k_out = kf.p;
    da.v_out = vf.p;
    da.out_dtype = DType::F32;
    tqkv::cuda::dequantize(codec, kv, da);
    tqkv::cuda::StoreArgs sa;
    sa.k = kf.p;
    sa.v = vf.p;
    sa.dtype = DType::F32;
    sa.slot_mapping = dslots.p;
    sa.n_tokens = static_cast<int>(n_tokens);
    tqkv::cuda::store(f16_codec, tqkv::cuda::PagedKv{f16_pool.p, c.num_blocks, c.bs, c.H, PageLayout::Page}, sa);
    CK(cudaDeviceSynchronize());
    kv.pages = f16_pool.p;
  }
  const tqkv::cuda::CacheCodec& dcodec = generic ? f16_codec : codec;
  const int max_len = *std::max_element(c.lens.begin(), c.lens.end());
  auto plan = tqkv::cuda::plan_decode(dcodec, kv, c.batch, Hq, max_len, s.forced_splits);
  if (s.workspace_merge) plan.cluster_merge = false;
  DevBuf<uint8_t> ws(plan.workspace_bytes);
  ASSERT_TRUE(ws.p);
  CK(cudaMemset(ws.p, 0xff, ws.bytes()));
  if (prepare) tqkv::cuda::init_decode_workspace(dcodec, kv, plan, ws.p);
  tqkv::cuda::DecodeArgs a;
  a.q = dq.p;
  a.q_dtype = DType::F32;
  a.out = dout.p;
  a.out_dtype = DType::F32;
  a.params.lse = dlse.p;
  a.block_tables = dbt.p;
  a.block_table_stride = c.max_blocks;
  a.seq_lens = dlens.p;
  a.batch = c.batch;
  a.params.n_q_heads = Hq;
  a.params.scale = scale;
  a.params.min_key_pos = s.min_key_pos;
  a.params.window = s.window;
  a.params.exclude_recent = s.exclude_recent;
  if (graph) {
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    // Warm-up launch outside the capture (sets the kernel's shared-memory attribute).
    tqkv::cuda::run_decode(dcodec, kv, a, plan, ws.p, st);
    CK(cudaStreamSynchronize(st));
    CK(cudaMemset(dout.p, 0xff, dout.bytes()));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    tqkv::cuda::run_decode(dcodec, kv, a, plan, ws.p, st);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (int r = 0; r < replays; ++r) {
      if (r > 0) {  // fresh queries, fresh poison; the last replay's output is checked below
        for (auto& x : q) x = nd(rng);
        CK(cudaMemcpy(dq.p, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemset(dout.p, 0xff, dout.bytes()));
        CK(cudaMemset(dlse.p, 0xff, dlse.bytes()));
      }
      CK(cudaGraphLaunch(ge, st));
      CK(cudaStreamSynchronize(st));
    }
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    CK(cudaStreamDestroy(st));
  } else {
    tqkv::cuda::run_decode(dcodec, kv, a, plan, ws.p);
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<float> out(q.size()), lse(static_cast<size_t>(c.batch) * Hq);
  CK(cudaMemcpy(out.data(), dout.p, out.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lse.data(), dlse.p, lse.size() * 4, cudaMemcpyDeviceToHost));

  if (!prepare) {  // every (sequence, kv head) with a non-empty range and > 1 CTA: NaN
    size_t nan = 0;
    for (float x : out) nan += std::isnan(x);
    EXPECT_GT(nan, 0u) << f.name() << ": an unprepared workspace must not merge silently";
    for (int b = 0; b < c.batch; ++b)
      for (int j = 0; j < Hq * d; ++j)
        ASSERT_TRUE(std::isnan(out[static_cast<size_t>(b) * Hq * d + j])) << "b=" << b << " j=" << j;
    return;
  }
  // fp16 tensor-core inputs (bf16 for a bf16 side): errors of a few 1e-3 are expected.
  const double tol = f.key == KeyCodec::BF16 || f.value == ValueCodec::BF16 ? 2.5e-2 : 1e-2;
  const size_t sb = f.slot_bytes(d);
  double worst = 0;
  for (int b = 0; b < c.batch; ++b) {
    // The keys the query at position lens[b] - 1 reads: [lo, hi).
    const int lo = std::max(s.min_key_pos, s.window > 0 ? c.lens[b] - s.window : 0);
    const int hi = std::max(lo, c.lens[b] - s.exclude_recent);
    const int L = hi - lo;
    for (int h = 0; h < s.H; ++h) {
      std::vector<const uint8_t*> ptrs(L);
      for (int t = 0; t < L; ++t) ptrs[t] = &c.slots[b][(static_cast<size_t>(lo + t) * s.H + h) * sb];
      std::vector<float> ref(static_cast<size_t>(s.group) * d), rlse(s.group);
      reference_attention(cpu, ptrs.data(), L, &q[(static_cast<size_t>(b) * Hq + h * s.group) * d], s.group, scale,
                          ref.data(), rlse.data());
      for (int j = 0; j < s.group; ++j) {
        const float* o = &out[(static_cast<size_t>(b) * Hq + h * s.group + j) * d];
        const float* r = &ref[static_cast<size_t>(j) * d];
        double num = 0, den = 0;
        for (int i = 0; i < d; ++i) {
          ASSERT_TRUE(std::isfinite(o[i])) << f.name() << " b=" << b << " head " << h * s.group + j << " dim " << i;
          num += (o[i] - r[i]) * static_cast<double>(o[i] - r[i]);
          den += static_cast<double>(r[i]) * r[i];
        }
        const float gl = lse[static_cast<size_t>(b) * Hq + h * s.group + j];
        if (L == 0) {
          EXPECT_EQ(num, 0.0) << "empty sequence must give zeros";
          EXPECT_TRUE(std::isinf(gl) && gl < 0);
          continue;
        }
        const double rel = std::sqrt(num / std::max(den, 1e-30));
        worst = std::max(worst, rel);
        EXPECT_LT(rel, tol) << f.name() << " d=" << d << " b=" << b << " len=" << L << " q head " << h * s.group + j;
        EXPECT_NEAR(gl, rlse[j], 2e-2 + 2e-3 * std::abs(rlse[j])) << f.name() << " lse, b=" << b;
      }
    }
  }
  std::printf("[decode] %-20s d=%3d group=%d bs=%3d splits=%3d %-9s %-7s worst rel err %.2e\n", f.name().c_str(), d,
              s.group, s.bs, plan.num_splits, plan.cluster_merge ? "cluster" : "workspace", generic ? "generic" : "kernel",
              worst);
}

// Every pair of sides at every head dim (170 x 3), short contexts, through its compiled kernel
// or the generic path; the named formats but f32 and every pair the generated list names have a
// kernel. A failing case does not stop the sweep: the failing formats are listed at the end.
TEST(CudaDecode, MatchesReferenceAllFormatsAndDims) {
  SKIP_WITHOUT_GPU();
  const testing_util::TestSeed test_seed;  // TQKV_TEST_SEED replays a failure
  const uint64_t seed = test_seed.value();
  std::mt19937_64 rng(seed);
  const std::vector<Format> formats = decode_formats();
  EXPECT_EQ(formats.size(), 170u);
  for (const NamedFormat& f : named_formats())
    for (int d : {64, 128, 256})
      EXPECT_EQ(tqkv::cuda::CacheCodec(f.format, d).decode_supported(), f.format.key != KeyCodec::F32) << f.name;
  // The fixed set (tqkv/format.h), whatever recipes exist: every pair the recipe fitter may
  // choose and the window's k6v6, at every head dim; no other pair of 2-8-bit codes.
  for (int d : {64, 128, 256}) {
    for (int k = 2; k <= 8; ++k)
      for (int v = 2; v <= 8; ++v) {
        // Appended piece by piece: GCC 12 at -O2 reports a false -Wrestrict on "k" + std::string.
        std::string name = "k";
        name += std::to_string(k);
        name += 'v';
        name += std::to_string(v);
        const bool in_set = (k <= kKernelMaxKeyBits && v <= kKernelMaxValueBits) ||
                            (k == kKernelWindowBits && v == kKernelWindowBits);
        EXPECT_EQ(tqkv::cuda::CacheCodec(Format::parse(name), d).decode_supported(), in_set) << name << " d " << d;
      }
  }
  const testing::TestResult& result = *testing::UnitTest::GetInstance()->current_test_info()->result();
  std::string failing;
  int kernels = 0;
  for (const Format& f : formats)
    for (int d : {64, 128, 256}) {
      kernels += tqkv::cuda::CacheCodec(f, d).decode_supported();
      const int l0 = 1 + static_cast<int>(rng() % 15), l1 = 40 + static_cast<int>(rng() % 160);
      const int parts = result.total_part_count();
      run_decode_case(f, DecodeShape{d, 2, 4, 16, {l0, l1, 37}, 0}, rng());
      if (result.total_part_count() != parts) failing += std::string(" ") + f.name() + "@" + std::to_string(d);
    }
  std::printf("[decode] %d of %zu pair x head-dim cases with a compiled kernel\n", kernels, 3 * formats.size());
  EXPECT_TRUE(failing.empty()) << "failing:" << failing;
}

// The kernel variants the host can pick (decode_kernel.cuh: TQKV_DECODE_VALUE_LUT for 2- and 3-bit
// MSE values, the levels in registers or the shared-memory table; TQKV_DECODE_KEY_LUT for 4-bit
// MSE keys at d = 64, table entries 128 or 256 bytes apart, with tq-k4v4's values in the same
// table) all match the reference, at every head dim, with partial tiles and block sizes above 16.
TEST(CudaDecode, EveryKernelVariantMatchesReference) {
  SKIP_WITHOUT_GPU();
  const testing_util::TestSeed test_seed;  // TQKV_TEST_SEED replays a failure
  const uint64_t seed = test_seed.value();
  std::mt19937_64 rng(seed);
  for (const char* vlut : {"reg", "smem"})
    for (const char* klut : {"128", "256"}) {
      SCOPED_TRACE(std::string("TQKV_DECODE_VALUE_LUT=") + vlut + " TQKV_DECODE_KEY_LUT=" + klut);
      setenv("TQKV_DECODE_VALUE_LUT", vlut, 1);
      setenv("TQKV_DECODE_KEY_LUT", klut, 1);
      for (const char* name : {"tq-k4v2", "tq-k3v2", "tq-k2v2", "tq-k4v3", "tq-k3v3", "tq-k4v4", "turboquant_4bit_nc", "k5v3",
                               "k8v2", "k6v6"}) {
        const Format f = Format::parse(name);
        for (int d : {64, 128, 256}) {
          if (!tqkv::cuda::CacheCodec(f, d).decode_supported()) continue;  // no kernel, no variants
          const int l0 = 1 + static_cast<int>(rng() % 15), l1 = 300 + static_cast<int>(rng() % 300);
          run_decode_case(f, DecodeShape{d, 2, 4, 16, {l0, l1}, 0}, rng());
          run_decode_case(f, DecodeShape{d, 3, 3, 32, {700 + static_cast<int>(rng() % 100), 5}, 0}, rng());
          if (HasFatalFailure()) break;
        }
        if (HasFatalFailure()) break;
      }
      unsetenv("TQKV_DECODE_VALUE_LUT");
      unsetenv("TQKV_DECODE_KEY_LUT");
      if (HasFatalFailure()) return;
    }
}

TEST(CudaDecode, GqaGroupsBlockSizesSplitsAndEmptySequences) {
  SKIP_WITHOUT_GPU();
  const testing_util::TestSeed test_seed;  // TQKV_TEST_SEED replays a failure
  const uint64_t seed = test_seed.value();
  std::mt19937_64 rng(seed);
  for (const char* name : {"turboquant_4bit_nc", "tq-k4v2", "bf16", "turboquant_3bit_nc"}) {
    const Format& f = find_format(name);
    // SmolLM2's 3:1, a full group of 8, block sizes 32 and 128, many (partly empty) splits.
    run_decode_case(f, DecodeShape{64, 3, 3, 32, {700 + static_cast<int>(rng() % 100), 0, 5}, 0}, rng());
    if (HasFatalFailure()) return;
    run_decode_case(f, DecodeShape{128, 1, 8, 128, {1000 + static_cast<int>(rng() % 500), 17}, 64}, rng());
    if (HasFatalFailure()) return;
    run_decode_case(f, DecodeShape{128, 2, 1, 16, {33, 2000}, 12}, rng());
    if (HasFatalFailure()) return;
  }
}

TEST(CudaDecode, CapturedInCudaGraph) {
  SKIP_WITHOUT_GPU();
  const testing_util::TestSeed test_seed;  // TQKV_TEST_SEED replays a failure
  const uint64_t seed = test_seed.value();
  std::mt19937_64 rng(seed);
  // The planner's split count, then many CTAs per (sequence, kv head): the fused merge's
  // counters must come back to their initial state after every replay.
  run_decode_case(find_format("turboquant_4bit_nc"), DecodeShape{128, 2, 4, 16, {900, 64, 3}, 0}, rng(), true, 3);
  if (HasFatalFailure()) return;
  run_decode_case(find_format("turboquant_4bit_nc"), DecodeShape{128, 2, 4, 16, {900, 64, 3}, 64}, rng(), true, 3);
  if (HasFatalFailure()) return;
  run_decode_case(find_format("turboquant_4bit_nc"), DecodeShape{128, 2, 4, 16, {900, 64, 3}, 64, true}, rng(), true,
                  3);
  if (HasFatalFailure()) return;
  run_decode_case(find_format("tq-k4v2"), DecodeShape{64, 3, 3, 16, {4000, 1, 0}, 256}, rng(), true, 4);
  if (HasFatalFailure()) return;
  run_decode_case(find_format("bf16"), DecodeShape{64, 3, 3, 16, {513, 77}, 40}, rng(), true, 2);
}

TEST(CudaDecode, BatchOneSmallWorkShapes) {
  SKIP_WITHOUT_GPU();
  const testing_util::TestSeed test_seed;  // TQKV_TEST_SEED replays a failure
  const uint64_t seed = test_seed.value();
  std::mt19937_64 rng(seed);
  // The benchmark's batch-1 shapes at a reduced context with the planner's choice (clusters),
  // one CTA per (sequence, kv head) (no cross-CTA merge), the workspace merge forced, and 16
  // CTAs per (sequence, kv head).
  for (const char* name : {"turboquant_4bit_nc", "tq-k4v4", "turboquant_k8v4", "fp8"}) {
    run_decode_case(find_format(name), DecodeShape{128, 8, 4, 16, {1024 + static_cast<int>(rng() % 64)}, 0}, rng());
    if (HasFatalFailure()) return;
    run_decode_case(find_format(name), DecodeShape{64, 3, 3, 16, {1500 + static_cast<int>(rng() % 64)}, 0}, rng());
    if (HasFatalFailure()) return;
    run_decode_case(find_format(name), DecodeShape{128, 2, 4, 16, {300, 299}, 8}, rng());
    if (HasFatalFailure()) return;
    run_decode_case(find_format(name), DecodeShape{64, 3, 3, 32, {600, 301, 0}, 40, true}, rng());
    if (HasFatalFailure()) return;
    // 16 CTAs per (sequence, kv head): a non-portable cluster where the device fits one.
    run_decode_case(find_format(name), DecodeShape{128, 2, 4, 16, {2000, 1500 + static_cast<int>(rng() % 64)}, 128},
                    rng());
    if (HasFatalFailure()) return;
  }
}

TEST(CudaDecode, UnpreparedWorkspaceGivesNaN) {
  SKIP_WITHOUT_GPU();
  const testing_util::TestSeed test_seed;  // TQKV_TEST_SEED replays a failure
  const uint64_t seed = test_seed.value();
  // 0xff-poisoned counters (no init_decode_workspace), 16 and 4 CTAs per (sequence, kv head),
  // the workspace merge forced (a cluster merge needs no counters).
  run_decode_case(find_format("turboquant_4bit_nc"), DecodeShape{128, 2, 4, 16, {900, 700}, 128, true}, seed, false, 1,
                  false);
  if (HasFatalFailure()) return;
  run_decode_case(find_format("tq-k4v2"), DecodeShape{128, 2, 4, 16, {900, 700}, 32, true}, seed + 1, false, 1,
                  false);
}

TEST(CudaDecode, RejectsSlotLayoutAndBadGroups) {
  SKIP_WITHOUT_GPU();
  const tqkv::cuda::CacheCodec codec(find_format("turboquant_4bit_nc"), 128);
  uint8_t* fake = reinterpret_cast<uint8_t*>(16);
  tqkv::cuda::PagedKv kv{fake, 4, 16, 2, PageLayout::Page};
  EXPECT_THROW(tqkv::cuda::plan_decode(codec, kv, 1, 3, 100), tqkv::Error);   // 3 % 2 != 0
  EXPECT_THROW(tqkv::cuda::plan_decode(codec, kv, 1, 32, 100), tqkv::Error);  // group 16 > 8
  const tqkv::cuda::CacheCodec f32(find_format("f32"), 128);
  EXPECT_FALSE(f32.decode_supported());
  // A pair without a compiled kernel is refused by name (the engine takes its generic path).
  for (const char* name : {"k1v4", "k4v7"}) {
    const tqkv::cuda::CacheCodec none(Format::parse(name), 128);
    EXPECT_FALSE(none.decode_supported()) << name;
    try {
      tqkv::cuda::plan_decode(none, kv, 1, 4, 100);
      ADD_FAILURE() << name << " was planned";
    } catch (const tqkv::Error& e) {
      EXPECT_NE(std::string(e.what()).find("no compiled kernel for format"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(tqkv::cuda::CacheCodec(find_format("tq-k4v2"), 96), tqkv::Error);
}

// Key-range cuts (sinks, the compressed middle and the recent window of engine::CudaKvCache):
// empty ranges, ranges inside one tile, ranges across splits and CTAs, every width class.
TEST(CudaDecode, KeyRangeCutsMatchReference) {
  SKIP_WITHOUT_GPU();
  const testing_util::TestSeed test_seed;  // TQKV_TEST_SEED replays a failure
  const uint64_t seed = test_seed.value();
  std::mt19937_64 rng(seed);
  for (const char* name : {"turboquant_4bit_nc", "k5v3", "k6v6", "f16", "tq-k3v2", "bf16"}) {
    const Format f = Format::parse(name);
    for (int d : {64, 128, 256}) {
      const std::vector<int> lens = {1, 5, 17, 300 + static_cast<int>(rng() % 200), 33};
      DecodeShape mid{d, 3, 3, 16, lens, 0};
      mid.min_key_pos = 1;
      mid.exclude_recent = 7;
      run_decode_case(f, mid, rng());
      if (HasFatalFailure()) return;
      DecodeShape recent{d, 3, 3, 16, lens, 0};
      recent.min_key_pos = 2;
      recent.window = 19;
      run_decode_case(f, recent, rng());
      if (HasFatalFailure()) return;
      DecodeShape many{d, 2, 4, 32, {2000, 1200}, 64};  // many splits, cuts inside tiles
      many.min_key_pos = 37;
      many.exclude_recent = 5;
      many.workspace_merge = d == 128;
      run_decode_case(f, many, rng());
      if (HasFatalFailure()) return;
    }
  }
}

// Invalid AttentionParams are refused, not ignored (checked on the host before any launch, so
// no device is needed).
TEST(CudaDecode, RejectsAttentionParamsItCannotHonour) {
  const tqkv::cuda::CacheCodec codec(find_format("turboquant_4bit_nc"), 128);
  uint8_t* fake = reinterpret_cast<uint8_t*>(16);
  const tqkv::cuda::PagedKv kv{fake, 4, 16, 2, PageLayout::Page};
  tqkv::cuda::DecodePlan plan;
  plan.batch = 1;
  plan.n_q_heads = 4;
  plan.num_splits = 8;
  // The message, so that the other argument checks (null pointers here) cannot pass for these.
  auto error_of = [&](const AttentionParams& ap) {
    tqkv::cuda::DecodeArgs a;
    a.batch = 1;
    a.params = ap;
    try {
      tqkv::cuda::run_decode(codec, kv, a, plan, fake);
    } catch (const tqkv::Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
      return std::string(e.what());
    }
    return std::string();
  };
  auto refused = [&](const AttentionParams& ap) { return error_of(ap).find(">= 0") != std::string::npos; };
  AttentionParams ap;
  ap.n_q_heads = 4;
  EXPECT_FALSE(refused(ap));
  ap.window = 8;
  ap.min_key_pos = 1;
  ap.exclude_recent = 1;
  EXPECT_FALSE(refused(ap));  // honoured (KeyRangeCutsMatchReference)
  ap.window = -1;
  EXPECT_TRUE(refused(ap));
  ap.window = 0;
  ap.min_key_pos = -1;
  EXPECT_TRUE(refused(ap));
  ap.min_key_pos = 0;
  ap.exclude_recent = -2;
  EXPECT_TRUE(refused(ap));
  ap.exclude_recent = 0;
  ap.head_dim = 64;
  EXPECT_NE(error_of(ap).find("head dim"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Dequantize: paged -> contiguous, vs SlotCodec::decode_key / decode_value.

TEST(CudaDequant, MatchesCpuDecodeAllFormatsDimsLayouts) {
  SKIP_WITHOUT_GPU();
  const testing_util::TestSeed test_seed;  // TQKV_TEST_SEED replays a failure
  const uint64_t seed = test_seed.value();
  std::mt19937_64 rng(seed);
  size_t total = 0, differ = 0;
  for (const Format& f : store_formats())
    for (int d : {64, 128, 256})
      for (PageLayout layout : {PageLayout::Slot, PageLayout::Page}) {
        const int H = 2, bs = 32, len = 40 + static_cast<int>(rng() % 60);
        const PagedCase c = make_case(f, d, H, 1, bs, {len}, layout, rng);
        const tqkv::cuda::CacheCodec codec(f, d);
        const SlotCodec cpu(f, d);
        const int start = static_cast<int>(rng() % 10), n = len - start;
        DevBuf<uint8_t> pool(c.pool.size());
        DevBuf<int32_t> dbt(c.block_tables.size());
        DevBuf<float> dk(static_cast<size_t>(n) * H * d), dv(dk.n);
        ASSERT_TRUE(pool.p && dbt.p && dk.p && dv.p);
        CK(cudaMemcpy(pool.p, c.pool.data(), c.pool.size(), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dbt.p, c.block_tables.data(), c.block_tables.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemset(dk.p, 0xff, dk.bytes()));
        CK(cudaMemset(dv.p, 0xff, dv.bytes()));
        tqkv::cuda::PagedKv kv{pool.p, c.num_blocks, bs, H, layout};
        tqkv::cuda::DequantArgs a;
        a.block_table = dbt.p;
        a.start = start;
        a.n_tokens = n;
        a.k_out = dk.p;
        a.v_out = dv.p;
        a.out_dtype = DType::F32;
        tqkv::cuda::dequantize(codec, kv, a);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        std::vector<float> gk(dk.n), gv(dv.n), rk(d), rv(d);
        CK(cudaMemcpy(gk.data(), dk.p, dk.bytes(), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(gv.data(), dv.p, dv.bytes(), cudaMemcpyDeviceToHost));
        const size_t sb = f.slot_bytes(d);
        for (int t = 0; t < n; ++t)
          for (int h = 0; h < H; ++h) {
            const uint8_t* s = &c.slots[0][(static_cast<size_t>(start + t) * H + h) * sb];
            cpu.decode_key(s, rk.data());
            cpu.decode_value(s + cpu.key_bytes(), rv.data());
            for (int i = 0; i < d; ++i) {
              const float ak = gk[(static_cast<size_t>(t) * H + h) * d + i];
              const float av = gv[(static_cast<size_t>(t) * H + h) * d + i];
              ASSERT_TRUE(std::isfinite(ak) && std::isfinite(av)) << f.name() << " d=" << d;
              total += 2;
              differ += (ak != rk[i]) + (av != rv[i]);
              ASSERT_NEAR(ak, rk[i], 1e-5f * (1.0f + std::abs(rk[i]))) << f.name() << " d=" << d << " key t=" << t;
              ASSERT_NEAR(av, rv[i], 1e-5f * (1.0f + std::abs(rv[i]))) << f.name() << " d=" << d << " value t=" << t;
            }
          }
      }
  std::printf("[dequant] %zu of %zu elements not bit-identical to the CPU decode\n", differ, total);
}

TEST(CudaDequant, Bf16Output) {
  SKIP_WITHOUT_GPU();
  const testing_util::TestSeed test_seed;  // TQKV_TEST_SEED replays a failure
  const uint64_t seed = test_seed.value();
  std::mt19937_64 rng(seed);
  const Format& f = find_format("turboquant_4bit_nc");
  const int d = 128, H = 2, bs = 16, len = 77;
  const PagedCase c = make_case(f, d, H, 1, bs, {len}, PageLayout::Page, rng);
  const tqkv::cuda::CacheCodec codec(f, d);
  const SlotCodec cpu(f, d);
  DevBuf<uint8_t> pool(c.pool.size());
  DevBuf<int32_t> dbt(c.block_tables.size());
  DevBuf<uint16_t> dk(static_cast<size_t>(len) * H * d), dv(dk.n);
  ASSERT_TRUE(pool.p && dbt.p && dk.p && dv.p);
  CK(cudaMemcpy(pool.p, c.pool.data(), c.pool.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dbt.p, c.block_tables.data(), c.block_tables.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dk.p, 0xff, dk.bytes()));
  CK(cudaMemset(dv.p, 0xff, dv.bytes()));
  tqkv::cuda::PagedKv kv{pool.p, c.num_blocks, bs, H, PageLayout::Page};
  tqkv::cuda::DequantArgs a;
  a.block_table = dbt.p;
  a.n_tokens = len;
  a.k_out = dk.p;
  a.v_out = dv.p;
  a.out_dtype = DType::BF16;
  tqkv::cuda::dequantize(codec, kv, a);
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> gk(dk.n);
  CK(cudaMemcpy(gk.data(), dk.p, dk.bytes(), cudaMemcpyDeviceToHost));
  std::vector<float> rk(d);
  const size_t sb = f.slot_bytes(d);
  for (int t = 0; t < len; ++t)
    for (int h = 0; h < H; ++h) {
      cpu.decode_key(&c.slots[0][(static_cast<size_t>(t) * H + h) * sb], rk.data());
      for (int i = 0; i < d; ++i)
        ASSERT_EQ(gk[(static_cast<size_t>(t) * H + h) * d + i], float_to_bf16(rk[i])) << "t=" << t << " i=" << i;
    }
}

}  // namespace
