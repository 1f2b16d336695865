"""tqkv's kernels against vLLM's own Triton TurboQuant kernels on the GPU (vllm_peer.py loads
them from vLLM), on vLLM's cache tensor as vLLM 0.26+ allocates it (head-major, transposed to
[num_blocks, block_size, num_kv_heads, slot]), every preset at head dims 64, 128, 256, with
scattered block tables:
  store        bytes identical to vLLM's store on the same inputs and cache;
  decode       within tolerance of vLLM's decode, eagerly and replayed in a CUDA graph, both of
               tqkv's decode kernels (CUDA cores, tensor cores);
  continuation the short-chunk path (a decode per query row over one block-table row) and the
               long-chunk dequantize, within tolerance of vLLM's.
Skipped without a GPU or the extension, unless TQKV_REQUIRE_CUDA=1 (then they fail).
    TQKV_VLLM_PEER=.peer/vllm-0.26.0 python -m pytest vllm_plugin/tests/test_vs_vllm_gpu.py
"""

from __future__ import annotations

import math
import os

import pytest

torch = pytest.importorskip("torch")

REQUIRE = os.environ.get("TQKV_REQUIRE_CUDA") == "1"


def _need(cond: bool, why: str):
    if not cond:
        if REQUIRE:
            pytest.fail(why)
        pytest.skip(why, allow_module_level=True)


_need(torch.cuda.is_available(), "no CUDA device")
try:
    from tqkv_vllm import ops
except ImportError as e:  # the extension was not built
    ops = None
    _need(False, f"tqkv_vllm ops: {e}")

import vllm_peer  # noqa: E402

PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
DIMS = [64, 128, 256]


@pytest.fixture(scope="module")
def peer():
    try:
        return vllm_peer.load()
    except (ImportError, FileNotFoundError) as e:
        _need(False, f"vLLM's kernels: {e}")


class Layer:
    """What vLLM's TurboQuant impl derives for a layer (_ensure_on_device), from vLLM's code."""

    def __init__(self, peer, preset: str, d: int, dev="cuda"):
        self.cfg = peer.config.TurboQuantConfig.from_cache_dtype(preset, d)
        self.d = d
        self.kb = 8 if self.cfg.key_fp8 else self.cfg.key_mse_bits
        self.vb = self.cfg.effective_value_quant_bits
        self.nc = bool(self.cfg.norm_correction)
        self.H = peer.hadamard(d, str(torch.device(dev)))
        self.centroids = peer.centroids.get_centroids(d, self.cfg.centroid_bits).to(device=dev, dtype=torch.float32)
        c_sorted, _ = self.centroids.sort()
        self.midpoints = (c_sorted[:-1] + c_sorted[1:]) / 2
        self.slot = self.cfg.slot_size_aligned


def new_cache(layer: Layer, num_blocks: int, block_size: int, hk: int, gen) -> torch.Tensor:
    """vLLM 0.26's allocation [num_blocks, Hk, block_size, slot] of random bytes, and the view
    its backend passes to the kernels."""
    raw = torch.randint(0, 256, (num_blocks, hk, block_size, layer.slot), dtype=torch.uint8, device="cuda",
                        generator=gen)
    return raw


def view(raw: torch.Tensor) -> torch.Tensor:
    return raw.transpose(1, 2)


def kv_rows(n: int, hq: int, hk: int, d: int, gen, dtype=torch.bfloat16):
    """K, V [n, hk, d] as strided views into one qkv projection, with per-token scales and a few
    outliers (so the value ranges and key norms vary as a model's do)."""
    qkv = torch.randn(n, (hq + 2 * hk) * d, device="cuda", generator=gen)
    scale = torch.exp(torch.randn(n, 1, device="cuda", generator=gen))
    qkv = qkv * scale
    qkv[torch.rand(qkv.shape, device="cuda", generator=gen) < 1e-3] *= 20
    qkv = qkv.to(dtype)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(n, hk, d)
    v = qkv[:, (hq + hk) * d:].view(n, hk, d)
    return q, k, v


def vllm_store(peer, layer: Layer, k, v, cache_view, slots):
    peer.store.triton_turboquant_store(k, v, cache_view, slots, layer.H, layer.midpoints,
                                       mse_bits=layer.cfg.key_mse_bits, key_packed_size=layer.cfg.key_packed_size,
                                       value_quant_bits=layer.vb, key_fp8=layer.cfg.key_fp8)


def tqkv_store(layer: Layer, k, v, cache_view, slots):
    ops.store(k, v, cache_view, slots, layer.kb, layer.vb, layer.H, layer.midpoints)


def field_report(a: torch.Tensor, b: torch.Tensor, layer: Layer) -> str:
    """Where two caches differ, by slot field."""
    diff = (a != b).reshape(-1, layer.slot).sum(0).cpu()
    cfg = layer.cfg
    kc = layer.d if cfg.key_fp8 else math.ceil(layer.d * cfg.key_mse_bits / 8)
    vc = math.ceil(layer.d * layer.vb / 8)
    fields = [("key codes", 0, kc)]
    if not cfg.key_fp8:
        fields.append(("key norm", kc, kc + 2))
    kp = cfg.key_packed_size
    fields += [("value codes", kp, kp + vc), ("value scale", kp + vc, kp + vc + 2),
               ("value zero", kp + vc + 2, kp + vc + 4)]
    return ", ".join(f"{n}: {int(diff[lo:hi].sum())}" for n, lo, hi in fields)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("preset", PRESETS)
def test_store_bytes_identical(peer, preset, d):
    gen = torch.Generator(device="cuda").manual_seed(1000 + d)
    layer = Layer(peer, preset, d)
    hk, bs, nb, n = 2, 16, 64, 700  # the shape of filled_cache's stores: vLLM's store compiles once
    raw = new_cache(layer, nb, bs, hk, gen)
    _, k, v = kv_rows(n, 8, hk, d, gen)
    slots = torch.randperm(nb * bs, device="cuda", generator=gen)[:n].to(torch.int64)
    slots[torch.rand(n, device="cuda", generator=gen) < 0.1] = -1  # padding tokens
    a, b = raw.clone(), raw.clone()
    vllm_store(peer, layer, k, v, view(a), slots)
    tqkv_store(layer, k, v, view(b), slots)
    torch.cuda.synchronize()
    assert not torch.equal(a, raw), "vLLM's store wrote nothing"
    assert torch.equal(a, b), f"{int((a != b).sum())} bytes differ ({field_report(a, b, layer)})"


def filled_cache(peer, layer: Layer, lens, hk: int, hq: int, bs: int, gen):
    """A cache holding len_b tokens for each sequence b, stored by vLLM's store, behind a block
    table of scattered pages (with spare pages between)."""
    pages = [math.ceil(n / bs) for n in lens]
    nb = 2 * sum(pages) + 3
    raw = new_cache(layer, nb, bs, hk, gen)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(7)).tolist()
    width = max(pages) + 2
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    it = iter(perm)
    for i, p in enumerate(pages):
        for j in range(p):
            bt[i, j] = next(it)
    bt = bt.cuda()
    for i, n in enumerate(lens):
        _, k, v = kv_rows(n, hq, hk, layer.d, gen)
        pos = torch.arange(n, device="cuda")
        slots = (bt[i, pos // bs].long() * bs + pos % bs)
        vllm_store(peer, layer, k, v, view(raw), slots)
    return raw, bt


def vllm_decode(peer, layer: Layer, q, cache_view, bt, lens):
    return peer.decode.triton_turboquant_decode_attention(
        query=q, kv_cache=cache_view, block_table=bt, seq_lens=lens, Pi=layer.H, centroids=layer.centroids,
        scale=1.0 / math.sqrt(layer.d), mse_bits=layer.cfg.key_mse_bits, key_packed_size=layer.cfg.key_packed_size,
        value_quant_bits=layer.vb, key_fp8=layer.cfg.key_fp8, norm_correction=layer.nc, PiT=layer.H,
        max_num_kv_splits=32)


KERNELS = [1, 2]  # ops.KERNELS: CUDA cores, tensor cores (GQA groups of up to 8)


def tqkv_decode(layer: Layer, q, cache_view, bt, lens, splits=None, out=None, workspace=None, kernel=0):
    b, hq, d = q.shape
    splits = splits or ops.num_splits(b, cache_view.shape[2], q.device)
    out = torch.empty_like(q) if out is None else out
    if workspace is None:
        workspace = torch.empty(b, hq, splits, d + 1, dtype=torch.float32, device=q.device)
    return ops.decode(q, cache_view, bt, lens, layer.centroids, out, workspace, layer.kb, layer.vb, layer.nc,
                      1.0 / math.sqrt(d), splits, kernel)


def close(ours: torch.Tensor, theirs: torch.Tensor, what: str):
    err = (ours.float() - theirs.float()).abs().max().item()
    mag = theirs.float().abs().max().item()
    assert err <= 2e-2 * max(1.0, mag), f"{what}: max |tqkv - vLLM| = {err:.3g} (|vLLM| up to {mag:.3g})"


def check_decode(peer, preset: str, d: int, group: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    layer = Layer(peer, preset, d)
    hk, bs = 2, 16
    lens = [1, 15, 16, 17, 333, 2100]
    raw, bt = filled_cache(peer, layer, lens, hk, hk * group, bs, gen)
    q = torch.randn(len(lens), hk * group, d, device="cuda", generator=gen).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    theirs = vllm_decode(peer, layer, q, view(raw), bt, lens_t)
    for kernel in KERNELS if group <= 8 else [0]:
        for splits in (None, 1, 13):
            ours = tqkv_decode(layer, q, view(raw), bt, lens_t, splits, kernel=kernel)
            close(ours, theirs, f"kernel={kernel} splits={splits}")


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_matches_vllm(peer, preset, d):
    check_decode(peer, preset, d, 4, 2000 + d)


@pytest.mark.parametrize("group", [1, 7, 16])
def test_decode_gqa_groups(peer, group):
    check_decode(peer, "turboquant_4bit_nc", 128, group, 2100 + group)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("block_size", [32, 128])
def test_decode_block_sizes(peer, block_size, kernel):
    gen = torch.Generator(device="cuda").manual_seed(block_size)
    layer = Layer(peer, "turboquant_4bit_nc", 128)
    lens = [5, 200, 1025]
    raw, bt = filled_cache(peer, layer, lens, 4, 16, block_size, gen)
    q = torch.randn(len(lens), 16, 128, device="cuda", generator=gen).to(torch.float16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    theirs = vllm_decode(peer, layer, q, view(raw), bt, lens_t)
    close(tqkv_decode(layer, q, view(raw), bt, lens_t, kernel=kernel), theirs, "decode")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_in_cuda_graph(peer, preset, kernel):
    """Captured once, replayed with other lengths, pages and queries: what vLLM's decode graphs do.
    The op allocates nothing (the workspace is the caller's) and never waits for the device."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    layer = Layer(peer, preset, 128)
    hk, group = 2, 4
    lens = [700, 64, 1500, 3]
    raw, bt = filled_cache(peer, layer, lens, hk, hk * group, 16, gen)
    b, hq = len(lens), hk * group
    q = torch.zeros(b, hq, 128, dtype=torch.bfloat16, device="cuda")
    lens_t = torch.ones(b, dtype=torch.int32, device="cuda")  # as vLLM captures: length 1
    bt_s = torch.zeros_like(bt)
    out = torch.empty_like(q)
    splits = ops.num_splits(b, hk, q.device)
    ws = torch.empty(b, hq, splits, 129, dtype=torch.float32, device="cuda")
    tqkv_decode(layer, q, view(raw), bt_s, lens_t, splits, out, ws, kernel)  # warm-up outside the capture
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tqkv_decode(layer, q, view(raw), bt_s, lens_t, splits, out, ws, kernel)
    assert torch.cuda.memory_allocated() == before
    for trial in range(2):
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen))
        new_lens = [lens[(i + trial) % b] for i in range(b)]
        rows = [(i + trial) % b for i in range(b)]
        lens_t.copy_(torch.tensor(new_lens, dtype=torch.int32))
        bt_s.copy_(bt[rows])
        g.replay()
        close(out, vllm_decode(peer, layer, q, view(raw), bt_s, lens_t), f"graph replay {trial}")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("preset", PRESETS)
def test_continuation_short_chunk(peer, preset, d, kernel):
    """A chunk of q_len <= 128 queries after `cached` tokens: one decode row per query, lengths
    cached + 1 .. seq_len over the request's block-table row (stride 0), as vLLM's backend runs it."""
    gen = torch.Generator(device="cuda").manual_seed(4000 + d)
    layer = Layer(peer, preset, d)
    hk, group, cached, q_len = 2, 4, 900, 37
    raw, bt = filled_cache(peer, layer, [cached + q_len], hk, hk * group, 16, gen)
    q = torch.randn(q_len, hk * group, d, device="cuda", generator=gen).to(torch.bfloat16)
    lens = torch.arange(cached + 1, cached + q_len + 1, dtype=torch.int32, device="cuda")
    row = bt[0:1].expand(q_len, -1)
    close(tqkv_decode(layer, q, view(raw), row, lens, kernel=kernel), vllm_decode(peer, layer, q, view(raw), row, lens),
          "chunk")


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("preset", PRESETS)
def test_continuation_long_chunk_dequant(peer, preset, d):
    """The long-chunk path's dequantized history: tqkv's dequant (keys rotated back in the kernel)
    against vLLM's _tq_full_dequant_kv followed by its fp16 rotation, as its backend does."""
    gen = torch.Generator(device="cuda").manual_seed(5000 + d)
    layer = Layer(peer, preset, d)
    hk, bs, cached = 4, 16, 1000
    raw, bt = filled_cache(peer, layer, [cached], hk, 8, bs, gen)
    cache_view = view(raw)
    alloc = math.ceil(cached / bs) * bs
    k_buf = torch.empty(1, hk, alloc, d, dtype=torch.float16, device="cuda")
    v_buf = torch.empty_like(k_buf)
    row = bt[0:1]
    cfg = layer.cfg
    peer.decode._tq_full_dequant_kv[(alloc, hk)](
        cache_view, row, layer.centroids, k_buf, v_buf, k_buf.stride(0), k_buf.stride(1), k_buf.stride(2),
        v_buf.stride(0), v_buf.stride(1), v_buf.stride(2), cache_view.stride(0), cache_view.stride(1),
        cache_view.stride(2), row.stride(0), HEAD_DIM=d, BLOCK_SIZE=bs, NUM_KV_HEADS=hk,
        MSE_BYTES=math.ceil(d * cfg.key_mse_bits / 8) if not cfg.key_fp8 else d, KPS=cfg.key_packed_size,
        VQB=layer.vb, VAL_DATA_BYTES=math.ceil(d * layer.vb / 8), MSE_BITS=cfg.key_mse_bits,
        KEY_FP8=1 if cfg.key_fp8 else 0, BLOCK_D=d, NORM_CORRECTION=1 if layer.nc else 0,
        FP8_E4B15=peer.decode._use_fp8_e4b15(0), num_warps=4)
    k_ref = k_buf[0, :, :cached]
    if not cfg.key_fp8:
        k_ref = (k_ref.reshape(-1, d) @ layer.H.to(torch.float16)).reshape(hk, cached, d)
    k_ref, v_ref = k_ref.transpose(0, 1), v_buf[0, :, :cached].transpose(0, 1)
    k_out = torch.empty(cached, hk, d, dtype=torch.bfloat16, device="cuda")
    v_out = torch.empty_like(k_out)
    ops.dequant(cache_view, row[0], layer.centroids, k_out, v_out, cached, layer.kb, layer.vb, layer.nc)
    close(k_out, k_ref, "keys")
    close(v_out, v_ref, "values")
