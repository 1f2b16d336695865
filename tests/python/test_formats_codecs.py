"""Formats and slot codecs through the bindings, against the C++ results."""
import numpy as np
import pytest

import tqkv
from conftest import randn


def test_named_formats_round_trip_by_name():
    named = tqkv.named_formats()
    names = [f.name for f in named]
    assert {"f16", "f32", "turboquant_4bit_nc", "turboquant_k8v4", "tq-k4v2"} <= set(names)
    for f in named:
        assert tqkv.Format(f.name) == f
        assert f.summary != "variant"
    assert len(set(named)) == len(named)  # hashable, and distinct formats hash apart


def test_variant_grammar():
    f = tqkv.Format("k5v4")
    assert (f.key_codec, f.key_bits, f.value_codec, f.value_bits) == ("mse", 5, "mse", 4)
    assert f.name == "k5v4" and f.summary == "variant" and f.compressed and f.norm_correction
    g = tqkv.Format("k3v3+gauss+had+raw")
    assert (g.law, g.rotation, g.norm_correction) == ("gauss", "hadamard", False)
    assert tqkv.Format(g.name) == g and g != tqkv.Format("k3v3")
    u = tqkv.Format("tq-k4v2+vu")
    assert u.value_codec == "uniform" and u.value_bytes(128) == 128 * 2 // 8 + 4
    assert not tqkv.Format("bf16").compressed


def test_bytes_per_slot_match_the_c_api(capi):
    for kb, vb in [(4, 2), (3, 3), (2, 4)]:
        st, c = capi.cache(128, kb, vb, 7, 3, 2, 8)
        f = tqkv.Format(f"tq-k{kb}v{vb}")
        assert capi.lib.fa_tq_cache_bytes_per_token(c) == 3 * 2 * f.slot_bytes(128)
        capi.lib.fa_tq_cache_free(c)
        capi.lib.fa_tq_free(st)
    f = tqkv.Format("turboquant_4bit_nc")
    assert f.slot_bytes(128) == f.key_bytes(128) + f.value_bytes(128) == 134
    assert f.bits_per_element(128) == pytest.approx(134 * 8 / 256)


def test_uncompressed_round_trips_exactly(rng):
    x, y = randn(rng, 6, 64), randn(rng, 6, 64)
    c32 = tqkv.SlotCodec("f32", 64)
    s = c32.encode(x, y)
    assert s.shape == (6, c32.slot_bytes) and s.dtype == np.uint8
    np.testing.assert_array_equal(c32.decode_keys(s), x)
    np.testing.assert_array_equal(c32.decode_values(s), y)
    c16 = tqkv.SlotCodec(tqkv.Format("f16"), 64)
    np.testing.assert_array_equal(c16.decode_keys(c16.encode(x, y)), x.astype(np.float16).astype(np.float32))
    # float16 input is the same as its float32 widening.
    h = x.astype(np.float16)
    np.testing.assert_array_equal(c16.encode(h, h), c16.encode(h.astype(np.float32), h.astype(np.float32)))


@pytest.mark.parametrize("kb,vb", [(4, 2), (3, 4), (2, 2)])
def test_compressed_decode_equals_the_c_api(capi, rng, kb, vb):
    dim, heads, n, seed = 64, 2, 5, 99
    k, v = randn(rng, n, heads, dim), randn(rng, n, heads, dim)
    st, c = capi.cache(dim, kb, vb, seed, 1, heads, n)
    for pos in range(n):
        capi.lib.fa_tq_quantize(st, c, 0, pos, capi.ptr(np.ascontiguousarray(k[pos])), True)
        capi.lib.fa_tq_quantize(st, c, 0, pos, capi.ptr(np.ascontiguousarray(v[pos])), False)
        capi.check()
    want_k, want_v = np.zeros((n, heads, dim), np.float32), np.zeros((n, heads, dim), np.float32)
    capi.lib.fa_tq_dequantize(st, c, 0, 0, n, True, capi.ptr(want_k))
    capi.lib.fa_tq_dequantize(st, c, 0, 0, n, False, capi.ptr(want_v))
    capi.check()
    capi.lib.fa_tq_cache_free(c)
    capi.lib.fa_tq_free(st)

    codec = tqkv.SlotCodec(f"tq-k{kb}v{vb}", dim, seed=seed)
    slots = codec.encode(k.reshape(-1, dim), v.reshape(-1, dim))
    np.testing.assert_array_equal(codec.decode_keys(slots).reshape(n, heads, dim), want_k)
    np.testing.assert_array_equal(codec.decode_values(slots).reshape(n, heads, dim), want_v)
    rel = np.linalg.norm(want_k - k) / np.linalg.norm(k)
    assert 0 < rel < {2: 0.4, 3: 0.2, 4: 0.12}[kb]


def test_encoding_is_the_same_at_every_simd_level(rng):
    codec = tqkv.SlotCodec("turboquant_k3v4_nc", 128)
    x, y = randn(rng, 9, 128), randn(rng, 9, 128)
    level = tqkv.simd_level()
    try:
        tqkv.set_simd_level("scalar")
        scalar = codec.encode(x, y)
    finally:
        tqkv.set_simd_level(level)
    np.testing.assert_array_equal(codec.encode(x, y), scalar)


def test_the_package_docstring_example_runs():
    import doctest
    result = doctest.testmod(tqkv)
    assert result.attempted >= 2 and result.failed == 0
