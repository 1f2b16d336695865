#include "attention_driver.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "thread_pool.h"

namespace tqkv::cpu {

namespace {

float max_abs_level(const Codebook& cb) {
  float amax = 0.0f;
  for (float x : cb.levels_f32) amax = std::max(amax, std::fabs(x));
  return amax;
}

// 6-8-bit keys' and 6-bit values' levels in two bytes (kernel.h key_wide, value_wide): L16 =
// round(level / step), step = max |level| / (64 kI8LevelMax) (returned), hi[j] = floor(L16 /
// 64) + kI8Offset, lo[j] = L16 mod 64, for the first n entries (replicated every size()).
float wide_levels(const Codebook& cb, uint8_t* hi, uint8_t* lo, int n) {
  const float step = max_abs_level(cb) / static_cast<float>(64 * kI8LevelMax);
  for (int j = 0; j < n; ++j) {
    const float x = std::nearbyint(cb.levels_f32[j % cb.size()] / step);
    const int l16 = static_cast<int>(std::clamp(x, -float{64 * kI8LevelMax}, float{64 * kI8LevelMax}));
    const int h = l16 >= 0 ? l16 / 64 : -((-l16 + 63) / 64);  // floor
    hi[j] = static_cast<uint8_t>(h + kI8Offset);
    lo[j] = static_cast<uint8_t>(l16 - 64 * h);
  }
  return step;
}

// The codebook's levels as 7-bit integers, replicated every size() entries: out[j] =
// round(level[j mod size] / step), step = max |level| / kI8LevelMax (returned).
float int8_levels(const Codebook& cb, int8_t out[64]) {
  const float step = max_abs_level(cb) / static_cast<float>(kI8LevelMax);
  for (int j = 0; j < 64; ++j) {
    const float x = std::nearbyint(cb.levels_f32[j % cb.size()] / step);
    out[j] = static_cast<int8_t>(std::clamp(x, -float{kI8LevelMax}, float{kI8LevelMax}));
  }
  return step;
}

}  // namespace

KernelFormat kernel_format(const SlotCodec& codec) {
  const Format& f = codec.format();
  KernelFormat k{};
  k.dim = codec.dim();
  k.key = f.key;
  k.key_bits = f.key_bits;
  k.value = f.value;
  k.value_bits = f.value_bits;
  if (const Codebook* cb = codec.key_codebook()) {
    k.key_levels = cb->levels_f32.data();
    for (int i = 0; i < 16; ++i) k.key_lut[i] = cb->levels_f32[i % cb->size()];
  }
  if (const Codebook* cb = codec.value_codebook()) {
    k.value_levels = cb->levels_f32.data();
    for (int i = 0; i < 16; ++i) k.value_lut[i] = cb->levels_f32[i % cb->size()];
  } else if (f.value == ValueCodec::Uniform && f.value_bits <= 4) {
    const int n = 1 << f.value_bits;
    for (int i = 0; i < 16; ++i) k.value_lut[i] = static_cast<float>(i % n) - 0.5f * static_cast<float>(n - 1);
  }
  const KeyScores mode = active_key_scores();
  k.int8_keys = f.key == KeyCodec::Mse && f.key_bits >= 2 && f.key_bits <= kI8MaxKeyBits && mode != KeyScores::Exact;
  k.key_wide = k.int8_keys && f.key_bits >= kI8WideBits;
  if (k.key_wide) {
    k.key_i8_step = wide_levels(*codec.key_codebook(), k.key_u8, k.key_lo, 256);
  } else if (k.int8_keys) {
    int8_t l8[64];
    k.key_i8_step = int8_levels(*codec.key_codebook(), l8);
    for (int j = 0; j < 64; ++j) k.key_u8[j] = static_cast<uint8_t>(l8[j] + kI8Offset);
  }
  k.int8_values = f.value_bits >= 2 && mode == KeyScores::Int8 &&
                  ((f.value == ValueCodec::Mse && f.value_bits <= kI8WideBits) || (f.value == ValueCodec::Uniform && f.value_bits <= 4));
  k.value_wide = k.int8_values && f.value == ValueCodec::Mse && f.value_bits == kI8WideBits;
  if (k.value_wide) {
    uint8_t hi[64], lo[64];
    k.value_i8_step = wide_levels(*codec.value_codebook(), hi, lo, 64);
    for (int j = 0; j < 64; ++j) {
      k.value_i8[j] = static_cast<int8_t>(hi[j] - kI8Offset);
      k.value_lo[j] = static_cast<int8_t>(lo[j]);
    }
  } else if (k.int8_values) {
    const int n = 1 << f.value_bits;
    if (f.value == ValueCodec::Uniform) {  // code - mid = (2 code - (n - 1)) / 2: exact
      k.value_i8_step = 0.5f;
      for (int j = 0; j < 64; ++j) k.value_i8[j] = static_cast<int8_t>(2 * (j % n) - (n - 1));
    } else {
      k.value_i8_step = int8_levels(*codec.value_codebook(), k.value_i8);
    }
  }
  k.key_code_bytes = f.key_code_bytes(k.dim);
  k.value_code_bytes = f.value_code_bytes(k.dim);
  return k;
}

SlotRun slot_layout_run(const Format& f, int dim, const uint8_t* first, size_t stride, int64_t pos0, int n) {
  SlotRun r{};
  r.pos0 = pos0;
  r.n = n;
  r.kc = first;
  r.kc_stride = r.km_stride = r.vc_stride = r.vm0_stride = r.vm1_stride = stride;
  if (f.key_meta_bytes()) r.km = first + f.key_code_bytes(dim);
  r.vc = first + f.key_bytes(dim);
  if (f.value_meta_bytes()) r.vm0 = r.vc + f.value_code_bytes(dim);
  if (f.value == ValueCodec::Uniform) r.vm1 = r.vm0 + 2;
  return r;
}

void push_query(const SlotCodec& codec, const float* q, float scale, AttnGroup& g) {
  const int d = codec.dim();
  const size_t at = g.q.size();
  g.q.insert(g.q.end(), q, q + d);
  float* row = g.q.data() + at;
  if (codec.format().keys_rotated()) codec.rotation().apply(row);
  for (int i = 0; i < d; ++i) row[i] *= scale;
}

void push_chunk_groups(const SlotCodec& codec, const KvSource& src, int n_kv_heads, int group, float scale,
                       const float* q, int n_q, int64_t q_pos0, int64_t first_key, const AttentionParams& params,
                       float* out, std::vector<AttnGroup>& groups) {
  // Rows per block: enough query tokens of a prefill chunk to amortise each decoded tile.
  constexpr int kMaxRows = 64;
  const int Hq = n_kv_heads * group, d = codec.dim();
  const int tokens_per_block = std::max(1, kMaxRows / group);
  for (int h = 0; h < n_kv_heads; ++h) {
    for (int t0 = 0; t0 < n_q; t0 += tokens_per_block) {
      const int t1 = std::min(n_q, t0 + tokens_per_block);
      AttnGroup& g = groups.emplace_back();
      g.src = &src;
      g.head = h;
      for (int t = t0; t < t1; ++t) {
        const int64_t pos = q_pos0 + t;
        int64_t begin = std::max(first_key, params.min_key_pos);
        if (params.window > 0) begin = std::max(begin, pos - params.window + 1);
        for (int j = 0; j < group; ++j) {
          const size_t row = static_cast<size_t>(t) * Hq + static_cast<size_t>(h) * group + j;
          push_query(codec, q + row * d, scale, g);
          g.begin.push_back(begin);
          g.end.push_back(pos - params.exclude_recent);
          g.out.push_back(out + row * d);
          if (params.lse) g.lse.push_back(params.lse + row);
          ++g.rows;
        }
      }
    }
  }
}

namespace {

struct Task {
  int group;
  int64_t k0, k1;  // inclusive key range
  size_t state;    // offset of this task's partial state in the state buffer
};

}  // namespace

void run_attention_groups(const SlotCodec& codec, const std::vector<AttnGroup>& groups) {
  if (groups.empty()) return;
  const int d = codec.dim();
  const KernelFormat kf = kernel_format(codec);
  const RunKernel kernel = pick_kernel(kf, active_simd_level());
  const int threads = pool_threads();

  // Plan: split each group's key range so that there are a few tasks per thread, but never
  // below 256 keys a task (the merge and the per-task setup must stay negligible).
  int64_t total = 0;
  std::vector<int64_t> lo(groups.size()), hi(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    // Rows that see no key (begin > end) do not widen the group's range.
    lo[g] = std::numeric_limits<int64_t>::max();
    hi[g] = std::numeric_limits<int64_t>::min();
    for (int r = 0; r < groups[g].rows; ++r)
      if (groups[g].begin[r] <= groups[g].end[r]) {
        lo[g] = std::min(lo[g], groups[g].begin[r]);
        hi[g] = std::max(hi[g], groups[g].end[r]);
      }
    if (lo[g] > hi[g]) lo[g] = 0, hi[g] = -1;
    total += std::max<int64_t>(0, hi[g] - lo[g] + 1);
  }
  const int64_t chunk = std::max<int64_t>(256, (total + 4 * threads - 1) / (4 * threads));
  std::vector<Task> tasks;
  std::vector<int> first_task(groups.size() + 1);
  size_t state_floats = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    first_task[g] = static_cast<int>(tasks.size());
    const int64_t n = std::max<int64_t>(1, hi[g] - lo[g] + 1);
    const int64_t splits = std::max<int64_t>(1, (n + chunk - 1) / chunk);
    for (int64_t s = 0; s < splits; ++s) {
      const int64_t a = lo[g] + n * s / splits, b = lo[g] + n * (s + 1) / splits - 1;
      tasks.push_back({static_cast<int>(g), a, b, state_floats});
      state_floats += static_cast<size_t>(groups[g].rows) * (d + 3);
    }
  }
  first_task[groups.size()] = static_cast<int>(tasks.size());

  // Partial states: per task [rows] m, [rows] l, [rows] zs, [rows, d] acc.
  std::vector<float> state(state_floats);
  int max_rows = 0;
  for (const auto& g : groups) max_rows = std::max(max_rows, g.rows);
  // Small calls (a short context, one decode token) stay on the calling thread: waking the
  // pool costs more than it saves below ~16K slot-rows (~0.2 ms of work; see simd.h).
  int64_t work = 0;
  for (size_t g = 0; g < groups.size(); ++g) work += std::max<int64_t>(0, hi[g] - lo[g] + 1) * groups[g].rows;
  const int workers =
      work < attention_parallel_threshold() ? 1 : std::max(1, std::min<int>(threads, static_cast<int>(tasks.size())));
  const size_t scratch_floats = kernel_scratch_floats(d, max_rows);
  std::vector<float> scratch(scratch_floats * workers);

  parallel_for(static_cast<int>(tasks.size()), workers, [&](int ti, int worker) {
    const Task& t = tasks[ti];
    const AttnGroup& g = groups[t.group];
    float* s = state.data() + t.state;
    RowState st{s, s + g.rows, s + 3 * g.rows, s + 2 * g.rows};
    std::fill(st.m, st.m + g.rows, -std::numeric_limits<float>::infinity());
    std::fill(st.l, st.l + 2 * g.rows + static_cast<size_t>(g.rows) * d, 0.0f);  // l, zs, acc
    if (t.k1 < t.k0) return;
    const RowBlock rb{g.q.data(), g.rows, g.begin.data(), g.end.data()};
    thread_local std::vector<SlotRun> runs;
    runs.clear();
    g.src->runs(g.head, t.k0, t.k1, runs);
    kernel(kf, runs.data(), static_cast<int>(runs.size()), rb, st, scratch.data() + scratch_floats * worker);
  });

  // Merge the splits of each group by log-sum-exp and rotate Mse values back once.
  const bool rotate_back = codec.format().values_rotated();
  parallel_for(static_cast<int>(groups.size()), workers, [&](int gi, int) {
    const AttnGroup& g = groups[gi];
    std::vector<float> o(d);
    for (int r = 0; r < g.rows; ++r) {
      float M = -std::numeric_limits<float>::infinity();
      for (int ti = first_task[gi]; ti < first_task[gi + 1]; ++ti) M = std::max(M, state[tasks[ti].state + r]);
      std::fill(o.begin(), o.end(), 0.0f);
      float lse = -std::numeric_limits<float>::infinity();
      if (M != -std::numeric_limits<float>::infinity()) {
        double L = 0;
        for (int ti = first_task[gi]; ti < first_task[gi + 1]; ++ti) {
          const float* s = state.data() + tasks[ti].state;
          const float m = s[r];
          if (m == -std::numeric_limits<float>::infinity()) continue;
          const float e = std::exp(m - M);
          L += static_cast<double>(e) * s[g.rows + r];
          const float zs = s[2 * g.rows + r];
          const float* acc = s + 3 * g.rows + static_cast<size_t>(r) * d;
          for (int i = 0; i < d; ++i) o[i] += e * (acc[i] + zs);
        }
        lse = M + static_cast<float>(std::log(L));
        const float inv = static_cast<float>(1.0 / L);
        for (int i = 0; i < d; ++i) o[i] *= inv;
        if (rotate_back) codec.rotation().inverse(o.data());
      }
      std::memcpy(g.out[r], o.data(), sizeof(float) * d);
      if (!g.lse.empty()) *g.lse[r] = lse;
    }
  });
}

}  // namespace tqkv::cpu
