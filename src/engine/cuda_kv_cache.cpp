#include "cuda_kv_cache.h"

#include <algorithm>
#include <climits>
#include <optional>
#include <cmath>
#include <string>

#include "tqkv/cuda_ops.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::InvalidArgument, std::string("cuda cache: ") + what + ": " + cudaGetErrorString(e));
}

[[noreturn]] void not_yet(const std::string& what) {
  throw Error(ErrorCode::InvalidArgument, "cache spec: " + what + " is not on the GPU yet (use --device cpu)");
}

}  // namespace

CudaKvCache::CudaKvCache(const CacheSpec& spec, const CacheShape& shape, std::shared_ptr<CUstream_st> stream)
    : KvCache(spec, shape), owner_(std::move(stream)), stream_(owner_.get()), centring_(spec, shape.capacity) {
  if (shape.capacity < 1 || shape.max_seqs < 1)
    throw Error(ErrorCode::InvalidArgument, "cache: capacity and sequence count must be at least 1");
  const ModelConfig& m = spec.model;
  if (spec.sinks > 0) not_yet("attention sinks (sink<N>)");
  if (spec.window_at(shape.capacity) > 0 || spec.window_format) not_yet("the recent window (w<N>, fill<B>, wq<B>)");
  if (m.head_dim != 64 && m.head_dim != 128 && m.head_dim != 256)
    not_yet("head_dim " + std::to_string(m.head_dim) + " (the kernels take 64, 128, 256)");
  if (static_cast<int>(spec.layers.size()) != m.n_layers)
    throw Error(ErrorCode::InvalidArgument, "cache: the spec has no format for every layer");
  blocks_per_seq_ = (shape.capacity + kBlockSize - 1) / kBlockSize;
  const int num_blocks = blocks_per_seq_ * shape.max_seqs;
  layers_.reserve(m.n_layers);
  try {
    for (int l = 0; l < m.n_layers; ++l) {
      const Format& f = spec.layers[l];
      std::optional<cuda::CacheCodec> codec;
      try {
        codec.emplace(f, m.head_dim);
      } catch (const Error& e) {
        not_yet("layer " + std::to_string(l) + "'s format " + f.name() + " (" + e.what() + ")");
      }
      Layer L{*codec, {}, false, false};
      L.kv.num_blocks = num_blocks;
      L.kv.block_size = kBlockSize;
      L.kv.n_kv_heads = m.n_kv_heads;
      L.kv.layout = cuda::PageLayout::Page;
      const size_t pb = static_cast<size_t>(num_blocks) * page_geometry(f, m.head_dim, kBlockSize, m.n_kv_heads,
                                                                         cuda::PageLayout::Page).page_bytes();
      ck(cudaMalloc(reinterpret_cast<void**>(&L.kv.pages), std::max<size_t>(pb, 1)), "allocating a page pool");
      L.decode = L.codec.decode_supported() && m.n_heads / m.n_kv_heads <= 8;
      L.f32_workspace = !f.compressed() && (f.value == ValueCodec::F32 || f.value == ValueCodec::F16 ||
                                            f.value == ValueCodec::BF16);
      layers_.push_back(L);
    }
    if (centring_.active()) {
      const size_t per_layer = static_cast<size_t>(m.n_kv_heads) * m.head_dim, total = per_layer * m.n_layers;
      ck(cudaMalloc(reinterpret_cast<void**>(&mean_), total * sizeof(float)), "allocating centring");
      ck(cudaMalloc(reinterpret_cast<void**>(&scale_), total * sizeof(float)), "allocating centring");
      ck(cudaMemcpy(mean_, centring_.mean(0), total * sizeof(float), cudaMemcpyHostToDevice), "uploading centring");
      ck(cudaMemcpy(scale_, centring_.scale(0), total * sizeof(float), cudaMemcpyHostToDevice), "uploading centring");
    }
  } catch (...) {
    for (Layer& L : layers_) cudaFree(L.kv.pages);
    cudaFree(mean_);
    cudaFree(scale_);
    throw;
  }
  free_.reserve(num_blocks);
  for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

CudaKvCache::~CudaKvCache() {
  cudaStreamSynchronize(stream_);
  for (Layer& L : layers_) cudaFree(L.kv.pages);
  for (auto& [key, p] : plans_) cudaFree(p.workspace);
  for (void* p : {static_cast<void*>(mean_), static_cast<void*>(scale_), slots_, tables_, kws_, vws_, qbuf_, obuf_})
    cudaFree(p);
}

int64_t CudaKvCache::add_sequence() {
  if (static_cast<int>(seqs_.size()) >= max_seqs())
    throw Error(ErrorCode::Capacity, "cache: all " + std::to_string(max_seqs()) + " sequences are in use");
  const int64_t id = next_id_++;
  seqs_.emplace(id, Sequence{});
  return id;
}

void CudaKvCache::free_sequence(int64_t seq) {
  at(seq);
  Sequence& s = seqs_.at(seq);
  free_.insert(free_.end(), s.blocks.rbegin(), s.blocks.rend());
  seqs_.erase(seq);
}

const CudaKvCache::Sequence& CudaKvCache::at(int64_t seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw Error(ErrorCode::OutOfRange, "cache: unknown sequence " + std::to_string(seq));
  return it->second;
}

int64_t CudaKvCache::seq_len(int64_t seq) const { return at(seq).len; }

int CudaKvCache::max_step_tokens() const { return INT_MAX; }

void CudaKvCache::check(const Batch& batch) const {
  for (const Batch::Run& r : batch.runs()) {
    const Sequence& s = at(r.seq);
    if (r.pos0 != s.len)
      throw Error(ErrorCode::OutOfRange, "forward: position " + std::to_string(r.pos0) + " of sequence " +
                                             std::to_string(r.seq) + " does not follow the cache (" +
                                             std::to_string(s.len) + " tokens held)");
    if (r.pos0 + r.count > capacity())
      throw Error(ErrorCode::Capacity, "forward: " + std::to_string(r.pos0 + r.count) + " positions of sequence " +
                                           std::to_string(r.seq) + " exceed the cache capacity of " +
                                           std::to_string(capacity()));
  }
}

void* CudaKvCache::grow(void*& p, size_t& have, size_t bytes) {
  if (bytes > have) {
    if (p) cudaStreamSynchronize(stream_);  // the old buffer may still be read
    cudaFree(p);
    p = nullptr;
    have = 0;
    const size_t want = std::max<size_t>(bytes, 256) * 3 / 2;
    ck(cudaMalloc(&p, want), "allocating a workspace");
    have = want;
  }
  return p;
}

// Once per step (at layer 0): blocks for the new positions, the slot mapping, block tables.
void CudaKvCache::prepare(const Batch& batch) {
  step_ = Step{};
  step_.runs = batch.runs();
  const int n = batch.size();
  const int bps = blocks_per_seq_;
  // Blocks first (check() guaranteed room: each sequence holds at most capacity positions).
  for (const Batch::Run& r : step_.runs) {
    Sequence& s = seqs_.at(r.seq);
    const size_t need = static_cast<size_t>((r.pos0 + r.count + kBlockSize - 1) / kBlockSize);
    while (s.blocks.size() < need) {
      if (free_.empty()) throw Error(ErrorCode::Capacity, "cache: the page pool is exhausted");
      s.blocks.push_back(free_.back());
      free_.pop_back();
    }
  }
  std::vector<int64_t> slots(n);
  const size_t n_runs = step_.runs.size();
  for (size_t j = 0; j < n_runs; ++j) {
    const Batch::Run& r = step_.runs[j];
    const Sequence& s = seqs_.at(r.seq);
    for (int i = 0; i < r.count; ++i) {
      const int64_t pos = r.pos0 + i;
      slots[r.begin + i] = static_cast<int64_t>(s.blocks[pos / kBlockSize]) * kBlockSize + pos % kBlockSize;
    }
    if (r.count == 1) step_.decode_runs.push_back(static_cast<int>(j));
  }
  const size_t n_dec = step_.decode_runs.size();
  step_.decode_contiguous = static_cast<int>(n_dec) == n;
  // Int32 block tables: [n_runs, bps] for every run, [n_dec, bps] for decode, then decode
  // lengths [n_dec] and rows [n_dec].
  std::vector<int32_t> ints((n_runs + n_dec) * bps + 2 * n_dec, 0);
  for (size_t j = 0; j < n_runs; ++j) {
    const Sequence& s = seqs_.at(step_.runs[j].seq);
    std::copy(s.blocks.begin(), s.blocks.end(), ints.begin() + j * bps);
  }
  for (size_t i = 0; i < n_dec; ++i) {
    const Batch::Run& r = step_.runs[step_.decode_runs[i]];
    std::copy(ints.begin() + step_.decode_runs[i] * bps, ints.begin() + (step_.decode_runs[i] + 1) * bps,
              ints.begin() + (n_runs + i) * bps);
    ints[(n_runs + n_dec) * bps + i] = static_cast<int32_t>(r.pos0 + 1);
    ints[(n_runs + n_dec) * bps + n_dec + i] = r.begin;
  }
  grow(slots_, slots_bytes_, slots.size() * sizeof(int64_t));
  grow(tables_, tables_bytes_, ints.size() * sizeof(int32_t));
  ck(cudaMemcpyAsync(slots_, slots.data(), slots.size() * sizeof(int64_t), cudaMemcpyHostToDevice, stream_),
     "uploading the slot mapping");
  ck(cudaMemcpyAsync(tables_, ints.data(), ints.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_),
     "uploading block tables");
  auto* base = static_cast<int32_t*>(tables_);
  dec_tables_ = base + n_runs * bps;
  dec_lens_ = base + (n_runs + n_dec) * bps;
  dec_rows_ = dec_lens_ + n_dec;
  for (const Batch::Run& r : step_.runs) seqs_.at(r.seq).len = r.pos0 + r.count;
}

CudaKvCache::Plan& CudaKvCache::plan_for(const Layer& L, int batch) {
  const auto key = std::make_pair(L.codec.format().name(), batch);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  Plan p;
  p.plan = cuda::plan_decode(L.codec, L.kv, batch, spec().model.n_heads, capacity());
  ck(cudaMalloc(&p.workspace, std::max<size_t>(p.plan.workspace_bytes, 256)), "allocating a decode workspace");
  try {
    cuda::init_decode_workspace(L.codec, L.kv, p.plan, p.workspace, stream_);
  } catch (...) {
    cudaFree(p.workspace);
    throw;
  }
  return plans_.emplace(key, p).first->second;
}

void CudaKvCache::attend(int layer, const Batch& batch, float* q, float* k, const float* v, float* out) {
  const ModelConfig& m = spec().model;
  const int n = batch.size();
  if (n == 0) return;
  if (layer == 0) prepare(batch);
  const int D = m.head_dim, hq = m.n_heads, hkv = m.n_kv_heads, group = hq / hkv;
  const size_t q_row = static_cast<size_t>(hq) * D;
  if (centring_.active()) {
    const size_t off = static_cast<size_t>(layer) * hkv * D;
    cuda::centre_keys(k, q, mean_ + off, scale_ + off, n, hkv, group, D, centring_.scales(), stream_);
  }
  if (key_hook()) key_hook()(layer, n, k, q);
  Layer& L = layers_[layer];
  cuda::StoreArgs sa;
  sa.k = k;
  sa.v = v;
  sa.dtype = cuda::DType::F32;
  sa.slot_mapping = static_cast<const int64_t*>(slots_);
  sa.n_tokens = n;
  cuda::store(L.codec, L.kv, sa, stream_);

  const int window = m.window(layer);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const bool decode = L.decode && window == 0 && !step_.decode_runs.empty();
  if (decode) {
    const int n_dec = static_cast<int>(step_.decode_runs.size());
    Plan& p = plan_for(L, n_dec);
    const float* q_in = q;
    float* o = out;
    if (!step_.decode_contiguous) {
      const size_t bytes = static_cast<size_t>(n_dec) * q_row * sizeof(float);
      q_in = static_cast<float*>(grow(qbuf_, qbuf_bytes_, bytes));
      o = static_cast<float*>(grow(obuf_, obuf_bytes_, bytes));
      cuda::gather_rows(q, static_cast<int>(q_row), dec_rows_, n_dec, const_cast<float*>(q_in), stream_);
    }
    cuda::DecodeArgs da;
    da.q = q_in;
    da.q_dtype = cuda::DType::F32;
    da.out = o;
    da.out_dtype = cuda::DType::F32;
    da.block_tables = dec_tables_;
    da.block_table_stride = blocks_per_seq_;
    da.seq_lens = dec_lens_;
    da.batch = n_dec;
    da.params.n_q_heads = hq;
    da.params.head_dim = D;
    da.params.scale = scale;
    cuda::run_decode(L.codec, L.kv, da, p.plan, p.workspace, stream_);
    if (!step_.decode_contiguous) cuda::scatter_rows(o, static_cast<int>(q_row), dec_rows_, n_dec, out, stream_);
  }
  const size_t elem = L.f32_workspace ? sizeof(float) : 2;
  for (size_t j = 0; j < step_.runs.size(); ++j) {
    const Batch::Run& r = step_.runs[j];
    if (decode && r.count == 1) continue;
    const int n_kv = static_cast<int>(r.pos0 + r.count);
    const size_t bytes = static_cast<size_t>(n_kv) * hkv * D * elem;
    cuda::DequantArgs dq;
    dq.block_table = static_cast<const int32_t*>(tables_) + j * blocks_per_seq_;
    dq.start = 0;
    dq.n_tokens = n_kv;
    dq.k_out = grow(kws_, kws_bytes_, bytes);
    dq.v_out = grow(vws_, vws_bytes_, bytes);
    dq.out_dtype = L.f32_workspace ? cuda::DType::F32 : cuda::DType::BF16;
    cuda::dequantize(L.codec, L.kv, dq, stream_);
    cuda::PrefillArgs pa;
    pa.q = q + static_cast<size_t>(r.begin) * q_row;
    pa.k = kws_;
    pa.v = vws_;
    pa.kv_bf16 = !L.f32_workspace;
    pa.out = out + static_cast<size_t>(r.begin) * q_row;
    pa.n_q = r.count;
    pa.pos0 = r.pos0;
    pa.n_kv = n_kv;
    pa.n_q_heads = hq;
    pa.n_kv_heads = hkv;
    pa.head_dim = D;
    pa.scale = scale;
    pa.window = window;
    cuda::prefill_attention(pa, stream_);
  }
}

// Not a hot path (tests, tools, bindings): temporary buffers, a synchronous copy.
void CudaKvCache::read(int layer, int64_t seq, int64_t start, int count, bool keys, float* out) const {
  const Sequence& s = at(seq);
  if (layer < 0 || layer >= static_cast<int>(layers_.size()))
    throw Error(ErrorCode::OutOfRange, "cache: layer " + std::to_string(layer) + " out of range");
  if (start < 0 || count < 0 || start + count > s.len)
    throw Error(ErrorCode::OutOfRange, "cache: positions [" + std::to_string(start) + ", " +
                                           std::to_string(start + count) + ") of sequence " + std::to_string(seq) +
                                           " are not held (" + std::to_string(s.len) + " held)");
  if (count == 0) return;
  const Layer& L = layers_[layer];
  const size_t n = static_cast<size_t>(count) * spec().model.n_kv_heads * spec().model.head_dim;
  int32_t* table = nullptr;
  float* kd = nullptr;
  float* vd = nullptr;
  ck(cudaMalloc(reinterpret_cast<void**>(&table), s.blocks.size() * sizeof(int32_t)), "cudaMalloc");
  ck(cudaMalloc(reinterpret_cast<void**>(&kd), n * sizeof(float)), "cudaMalloc");
  ck(cudaMalloc(reinterpret_cast<void**>(&vd), n * sizeof(float)), "cudaMalloc");
  std::unique_ptr<void, void (*)(void*)> free_table(table, [](void* p) { cudaFree(p); });
  std::unique_ptr<void, void (*)(void*)> free_k(kd, [](void* p) { cudaFree(p); });
  std::unique_ptr<void, void (*)(void*)> free_v(vd, [](void* p) { cudaFree(p); });
  ck(cudaMemcpyAsync(table, s.blocks.data(), s.blocks.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_),
     "cudaMemcpyAsync");
  cuda::DequantArgs dq;
  dq.block_table = table;
  dq.start = static_cast<int>(start);
  dq.n_tokens = count;
  dq.k_out = kd;
  dq.v_out = vd;
  dq.out_dtype = cuda::DType::F32;
  cuda::dequantize(L.codec, L.kv, dq, stream_);
  ck(cudaMemcpyAsync(out, keys ? kd : vd, n * sizeof(float), cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync");
  ck(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  if (keys) centring_.restore(layer, count, out);
}

}  // namespace tqkv::engine
