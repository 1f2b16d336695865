"""Bad input raises tqkv.Error (a ValueError carrying the C++ message) and changes nothing."""
import numpy as np
import pytest

import tqkv
from conftest import randn


@pytest.fixture
def cache(rng):
    c = tqkv.ContiguousCache(2, 2, 32, 16, formats="tq-k4v2")
    x = randn(rng, 4, 2, 32)
    for layer in range(2):
        c.write(layer, 0, x, x)
    return c


def test_error_is_a_value_error_with_the_cpp_message():
    with pytest.raises(ValueError, match="unknown KV-cache format 'k9v1'") as e:
        tqkv.Format("k9v1")
    assert isinstance(e.value, tqkv.Error) and e.value.code == "invalid_argument"
    with pytest.raises(tqkv.Error, match="layout"):
        tqkv.PagedCache(1, 1, 32, layout="rows")
    with pytest.raises(tqkv.Error):
        tqkv.PagedCache(1, 1, 32, block_size=12)
    with pytest.raises(tqkv.Error):
        tqkv.ContiguousCache(2, 1, 32, 8, formats=["f16"])  # one format for two layers
    with pytest.raises(tqkv.Error):
        tqkv.SlotCodec(3, 32)
    with pytest.raises(tqkv.Error):
        tqkv.set_simd_level("sse9")


@pytest.mark.parametrize("bad", [
    lambda x: x.astype(np.float64),
    lambda x: x.astype(np.int32),
    lambda x: x[:, :, :16],
    lambda x: x[:2],
    lambda x: x.reshape(4, 64),
    lambda x: np.asfortranarray(x),
    lambda x: np.repeat(x, 2, axis=2)[:, :, ::2],
])
def test_bad_arrays_raise_and_change_nothing(cache, rng, bad):
    x = randn(rng, 4, 2, 32)
    before = cache.ring(0, 0).copy()
    with pytest.raises(tqkv.Error, match="^(k|v): "):
        cache.write(0, 4, x, bad(x))
    with pytest.raises(tqkv.Error, match="^(q|attention): "):
        cache.attention(0, bad(x), 3)
    np.testing.assert_array_equal(cache.ring(0, 0), before)
    assert cache.seq_len == 4


def test_non_finite_and_out_of_range_change_nothing(cache, rng):
    x = randn(rng, 2, 2, 32)
    x[1, 0, 3] = np.nan
    before = cache.ring(0, 0).copy()
    with pytest.raises(tqkv.Error) as e:
        cache.write(0, 4, x, x)
    assert e.value.code == "non_finite" and cache.seq_len == 4
    big = np.full((1, 2, 32), 1e30, np.float32)
    with pytest.raises(tqkv.Error):
        cache.write(0, 4, big, big)
    np.testing.assert_array_equal(cache.ring(0, 0), before)
    y = randn(rng, 1, 2, 32)
    for layer, pos in [(2, 4), (-1, 4), (0, 6)]:  # no such layer; a gap after seq_len
        with pytest.raises(tqkv.Error) as e:
            cache.write(layer, pos, y, y)
        assert e.value.code in ("out_of_range", "invalid_argument")
    with pytest.raises(tqkv.Error):
        cache.attention(0, randn(rng, 1, 3, 32), 3)  # 3 query heads over 2 kv heads
    with pytest.raises(tqkv.Error):
        cache.attention(0, randn(rng, 1, 2, 32), 9)  # position not written
    with pytest.raises(tqkv.Error):
        cache.ring(0, 2)
    with pytest.raises(tqkv.Error):
        cache.decode(0, 0, -1)
    with pytest.raises(TypeError):
        cache.write(0, 4, [[0.0] * 32] * 2, y)  # a list is not an array


def test_paged_bad_inputs(rng):
    paged = tqkv.PagedCache(1, 2, 32, num_blocks=4)
    s = paged.add_sequence()
    slots = paged.append_slots(s, 2)
    x = randn(rng, 2, 2, 32)
    with pytest.raises(tqkv.Error, match="slot_mapping"):
        paged.store(0, slots.astype(np.float32), x, x)
    with pytest.raises(tqkv.Error, match="^k: "):
        paged.store(0, slots, x[:1], x)
    with pytest.raises(tqkv.Error) as e:
        paged.store(0, np.array([0, 10_000]), x, x)
    assert e.value.code == "out_of_range"
    with pytest.raises(tqkv.Error):
        paged.fork(77)
    with pytest.raises(tqkv.Error):
        paged.attention(0, np.array([s, 77]), randn(rng, 2, 2, 32))
    with pytest.raises(tqkv.Error, match="one row per sequence"):
        paged.attention(0, np.array([s]), randn(rng, 2, 2, 32))
    codec = tqkv.SlotCodec("tq-k4v2", 32)
    with pytest.raises(tqkv.Error, match="slots"):
        codec.decode_keys(np.zeros((2, codec.slot_bytes + 1), np.uint8))


def test_environment_variables_read_strictly(monkeypatch):
    """tqkv._core.env reads a TQKV_* variable as the C++ code does (docs/ENV.md): typed, default
    where unset, and a malformed value an Error naming the variable."""
    env = tqkv._core.env
    monkeypatch.delenv("TQKV_FOLD_NEWEST", raising=False)
    monkeypatch.delenv("TQKV_POOL_SPIN_US", raising=False)
    assert env("TQKV_FOLD_NEWEST") is True
    assert env("TQKV_POOL_SPIN_US") == 50
    assert env("TQKV_THREADS") is None or isinstance(env("TQKV_THREADS"), int)  # worked out at run time if unset
    monkeypatch.setenv("TQKV_FOLD_NEWEST", "0")
    assert env("TQKV_FOLD_NEWEST") is False
    monkeypatch.setenv("TQKV_RECIPES", "/a:/b")
    assert env("TQKV_RECIPES") == "/a:/b"
    monkeypatch.setenv("TQKV_FOLD_NEWEST", "yes")
    with pytest.raises(tqkv.Error, match="TQKV_FOLD_NEWEST=yes: give 0 or 1"):
        env("TQKV_FOLD_NEWEST")
    with pytest.raises(tqkv.Error, match="TQKV_NO_SUCH"):
        env("TQKV_NO_SUCH")
