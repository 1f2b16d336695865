"""Hugging Face transformers on the tqkv compressed KV cache.

:class:`TQCache` is a transformers ``Cache`` whose layers hold their keys and values in
:class:`tqkv.ContiguousCache` slots, in the per-layer formats of a cache spec (a format name,
``k<K>v<V>`` or a recipe fitted to the model such as ``tq-4.375``; docs/FORMAT.md). Importing
this module also registers ``attn_implementation="tqkv"``: an attention function that computes
attention on the compressed cache (the C++ kernels, GQA included) instead of dequantizing the
history at every step::

    import tqkv.transformers  # registers attn_implementation="tqkv"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf = dict(gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = AutoTokenizer.from_pretrained("models", **gguf)
    model = AutoModelForCausalLM.from_pretrained("models", attn_implementation="tqkv", **gguf)
    cache = tqkv.transformers.TQCache(model.config, spec="tq-4.375")
    ids = tok("In the beginning", return_tensors="pt").input_ids
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32, do_sample=False)
    print(tok.decode(out[0]), cache.bits_per_element())

How the two fit: with ``attn_implementation="tqkv"`` the cache's ``update`` writes the new keys
and values and hands the attention function only the new ones, tagged; the function reads the
history from the codes. The first chunk (the prompt, on an empty cache) attends over its own
float keys and values with PyTorch's SDPA, as transformers' quantized caches do; every later
chunk and every decoded token attends over the compressed cache, itself included. With any
other attention implementation the cache returns the decoded history instead (correct but
slower: the whole history is dequantized at every step).

The cache behind it is the engine's own CPU cache layer (``tqkv.ModelCache``, the C++ of
``tqkv generate``): a spec means here what it means there — per-layer formats, key centring
(``+c``, ``+s``, with the key statistics of the model's recipe file, keys in the GGUF's channel
order), attention sinks and the recent window (``+sink<N>``, ``+w<N>``, ``+wq<B>``, ``+fill<B>``:
f16 or wq copies merged with the compressed part by log-sum-exp); :meth:`TQCache.bits_per_element`
counts the slots and the copies. Recipes match a model by architecture, layer count, kv heads and
head dim (the GGUF weights hash the engine also checks is not available to transformers).

Limits: one sequence per batch row, no padding (attention masks are not read); no beam search
or cache cropping. On a GPU the cache stays there: per layer a paged cache tensor of the
``tqkv.torch`` ops (store and decode kernels, no host copy per step; chunks of several tokens
attend with SDPA over the decoded history). Sinks and the recent window are kept there as the
engine keeps them (f16 copies of the first positions, a paged ring of the window's format written
and read with the same ops); the layers that have them attend with SDPA over the decoded history
with the copies in place of their positions (the engine's split, per query), not with the decode
kernel.

Needs ``torch`` and ``transformers`` (4.46 or later for :class:`TQCache`; the attention
function needs the ``AttentionInterface`` of 4.48 and later).
"""
from __future__ import annotations

import functools
import glob
import json
import os
import warnings
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from . import _core

try:  # transformers >= 4.56: caches are lists of layer objects
    from transformers.cache_utils import Cache, CacheLayerMixin as _LayerBase
except ImportError:  # pragma: no cover - older transformers
    from transformers.cache_utils import Cache

    _LayerBase = object

__all__ = ["TQCache", "TQLayer", "tqkv_attention", "register", "recipes_for", "resolve_spec"]

ATTN_NAME = "tqkv"
DEFAULT_CAPACITY = 4096
_TAG = "_tqkv_chunk"
# transformers' model_type -> the GGUF architecture name the recipe files use.
_ARCH = {"gemma3_text": "gemma3", "gemma3": "gemma3", "qwen2": "qwen2", "llama": "llama"}


def _recipe_dirs() -> list[str]:
    """$TQKV_RECIPES (colon-separated), ./recipes, the package's recipes/, the source tree's."""
    here = os.path.dirname(os.path.abspath(__file__))
    dirs = [d for d in _core.env("TQKV_RECIPES").split(":") if d]
    dirs += ["recipes", os.path.join(here, "recipes"), os.path.join(here, "..", "..", "recipes")]
    out, seen = [], set()
    for d in dirs:
        real = os.path.realpath(d)
        if os.path.isdir(real) and real not in seen:
            seen.add(real)
            out.append(real)
    return out


def recipes_for(arch: str, n_layers: int, n_kv_heads: int, head_dim: int,
                recipe_file: Optional[str] = None) -> dict[str, str]:
    """Recipe name -> spec of the recipe files fitted to a model of this architecture and shape
    (the first file of the search order wins a name; ``recipe_file`` comes first)."""
    return dict(_recipe_files(arch, n_layers, n_kv_heads, head_dim, recipe_file)[0])


@functools.lru_cache(maxsize=16)
def _recipe_files(arch, n_layers, n_kv_heads, head_dim, recipe_file=None):
    """(name -> spec, the key statistics of the first matching file that has them, or None).
    Read once per model shape: a TQCache resolves its spec and its centring from the same files,
    several hundred KB of JSON (callers copy before changing what it returns)."""
    files = [recipe_file] if recipe_file else []
    for d in _recipe_dirs():
        files += sorted(glob.glob(os.path.join(d, "*.json")))
    out: dict[str, str] = {}
    stats = None
    for path in files:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        m = data.get("model", {})
        if recipe_file is None or path != recipe_file:
            if (m.get("arch"), m.get("n_layers"), m.get("n_kv_heads"), m.get("head_dim")) != (
                    arch, n_layers, n_kv_heads, head_dim):
                continue
        for r in data.get("recipes", []):
            out.setdefault(r["name"], r["spec"])
        if stats is None:
            stats = data.get("key_stats")
    return out, stats


def _text_config(config):
    return getattr(config, "text_config", None) or config


def _rope_base(config) -> float:
    """The RoPE base of the full-attention layers (the engine's rope.freq_base)."""
    config = _text_config(config)
    params = getattr(config, "rope_parameters", None) or {}
    params = params.get("full_attention", params)
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _layer_windows(config) -> list[int]:
    """The sliding window of each layer (0: full attention), from transformers' layer types."""
    config = _text_config(config)
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None) or 0
    if not types or not window:
        return []
    return [int(window) if t == "sliding_attention" else 0 for t in types]


def _centring(config, spec: str, capacity: int, recipe_file: Optional[str]):
    """The engine's key centring of `spec` for this model (GGUF channel order): (mean, scale or None)
    as [n_layers, n_kv_heads, head_dim] tensors, or None. The CUDA path applies it in torch."""
    arch, n_layers, n_kv, head_dim = _model_shape(config)
    recipes, stats = _recipe_files(arch, n_layers, n_kv, head_dim, recipe_file)
    if stats is None:
        return None
    fields = [np.asarray(stats[k], dtype=np.float32).ravel().tolist() for k in ("key_mean", "key_sq", "query_sq")]
    out = _core.key_centring(spec, n_layers, n_kv, head_dim, _text_config(config).num_attention_heads,
                             _rope_base(config), arch != "llama", *fields, capacity, dict(recipes))
    return None if out is None else tuple(None if a is None else torch.from_numpy(a) for a in out)


def _model_cache(config, spec: str, capacity: int, max_seqs: int, recipe_file: Optional[str]):
    """The engine's CPU cache layer (tqkv.ModelCache) for this model and spec: formats, centring with
    the recipe file's key statistics, sinks and recent window, as `tqkv generate` runs them."""
    arch, n_layers, n_kv, head_dim = _model_shape(config)
    recipes, stats = _recipe_files(arch, n_layers, n_kv, head_dim, recipe_file)
    kw = {}
    if stats is not None:
        kw = {k: np.asarray(stats[k], dtype=np.float32).ravel().tolist() for k in ("key_mean", "key_sq", "query_sq")}
    # Keys in the GGUF's channel order, as the cache stores them (see _gguf_key_order).
    return _core.ModelCache(spec, n_layers, _text_config(config).num_attention_heads, n_kv, head_dim,
                            rope_base=_rope_base(config), rope_halves=arch != "llama", capacity=capacity,
                            max_seqs=max_seqs, layer_windows=_layer_windows(config), recipes=dict(recipes), **kw)


def _gguf_key_order(arch: str, head_dim: int) -> Optional[torch.Tensor]:
    """Llama GGUFs store the q/k rows of each head permuted for RoPE on adjacent pairs
    (2i, 2i+1), and the engine runs them so; transformers' GGUF loader undoes the permutation
    (RoPE on halves i, i + d/2). The cache stores keys in the GGUF's order — channel 2i+h is
    transformers' h*d/2 + i — so that its codes, and the recipes' key statistics, are the
    engine's. None for the architectures that use halves in both (Qwen2, Gemma 3)."""
    if arch != "llama":
        return None
    return torch.arange(head_dim).reshape(2, head_dim // 2).t().reshape(-1)


def _model_shape(config) -> tuple[str, int, int, int]:
    config = _text_config(config)
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    arch = _ARCH.get(config.model_type, config.model_type)
    return arch, config.num_hidden_layers, n_kv, head_dim


def resolve_spec(config, spec: str, recipe_file: Optional[str] = None) -> dict:
    """The engine's resolution of `spec` for the model of `config` (tqkv.resolve_cache_spec with
    the model's recipes): a dict with the per-layer formats in ``layers``."""
    arch, n_layers, n_kv, head_dim = _model_shape(config)
    return _core.resolve_cache_spec(spec, n_layers, n_kv, head_dim, recipes_for(arch, n_layers, n_kv, head_dim,
                                                                                  recipe_file))


def _core_input(x: torch.Tensor, name: str, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[B, H, T, D] float (any device) -> [B, T, H, D] float32, C-contiguous, on the CPU."""
    return _checked(x, name, n_kv_heads, head_dim).transpose(1, 2).to("cpu", torch.float32).contiguous()


def _checked(x: torch.Tensor, name: str, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """x, detached, once it is a [B, n_kv_heads, T, head_dim] float tensor on the CPU or a GPU."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: expected float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() != 4 or x.shape[1] != n_kv_heads or x.shape[3] != head_dim:
        raise ValueError(f"{name}: expected shape [batch, n_kv_heads={n_kv_heads}, tokens, head_dim={head_dim}], "
                         f"got {list(x.shape)}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a CPU or CUDA tensor, got device {x.device}")
    return x.detach()


class _Store:
    """The storage a TQCache's layers share: the engine's cache layer (tqkv.ModelCache: formats,
    centring, sinks, recent window) with one sequence per batch row, made when the first layer
    sees the batch."""

    def __init__(self, make):
        self.make = make  # max_seqs -> tqkv.ModelCache
        self.cache = None
        self.seqs: list[int] = []

    def ensure(self, batch: int):
        if self.cache is None:
            self.cache = self.make(batch)
            self.seqs = [self.cache.add_sequence() for _ in range(batch)]
        elif batch != len(self.seqs):
            raise ValueError(f"key_states: batch {batch}, but the cache holds {len(self.seqs)} sequences")
        return self.cache

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, T, H, D] float32 at positions start.., in pieces the copies' ring takes."""
        step = self.cache.max_step_tokens
        for p in range(0, k.shape[1], step):
            self.cache.store(layer, self.seqs, [start + p] * len(self.seqs), k[:, p:p + step].contiguous(),
                             v[:, p:p + step].contiguous())


# Test-only: run the GPU path (tqkv.torch's paged cache) on CPU tensors, whose ops have CPU
# implementations, so that the path can be checked on a machine without a GPU.
_DEVICE_PATH_ON_CPU = False


def _fold_newest() -> bool:
    """TQKV_FOLD_NEWEST as the engine reads it: each query's own position folded in exactly (default)."""
    return _core.env("TQKV_FOLD_NEWEST")


def _device_path(device: torch.device) -> bool:
    return device.type == "cuda" or _DEVICE_PATH_ON_CPU


class _CudaStore:
    """The storage of a TQCache on a GPU: per layer one paged cache tensor of the ``tqkv.torch`` ops
    (uint8 ``[num_blocks, page_bytes]``, the layer's format; docs/FORMAT.md "Paged cache"), batch row b
    owning blocks ``[b * width, (b + 1) * width)``. Stores and decode attention run as those ops'
    CUDA kernels on the current stream; nothing is copied to the host per step. Key centring (+c, +s)
    is applied with the engine's numbers (tqkv.key_centring).

    Attention sinks and the recent window (+sink<N>, +w<N>, +wq<B>, +fill<B>) are kept as the
    engine keeps them, for the compressed layers: the first ``sinks`` positions' centred keys and
    values as f16 tensors, the recent ones in a paged ring of the window's format (written with
    tqkv.torch.store, read back with tqkv.torch.dequantize), ``window + STEP`` positions per row so
    that every query of a piece of up to STEP tokens finds its ``window`` predecessors (the engine's
    ring). A query at p attends over the sinks' [0, S), the compressed (S, p - window] and the
    window's (p - window, p] (SDPA with that mask over the three parts); as the engine does, its own
    position p comes from the chunk's keys and values as given, not from a copy (TQKV_FOLD_NEWEST=0:
    from the copy)."""

    BLOCK = 16
    STEP = 512  # tokens of one attention piece (the engine's kCopyStepTokens)

    def __init__(self, formats, n_kv_heads: int, head_dim: int, capacity: int, centring, copies=(0, 0, "f16")):
        from . import torch as tq

        self.tq, self.formats = tq, [f.name for f in formats]
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.width = -(-capacity // self.BLOCK)
        self.mean, self.scale = centring if centring is not None else (None, None)
        self.sinks, self.window, self.window_format = copies
        has = self.sinks > 0 or self.window > 0
        self.covered = [has and f.compressed for f in formats]
        self.ring_width = -(-(self.window + self.STEP) // self.BLOCK) if self.window > 0 else 0
        self.ring_len = self.ring_width * self.BLOCK
        self.caches: list = []
        self.device = None

    def ensure(self, batch: int, device: torch.device):
        if not self.caches:
            if device.type == "cuda" and not self.tq.has_cuda:
                raise ValueError("TQCache: CUDA tensors, but this tqkv module was built without CUDA (TQKV_CUDA=ON)")
            self.device = device
            self.caches = [self.tq.new_cache(f, self.head_dim, self.n_kv_heads, self.BLOCK, batch * self.width,
                                             device=device) for f in self.formats]
            self.tables = (torch.arange(batch * self.width, dtype=torch.int32, device=device)
                           .reshape(batch, self.width))
            self.row_base = torch.arange(batch, dtype=torch.int64, device=device) * (self.width * self.BLOCK)
            self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
            # Formats without a CUDA decode kernel (e.g. k8v8) attend with SDPA over the decoded history.
            self.kernel = [device.type != "cuda" or self.tq._cuda_codec(f, self.head_dim, _core.DEFAULT_SEED)
                           .decode_supported for f in self.formats]
            if self.mean is not None:
                self.mean = self.mean.to(device)
                self.scale = None if self.scale is None else self.scale.to(device)
            shape = (batch, self.sinks, self.n_kv_heads, self.head_dim)
            self.sink_kv = [(torch.zeros(shape, dtype=torch.float16, device=device),
                             torch.zeros(shape, dtype=torch.float16, device=device)) if c and self.sinks else None
                            for c in self.covered]
            self.rings = [self.tq.new_cache(self.window_format, self.head_dim, self.n_kv_heads, self.BLOCK,
                                            batch * self.ring_width, device=device) if c and self.window else None
                          for c in self.covered]
            if self.window:
                blocks = torch.arange(batch * self.ring_width, dtype=torch.int32, device=device)
                blocks = blocks.reshape(batch, self.ring_width)
                # Each row's ring pages twice over, so that positions that wrap read as one run.
                self.ring_tables = torch.cat([blocks, blocks], 1).contiguous()
                self.ring_base = torch.arange(batch, dtype=torch.int64, device=device) * self.ring_len
        elif batch != self.tables.shape[0]:
            raise ValueError(f"key_states: batch {batch}, but the cache holds {self.tables.shape[0]} sequences")
        elif device != self.device:
            raise ValueError(f"key_states: on {device}, but the cache is on {self.device}")

    def centre(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Keys [..., H, D] in the cache's channel order -> as cached ((k - mean) / scale)."""
        if self.mean is None:
            return k
        k = k.float() - self.mean[layer]
        return k if self.scale is None else k / self.scale[layer]

    def restore(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Cached keys [..., H, D] (float32) -> with the centring undone."""
        if self.mean is None:
            return k
        return (k if self.scale is None else k * self.scale[layer]) + self.mean[layer]

    def _write(self, cache, fmt: str, base: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Centred keys k, values v [B, T, H, D] into slots base[b] + pos[t] of a paged cache."""
        batch, n = k.shape[0], k.shape[1]
        slots = (base[:, None] + pos).reshape(-1)
        self.tq.store(k.to(v.dtype).reshape(batch * n, self.n_kv_heads, self.head_dim).contiguous(),
                      v.reshape(batch * n, self.n_kv_heads, self.head_dim).contiguous(), cache, slots, fmt, self.BLOCK)

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, ring: bool = True) -> None:
        """k, v [B, T, H, D] (cache channel order, not yet centred) at positions start..: the slots,
        the sinks among them, and (ring) the window's copies of the last positions."""
        n = k.shape[1]
        kc = self.centre(layer, k)
        self._write(self.caches[layer], self.formats[layer], self.row_base,
                    torch.arange(start, start + n, device=k.device), kc, v)
        sinks = self.sink_kv[layer] if self.covered[layer] else None
        if sinks is not None and start < self.sinks:
            m = min(self.sinks, start + n) - start
            ks, vs = kc[:, :m].float(), v[:, :m].float()
            if not bool(((ks.abs() <= 65504) & (vs.abs() <= 65504)).all()):  # once per sequence
                raise _core.Error("attention sink: key or value element beyond the fp16 range (or NaN)")
            sinks[0][:, start:start + m] = ks.to(torch.float16)
            sinks[1][:, start:start + m] = vs.to(torch.float16)
        if ring:
            self.ring_store(layer, start, kc, v, centred=True)

    def ring_store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, centred: bool = False) -> None:
        """The window's copies of positions start.. (only the last ring_len of them: the ring's)."""
        if not self.covered[layer] or not self.window:
            return
        n = k.shape[1]
        skip = max(0, n - self.ring_len)
        kc = k[:, skip:] if centred else self.centre(layer, k[:, skip:])
        pos = torch.arange(start + skip, start + n, device=k.device) % self.ring_len
        self._write(self.rings[layer], self.window_format, self.ring_base, pos, kc, v[:, skip:])

    def decode(self, layer: int, q: torch.Tensor, seq_len: int, scale: float, window: int) -> torch.Tensor:
        """One query per row q [B, Hq, D] (cache channel order, scaled) over seq_len positions."""
        self.seq_lens.fill_(seq_len)
        return self.tq.decode(q, self.caches[layer], self.tables, self.seq_lens, self.formats[layer], scale=scale,
                              block_size=self.BLOCK, window=window)

    def _rows(self, cache, fmt: str, tables, start: int, n: int):
        """Positions [start, start + n) of every row of a paged cache, decoded: (k, v) [B, n, H, D] float32."""
        k, v = zip(*(self.tq.dequantize(cache, tables[b], start, n, fmt, self.head_dim, self.BLOCK,
                                        dtype=torch.float32) for b in range(tables.shape[0])))
        return torch.stack(k), torch.stack(v)

    def read(self, layer: int, n: int, keys: bool, dtype) -> torch.Tensor:
        """Positions [0, n) of every row, decoded, centring undone: [B, n, H, D]."""
        k, v = self._rows(self.caches[layer], self.formats[layer], self.tables, 0, n)
        return (self.restore(layer, k) if keys else v).to(dtype)

    def with_copies(self, layer: int, start: int, n: int):
        """The keys and values queries at positions start..start+n-1 read, [B, L, H, D] float32 (centring
        undone), with their positions and parts (0 compressed, 1 sink, 2 window) [L]: every
        compressed position of [0, start + n), the sinks, and the window copies those queries read."""
        end = start + n
        k, v = self._rows(self.caches[layer], self.formats[layer], self.tables, 0, end)
        dev = k.device
        ks, vs = [k], [v]
        pos, part = [torch.arange(end, device=dev)], [torch.zeros(end, dtype=torch.int8, device=dev)]
        n_sink = min(self.sinks, end)
        if n_sink:
            sk, sv = self.sink_kv[layer]
            ks.append(sk[:, :n_sink].float())
            vs.append(sv[:, :n_sink].float())
            pos.append(torch.arange(n_sink, device=dev))
            part.append(torch.ones(n_sink, dtype=torch.int8, device=dev))
        first = max(self.sinks, start - self.window + 1)
        if self.window and first < end:
            wk, wv = self._rows(self.rings[layer], self.window_format, self.ring_tables, first % self.ring_len,
                                end - first)
            ks.append(wk)
            vs.append(wv)
            pos.append(torch.arange(first, end, device=dev))
            part.append(torch.full((end - first,), 2, dtype=torch.int8, device=dev))
        return self.restore(layer, torch.cat(ks, 1)), torch.cat(vs, 1), torch.cat(pos), torch.cat(part)

    def copies_mask(self, pos: torch.Tensor, part: torch.Tensor, start: int, n: int, window: int,
                    fold: bool = False) -> torch.Tensor:
        """[n, L] bool: the query at start + i reads key j (the engine's split: sinks [0, S), compressed
        [S, p - window], window copies (p - window, p]; causal; the layer's sliding window). fold:
        position p itself only from part 3 (the chunk's own keys), every other part stops at p - 1."""
        qpos = torch.arange(start, start + n, device=pos.device)[:, None]
        kpos = pos[None, :]
        if fold:
            own = (part == 3)[None, :] & (kpos == qpos)
            return own | (self.copies_mask(pos, part, start, n, window) & (kpos < qpos))
        seen = kpos <= qpos
        if window:
            seen &= kpos > qpos - window
        recent = kpos > qpos - self.window
        comp = (part == 0)[None, :] & (kpos >= self.sinks) & ~recent
        copy = ((part == 1)[None, :]) | ((part == 2)[None, :] & recent)
        return seen & (comp | copy)


class TQLayer(_LayerBase):
    """One model layer of a :class:`TQCache` (layer `index` of the shared per-row caches)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, store: _Store, index: int, fmt, n_kv_heads: int, head_dim: int, capacity: int,
                 attention_on_codes: bool, key_order: Optional[torch.Tensor] = None,
                 cuda_store=None):
        if _LayerBase is not object:
            super().__init__()
        self.keys = self.values = None
        self.is_initialized = False
        self.store, self.index, self.format = store, index, fmt
        self.cuda_store = cuda_store  # () -> the TQCache's _CudaStore (made on first use)
        self.n_kv_heads, self.head_dim, self.capacity = n_kv_heads, head_dim, capacity
        self.attention_on_codes = attention_on_codes
        self.seq_len = 0
        self.dtype, self.device = torch.float32, torch.device("cpu")
        # Keys (and queries) in the GGUF's channel order: channel j of the cache is key_order[j].
        self.key_order = key_order
        self.key_order_inv = None if key_order is None else torch.argsort(key_order)

    # transformers' layer interface ------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor = None) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store.ensure(key_states.shape[0])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if isinstance(key_states, torch.Tensor) and _device_path(key_states.device):
            return self._update_cuda(key_states, value_states)
        k = _core_input(key_states, "key_states", self.n_kv_heads, self.head_dim)
        v = _core_input(value_states, "value_states", self.n_kv_heads, self.head_dim)
        if k.shape != v.shape:
            raise ValueError(f"value_states: expected the shape of key_states {list(key_states.shape)}, "
                             f"got {list(value_states.shape)}")
        if key_states.device != value_states.device:
            raise ValueError("value_states: on another device than key_states")
        if self.key_order is not None:
            k = k[..., self.key_order].contiguous()
        if not torch.isfinite(k).all() or not torch.isfinite(v).all():
            raise _core.Error("key_states / value_states: non-finite element")
        batch, n_new = k.shape[0], k.shape[1]
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        self.store.ensure(batch)
        start = self.seq_len
        if start + n_new > self.capacity:
            raise ValueError(f"TQCache: {start + n_new} positions exceed the capacity {self.capacity} "
                             "(pass max_cache_len)")
        raw_prefill = start == 0  # the prompt attends to its own keys and values, as in the engine
        if self.attention_on_codes and not raw_prefill:
            # Stored by the attention function, piece by piece with the queries, as the engine
            # does: the recent window's ring holds at most max_step_tokens new positions.
            pending = (k, v)
        else:
            self.store.store(self.index, start, k, v)
            pending = None
        self.seq_len += n_new
        if self.attention_on_codes:
            return self._tag(key_states, start, raw_prefill, pending), self._tag(value_states, start, raw_prefill, None)
        if raw_prefill:  # the prompt attends over its own float keys and values
            return key_states, value_states
        return self.decoded(keys=True), self.decoded(keys=False)

    def _update_cuda(self, key_states: torch.Tensor, value_states: torch.Tensor):
        k = _checked(key_states, "key_states", self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = _checked(value_states, "value_states", self.n_kv_heads, self.head_dim).transpose(1, 2)
        if k.shape != v.shape:
            raise ValueError(f"value_states: expected the shape of key_states {list(key_states.shape)}, "
                             f"got {list(value_states.shape)}")
        if key_states.device != value_states.device:
            raise ValueError("value_states: on another device than key_states")
        st = self.cuda_store()
        st.ensure(k.shape[0], k.device)
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        if self.key_order is not None:
            k = k[..., self.key_order.to(k.device)]
        start, n_new = self.seq_len, k.shape[1]
        if start + n_new > self.capacity:
            raise ValueError(f"TQCache: {start + n_new} positions exceed the capacity {self.capacity} "
                             "(pass max_cache_len)")
        raw_prefill = start == 0  # the prompt attends to its own keys and values, as in the engine
        # The window's copies of a chunk that attends on the codes are written by the attention
        # function, piece by piece with the queries (the ring holds window + STEP positions).
        defer = self.attention_on_codes and not raw_prefill and st.covered[self.index] and st.window > 0
        st.store(self.index, start, k, v, ring=not defer)
        self.seq_len += n_new
        if self.attention_on_codes:
            pending = (k, v) if defer else None
            # The engine's fold: each query of a layer with copies reads its own key and value from
            # these, exactly, not from their copies (docs/FORMAT.md, "Recent-token window").
            fresh = (k, v) if st.covered[self.index] and _fold_newest() else None
            return (self._tag(key_states, start, raw_prefill, pending, fresh),
                    self._tag(value_states, start, raw_prefill, None))
        if raw_prefill:
            return key_states, value_states
        return self.decoded(keys=True), self.decoded(keys=False)

    def _attention_cuda(self, query: torch.Tensor, start: int, scale: float, window: int,
                        pending=None, fresh=None) -> torch.Tensor:
        """The CUDA path of attention(): one token per row through tqkv.torch's decode kernel; a
        chunk of several, or a format without a decode kernel, through SDPA over the decoded history;
        a layer with sinks or a recent window through SDPA over [sinks | compressed | window]."""
        st, n = self.cuda_store(), query.shape[2]
        if st.covered[self.index]:
            return self._attention_copies(query, start, scale, window, pending, fresh)
        if n > 1 or not st.kernel[self.index]:
            return _sdpa(query, self.decoded(keys=True), self.decoded(keys=False), None, scale, window)
        q = query[:, :, 0]
        if self.key_order is not None:
            q = q[..., self.key_order.to(q.device)]
        if st.scale is not None:
            q = q * st.scale[self.index].repeat_interleave(q.shape[1] // self.n_kv_heads, dim=0)
        out = st.decode(self.index, q.to(query.dtype).contiguous(), start + 1, scale, window)
        return out[:, None]

    def _attention_copies(self, query: torch.Tensor, start: int, scale: float, window: int,
                          pending, fresh=None) -> torch.Tensor:
        """The engine's attention with sinks and a recent window (RecentWindow::attention): pieces of
        at most STEP queries, each writing its window copies (pending) first, then SDPA over the
        compressed history, the sinks and the window copies with the engine's split as the mask;
        with fresh, each query's own position from the chunk's keys and values instead."""
        st, n, out = self.cuda_store(), query.shape[2], []
        inv = None if self.key_order_inv is None else self.key_order_inv.to(query.device)
        for p in range(0, n, st.STEP):
            m = min(st.STEP, n - p)
            if pending is not None:
                st.ring_store(self.index, start + p, pending[0][:, p:p + m], pending[1][:, p:p + m])
            k, v, pos, part = st.with_copies(self.index, start + p, m)
            if fresh is not None:  # part 3: the piece's own keys and values, each read by its query alone
                k = torch.cat([k, fresh[0][:, p:p + m].float()], 1)
                v = torch.cat([v, fresh[1][:, p:p + m].float()], 1)
                pos = torch.cat([pos, torch.arange(start + p, start + p + m, device=pos.device)])
                part = torch.cat([part, torch.full((m,), 3, dtype=torch.int8, device=part.device)])
            if inv is not None:
                k = k[..., inv]
            mask = st.copies_mask(pos, part, start + p, m, window, fold=fresh is not None)
            out.append(_sdpa(query[:, :, p:p + m], k.transpose(1, 2).to(self.dtype), v.transpose(1, 2).to(self.dtype),
                             mask[None, None], scale, window))
        return torch.cat(out, 1)

    def _tag(self, x: torch.Tensor, start: int, raw: bool, pending, fresh=None) -> torch.Tensor:
        t = x.view_as(x)
        setattr(t, _TAG, (self, start, raw, pending, fresh))
        return t

    def decoded(self, keys: bool = True) -> torch.Tensor:
        """Every position's keys (or values) decoded: [batch, n_kv_heads, seq_len, head_dim]."""
        if _device_path(self.device):
            rows = self.cuda_store().read(self.index, self.seq_len, keys, self.dtype)
            if keys and self.key_order_inv is not None:
                rows = rows[..., self.key_order_inv.to(rows.device)]
            return rows.transpose(1, 2)
        c = self.store.cache
        rows = torch.stack([torch.from_numpy(c.read(self.index, s, 0, self.seq_len, keys=keys))
                            for s in self.store.seqs])
        if keys and self.key_order_inv is not None:
            rows = rows[..., self.key_order_inv]
        return rows.transpose(1, 2).to(device=self.device, dtype=self.dtype)

    def attention(self, query: torch.Tensor, start: int, scale: float, window: int, pending=None,
                  fresh=None) -> torch.Tensor:
        """Queries [B, n_q_heads, T, D] at positions start.. over the compressed cache -> [B, T, n_q_heads, D]
        (the engine's attention: sinks, recent window, compressed part, the layer's sliding window).
        pending: the (keys, values) [B, T, H, D] update() left for this call to store; fresh: the
        chunk's own keys and values (a layer with copies), each query's own position read from
        them (the CPU path has the engine do it from what it stored)."""
        if _device_path(query.device):
            return self._attention_cuda(query, start, scale, window, pending, fresh)
        q = query.detach().transpose(1, 2).to("cpu", torch.float32)
        if self.key_order is not None:
            q = q[..., self.key_order]
        if scale != self.head_dim ** -0.5:  # the cache scores with 1/sqrt(head_dim)
            q = q * (scale * self.head_dim ** 0.5)
        q = q.contiguous()
        st, n = self.store, q.shape[1]
        step = st.cache.max_step_tokens if pending is not None else n
        out = []
        for p in range(0, n, step):
            pos = [start + p] * len(st.seqs)
            if pending is not None:
                st.cache.store(self.index, st.seqs, pos, pending[0][:, p:p + step].contiguous(),
                               pending[1][:, p:p + step].contiguous())
            out.append(torch.from_numpy(st.cache.attention(self.index, st.seqs, pos, q[:, p:p + step].contiguous())))
        return torch.cat(out, 1).to(device=query.device, dtype=query.dtype)

    def get_seq_length(self, *args) -> int:
        return self.seq_len

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        n = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.seq_len + n, 0

    def get_max_length(self) -> int:
        return self.capacity

    def get_max_cache_shape(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.seq_len = 0
        self.is_initialized = False
        self.store.cache, self.store.seqs = None, []
        if self.cuda_store is not None:
            self.cuda_store().caches = []

    def offload(self):
        pass

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("TQCache: beam search is not supported")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("TQCache: cropping is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("TQCache: expanding the batch of a filled cache is not supported")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("TQCache: selecting batch rows is not supported")


def _default_capacity(config) -> int:
    n = getattr(_text_config(config), "max_position_embeddings", None) or DEFAULT_CAPACITY
    return min(int(n), DEFAULT_CAPACITY)


class TQCache(Cache):
    """A transformers ``Cache`` over tqkv's compressed KV cache.

    config: the model's config (``model.config``). spec: a cache spec — a format name
    (``f16``, ``turboquant_4bit_nc``, ...), ``k<K>v<V>``, a recipe fitted to the model
    (``tq-4.375``; recipes/*.json) with ``+options`` — resolved as the engine resolves
    ``--kv-cache-dtype`` (boundary layers in f16 for compressed formats), or a list of formats,
    one per layer. max_cache_len: positions each layer can hold (default: the model's context,
    at most 4096). attention_on_codes: hand the ``tqkv`` attention function the new keys only
    (default: when ``config._attn_implementation == "tqkv"``); otherwise ``update`` returns the
    decoded history, for any attention implementation. The first chunk (the prompt) attends to its
    own float keys and values, as the engine's fresh prompts do; later chunks read the cache.
    recipe_file: a recipe file to use first.
    """

    is_compileable = False

    def __init__(self, config, spec: Union[str, Sequence[Any]] = "tq-4.375", max_cache_len: Optional[int] = None,
                 attention_on_codes: Optional[bool] = None, seed: int = _core.DEFAULT_SEED,
                 recipe_file: Optional[str] = None):
        arch, n_layers, n_kv, head_dim = _model_shape(config)
        if seed != _core.DEFAULT_SEED:
            raise ValueError("TQCache: the engine's cache layer rotates with the engine's seed (DEFAULT_SEED)")
        if not isinstance(spec, str):  # one format per layer: the spec that says so
            formats = [f if isinstance(f, _core.Format) else _core.Format(f) for f in spec]
            if len(formats) != n_layers:
                raise ValueError(f"TQCache: {len(formats)} formats for {n_layers} layers")
            spec = "f32+skip0" + "".join(f"+L{i}={f.name}" for i, f in enumerate(formats))
        if max_cache_len is None:
            max_cache_len = _default_capacity(config)
        self.capacity = int(max_cache_len)  # (transformers 4.5x has a read-only max_cache_len)
        probe = _model_cache(config, spec, self.capacity, 1, recipe_file)  # a bad spec raises here
        self.spec, self.detail, self.formats = spec, probe.detail, list(probe.formats)
        self.centred_keys = probe.centred_keys
        self._copies = (probe.sinks, probe.recent_window, probe.window_format.name)  # the engine's, at this capacity
        if attention_on_codes is None:
            attention_on_codes = getattr(config, "_attn_implementation", None) == ATTN_NAME
        if attention_on_codes and ATTN_NAME not in _registered:
            raise ValueError("TQCache: attention_on_codes needs transformers' AttentionInterface (4.48 or later)")
        self._store = _Store(lambda batch: _model_cache(config, spec, self.capacity, batch, recipe_file))
        self._cuda = None
        self._cuda_args = (config, recipe_file)
        order = _gguf_key_order(arch, head_dim)
        layers = [TQLayer(self._store, i, f, n_kv, head_dim, self.capacity, attention_on_codes, order,
                          self._cuda_store) for i, f in enumerate(self.formats)]
        try:
            super().__init__(layers=layers)
        except TypeError:  # transformers < 4.56: no layer objects in the base class
            super().__init__()
            self.layers = layers
        self.attention_on_codes = attention_on_codes

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx {layer_idx} out of range (the cache has {len(self.layers)} layers)")
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        return self.layers[layer_idx or 0].seq_len if self.layers else 0

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.capacity

    def get_max_cache_shape(self, layer_idx: Optional[int] = None) -> int:
        return self.capacity

    def get_usable_length(self, new_seq_length: int, layer_idx: Optional[int] = 0) -> int:  # transformers 4.x
        return self.get_seq_length(layer_idx)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    # reorder_cache, crop, batch_repeat_interleave, batch_select_indices: the base class hands
    # them to the layers, which raise NotImplementedError.

    def _cuda_store(self) -> _CudaStore:
        """The GPU storage, made on the first CUDA update (with the engine's sinks and recent window
        at this capacity: the probe's)."""
        if self._cuda is None:
            config, recipe_file = self._cuda_args
            r = resolve_spec(config, self.spec, recipe_file)
            arch, n_layers, n_kv, head_dim = _model_shape(config)
            self._cuda = _CudaStore(self.formats, n_kv, head_dim, self.capacity,
                                    _centring(config, self.spec, self.capacity, recipe_file)
                                    if r["centre_keys"] else None, self._copies)
        return self._cuda

    def bytes(self) -> int:
        """Bytes of the positions held (every layer and batch row): the compressed slots and the
        copies (sinks, recent window), by the engine's accounting."""
        if self._cuda is not None and self._cuda.caches:
            layer, st = self.layers[0], self._cuda
            rows, n, d = st.tables.shape[0], layer.seq_len, layer.head_dim
            copy = (_core.Format(st.window_format).slot_bytes(d) * min(st.window, n) + 4 * d * min(st.sinks, n))
            return sum((f.slot_bytes(d) * n + (copy if c else 0)) * layer.n_kv_heads * rows
                       for f, c in zip(self.formats, st.covered))
        st = self._store
        return sum(sum(st.cache.bytes(s)) for s in st.seqs) if st.cache is not None else 0

    def bits_per_element(self) -> float:
        """Bits per cached key or value element, slot metadata and copies included."""
        layer = self.layers[0]
        rows = self._cuda.tables.shape[0] if self._cuda is not None and self._cuda.caches else len(self._store.seqs)
        elements = 2 * len(self.layers) * layer.n_kv_heads * layer.head_dim * layer.seq_len * rows
        return 8.0 * self.bytes() / elements if elements else float(
            sum(f.bits_per_element(layer.head_dim) for f in self.formats) / len(self.formats))


def _causal_mask(n_q: int, n_k: int, window: int, device) -> torch.Tensor:
    """[n_q, n_k] bool: query i (at position n_k - n_q + i) sees key j."""
    qpos = torch.arange(n_k - n_q, n_k, device=device)[:, None]
    kpos = torch.arange(n_k, device=device)[None, :]
    seen = kpos <= qpos
    if window:
        seen &= kpos > qpos - window
    return seen


def _sdpa(query, key, value, attention_mask, scaling, window) -> torch.Tensor:
    """Float attention over the given keys (GQA by repetition) -> [B, T, n_q_heads, D]."""
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask[:, :, :, : key.shape[2]]
    else:
        mask = _causal_mask(query.shape[2], key.shape[2], window, query.device)
    out = torch.nn.functional.scaled_dot_product_attention(query, key.to(query.dtype), value.to(query.dtype),
                                                           attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()


def tqkv_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                   sliding_window: Optional[int] = None, softcap: Optional[float] = None, **kwargs):
    """transformers' attention interface (``attn_implementation="tqkv"``): query [B, n_q_heads, T, D];
    key, value as :class:`TQCache` returned them. Returns ([B, T, n_q_heads, D], None).

    Keys from a TQCache after its first chunk: attention on the compressed cache (tqkv's C++
    kernels, causal, sliding window where the layer has one). The first chunk, or keys from
    another cache: float attention over the keys given (SDPA)."""
    if dropout:
        raise ValueError("tqkv attention: dropout is not supported (inference only)")
    if softcap:
        raise ValueError("tqkv attention: logit soft-capping is not supported")
    window = int(sliding_window or 0)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    tag = getattr(key, _TAG, None)
    if tag is None or tag[2]:
        return _sdpa(query, key, value, None if tag else attention_mask, scale, window), None
    layer, start, _, pending, fresh = tag
    return layer.attention(query, start, scale, window, pending, fresh), None


_registered: set[str] = set()


def register(name: str = ATTN_NAME) -> None:
    """Registers :func:`tqkv_attention` with transformers' AttentionInterface under `name`
    (done on import for "tqkv"); a no-op on transformers without the interface."""
    try:
        from transformers import AttentionInterface
        AttentionInterface.register(name, tqkv_attention)
    except ImportError:
        try:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        except ImportError:
            return
        ALL_ATTENTION_FUNCTIONS[name] = tqkv_attention
    _registered.add(name)


register()
