"""Shared helpers of the tqkv Python tests: seeded inputs, a NumPy attention reference, and
the C API (libtqkv.so through ctypes) as the C++ results the bindings must reproduce.

Run: `pip install .` (or build with -DTQKV_BUILD_PYTHON=ON and put build/<preset>/python on
PYTHONPATH), then `python3 -m pytest tests/python`. The C API comparisons load libtqkv.so
from TQKV_C_LIBRARY, else build/release/lib or build/dev/lib.
"""
import ctypes
import os

import numpy as np
import pytest

# The bindings' attention is compared with references at 1e-4..1e-6: exact fp32 key scores
# (tqkv/simd.h KeyScores; the default int8 scores are checked against their error bound and
# their integer contract in tests/cpu/test_int8_scores.cpp). Read at the first attention call.
os.environ.setdefault("TQKV_SCORES", "exact")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def randn(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def softmax_attention(q, k, v, q_pos, first_pos=0, window=0, scale=0.0):
    """Causal GQA attention in float64: q [n_q, n_q_heads, d] at positions q_pos + i over
    k, v [n_keys, n_kv_heads, d] at positions first_pos + j. Returns (out, lse)."""
    n_q, n_q_heads, d = q.shape
    n_keys, n_kv_heads, _ = k.shape
    group = n_q_heads // n_kv_heads
    scale = scale or 1.0 / np.sqrt(d)
    out = np.zeros(q.shape)
    lse = np.full((n_q, n_q_heads), -np.inf)
    key_pos = first_pos + np.arange(n_keys)
    for i in range(n_q):
        p = q_pos + i
        seen = key_pos <= p
        if window:
            seen &= key_pos > p - window
        for h in range(n_q_heads):
            kv = h // group
            s = (k[seen, kv].astype(np.float64) @ q[i, h].astype(np.float64)) * scale
            if s.size == 0:
                continue
            m = s.max()
            w = np.exp(s - m)
            out[i, h] = w @ v[seen, kv].astype(np.float64) / w.sum()
            lse[i, h] = m + np.log(w.sum())
    return out, lse


class CApi:
    """The fa_tq_* C API of libtqkv.so (include/tqkv/tqkv.h)."""

    def __init__(self, path):
        lib = ctypes.CDLL(path)

        class Config(ctypes.Structure):
            _fields_ = [("key_bits", ctypes.c_int), ("value_bits", ctypes.c_int)]

        self.Config = Config
        fp = ctypes.POINTER(ctypes.c_float)
        lib.fa_tq_init.restype = ctypes.c_void_p
        lib.fa_tq_init.argtypes = [ctypes.c_int, Config, ctypes.c_uint64]
        lib.fa_tq_free.argtypes = [ctypes.c_void_p]
        lib.fa_tq_cache_new.restype = ctypes.c_void_p
        lib.fa_tq_cache_new.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.fa_tq_cache_free.argtypes = [ctypes.c_void_p]
        lib.fa_tq_quantize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, fp, ctypes.c_bool]
        lib.fa_tq_dequantize.restype = fp
        lib.fa_tq_dequantize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                         ctypes.c_bool, fp]
        lib.fa_tq_attention.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, fp, ctypes.c_int,
                                        ctypes.c_float, fp]
        lib.fa_tq_cache_bytes_per_token.argtypes = [ctypes.c_void_p]
        lib.fa_tq_last_error_message.restype = ctypes.c_char_p
        self.lib = lib

    @staticmethod
    def ptr(a):
        assert a.dtype == np.float32 and a.flags.c_contiguous
        return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))

    def cache(self, head_dim, key_bits, value_bits, seed, n_layers, n_heads, max_len):
        st = self.lib.fa_tq_init(head_dim, self.Config(key_bits, value_bits), seed)
        assert st, self.lib.fa_tq_last_error_message()
        c = self.lib.fa_tq_cache_new(st, n_layers, n_heads, max_len)
        assert c, self.lib.fa_tq_last_error_message()
        return st, c

    def check(self):
        msg = self.lib.fa_tq_last_error_message()
        assert not msg, msg


@pytest.fixture(scope="session")
def capi():
    candidates = [os.environ.get("TQKV_C_LIBRARY", "")] + [
        os.path.join(REPO, "build", p, "lib", "libtqkv.so") for p in ("release", "dev")]
    for path in candidates:
        if path and os.path.exists(path):
            return CApi(path)
    if os.environ.get("TQKV_C_LIBRARY"):
        pytest.fail(f"TQKV_C_LIBRARY={os.environ['TQKV_C_LIBRARY']} does not exist")
    pytest.skip("libtqkv.so not built (bash scripts/test.sh builds build/release/lib/libtqkv.so)")


def require_module(name, cuda=False):
    """Imports an optional dependency (torch, transformers, gguf) or skips the test module; with
    TQKV_REQUIRE_TORCH=1 (CI) a missing one fails instead, so those tests cannot skip silently.
    cuda: the module holds CUDA tests, which need it: TQKV_REQUIRE_CUDA=1 fails a missing one too."""
    for switch in ("TQKV_REQUIRE_TORCH",) + (("TQKV_REQUIRE_CUDA",) if cuda else ()):
        if os.environ.get(switch) == "1":
            import importlib

            try:
                return importlib.import_module(name)
            except ImportError as e:
                pytest.fail(f"{switch}=1 but {name} does not import: {e}", pytrace=False)
    return pytest.importorskip(name)


def find_cli():
    """The `tqkv` program: TQKV_CLI, else build/release/tqkv or build/dev/tqkv; skips without one."""
    for path in (os.environ.get("TQKV_CLI", ""), os.path.join(REPO, "build", "release", "tqkv"),
                 os.path.join(REPO, "build", "dev", "tqkv")):
        if path and os.path.exists(path):
            return path
    if os.environ.get("TQKV_CLI"):
        pytest.fail(f"TQKV_CLI={os.environ['TQKV_CLI']} does not exist")
    pytest.skip("the tqkv CLI is not built (bash scripts/test.sh builds build/release/tqkv)")


def needs_cuda(torch, tq):
    """The mark of the tests that need a CUDA device and tqkv built with the CUDA ops: they skip
    without them, and fail instead under TQKV_REQUIRE_CUDA=1 (scripts/gpu_*.sh set it), so a run
    meant for the GPU cannot pass by skipping."""
    missing = ("no CUDA device" if not torch.cuda.is_available()
               else None if tq.has_cuda else "tqkv was built without the CUDA ops")
    if missing is None:
        return pytest.mark.skipif(False, reason="")
    if os.environ.get("TQKV_REQUIRE_CUDA") == "1":
        return pytest.mark.tqkv_cuda_missing(missing)
    return pytest.mark.skip(reason=f"{missing} (needs a CUDA device and tqkv built with the CUDA ops)")


def pytest_configure(config):
    config.addinivalue_line("markers", "tqkv_cuda_missing(why): fails the test (TQKV_REQUIRE_CUDA=1 without CUDA)")


def pytest_runtest_setup(item):
    mark = item.get_closest_marker("tqkv_cuda_missing")
    if mark:
        pytest.fail(f"TQKV_REQUIRE_CUDA=1 but {mark.args[0]}", pytrace=False)
