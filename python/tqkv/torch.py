"""PyTorch custom ops over a paged, compressed KV cache: the calls a vLLM- or SGLang-style
attention backend makes, on CPU and CUDA tensors.

One layer's cache is a ``uint8`` tensor ``[num_blocks, page_bytes]`` (:func:`cache_shape`,
:func:`new_cache`) holding the bytes of docs/FORMAT.md ("Paged cache"); the CPU and CUDA ops
read and write the same bytes. Three ops in the ``tqkv`` namespace (``torch.ops.tqkv.*``):

- :func:`store` (``tqkv::store``): writes ``key``, ``value`` ``[n_tokens, n_kv_heads, head_dim]``
  into the cache through ``slot_mapping`` (``int64 [n_tokens]``, slot = block * block_size +
  offset, negative = skip); mutates ``cache``.
- :func:`decode` (``tqkv::decode``): split-KV decode attention, one query token per sequence at
  its last position, GQA: ``query [batch, n_q_heads, head_dim]`` over ``block_tables``
  (``int32 [batch, width]``) and ``seq_lens`` (``int32 [batch]``) -> ``out`` like ``query``.
- :func:`dequantize` (``tqkv::dequantize``): positions ``[start, start + n_tokens)`` of one
  sequence (``block_table int32 [width]``) -> ``(k, v)`` ``[n_tokens, n_kv_heads, head_dim]``.

Every op has a fake implementation (shapes and dtypes only), so ``torch.compile`` traces it.
``format`` is a format name (``tqkv.named_formats()``); ``layout`` is ``'page'`` (the default,
the one the CUDA decode reads) or ``'slot'`` (vLLM's); ``seed`` seeds the rotation (the same
seed must write and read a cache).

Inputs are checked before anything runs (dtype, shape, device, contiguity, format) and raise
:class:`tqkv.Error`; slot and block ids are checked on the CPU. On CUDA the ops only enqueue
kernels on the current stream: ids are not read back (that would synchronise) unless
:func:`set_index_checks` turns it on, and ``store`` trusts its inputs to be finite and within
fp16 range, which the CPU op checks.

CUDA graphs: ``decode`` keeps one plan and workspace per (device, format, head_dim, seed,
n_kv_heads, block_size, batch, n_q_heads, max_seq_len), made on its first call outside
capture; a call under capture allocates only its output (from torch's caching allocator) and
launches one kernel. Run each decode shape once before capturing (the usual warm-up); a
first call under capture raises. Decodes of one plan share its workspace, so run them on one
stream at a time. ``max_seq_len`` (0: ``block_tables.shape[1] * block_size``) bounds every
``seq_lens[b]``; keep it fixed to keep one plan.

    >>> import torch, tqkv.torch as tq
    >>> cache = tq.new_cache("turboquant_4bit_nc", head_dim=128, n_kv_heads=2, block_size=16, num_blocks=64)
    >>> k = torch.randn(5, 2, 128); v = torch.randn(5, 2, 128)
    >>> tq.store(k, v, cache, torch.arange(5), "turboquant_4bit_nc")
    >>> out = tq.decode(torch.randn(1, 8, 128), cache, torch.zeros(1, 4, dtype=torch.int32),
    ...                 torch.tensor([5], dtype=torch.int32), "turboquant_4bit_nc")
"""
import atexit
import functools
import threading

import torch
from torch import Tensor

from . import _core
from ._core import DEFAULT_SEED, Error, Format

__all__ = ["cache_shape", "new_cache", "store", "decode", "dequantize", "set_index_checks", "has_cuda"]

has_cuda = bool(_core.has_cuda)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_BLOCK_SIZES = (16, 32, 64, 128)
_index_checks = False


def set_index_checks(enabled: bool) -> None:
    """On CUDA, also check slot and block ids and sequence lengths against the cache (reads
    them back: one synchronisation per op, not capturable). The CPU ops always check."""
    global _index_checks
    _index_checks = bool(enabled)


def _error(msg: str, code: str = "invalid_argument") -> Error:
    e = Error(msg)
    e.code = code
    return e


@functools.lru_cache(maxsize=None)
def _slot_bytes(format: str, head_dim: int) -> int:
    if not isinstance(format, str):
        raise _error(f"format: expected a format name (str), got {type(format).__name__}")
    if head_dim < 2:
        raise _error(f"head_dim: expected >= 2, got {head_dim}")
    return Format(format).slot_bytes(head_dim)


def _check_geometry(block_size: int, layout: str) -> None:
    if block_size not in _BLOCK_SIZES:
        raise _error(f"block_size: expected 16, 32, 64 or 128, got {block_size}")
    if layout not in ("page", "slot"):
        raise _error(f"layout: expected 'page' or 'slot', got {layout!r}")


def cache_shape(format: str, head_dim: int, n_kv_heads: int, block_size: int, num_blocks: int) -> tuple:
    """The shape of one layer's cache tensor: ``(num_blocks, page_bytes)`` with page_bytes =
    block_size * n_kv_heads * slot_bytes(format, head_dim); its dtype is ``torch.uint8``."""
    _check_geometry(block_size, "page")
    if n_kv_heads < 1 or num_blocks < 1:
        raise _error(f"n_kv_heads and num_blocks must be >= 1, got {n_kv_heads} and {num_blocks}")
    return (num_blocks, block_size * n_kv_heads * _slot_bytes(format, head_dim))


def new_cache(format: str, head_dim: int, n_kv_heads: int, block_size: int, num_blocks: int,
              device="cpu") -> Tensor:
    """A zeroed cache tensor of :func:`cache_shape` on ``device``."""
    return torch.zeros(cache_shape(format, head_dim, n_kv_heads, block_size, num_blocks), dtype=torch.uint8,
                       device=device)


def _check(t, name: str, dtypes, ndim: int, dims: str, device: torch.device, contiguous: bool = True) -> None:
    if not isinstance(t, Tensor):
        raise _error(f"{name}: expected a torch.Tensor {dims}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise _error(f"{name}: expected dtype {want}, got {t.dtype}")
    if t.dim() != ndim:
        raise _error(f"{name}: expected a {ndim}-D tensor {dims}, got shape {tuple(t.shape)}")
    if t.device != device:
        raise _error(f"{name}: on {t.device}, expected {device} (the cache's device)")
    if contiguous and not t.is_contiguous():
        raise _error(f"{name}: expected a contiguous tensor (call .contiguous())")


def _check_cache(cache) -> None:
    if not isinstance(cache, Tensor):
        raise _error(f"cache: expected a torch.Tensor [num_blocks, page_bytes], got {type(cache).__name__}")
    _check(cache, "cache", (torch.uint8,), 2, "[num_blocks, page_bytes]", cache.device)
    if cache.device.type not in ("cpu", "cuda", "meta"):
        raise _error(f"cache: tqkv ops run on CPU and CUDA tensors, got {cache.device}")


def _n_kv_heads(cache: Tensor, format: str, head_dim: int, block_size: int) -> int:
    per_head = block_size * _slot_bytes(format, int(head_dim))
    page_bytes = int(cache.shape[1])
    if page_bytes % per_head or page_bytes == 0:
        raise _error(f"cache: pages of {page_bytes} bytes are not a whole number of kv heads of {per_head} bytes "
                     f"(block_size {block_size} x slot_bytes of {format} at head_dim {head_dim}); see cache_shape()")
    return page_bytes // per_head


def _cuda_ready(t: Tensor) -> None:
    if t.device.type == "cuda" and not has_cuda:
        raise _error("this tqkv build has no CUDA ops (the extension was built without nvcc); "
                     "reinstall it where nvcc is found")


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


@functools.lru_cache(maxsize=None)
def _cuda_codec(format: str, head_dim: int, seed: int):
    return _core._CudaCodec(format, head_dim, seed)


# ---- store -------------------------------------------------------------------------------

def _check_store(key, value, cache, slot_mapping, format, block_size, layout) -> None:
    _check_cache(cache)
    _check_geometry(block_size, layout)
    dims = "[n_tokens, n_kv_heads, head_dim]"
    # Heads and head_dim must be dense; tokens may be strided (a slice of a fused QKV tensor).
    _check(key, "key", _FLOATS, 3, dims, cache.device, contiguous=False)
    _check(value, "value", (key.dtype,), 3, dims + " like key", cache.device, contiguous=False)
    if value.shape != key.shape:
        raise _error(f"value: shape {tuple(value.shape)} differs from key's {tuple(key.shape)}")
    n, heads, dim = key.shape
    for name, t in (("key", key), ("value", value)):
        if t.stride(2) != 1 or (heads > 1 and t.stride(1) != dim) or t.stride(0) < heads * dim:
            raise _error(f"{name}: heads and head_dim must be contiguous (strides {tuple(t.stride())}); "
                         "call .contiguous()")
    if n > 1 and key.stride(0) != value.stride(0):
        raise _error("key, value: expected the same token stride")
    _check(slot_mapping, "slot_mapping", (torch.int64,), 1, "[n_tokens]", cache.device)
    if slot_mapping.shape[0] != n:
        raise _error(f"slot_mapping: {slot_mapping.shape[0]} slots for {n} tokens")
    if _n_kv_heads(cache, format, int(dim), block_size) != heads:
        raise _error(f"cache: pages hold {_n_kv_heads(cache, format, int(dim), block_size)} kv heads, key has {heads}")


@torch.library.custom_op("tqkv::store", mutates_args=("cache",))
def store(key: Tensor, value: Tensor, cache: Tensor, slot_mapping: Tensor, format: str, block_size: int = 16,
          layout: str = "page", seed: int = DEFAULT_SEED) -> None:
    """Encodes ``key``, ``value`` ``[n_tokens, n_kv_heads, head_dim]`` (float32/float16/bfloat16)
    into ``cache`` at ``slot_mapping`` (int64 [n_tokens]; negative: skipped). Raises
    :class:`tqkv.Error` on bad arguments; on the CPU also on NaN/Inf, fp16 overflow and slots
    past the pool, writing nothing then."""
    _check_store(key, value, cache, slot_mapping, format, block_size, layout)
    n, heads, dim = key.shape
    if n == 0:
        return
    if cache.device.type == "cpu":
        _core._pool_store(cache, slot_mapping, key.float().contiguous(), value.float().contiguous(), format,
                          block_size, layout, seed)
        return
    _cuda_ready(cache)
    if _index_checks:
        bad = (slot_mapping >= cache.shape[0] * block_size).any()
        if bool(bad):
            raise _error(f"slot_mapping: a slot is past the pool ({cache.shape[0] * block_size} slots)", "out_of_range")
    _core._cuda_store(_cuda_codec(format, dim, seed), cache.data_ptr(), cache.shape[0], block_size, heads, layout,
                      key.data_ptr(), value.data_ptr(), _DTYPE_CODES[key.dtype], key.stride(0),
                      slot_mapping.data_ptr(), n, cache.device.index, _stream(cache.device))


@store.register_fake
def _(key, value, cache, slot_mapping, format, block_size=16, layout="page", seed=DEFAULT_SEED):
    _check_store(key, value, cache, slot_mapping, format, block_size, layout)


# ---- decode ------------------------------------------------------------------------------

def _check_decode(query, cache, block_tables, seq_lens, format, block_size, layout, window) -> int:
    _check_cache(cache)
    _check_geometry(block_size, layout)
    _check(query, "query", _FLOATS, 3, "[batch, n_q_heads, head_dim]", cache.device)
    batch, n_q_heads, dim = query.shape
    _check(block_tables, "block_tables", (torch.int32,), 2, "[batch, max_blocks]", cache.device)
    _check(seq_lens, "seq_lens", (torch.int32,), 1, "[batch]", cache.device)
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise _error(f"block_tables, seq_lens: expected {batch} rows (query's batch), got "
                     f"{block_tables.shape[0]} and {seq_lens.shape[0]}")
    heads = _n_kv_heads(cache, format, int(dim), block_size)
    if n_q_heads % heads:
        raise _error(f"query: {n_q_heads} query heads are not a multiple of the cache's {heads} kv heads")
    if window < 0:
        raise _error(f"window: expected >= 0, got {window}")
    return heads


def _decode_plan(codec, device, format, dim, seed, heads, block_size, batch, n_q_heads, max_seq_len):
    key = (device.index, format, dim, seed, heads, block_size, batch, n_q_heads, max_seq_len)
    with _plans_lock:
        got = _plans.get(key)
        if got is not None:
            return got
        if torch.cuda.is_current_stream_capturing():
            raise _error("decode: first call with this shape under CUDA graph capture; call it once before capturing "
                         "so that its plan and workspace exist")
        plan = _core._cuda_plan_decode(codec, 1, block_size, heads, batch, n_q_heads, max_seq_len, device.index)
        workspace = torch.empty(max(plan.workspace_bytes, 256), dtype=torch.uint8, device=device)
        _core._cuda_init_workspace(codec, plan, heads, workspace.data_ptr(), device.index, _stream(device))
        _plans[key] = (plan, workspace)
        return plan, workspace


_plans = {}
_plans_lock = threading.Lock()


@atexit.register
def _release():
    # The codecs and plans are extension objects: drop them before the extension goes away.
    _plans.clear()
    _cuda_codec.cache_clear()


@torch.library.custom_op("tqkv::decode", mutates_args=())
def decode(query: Tensor, cache: Tensor, block_tables: Tensor, seq_lens: Tensor, format: str, scale: float = 0.0,
           block_size: int = 16, layout: str = "page", seed: int = DEFAULT_SEED, window: int = 0,
           max_seq_len: int = 0) -> Tensor:
    """Decode attention: sequence b's query ``query[b]`` ([batch, n_q_heads, head_dim],
    float32/float16/bfloat16, at position seq_lens[b] - 1) over its ``seq_lens[b]`` tokens in the
    pages ``block_tables[b]``; GQA (query head h reads kv head h // (n_q_heads // n_kv_heads)).
    scale 0: 1/sqrt(head_dim); window > 0: only the last ``window`` keys. Returns a tensor like
    ``query``. CUDA needs layout 'page' and a format with a decode kernel."""
    heads = _check_decode(query, cache, block_tables, seq_lens, format, block_size, layout, window)
    batch, n_q_heads, dim = query.shape
    if batch == 0:
        return torch.empty_like(query)
    if cache.device.type == "cpu":
        out = torch.empty(query.shape, dtype=torch.float32)
        _core._pool_attention(cache, block_tables, seq_lens, query.float().contiguous(), out, format, block_size,
                              heads, layout, seed, scale, window, False)
        return out.to(query.dtype)
    _cuda_ready(cache)
    codec = _cuda_codec(format, dim, seed)
    if layout != "page":
        raise _error("decode: the CUDA kernel reads the 'page' layout")
    if not codec.decode_supported:
        raise _error(f"decode: no CUDA decode kernel for {format} at head_dim {dim} "
                     "(dequantize and use torch's attention instead)")
    width = block_tables.shape[1]
    max_len = max_seq_len if max_seq_len > 0 else width * block_size
    if _index_checks:
        lens = seq_lens.cpu()
        if bool((lens < 1).any()) or int(lens.max()) > min(max_len, width * block_size):
            raise _error(f"seq_lens: expected 1..{min(max_len, width * block_size)}", "out_of_range")
        used = torch.arange(width, device=cache.device)[None, :] < ((seq_lens + block_size - 1) // block_size)[:, None]
        if bool((((block_tables < 0) | (block_tables >= cache.shape[0])) & used).any()):
            raise _error(f"block_tables: a block outside the pool of {cache.shape[0]}", "out_of_range")
    plan, workspace = _decode_plan(codec, cache.device, format, dim, seed, heads, block_size, batch, n_q_heads, max_len)
    out = torch.empty_like(query)
    _core._cuda_decode(codec, plan, cache.data_ptr(), cache.shape[0], block_size, heads, layout, query.data_ptr(),
                       _DTYPE_CODES[query.dtype], out.data_ptr(), _DTYPE_CODES[out.dtype], block_tables.data_ptr(),
                       width, seq_lens.data_ptr(), batch, n_q_heads, scale, window, workspace.data_ptr(),
                       cache.device.index, _stream(cache.device))
    return out


@decode.register_fake
def _(query, cache, block_tables, seq_lens, format, scale=0.0, block_size=16, layout="page", seed=DEFAULT_SEED,
      window=0, max_seq_len=0):
    _check_decode(query, cache, block_tables, seq_lens, format, block_size, layout, window)
    return torch.empty_like(query)


# ---- dequantize --------------------------------------------------------------------------

def _check_dequantize(cache, block_table, start, n_tokens, format, head_dim, block_size, layout, dtype) -> int:
    _check_cache(cache)
    _check_geometry(block_size, layout)
    _check(block_table, "block_table", (torch.int32,), 1, "[max_blocks]", cache.device)
    if dtype not in _FLOATS:
        raise _error(f"dtype: expected torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
    if start < 0 or n_tokens < 0:
        raise _error(f"start, n_tokens: expected >= 0, got {start} and {n_tokens}")
    if start + n_tokens > block_table.shape[0] * block_size:
        raise _error(f"block_table: {block_table.shape[0]} pages hold {block_table.shape[0] * block_size} positions, "
                     f"[{start}, {start + n_tokens}) asked", "out_of_range")
    return _n_kv_heads(cache, format, head_dim, block_size)


@torch.library.custom_op("tqkv::dequantize", mutates_args=())
def dequantize(cache: Tensor, block_table: Tensor, start: int, n_tokens: int, format: str, head_dim: int,
               block_size: int = 16, layout: str = "page", seed: int = DEFAULT_SEED,
               dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Keys and values of positions [start, start + n_tokens) of one sequence (its pages
    ``block_table``, int32) -> ``(k, v)`` ``[n_tokens, n_kv_heads, head_dim]`` of ``dtype``, in the
    original (unrotated) domain."""
    heads = _check_dequantize(cache, block_table, start, n_tokens, format, head_dim, block_size, layout, dtype)
    shape = (n_tokens, heads, head_dim)
    if cache.device.type == "cpu":
        k, v = torch.empty(shape, dtype=torch.float32), torch.empty(shape, dtype=torch.float32)
        if n_tokens:
            _core._pool_dequantize(cache, block_table, start, k, v, format, block_size, layout, seed)
        return k.to(dtype), v.to(dtype)
    _cuda_ready(cache)
    k = torch.empty(shape, dtype=dtype, device=cache.device)
    v = torch.empty(shape, dtype=dtype, device=cache.device)
    if n_tokens == 0:
        return k, v
    if _index_checks:
        used = block_table[start // block_size:(start + n_tokens + block_size - 1) // block_size]
        if bool(((used < 0) | (used >= cache.shape[0])).any()):
            raise _error(f"block_table: a block outside the pool of {cache.shape[0]}", "out_of_range")
    _core._cuda_dequantize(_cuda_codec(format, head_dim, seed), cache.data_ptr(), cache.shape[0], block_size, heads,
                           layout, block_table.data_ptr(), start, n_tokens, k.data_ptr(), v.data_ptr(),
                           _DTYPE_CODES[dtype], cache.device.index, _stream(cache.device))
    return k, v


@dequantize.register_fake
def _(cache, block_table, start, n_tokens, format, head_dim, block_size=16, layout="page", seed=DEFAULT_SEED,
      dtype=torch.float32):
    heads = _check_dequantize(cache, block_table, start, n_tokens, format, head_dim, block_size, layout, dtype)
    shape = (n_tokens, heads, head_dim)
    return cache.new_empty(shape, dtype=dtype), cache.new_empty(shape, dtype=dtype)
