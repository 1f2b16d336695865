"""The contiguous and paged caches and attention on them, against NumPy and the C++ reference."""
import numpy as np
import pytest

import tqkv
from conftest import randn, softmax_attention

COMPRESSED = ["tq-k4v2", "turboquant_4bit_nc", "k3v3+gauss+had", "turboquant_k8v4"]


def filled(rng, fmt, n_layers=2, heads=2, dim=64, n=12, capacity=32):
    cache = tqkv.ContiguousCache(n_layers, heads, dim, capacity, formats=fmt)
    ks, vs = [], []
    for layer in range(n_layers):
        k, v = randn(rng, n, heads, dim), randn(rng, n, heads, dim)
        cache.write(layer, 0, k, v)
        ks.append(k)
        vs.append(v)
    return cache, ks, vs


def test_contiguous_cache_holds_what_the_codec_encodes(rng):
    cache, ks, vs = filled(rng, "tq-k4v2")
    codec = tqkv.SlotCodec("tq-k4v2", 64)
    assert cache.seq_len == 12 and cache.first_pos == 0
    assert cache.bytes_per_token == 2 * 2 * codec.slot_bytes
    assert cache.bytes == cache.bytes_per_token * 32
    want = codec.encode(np.ascontiguousarray(ks[1][:, 1]), np.ascontiguousarray(vs[1][:, 1]))
    ring = cache.ring(1, 1)
    assert ring.shape == (32, codec.slot_bytes) and not ring.flags.writeable
    np.testing.assert_array_equal(ring[:12], want)
    np.testing.assert_array_equal(cache.decode(1, 3, 4)[:, 1], codec.decode_keys(want[3:7]))
    np.testing.assert_array_equal(cache.decode(1, 0, 12, keys=False)[:, 1], codec.decode_values(want))
    # The ring is a view: a later write shows through it.
    cache.write(1, 12, ks[1][:1], vs[1][:1])
    np.testing.assert_array_equal(ring[12], want[0])


def test_per_layer_formats_and_eviction(rng):
    formats = tqkv.boundary_layer_formats(5, "turboquant_4bit_nc", skip=1)
    assert [f.name for f in formats] == ["f16"] + ["turboquant_4bit_nc"] * 3 + ["f16"]
    cache = tqkv.ContiguousCache(5, 1, 32, 4, formats=formats)
    assert cache.format(0) == tqkv.Format("f16") and cache.format(2).name == "turboquant_4bit_nc"
    x = randn(rng, 6, 1, 32)
    for pos in range(6):
        for layer in range(5):
            cache.write(layer, pos, x[pos:pos + 1], x[pos:pos + 1])
    assert (cache.first_pos, cache.seq_len) == (2, 6)  # capacity 4: positions 0, 1 evicted
    np.testing.assert_array_equal(cache.decode(0, 2, 4), x[2:].astype(np.float16).astype(np.float32))
    with pytest.raises(tqkv.Error) as e:
        cache.decode(0, 0, 1)
    assert e.value.code == "out_of_range"
    cache.evict_oldest(3)
    assert cache.first_pos == 5
    cache.clear()
    assert cache.seq_len == 0


@pytest.mark.parametrize("n_q_heads", [2, 4, 8])
def test_f16_attention_matches_numpy_softmax(rng, n_q_heads):
    cache, ks, vs = filled(rng, "f16", n=20)
    q = randn(rng, 5, n_q_heads, 64)
    out, lse = cache.attention(1, q, 15, return_lse=True)
    k16 = ks[1].astype(np.float16).astype(np.float32)
    v16 = vs[1].astype(np.float16).astype(np.float32)
    want, want_lse = softmax_attention(q, k16, v16, 15)
    assert out.shape == q.shape and out.dtype == np.float32
    np.testing.assert_allclose(out, want, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5)
    # A sliding window and an explicit scale.
    out = cache.attention(1, q, 15, window=6, scale=0.3)
    np.testing.assert_allclose(out, softmax_attention(q, k16, v16, 15, window=6, scale=0.3)[0], atol=2e-5)
    # float16 queries are their float32 widening.
    qh = q.astype(np.float16)
    np.testing.assert_array_equal(cache.attention(1, qh, 15), cache.attention(1, qh.astype(np.float32), 15))


@pytest.mark.parametrize("fmt", COMPRESSED)
def test_compressed_attention_matches_the_reference(rng, fmt):
    cache, _, _ = filled(rng, fmt, n=24)
    q = randn(rng, 3, 4, 64)
    out = cache.attention(0, q, 21)
    ref = cache.attention(0, q, 21, reference=True)
    np.testing.assert_allclose(out, ref, atol=1e-4)
    # Attention on the compressed cache is attention on its decoded keys and values (the rotation
    # is orthogonal), not on the originals.
    k, v = cache.decode(0, 0, 24), cache.decode(0, 0, 24, keys=False)
    np.testing.assert_allclose(out, softmax_attention(q, k, v, 21)[0], atol=1e-4)


def test_attention_equals_the_c_api(capi, rng):
    dim, heads, n, seed = 64, 2, 10, 5
    st, c = capi.cache(dim, 4, 2, seed, 1, heads, 16)
    cache = tqkv.ContiguousCache(1, heads, dim, 16, formats="tq-k4v2", seed=seed)
    k, v = randn(rng, n, heads, dim), randn(rng, n, heads, dim)
    for pos in range(n):
        capi.lib.fa_tq_quantize(st, c, 0, pos, capi.ptr(np.ascontiguousarray(k[pos])), True)
        capi.lib.fa_tq_quantize(st, c, 0, pos, capi.ptr(np.ascontiguousarray(v[pos])), False)
    cache.write(0, 0, k, v)
    q = randn(rng, 1, 6, dim)
    want = np.zeros(6 * dim, np.float32)
    assert capi.lib.fa_tq_attention(st, c, 0, n - 1, capi.ptr(np.ascontiguousarray(q[0])), 6, 0.0, capi.ptr(want)) == 0
    capi.lib.fa_tq_cache_free(c)
    capi.lib.fa_tq_free(st)
    np.testing.assert_allclose(cache.attention(0, q, n - 1)[0].ravel(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["slot", "page"])
def test_paged_cache_fork_and_attention(rng, layout):
    dim, heads, bs = 64, 2, 16
    paged = tqkv.PagedCache(2, heads, dim, num_blocks=8, block_size=bs, formats="turboquant_4bit_nc", layout=layout)
    flat = tqkv.ContiguousCache(2, heads, dim, 64, formats="turboquant_4bit_nc")
    a = paged.add_sequence()
    k, v = randn(rng, 2, 20, heads, dim), randn(rng, 2, 20, heads, dim)
    slots = paged.append_slots(a, 20)
    assert slots.dtype == np.int64 and list(slots[:3]) == [bs * int(paged.block_table(a)[0]) + i for i in range(3)]
    for layer in range(2):
        paged.store(layer, slots, k[layer], v[layer])
        flat.write(layer, 0, k[layer], v[layer])
    assert paged.seq_len(a) == 20 and paged.free_blocks == 6
    assert paged.pool(0).shape == (8, paged.page_bytes(0))
    np.testing.assert_array_equal(paged.decode(1, a, 0, 20), flat.decode(1, 0, 20))

    b = paged.fork(a)
    table = paged.block_table(a)
    assert list(paged.block_table(b)) == list(table) and paged.ref_count(int(table[1])) == 2
    x = randn(rng, 1, heads, dim)
    slot_b = paged.append_slots(b, 1)  # copies the shared, partly filled last page
    for layer in range(2):
        paged.store(layer, slot_b, x, x)
    assert paged.block_table(b)[1] != table[1] and paged.ref_count(int(table[0])) == 2
    np.testing.assert_array_equal(paged.decode(0, a, 0, 20), flat.decode(0, 0, 20))
    assert paged.seq_len(a) == 20 and paged.seq_len(b) == 21

    q = randn(rng, 1, 4, dim)
    out = paged.attention(1, np.array([a], np.int32), q)
    np.testing.assert_allclose(out, flat.attention(1, q, 19), atol=1e-5)
    np.testing.assert_allclose(out, paged.attention(1, np.array([a]), q, reference=True), atol=1e-4)
    both = paged.attention(0, np.array([a, b]), np.concatenate([q, q]))
    assert both.shape == (2, 4, dim)
    paged.free_sequence(b)
    paged.free_sequence(a)
    assert paged.free_blocks == 8 and not paged.has_sequence(a)


def test_paged_cache_capacity_is_an_error(rng):
    paged = tqkv.PagedCache(1, 1, 32, num_blocks=2, block_size=16)
    s = paged.add_sequence()
    paged.append_slots(s, 30)
    with pytest.raises(tqkv.Error) as e:
        paged.append_slots(s, 3)
    assert e.value.code == "capacity" and paged.seq_len(s) == 30
