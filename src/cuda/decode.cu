// Split-KV decode attention on the compressed paged cache: the host side (plan, workspace,
// launch). The kernel and how it works: decode_kernel.cuh; its instantiations: the units
// src/cuda/decode_pairs.cmake generates (listed in the generated decode_pairs.h).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <string>

#include "decode_kernel.cuh"
#include "decode_pairs.h"

namespace tqkv::cuda {
namespace detail {

// Instantiated in the generated units, not here.
#define TQKV_EXTERN_PAIR(D, K, V) extern template Kernel make_kernel<D, K, V>();
#define TQKV_EXTERN_QUAD(D, K, V, WK, WV) extern template FusedKernel make_fused_kernel<D, K, V, WK, WV>();
TQKV_DECODE_PAIRS(TQKV_EXTERN_PAIR)
TQKV_FUSED_QUADS(TQKV_EXTERN_QUAD)
#undef TQKV_EXTERN_PAIR
#undef TQKV_EXTERN_QUAD

namespace {

// The compiled kernel of head dim d for key kind kk and value kind vk, or {}.
Kernel pick_kernel(int d, int kk, int vk) {
#define TQKV_PICK_PAIR(D, K, V) \
  if (d == (D) && kk == (K) && vk == (V)) return make_kernel<D, K, V>();
  TQKV_DECODE_PAIRS(TQKV_PICK_PAIR)
#undef TQKV_PICK_PAIR
  return Kernel{};
}

// The compiled fused kernel of head dim d for the middle's kinds (kk, vk) and the window's
// (wk, wv), or {} (the sinks are f16).
FusedKernel pick_fused_kernel(int d, int kk, int vk, int wk, int wv) {
#define TQKV_PICK_QUAD(D, K, V, WK, WV) \
  if (d == (D) && kk == (K) && vk == (V) && wk == (WK) && wv == (WV)) return make_fused_kernel<D, K, V, WK, WV>();
  TQKV_FUSED_QUADS(TQKV_PICK_QUAD)
#undef TQKV_PICK_QUAD
  return FusedKernel{};
}

// The decode kernel's kinds of a format's keys and values (decode_kernel.cuh), -1 for none.
int kind_of_key(const Format& f) {
  switch (f.key) {
    case KeyCodec::Mse: return f.key_bits >= 1 && f.key_bits <= 8 ? kmse(f.key_bits) : -1;
    case KeyCodec::Fp8: return K_FP8;
    case KeyCodec::F16: return K_F16;
    case KeyCodec::BF16: return K_BF16;
    default: return -1;
  }
}
int kind_of_value(const Format& f) {
  const bool coded = f.value_bits >= 1 && f.value_bits <= 8;
  switch (f.value) {
    case ValueCodec::Uniform: return coded ? vuni(f.value_bits) : -1;
    case ValueCodec::Mse: return coded ? vmse(f.value_bits) : -1;
    case ValueCodec::Fp8: return V_FP8;
    case ValueCodec::F16: return V_F16;
    case ValueCodec::BF16: return V_BF16;
    default: return -1;
  }
}

Kernel find_kernel(const CacheCodec& codec) {
  const int kk = kind_of_key(codec.format()), vk = kind_of_value(codec.format());
  if (kk < 0 || vk < 0) return Kernel{};
  return pick_kernel(codec.head_dim(), kk, vk);
}

Kernel pick(const CacheCodec& codec) {
  const Kernel k = find_kernel(codec);
  if (!k.fn)
    throw_arg("decode: no compiled kernel for format " + codec.format().name() + " at head_dim " +
              std::to_string(codec.head_dim()) + " (src/cuda/decode_pairs.cmake)");
  return k;
}

size_t align256(size_t x) { return (x + 255) & ~size_t{255}; }

// The launch of kernel k (Kernel or FusedKernel) on `grid` in clusters of `cluster_x` CTAs along
// x; `attr` holds its one attribute.
template <typename K>
cudaLaunchConfig_t cluster_config(const K& k, dim3 grid, int cluster_x, cudaLaunchAttribute (&attr)[1]) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(k.warps * 32);
  cfg.dynamicSmemBytes = k.smem;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster_x;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// How many clusters of `ctas` CTAs of this kernel (Kernel or FusedKernel) the device holds at once (0 if none).
template <typename K>
int resident_clusters(const K& k, int ctas) {
  TQKV_CUDA_CHECK(cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem));
  if (ctas > kMaxClusterCtas && cudaFuncSetAttribute(k.fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = cluster_config(k, dim3(ctas, 1, 1), ctas, attr);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, k.fn, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 0;
  }
  return n;
}

// The current device's SMs.
int64_t device_sms() {
  int dev = 0, sms = 0;
  TQKV_CUDA_CHECK(cudaGetDevice(&dev));
  TQKV_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

// How many CTAs of this kernel (Kernel or FusedKernel) the device holds at once.
template <typename K>
int64_t resident_ctas(const K& k) {
  int per_sm = 0;
  TQKV_CUDA_CHECK(cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem));
  TQKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k.fn, k.warps * 32, k.smem));
  return device_sms() * std::max(per_sm, 1);
}

// Whether `units` (sequence, kv head) pairs of `ctas` CTAs each should merge as clusters in
// DSMEM: only when every cluster is resident at once (a cluster grid that needs more than one
// wave packs the SMs worse than plain CTAs: 5-CTA clusters at d = 64, batch 16 ran 25% slower),
// and, measured on the H200, 16-CTA clusters only while the grid covers at most half the SMs
// (3 kv heads at batch 1), not at 8 kv heads (128 CTAs), even where that many are resident.
template <typename K>
bool use_cluster(const K& k, int64_t units, int ctas) {
  if (ctas < 2 || ctas > kMaxClusterCtasNonPortable) return false;
  if (ctas > kMaxClusterCtas && units * ctas * 2 > device_sms()) return false;
  return resident_clusters(k, ctas) >= units;
}

// Launches kernel k (Kernel or FusedKernel) on `grid` with clusters of `cluster_x` CTAs along x.
template <typename K, typename P>
void launch_clustered(const K& k, dim3 grid, int cluster_x, cudaStream_t stream, const P& params) {
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = cluster_config(k, grid, cluster_x, attr);
  cfg.stream = stream;
  TQKV_CUDA_CHECK(cudaLaunchKernelEx(&cfg, k.fn, params));
}

// Workspace: per-CTA partial outputs and log2-sum-exps (only when a (sequence, kv head) has more
// than one CTA, or always: the fused decode), then one counter per (sequence, kv head).
struct Workspace {
  size_t o_part = 0, lse_part = 0, counters = 0, bytes = 0;
};
Workspace workspace_layout(int64_t units, int ctas, int group, int head_dim, bool partials) {
  const size_t rows = partials || ctas > 1 ? static_cast<size_t>(units) * ctas * group : 0;
  Workspace w;
  w.lse_part = align256(rows * head_dim * sizeof(float));
  w.counters = w.lse_part + align256(rows * sizeof(float));
  w.bytes = w.counters + align256(static_cast<size_t>(units) * sizeof(uint32_t));
  return w;
}
Workspace workspace_layout(const DecodePlan& plan, int n_kv_heads, int group, int head_dim, int warps) {
  return workspace_layout(static_cast<int64_t>(plan.batch) * n_kv_heads, plan.num_splits / warps, group, head_dim,
                          false);
}

__global__ void init_counters(uint32_t* c, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) c[i] = kCounterTag;
}

void init_counters(uint32_t* c, int64_t n, cudaStream_t stream) {
  init_counters<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(c, n);
  TQKV_CUDA_CHECK(cudaGetLastError());
}

// The kernel parameters of one key range (a whole decode, or one part of a fused one) but the
// output and workspace fields.
DecodeParams range_params(const CacheCodec& codec, const PagedKv& kv, const DecodeArgs& a, int num_splits,
                          int max_seq_len) {
  const AttentionParams& ap = a.params;
  if (kv.layout != PageLayout::Page) throw_arg("decode needs the page layout");
  if (ap.window < 0 || ap.min_key_pos < 0 || ap.exclude_recent < 0)
    throw_arg("decode: window, min_key_pos and exclude_recent must be >= 0");
  if (ap.head_dim != 0 && ap.head_dim != codec.head_dim())
    throw_arg("decode: query head dim " + std::to_string(ap.head_dim) + " does not match the cache's " +
              std::to_string(codec.head_dim()));
  if (!a.q || !a.out || !a.block_tables || !a.seq_lens) throw_arg("decode: null argument");
  const Layout L = make_layout(codec, kv);
  DecodeParams p{};
  p.pages = kv.pages;
  p.geo = L.geo;
  p.page_bytes = L.geo.page_bytes();
  p.block_size = kv.block_size;
  p.tpp_log2 = kv.block_size == 16 ? 0 : kv.block_size == 32 ? 1 : kv.block_size == 64 ? 2 : 3;
  p.n_kv_heads = kv.n_kv_heads;
  p.slot_bytes = L.geo.slot_bytes;
  p.q = a.q;
  p.q_dtype = a.q_dtype;
  p.block_tables = a.block_tables;
  p.bt_stride = a.block_table_stride;
  p.seq_lens = a.seq_lens;
  p.n_q_heads = ap.n_q_heads;
  p.group = ap.n_q_heads / kv.n_kv_heads;
  p.num_splits = num_splits;
  p.max_seq_len = max_seq_len;
  const float scale = ap.scale != 0 ? ap.scale : 1.0f / std::sqrt(static_cast<float>(codec.head_dim()));
  p.scale_log2 = scale * 1.4426950408889634f;
  p.keys_rotated = codec.format().keys_rotated();
  p.values_rotated = codec.format().values_rotated();
  p.out = a.out;
  p.out_dtype = a.out_dtype;
  p.lse = ap.lse;
  p.ranged = ap.window != 0 || ap.min_key_pos != 0 || ap.exclude_recent != 0;
  p.min_key_pos = static_cast<int>(std::min<int64_t>(ap.min_key_pos, INT_MAX));
  p.window = ap.window;
  p.exclude_recent = ap.exclude_recent;
  const CodecTables& t = codec.tables();
  std::copy(std::begin(t.k_levels_h), std::end(t.k_levels_h), p.tab.k_lv);
  std::copy(std::begin(t.v_levels_h), std::end(t.v_levels_h), p.tab.v_lv);
  // The kernel looks such values up in the key table (decode_kernel.cuh: shared_lut).
  const Format& f = codec.format();
  if (shared_lut(kind_of_key(f), kind_of_value(f)) && !std::equal(p.tab.k_lv, p.tab.k_lv + (1 << f.key_bits), p.tab.v_lv))
    throw_arg("decode: format " + f.name() + " has MSE keys and values of one width but different levels");
  std::copy(std::begin(t.sign_bits), std::end(t.sign_bits), p.tab.sign_bits);
  p.tab.rot_scale = t.rot_scale;
  return p;
}

// The fused kernel of a middle codec and a window codec (null: the f16 kinds), or {}.
FusedKernel find_fused_kernel(const CacheCodec& main, const CacheCodec* window) {
  const int kk = kind_of_key(main.format()), vk = kind_of_value(main.format());
  const int wk = window ? kind_of_key(window->format()) : K_F16, wv = window ? kind_of_value(window->format()) : V_F16;
  if (kk < 0 || vk < 0 || wk < 0 || wv < 0 || (window && window->head_dim() != main.head_dim())) return FusedKernel{};
  return pick_fused_kernel(main.head_dim(), kk, vk, wk, wv);
}

}  // namespace
}  // namespace detail

bool CacheCodec::decode_supported() const { return detail::find_kernel(*this).fn != nullptr; }

namespace {

// Whether a grid fills one CTA an SM ("sms") rather than every resident CTA slot ("slots"): the
// environment variable `name`, else `fallback`.
bool fill_sms_env(const char* name, bool fallback) {
  const std::optional<std::string> v = env_choice_if_set(name);
  return v ? *v == "sms" : fallback;
}

}  // namespace

DecodePlan plan_decode(const CacheCodec& codec, const PagedKv& kv, int batch, int n_q_heads, int max_seq_len,
                       int num_splits) {
  using namespace detail;
  if (batch <= 0 || n_q_heads <= 0 || kv.n_kv_heads <= 0 || n_q_heads % kv.n_kv_heads)
    throw_arg("decode: n_q_heads must be a positive multiple of n_kv_heads");
  const int group = n_q_heads / kv.n_kv_heads;
  if (group > kMaxGroup) throw_arg("decode: at most 8 query heads per kv head");
  const Kernel k = pick(codec);
  if (num_splits <= 0) {
    const int64_t units = static_cast<int64_t>(batch) * kv.n_kv_heads;
    const int64_t tiles = (std::max(max_seq_len, 1) + kTileTokens - 1) / kTileTokens;
    // Compressed kernels stream their tiles through shared-memory rings (two CTAs an SM at every
    // head_dim); the 16-bit ones load tiles into registers.
    const int key_kind = kind_of_key(codec.format());
    const bool compressed = key_kind != K_F16 && key_kind != K_BF16;
    const bool compressed_d256 = compressed && codec.head_dim() == 256;
    // Short contexts fill the resident CTA slots, except compressed kernels at d = 256 (4 warps a
    // CTA): there one CTA an SM with fewer splits merged in a cluster was faster on the H200
    // than two an SM (b64 x 4K: 46.7 against 53.3 us for turboquant_k8v4, 42.2 against 45.5 for
    // turboquant_4bit_nc); for bf16 it was 13-21% slower at d = 128 and 256.
    // TQKV_DECODE_FILL=slots|sms sets it for every kernel; TQKV_DECODE_FILL_LONG (default slots)
    // the long contexts' rule: one CTA an SM there was no faster at batch 16/64 x 32K, d = 64
    // and 128 (d = 128 batch 16: 10-17% slower; docs/journal/RESULTS-journal.md).
    const bool fill_sms = tiles <= 512 ? fill_sms_env("TQKV_DECODE_FILL", compressed_d256)
                                       : fill_sms_env("TQKV_DECODE_FILL_LONG", false);
    const int64_t slots = fill_sms ? device_sms() : resident_ctas(k);
    // At least 2 tiles per warp for short contexts; for long ones (the merge reads every CTA's
    // partial) 16 where the grid at 16 still gives every SM a CTA, else 8. On the H200 at
    // b1 x 32K: d = 128 with 8 kv heads (128 CTAs at 16) 16 was 10-18% faster than 8; d = 128
    // with 2 kv heads and d = 64 with 3 (32 and 48 CTAs) 11-20% slower. The compressed kernels
    // at d = 256 take 16 regardless: their merge of 256-dim partials made 64 CTAs slower than 32
    // even with one kv head (b1 x 32K: 53 against 44 us). TQKV_DECODE_MIN_TILES and
    // TQKV_DECODE_LONG_MIN_TILES (1 to 32) set the short and the long contexts' minimum instead.
    const auto long_min_tiles = [&]() -> int64_t {
      if (compressed_d256) return 16;
      const int64_t ctas16 = std::max<int64_t>(1, tiles / (16 * k.warps));
      return units * ctas16 * 10 >= device_sms() * 9 ? 16 : 8;
    };
    const int64_t min_tiles = tiles <= 512 ? env_count("TQKV_DECODE_MIN_TILES")
                                           : env_count("TQKV_DECODE_LONG_MIN_TILES", long_min_tiles());
    // Short contexts: at most one cluster of CTAs per (sequence, kv head), merged in DSMEM.
    const int64_t cap = tiles > 512 ? kMaxSplits / k.warps
                        : use_cluster(k, units, kMaxClusterCtasNonPortable) ? kMaxClusterCtasNonPortable
                                                                            : kMaxClusterCtas;
    const int64_t max_ctas = std::max<int64_t>(1, std::min<int64_t>(tiles / (min_tiles * k.warps), cap));
    // CTAs per (sequence, kv head): the smallest count whose grid keeps >= 90% of the resident
    // CTA slots busy over its waves (else the best one allowed). Fewer CTAs mean fewer table
    // builds and a cheaper merge.
    auto fill = [&](int64_t c) {
      const double w = static_cast<double>(units * c) / static_cast<double>(slots);
      return w / std::ceil(w);
    };
    int64_t ctas = 1;
    double best = fill(1);
    for (int64_t c = 1; c <= max_ctas; ++c) {
      if (fill(c) >= 0.9) {
        ctas = c;
        break;
      }
      if (fill(c) > best) best = fill(c), ctas = c;
    }
    num_splits = static_cast<int>(ctas) * k.warps;
  }
  num_splits = (num_splits + k.warps - 1) / k.warps * k.warps;
  if (num_splits > kMaxSplits) throw_arg("decode: at most " + std::to_string(kMaxSplits) + " splits");
  DecodePlan plan;
  plan.num_splits = num_splits;
  plan.batch = batch;
  plan.n_q_heads = n_q_heads;
  plan.max_seq_len = max_seq_len;
  const int ctas = num_splits / k.warps;
  plan.cluster_merge = use_cluster(k, static_cast<int64_t>(batch) * kv.n_kv_heads, ctas);
  const Workspace w = workspace_layout(plan, kv.n_kv_heads, group, codec.head_dim(), k.warps);
  plan.workspace_bytes = w.bytes;
  return plan;
}

void run_decode(const CacheCodec& codec, const PagedKv& kv, const DecodeArgs& a, const DecodePlan& plan,
                void* workspace, cudaStream_t stream) {
  using namespace detail;
  const AttentionParams& ap = a.params;
  if (a.batch != plan.batch || ap.n_q_heads != plan.n_q_heads) throw_arg("decode: arguments do not match the plan");
  if (!workspace) throw_arg("decode: null argument");
  DecodeParams p = range_params(codec, kv, a, plan.num_splits, plan.max_seq_len);
  const Kernel k = pick(codec);
  const Workspace w = workspace_layout(plan, kv.n_kv_heads, p.group, codec.head_dim(), k.warps);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  p.o_part = reinterpret_cast<float*>(ws + w.o_part);
  p.lse_part = reinterpret_cast<float*>(ws + w.lse_part);
  p.counters = reinterpret_cast<uint32_t*>(ws + w.counters);
  TQKV_CUDA_CHECK(cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem));
  if (plan.num_splits % k.warps) throw_arg("decode: plan does not match this format");
  const int ctas = plan.num_splits / k.warps;
  if (plan.cluster_merge && (ctas < 2 || ctas > kMaxClusterCtasNonPortable))
    throw_arg("decode: cluster merge needs 2..16 CTAs");
  if (plan.cluster_merge && ctas > kMaxClusterCtas)
    TQKV_CUDA_CHECK(cudaFuncSetAttribute(k.fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  p.cluster = plan.cluster_merge;
  launch_clustered(k, dim3(ctas, kv.n_kv_heads, a.batch), p.cluster ? ctas : 1, stream, p);
}

void init_decode_workspace(const CacheCodec& codec, const PagedKv& kv, const DecodePlan& plan, void* workspace,
                           cudaStream_t stream) {
  using namespace detail;
  if (!workspace) throw_arg("decode: null workspace");
  if (plan.batch <= 0 || kv.n_kv_heads <= 0 || plan.n_q_heads % kv.n_kv_heads)
    throw_arg("decode: plan does not match the cache");
  const Kernel k = pick(codec);
  const Workspace w = workspace_layout(plan, kv.n_kv_heads, plan.n_q_heads / kv.n_kv_heads, codec.head_dim(), k.warps);
  const int64_t n = static_cast<int64_t>(plan.batch) * kv.n_kv_heads;
  init_counters(reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(workspace) + w.counters), n, stream);
}

bool fused_decode_supported(const CacheCodec& main, const CacheCodec* window) {
  return detail::find_fused_kernel(main, window).fn != nullptr;
}

namespace {

const CacheCodec& fused_main(const DecodePart (&parts)[3]) {
  if (!parts[kFusedMain].codec) detail::throw_arg("fused decode: the main part needs a codec");
  const CacheCodec* s = parts[kFusedSinks].codec;
  if (s && (s->format().key != KeyCodec::F16 || s->format().value != ValueCodec::F16))
    detail::throw_arg("fused decode: the sinks must be f16");
  for (const DecodePart& part : parts)
    if (part.codec && part.kv.n_kv_heads != parts[kFusedMain].kv.n_kv_heads)
      detail::throw_arg("fused decode: the parts' kv heads differ");
  return *parts[kFusedMain].codec;
}

detail::FusedKernel fused_kernel(const DecodePart (&parts)[3]) {
  const detail::FusedKernel k = detail::find_fused_kernel(fused_main(parts), parts[kFusedWindow].codec);
  if (!k.fn)
    detail::throw_arg("fused decode: no kernel for " + parts[kFusedMain].codec->format().name() + " with window " +
                      (parts[kFusedWindow].codec ? parts[kFusedWindow].codec->format().name() : std::string("f16")) +
                      " (src/cuda/decode_pairs.cmake)");
  return k;
}

}  // namespace

// The middle takes plan_decode's CTAs (it fills the device as a plain decode would); the window
// and the sinks, short ranges, one CTA per kCopyTilesPerWarp tiles a warp, at most 8 (8 and 16
// tiles measured within 2% of 4 on the H200, fewer and more middle CTAs within 1.5%). Each
// part's splits share the tiles of its own key range (known before its first page id is read,
// since the parts have cuts), so a sequence far shorter than the cache keeps every split busy.
FusedDecodePlan plan_fused_decode(const DecodePart (&parts)[3], int batch, int n_q_heads,
                                  const FusedDecodeOptions& options) {
  using namespace detail;
  const FusedKernel k = fused_kernel(parts);
  const CacheCodec& main = *parts[kFusedMain].codec;
  FusedDecodePlan plan;
  plan.batch = batch;
  plan.n_q_heads = n_q_heads;
  const DecodePlan mp = plan_decode(main, parts[kFusedMain].kv, batch, n_q_heads, parts[kFusedMain].max_seq_len);
  int others = 0;
  for (int i : {kFusedWindow, kFusedSinks}) {
    if (!parts[i].codec) continue;
    const int tiles = (std::max(parts[i].max_seq_len, 1) + kTileTokens - 1) / kTileTokens;
    constexpr int kCopyTilesPerWarp = 4;
    const int per_cta = kCopyTilesPerWarp * k.warps;
    plan.ctas[i] = std::clamp((tiles + per_cta - 1) / per_cta, 1, 8);
    others += plan.ctas[i];
  }
  plan.ctas[kFusedMain] = std::max(1, std::min(mp.num_splits / pick(main).warps, kMaxSplits / k.warps - others));
  // A middle with no positions (max_seq_len 0: the window covers every position a row may read,
  // as in a sliding-window layer whose copy spans its whole window) takes no CTA at all.
  if (parts[kFusedMain].max_seq_len == 0 && others > 0) plan.ctas[kFusedMain] = 0;
  // The copies' parts (a few hundred positions at most) take no more CTAs per (row, kv head) than
  // the compressed middle: with many rows (prefill chunks as decode rows) plan_decode gives the
  // middle one CTA each, and a fixed share of up to 8 for the window left most CTAs nearly idle.
  // Only above 256 rows (the largest decode bucket) until the H200 has measured it for decode
  // steps too, so today's decode plans are unchanged.
  if (batch > 256 && plan.ctas[kFusedMain] > 0)
    for (int i : {kFusedWindow, kFusedSinks})
      if (parts[i].codec) {
        others -= plan.ctas[i] - std::min(plan.ctas[i], plan.ctas[kFusedMain]);
        plan.ctas[i] = std::min(plan.ctas[i], plan.ctas[kFusedMain]);
      }
  const int64_t units = static_cast<int64_t>(batch) * parts[kFusedMain].kv.n_kv_heads;
  if (options.cluster) plan.cluster_merge = use_cluster(k, units, plan.ctas[kFusedMain] + others);
  // The short parts first only where the grid takes more than one wave: in one wave every CTA
  // starts at once whatever the order, and on the H200 the grid order was then 9% faster (batch
  // 1 x 32K, 35 CTAs).
  const int64_t grid_ctas = units * (plan.ctas[kFusedMain] + others);
  plan.short_first = options.short_first != 0 && !plan.cluster_merge && others > 0 && plan.ctas[kFusedMain] > 0 &&
                     grid_ctas <= INT_MAX &&
                     (options.short_first > 0 || grid_ctas > resident_ctas(k));
  // The workspace stays allocated with a cluster merge (unused), so the plan's size is the same.
  const Workspace w = workspace_layout(units, plan.ctas[0] + others, n_q_heads / parts[kFusedMain].kv.n_kv_heads,
                                       main.head_dim(), true);
  plan.workspace_bytes = w.bytes;
  return plan;
}

void init_fused_decode_workspace(const FusedDecodePlan& plan, int n_kv_heads, void* workspace, cudaStream_t stream) {
  using namespace detail;
  if (!workspace) throw_arg("fused decode: null workspace");
  if (plan.batch <= 0 || n_kv_heads <= 0 || plan.n_q_heads % n_kv_heads) throw_arg("fused decode: bad plan");
  const int64_t units = static_cast<int64_t>(plan.batch) * n_kv_heads;
  // The counters close the workspace (workspace_layout).
  const size_t counters = plan.workspace_bytes - align256(static_cast<size_t>(units) * sizeof(uint32_t));
  init_counters(reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(workspace) + counters), units, stream);
}

void run_fused_decode(const DecodePart (&parts)[3], const DecodeArgs& a, const FusedDecodePlan& plan, void* workspace,
                      cudaStream_t stream, const NewestKv& newest) {
  using namespace detail;
  const FusedKernel k = fused_kernel(parts);
  const CacheCodec& main = *parts[kFusedMain].codec;
  const AttentionParams& ap = a.params;
  if (a.batch != plan.batch || ap.n_q_heads != plan.n_q_heads) throw_arg("fused decode: arguments do not match the plan");
  if (!workspace) throw_arg("fused decode: null workspace");
  if (ap.n_q_heads <= 0 || ap.n_q_heads % parts[kFusedMain].kv.n_kv_heads ||
      ap.n_q_heads / parts[kFusedMain].kv.n_kv_heads > kMaxGroup)
    throw_arg("fused decode: n_q_heads must be a multiple of n_kv_heads, at most 8 per kv head");
  FusedParams fp{};
  int end = 0;
  for (int i = 0; i < 3; ++i) {
    const DecodePart& part = parts[i];
    // The middle's parameters are read by every CTA (heads, scale, the newest position's fold),
    // so they are filled even where the plan gives it no CTA.
    if (part.codec && (plan.ctas[i] > 0 || i == kFusedMain)) {
      DecodeArgs pa = a;
      pa.block_tables = part.block_tables;
      pa.block_table_stride = part.block_table_stride;
      pa.seq_lens = part.seq_lens;
      pa.params.min_key_pos = part.min_key_pos;
      pa.params.window = part.window;
      pa.params.exclude_recent = part.exclude_recent;
      // The softmax scale is the query's, whichever part's head dim rounding: the middle's.
      if (pa.params.scale == 0) pa.params.scale = 1.0f / std::sqrt(static_cast<float>(main.head_dim()));
      fp.part[i] = range_params(*part.codec, part.kv, pa, plan.ctas[i] * k.warps, part.max_seq_len);
      fp.part[i].spread = true;
      end += plan.ctas[i];
    }
    fp.cta_end[i] = end;
  }
  const int ctas = end;
  if (ctas > kMaxSplits / k.warps) throw_arg("fused decode: too many CTAs");
  fp.part[0].group = fp.part[1].group = fp.part[2].group = ap.n_q_heads / parts[kFusedMain].kv.n_kv_heads;
  const int64_t units = static_cast<int64_t>(a.batch) * parts[kFusedMain].kv.n_kv_heads;
  const Workspace w = workspace_layout(units, ctas, fp.part[0].group, main.head_dim(), true);
  if (w.bytes != plan.workspace_bytes) throw_arg("fused decode: the workspace does not match the plan");
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  fp.o_part = reinterpret_cast<float*>(ws + w.o_part);
  fp.lse_part = reinterpret_cast<float*>(ws + w.lse_part);
  fp.counters = reinterpret_cast<uint32_t*>(ws + w.counters);
  fp.out = a.out;
  fp.out_dtype = a.out_dtype;
  fp.lse = ap.lse;
  fp.cluster = plan.cluster_merge;
  fp.short_first = plan.short_first && !plan.cluster_merge;
  if (newest.k && (!newest.v || a.q_dtype != DType::F32))
    throw_arg("fused decode: folding the newest position needs its values and f32 queries");
  fp.newest = newest;
  if (fp.short_first && (ctas == fp.cta_end[0] || units * ctas > INT_MAX))
    throw_arg("fused decode: a short-first plan needs window or sink CTAs and fewer than 2^31 CTAs");
  TQKV_CUDA_CHECK(cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem));
  const dim3 grid = fp.short_first ? dim3(static_cast<unsigned>(units * ctas))
                                   : dim3(ctas, parts[kFusedMain].kv.n_kv_heads, a.batch);
  if (!fp.cluster) {
    k.fn<<<grid, k.warps * 32, k.smem, stream>>>(fp);
    TQKV_CUDA_CHECK(cudaGetLastError());
    return;
  }
  if (ctas < 2 || ctas > kMaxClusterCtasNonPortable) throw_arg("fused decode: a cluster merge needs 2..16 CTAs");
  if (ctas > kMaxClusterCtas)
    TQKV_CUDA_CHECK(cudaFuncSetAttribute(k.fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  launch_clustered(k, grid, ctas, stream, fp);
}

}  // namespace tqkv::cuda
