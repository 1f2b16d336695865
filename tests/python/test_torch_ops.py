"""tqkv.torch: the paged-cache custom ops (store, decode, dequantize) against the core library
(SlotCodec, PagedCache and its attention), under fake tensors and torch.compile, and on CUDA
against the CPU ops (skipped without a GPU or without the CUDA build; a failure then when
TQKV_REQUIRE_CUDA=1)."""
import numpy as np
import pytest
from conftest import needs_cuda, require_module

torch = require_module("torch", cuda=True)
import tqkv  # noqa: E402
import tqkv.torch as tq  # noqa: E402

FMT = "turboquant_4bit_nc"
FORMATS = ["turboquant_4bit_nc", "tq-k4v2", "turboquant_k8v4", "f16"]


def filled(fmt, layout, dim=64, heads=2, bs=16, num_blocks=8, lens=(20, 7), seed=0):
    """A PagedCache with sequences of the given lengths and the same writes made through
    tq.store into a tensor: (paged, cache tensor, seq ids, padded int32 block tables, k, v)."""
    g = torch.Generator().manual_seed(seed)
    paged = tqkv.PagedCache(1, heads, dim, num_blocks=num_blocks, block_size=bs, formats=fmt, layout=layout)
    cache = tq.new_cache(fmt, dim, heads, bs, num_blocks)
    seqs, slots = [], []
    for n in lens:
        s = paged.add_sequence()
        seqs.append(s)
        slots.append(paged.append_slots(s, n))
    slot_mapping = torch.from_numpy(np.concatenate(slots))
    k = torch.randn(len(slot_mapping), heads, dim, generator=g)
    v = torch.randn(len(slot_mapping), heads, dim, generator=g)
    paged.store(0, slot_mapping.numpy(), k.numpy(), v.numpy())
    tq.store(k, v, cache, slot_mapping, fmt, block_size=bs, layout=layout)
    width = max(len(paged.block_table(s)) for s in seqs) + 1
    tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for i, s in enumerate(seqs):
        t = torch.from_numpy(paged.block_table(s))
        tables[i, : len(t)] = t
    return paged, cache, seqs, tables, k, v


@pytest.mark.parametrize("layout", ["page", "slot"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_store_writes_the_paged_cache_bytes(fmt, layout):
    paged, cache, *_ = filled(fmt, layout)
    np.testing.assert_array_equal(cache.numpy(), paged.pool(0))


def test_store_in_slot_layout_is_the_slot_codec():
    dim, heads, bs = 64, 2, 16
    cache = tq.new_cache(FMT, dim, heads, bs, 4)
    k, v = torch.randn(3, heads, dim), torch.randn(3, heads, dim)
    tq.store(k, v, cache, torch.tensor([17, -1, 5]), FMT, block_size=bs, layout="slot")
    codec = tqkv.SlotCodec(FMT, dim)
    sb = codec.slot_bytes
    page1 = cache[1].numpy().reshape(bs, heads, sb)
    page0 = cache[0].numpy().reshape(bs, heads, sb)
    for h in range(heads):
        np.testing.assert_array_equal(page1[1, h], codec.encode(k[0, h][None].numpy(), v[0, h][None].numpy())[0])
        np.testing.assert_array_equal(page0[5, h], codec.encode(k[2, h][None].numpy(), v[2, h][None].numpy())[0])
    assert cache.sum() == torch.from_numpy(page1[1]).sum() + torch.from_numpy(page0[5]).sum()  # token 1 skipped


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_takes_half_inputs_and_strided_tokens(dtype):
    dim, heads = 64, 2
    qkv = torch.randn(6, 3, heads, dim).to(dtype)
    k, v = qkv[:, 1], qkv[:, 2]  # token stride 3 * heads * dim
    a = tq.new_cache(FMT, dim, heads, 16, 2)
    b = tq.new_cache(FMT, dim, heads, 16, 2)
    slots = torch.arange(6) * 3
    tq.store(k, v, a, slots, FMT)
    tq.store(k.float().contiguous(), v.float().contiguous(), b, slots, FMT)
    assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["page", "slot"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_matches_paged_cache_attention(fmt, layout):
    paged, cache, seqs, tables, *_ = filled(fmt, layout)
    q = torch.randn(len(seqs), 8, 64)
    out = tq.decode(q, cache, tables, torch.tensor([20, 7], dtype=torch.int32), fmt, layout=layout)
    want = paged.attention(0, np.array(seqs), q.numpy())
    ref = paged.attention(0, np.array(seqs), q.numpy(), reference=True)
    assert out.dtype == torch.float32 and out.shape == q.shape
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out.numpy(), ref, atol=2e-4)


def test_decode_options_and_dtypes():
    paged, cache, seqs, tables, *_ = filled(FMT, "page")
    lens = torch.tensor([20, 7], dtype=torch.int32)
    q = torch.randn(2, 4, 64)
    for kw in ({"scale": 0.3}, {"window": 5}):
        got = tq.decode(q, cache, tables, lens, FMT, **kw)
        np.testing.assert_allclose(got.numpy(), paged.attention(0, np.array(seqs), q.numpy(), **kw), atol=1e-6)
    half = tq.decode(q.to(torch.bfloat16), cache, tables, lens, FMT)
    assert half.dtype == torch.bfloat16
    full = tq.decode(q.to(torch.bfloat16).float(), cache, tables, lens, FMT)
    torch.testing.assert_close(half, full.to(torch.bfloat16))
    # Shorter lengths read fewer tokens: the query sits at position seq_len - 1.
    short = tq.decode(q, cache, tables, torch.tensor([3, 7], dtype=torch.int32), FMT)
    assert not torch.allclose(short[0], tq.decode(q, cache, tables, lens, FMT)[0])


@pytest.mark.parametrize("layout", ["page", "slot"])
def test_dequantize_matches_paged_cache_decode(layout):
    paged, cache, seqs, tables, *_ = filled("tq-k4v2", layout)
    k, v = tq.dequantize(cache, tables[0], 3, 15, "tq-k4v2", 64, layout=layout)
    np.testing.assert_array_equal(k.numpy(), paged.decode(0, seqs[0], 3, 15))
    np.testing.assert_array_equal(v.numpy(), paged.decode(0, seqs[0], 3, 15, keys=False))
    kh, _ = tq.dequantize(cache, tables[0], 3, 15, "tq-k4v2", 64, layout=layout, dtype=torch.float16)
    assert kh.dtype == torch.float16 and torch.equal(kh, k.half())
    empty, _ = tq.dequantize(cache, tables[0], 0, 0, "tq-k4v2", 64)
    assert empty.shape == (0, 2, 64)


def test_cache_shape():
    assert tq.cache_shape(FMT, 128, 2, 16, 10) == (10, 16 * 2 * tqkv.Format(FMT).slot_bytes(128))
    assert tq.cache_shape("turboquant_k8v4", 128, 1, 16, 1) == (1, 16 * 196)
    with pytest.raises(tqkv.Error, match="block_size"):
        tq.cache_shape(FMT, 128, 2, 12, 10)


def expect_error(match, fn, *args, **kw):
    with pytest.raises(tqkv.Error, match=match):
        fn(*args, **kw)


def test_bad_inputs_raise():
    cache = tq.new_cache(FMT, 64, 2, 16, 4)
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    slots = torch.arange(3)
    expect_error("key: expected dtype", tq.store, k.double(), v, cache, slots, FMT)
    expect_error("value: expected dtype", tq.store, k, v.half(), cache, slots, FMT)
    expect_error("cache: expected dtype", tq.store, k, v, cache.to(torch.int8), slots, FMT)
    expect_error("slot_mapping: expected dtype", tq.store, k, v, cache, slots.int(), FMT)
    expect_error("slot_mapping: 2 slots for 3 tokens", tq.store, k, v, cache, slots[:2], FMT)
    expect_error("key: expected a 3-D", tq.store, k[0], v[0], cache, slots, FMT)
    expect_error("value: shape", tq.store, k, v[:, :1], cache, slots, FMT)
    expect_error("kv heads", tq.store, k[:, :1].contiguous(), v[:, :1].contiguous(), cache, slots, FMT)
    expect_error("contiguous", tq.store, k.transpose(1, 2).contiguous().transpose(1, 2), v, cache, slots, FMT)
    expect_error("contiguous", tq.store, k, v, cache[:, ::2], slots, FMT)
    expect_error("unknown format|format", tq.store, k, v, cache, slots, "no-such-format")
    expect_error("layout", tq.store, k, v, cache, slots, FMT, layout="rows")
    expect_error("block_size", tq.store, k, v, cache, slots, FMT, block_size=8)
    expect_error("pages of", tq.store, k, v, cache[:, :-2].contiguous(), slots, FMT)
    with pytest.raises(tqkv.Error, match="past the pool") as e:
        tq.store(k, v, cache, torch.tensor([0, 1, 64]), FMT)
    assert e.value.code == "out_of_range" and not cache.any()  # nothing written
    with pytest.raises(tqkv.Error) as e:
        tq.store(k, torch.full_like(v, float("nan")), cache, slots, FMT)
    assert e.value.code == "non_finite" and not cache.any()

    tq.store(k, v, cache, slots, FMT)
    q, lens = torch.randn(1, 4, 64), torch.tensor([3], dtype=torch.int32)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    expect_error("block_tables: expected dtype", tq.decode, q, cache, table.long(), lens, FMT)
    expect_error("seq_lens: expected dtype", tq.decode, q, cache, table, lens.long(), FMT)
    expect_error("query: expected dtype", tq.decode, q.double(), cache, table, lens, FMT)
    expect_error("query: 3 query heads", tq.decode, q[:, :3], cache, table, lens, FMT)
    expect_error("expected 2 rows", tq.decode, torch.cat([q, q]), cache, table, lens, FMT)
    expect_error("query: expected a contiguous", tq.decode, torch.randn(1, 64, 4).transpose(1, 2), cache, table, lens,
                 FMT)
    with pytest.raises(tqkv.Error, match="outside the pool") as e:
        tq.decode(q, cache, torch.tensor([[9, 1]], dtype=torch.int32), lens, FMT)
    assert e.value.code == "out_of_range"
    expect_error("needs 2 pages", tq.decode, q, cache, table[:, :1], torch.tensor([17], dtype=torch.int32), FMT)
    expect_error("is empty", tq.decode, q, cache, table, torch.tensor([0], dtype=torch.int32), FMT)
    expect_error("block_table: 2 pages", tq.dequantize, cache, table[0], 20, 13, FMT, 64)
    expect_error("outside the pool", tq.dequantize, cache, torch.tensor([7], dtype=torch.int32), 0, 3, FMT, 64)
    expect_error("dtype", tq.dequantize, cache, table[0], 0, 3, FMT, 64, dtype=torch.int32)
    if torch.cuda.is_available():
        expect_error("expected cpu", tq.decode, q.cuda(), cache, table, lens, FMT)


def test_fake_tensors_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        cache = torch.empty(tq.cache_shape(FMT, 64, 2, 16, 8), dtype=torch.uint8)
        q = torch.empty(3, 8, 64, dtype=torch.bfloat16)
        out = torch.ops.tqkv.decode(q, cache, torch.empty(3, 5, dtype=torch.int32), torch.empty(3, dtype=torch.int32),
                                    FMT)
        assert out.shape == (3, 8, 64) and out.dtype == torch.bfloat16
        k, v = torch.ops.tqkv.dequantize(cache, torch.empty(5, dtype=torch.int32), 2, 30, FMT, 64,
                                         dtype=torch.float16)
        assert k.shape == (30, 2, 64) and v.dtype == torch.float16
        torch.ops.tqkv.store(torch.empty(4, 2, 64), torch.empty(4, 2, 64), cache,
                             torch.empty(4, dtype=torch.int64), FMT)
        with pytest.raises(tqkv.Error, match="kv heads"):
            torch.ops.tqkv.decode(torch.empty(1, 3, 64), cache, torch.empty(1, 5, dtype=torch.int32),
                                  torch.empty(1, dtype=torch.int32), FMT)

    paged, cache, seqs, tables, k, v = filled(FMT, "page")
    lens = torch.tensor([20, 7], dtype=torch.int32)
    torch.library.opcheck(torch.ops.tqkv.decode.default, (torch.randn(2, 4, 64), cache, tables, lens, FMT))
    torch.library.opcheck(torch.ops.tqkv.dequantize.default, (cache, tables[0], 0, 20, FMT, 64))
    slots = torch.arange(0, 40, 2)
    torch.library.opcheck(torch.ops.tqkv.store.default, (k[:20], v[:20], cache.clone(), slots, FMT))


def test_torch_compile_aot_eager():
    dim, heads, bs = 64, 2, 16

    def step(k, v, q, cache, slots, tables, lens):
        tq.store(k, v, cache, slots, FMT, block_size=bs)
        out = tq.decode(q * 2, cache, tables, lens, FMT, block_size=bs)
        kd, vd = tq.dequantize(cache, tables[0], 0, 4, FMT, dim, block_size=bs)
        return out + 1, kd.sum() + vd.sum()

    k, v, q = torch.randn(4, heads, dim), torch.randn(4, heads, dim), torch.randn(1, 4, dim)
    slots, tables = torch.arange(4), torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.tensor([4], dtype=torch.int32)
    eager_cache, compiled_cache = tq.new_cache(FMT, dim, heads, bs, 2), tq.new_cache(FMT, dim, heads, bs, 2)
    want = step(k, v, q, eager_cache, slots, tables, lens)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(k, v, q, compiled_cache, slots, tables, lens)
    assert torch.equal(eager_cache, compiled_cache)  # the mutation of the cache survives compilation
    torch.testing.assert_close(got, want)


# ---- CUDA -----------------------------------------------------------------------------------

cuda = needs_cuda(torch, tq)
CUDA_FORMATS = ["turboquant_4bit_nc", "turboquant_k8v4", "tq-k4v2", "tq-k3v2"]


def cuda_case(fmt, dim=128, heads=2, bs=16, num_blocks=64, lens=(300, 17, 129), n_q_heads=8, seed=7):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    k, v = torch.randn(total, heads, dim, generator=g), torch.randn(total, heads, dim, generator=g)
    width = max((n + bs - 1) // bs for n in lens) + 1
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = perm[: len(lens) * width].reshape(len(lens), width).contiguous()
    slots = torch.cat([tables[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for i, n in enumerate(lens)])
    q = torch.randn(len(lens), n_q_heads, dim, generator=g)
    return k, v, slots, tables, torch.tensor(lens, dtype=torch.int32), q


@cuda
@pytest.mark.parametrize("layout", ["page", "slot"])
@pytest.mark.parametrize("fmt", CUDA_FORMATS)
def test_cuda_store_is_byte_identical_to_cpu(fmt, layout):
    k, v, slots, *_ = cuda_case(fmt)
    cpu = tq.new_cache(fmt, 128, 2, 16, 64)
    gpu = tq.new_cache(fmt, 128, 2, 16, 64, device="cuda")
    tq.store(k, v, cpu, slots, fmt, layout=layout)
    tq.store(k.cuda(), v.cuda(), gpu, slots.cuda(), fmt, layout=layout)
    assert torch.equal(gpu.cpu(), cpu)
    # bf16 inputs: the same bytes as their float32 widening on the CPU.
    kb, vb = k.bfloat16(), v.bfloat16()
    cpu.zero_(), gpu.zero_()
    tq.store(kb, vb, cpu, slots, fmt, layout=layout)
    tq.store(kb.cuda(), vb.cuda(), gpu, slots.cuda(), fmt, layout=layout)
    assert torch.equal(gpu.cpu(), cpu)


@cuda
@pytest.mark.parametrize("fmt", CUDA_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_decode_and_dequantize_match_cpu(fmt, dtype):
    k, v, slots, tables, lens, q = cuda_case(fmt)
    cache = tq.new_cache(fmt, 128, 2, 16, 64)
    tq.store(k, v, cache, slots, fmt)
    gpu = cache.cuda()
    want = tq.decode(q, cache, tables, lens, fmt)
    got = tq.decode(q.to(dtype).cuda(), gpu, tables.cuda(), lens.cuda(), fmt)
    assert got.dtype == dtype
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)
    kc, vc = tq.dequantize(cache, tables[0], 5, 200, fmt, 128)
    kg, vg = tq.dequantize(gpu, tables[0].cuda(), 5, 200, fmt, 128)
    torch.testing.assert_close(kg.cpu(), kc, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vg.cpu(), vc, atol=1e-5, rtol=1e-5)


@cuda
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # the capture that raises
def test_cuda_graph_capture_and_replay():
    fmt = FMT
    k, v, slots, tables, lens, q = cuda_case(fmt)
    cache = tq.new_cache(fmt, 128, 2, 16, 64, device="cuda")
    tq.store(k.cuda(), v.cuda(), cache, slots.cuda(), fmt)
    qg, tg, lg = q.cuda().bfloat16(), tables.cuda(), lens.cuda()
    eager = tq.decode(qg, cache, tg, lg, fmt)  # warm-up: makes the plan and workspace
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tq.decode(qg, cache, tg, lg, fmt)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tq.decode(qg, cache, tg, lg, fmt)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # New inputs in the captured buffers: the replay follows them.
    qg.copy_(torch.randn_like(qg))
    lg.copy_(torch.tensor([250, 3, 100], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, tq.decode(qg, cache, tg, lg, fmt))
    with pytest.raises(tqkv.Error, match="before capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            tq.decode(qg[:1], cache, tg[:1], lg[:1], fmt)


@cuda
def test_cuda_bad_inputs_raise():
    cache = tq.new_cache(FMT, 128, 2, 16, 4, device="cuda")
    k = torch.randn(3, 2, 128, device="cuda")
    expect_error("expected cuda", tq.store, k, k, cache, torch.arange(3), FMT)
    expect_error("'page' layout", tq.decode, torch.randn(1, 4, 128, device="cuda"), cache,
                 torch.zeros(1, 1, dtype=torch.int32, device="cuda"), torch.ones(1, dtype=torch.int32, device="cuda"),
                 FMT, layout="slot")
    tq.set_index_checks(True)
    try:
        expect_error("past the pool", tq.store, k, k, cache, torch.tensor([0, 1, 64], device="cuda"), FMT)
        expect_error("outside the pool", tq.decode, torch.randn(1, 4, 128, device="cuda"), cache,
                     torch.tensor([[5]], dtype=torch.int32, device="cuda"),
                     torch.ones(1, dtype=torch.int32, device="cuda"), FMT)
    finally:
        tq.set_index_checks(False)
