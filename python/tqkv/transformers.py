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

Spec options: key centring (``+c``, ``+s``) is applied as the engine applies it (its code,
with the key statistics of the model's recipe file, in transformers' channel order); attention
sinks and recent windows (``+sink<N>``, ``+w<N>``, ``+wq<B>``, ``+fill<B>``) are not — a spec
that has them (SmolLM2's ``tq-*`` recipes fill a recent window and keep one sink) runs without
them, with a warning, and :attr:`TQCache.ignored` lists what was left out;
:meth:`TQCache.bits_per_element` counts what is stored. Recipes match a model by architecture,
layer count, kv heads and head dim (the GGUF weights hash the engine also checks is not
available to transformers).

Limits: one sequence per batch row, no padding (attention masks are not read); no beam search
or cache cropping. Tensors on a GPU are copied to the CPU for the cache and the attention (the
CUDA custom ops of ``tqkv.torch`` are not used here yet).

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
    dirs = [d for d in os.environ.get("TQKV_RECIPES", "").split(":") if d]
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


def _centring(config, spec: str, capacity: int, recipe_file: Optional[str]):
    """The engine's key centring of `spec` for this model, in transformers' channel order:
    (mean, scale or None) as [n_layers, n_kv_heads, head_dim] tensors, or None when the spec
    does not centre or the model's recipe file has no key statistics."""
    arch, n_layers, n_kv, head_dim = _model_shape(config)
    recipes, stats = _recipe_files(arch, n_layers, n_kv, head_dim, recipe_file)
    if stats is None:
        return None
    fields = [np.asarray(stats[k], dtype=np.float32) for k in ("key_mean", "key_sq", "query_sq")]
    # In the GGUF's channel order, as the cache stores keys (see _gguf_key_order).
    n_heads = _text_config(config).num_attention_heads
    out = _core.key_centring(spec, n_layers, n_kv, head_dim, n_heads, _rope_base(config), arch != "llama", *fields,
                             capacity, recipes)
    if out is None:
        return None
    return tuple(None if a is None else torch.from_numpy(a) for a in out)


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
    """[B, H, T, D] float (any device) -> [B, T, H, D] float32/float16, C-contiguous, on the CPU."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: expected float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() != 4 or x.shape[1] != n_kv_heads or x.shape[3] != head_dim:
        raise ValueError(f"{name}: expected shape [batch, n_kv_heads={n_kv_heads}, tokens, head_dim={head_dim}], "
                         f"got {list(x.shape)}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a CPU or CUDA tensor, got device {x.device}")
    x = x.detach()
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.transpose(1, 2).to("cpu").contiguous()


class _Rows:
    """The storage a TQCache's layers share: one ``tqkv.ContiguousCache`` (every layer, the
    per-layer formats) per batch row, made when the first layer sees the batch."""

    def __init__(self, formats, n_kv_heads: int, head_dim: int, capacity: int, seed: int):
        self.formats, self.n_kv_heads, self.head_dim, self.capacity, self.seed = (
            formats, n_kv_heads, head_dim, capacity, seed)
        self.caches: list[_core.ContiguousCache] = []

    def ensure(self, batch: int) -> list:
        if not self.caches:
            self.caches = [
                _core.ContiguousCache(n_layers=len(self.formats), n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                                      capacity=self.capacity, formats=self.formats, seed=self.seed)
                for _ in range(batch)
            ]
        elif batch != len(self.caches):
            raise ValueError(f"key_states: batch {batch}, but the cache holds {len(self.caches)} sequences")
        return self.caches


class TQLayer(_LayerBase):
    """One model layer of a :class:`TQCache` (layer `index` of the shared per-row caches)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, rows: _Rows, index: int, attention_on_codes: bool, prefill_on_codes: bool = False,
                 key_mean: Optional[torch.Tensor] = None, key_scale: Optional[torch.Tensor] = None,
                 key_order: Optional[torch.Tensor] = None):
        if _LayerBase is not object:
            super().__init__()
        self.keys = self.values = None
        self.is_initialized = False
        self.rows, self.index = rows, index
        self.format = rows.formats[index]
        self.n_kv_heads, self.head_dim, self.capacity = rows.n_kv_heads, rows.head_dim, rows.capacity
        self.attention_on_codes, self.prefill_on_codes = attention_on_codes, prefill_on_codes
        self.seq_len = 0
        self.dtype, self.device = torch.float32, torch.device("cpu")
        # Key centring (+c, +s): keys cached as (k - mean) / scale, queries times scale.
        self.key_mean, self.key_scale = key_mean, key_scale
        # Keys (and queries) in the GGUF's channel order: channel j of the cache is key_order[j].
        self.key_order = key_order
        self.key_order_inv = None if key_order is None else torch.argsort(key_order)

    # transformers' layer interface ------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor = None) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.rows.ensure(key_states.shape[0])
        self.is_initialized = True

    @property
    def caches(self) -> list:
        return self.rows.caches if self.is_initialized else []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        k = _core_input(key_states, "key_states", self.n_kv_heads, self.head_dim)
        v = _core_input(value_states, "value_states", self.n_kv_heads, self.head_dim)
        if k.shape != v.shape:
            raise ValueError(f"value_states: expected the shape of key_states {list(key_states.shape)}, "
                             f"got {list(value_states.shape)}")
        if key_states.device != value_states.device:
            raise ValueError("value_states: on another device than key_states")
        if self.key_order is not None:
            k = k[..., self.key_order]
        if self.key_mean is not None:
            k = k.float() - self.key_mean
            if self.key_scale is not None:
                k = k / self.key_scale
        batch, n_new = k.shape[0], k.shape[1]
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        self.rows.ensure(batch)
        start = self.seq_len
        if start + n_new > self.capacity:
            raise ValueError(f"TQCache: {start + n_new} positions exceed the capacity {self.capacity} "
                             "(pass max_cache_len)")
        for b in range(batch):  # all or nothing: a raising write changes nothing
            self.caches[b].write(self.index, start, k[b], v[b])
        self.seq_len += n_new
        raw_prefill = start == 0 and not self.prefill_on_codes
        if self.attention_on_codes:
            return self._tag(key_states, start, raw_prefill), self._tag(value_states, start, raw_prefill)
        if raw_prefill:  # the prompt attends over its own float keys and values
            return key_states, value_states
        return self.decoded(keys=True), self.decoded(keys=False)

    def _tag(self, x: torch.Tensor, start: int, raw: bool) -> torch.Tensor:
        t = x.view_as(x)
        setattr(t, _TAG, (self, start, raw))
        return t

    def decoded(self, keys: bool = True) -> torch.Tensor:
        """Every position's keys (or values) decoded: [batch, n_kv_heads, seq_len, head_dim]."""
        rows = torch.stack([torch.from_numpy(c.decode(self.index, 0, self.seq_len, keys=keys)) for c in self.caches])
        if keys and self.key_mean is not None:
            rows = rows * (1.0 if self.key_scale is None else self.key_scale) + self.key_mean
        if keys and self.key_order_inv is not None:
            rows = rows[..., self.key_order_inv]
        return rows.transpose(1, 2).to(device=self.device, dtype=self.dtype)

    def attention(self, query: torch.Tensor, start: int, scale: float, window: int) -> torch.Tensor:
        """Queries [B, n_q_heads, T, D] at positions start.. over the compressed cache -> [B, T, n_q_heads, D]."""
        q = query.detach().transpose(1, 2).to("cpu", torch.float32)
        if self.key_order is not None:
            q = q[..., self.key_order]
        if self.key_scale is not None:
            q = q * self.key_scale.repeat_interleave(q.shape[2] // self.n_kv_heads, dim=0)
        q = q.contiguous()
        out = [torch.from_numpy(c.attention(self.index, q[b], start, scale=scale, window=window))
               for b, c in enumerate(self.caches)]
        return torch.stack(out).to(device=query.device, dtype=query.dtype)

    def get_seq_length(self, *args) -> int:
        return self.seq_len

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        n = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.seq_len + n, 0

    def get_max_length(self) -> int:
        return self.capacity

    def get_max_cache_shape(self) -> int:
        return self.capacity

    def bytes(self) -> int:
        """Slot bytes of the positions held (every batch row)."""
        return self.format.slot_bytes(self.head_dim) * self.n_kv_heads * self.seq_len * len(self.caches)

    def reset(self) -> None:
        for c in self.caches:
            c.clear()
        self.seq_len = 0
        self.is_initialized = False
        self.rows.caches = []

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
    decoded history, for any attention implementation. prefill_on_codes: the first chunk too
    attends over the compressed cache (as the engine does) rather than over its float keys.
    recipe_file: a recipe file to use first.
    """

    is_compileable = False

    def __init__(self, config, spec: Union[str, Sequence[Any]] = "tq-4.375", max_cache_len: Optional[int] = None,
                 attention_on_codes: Optional[bool] = None, seed: int = _core.DEFAULT_SEED,
                 recipe_file: Optional[str] = None, prefill_on_codes: bool = False):
        arch, n_layers, n_kv, head_dim = _model_shape(config)
        self.ignored: list[str] = []
        if isinstance(spec, str):
            r = resolve_spec(config, spec, recipe_file)
            if max_cache_len is None:
                max_cache_len = _default_capacity(config)
            centring = _centring(config, spec, int(max_cache_len), recipe_file) if r["centre_keys"] else None
            for what, on in (("+c/+s (key centring: no key statistics for this model)",
                              r["centre_keys"] and centring is None),
                             ("+w<N> (recent window)", r["recent_window"]), ("+sink<N> (attention sinks)", r["sinks"]),
                             ("+fill<B> (recent window)", r["fill_bits"])):
                if on:
                    self.ignored.append(what)
            if self.ignored:
                warnings.warn(f"TQCache: cache spec '{spec}': {', '.join(self.ignored)} not applied here; its "
                              "per-layer formats run alone", stacklevel=2)
            formats = list(r["layers"])
            self.detail = r["detail"]
        else:
            centring = None
            formats = [f if isinstance(f, _core.Format) else _core.Format(f) for f in spec]
            if len(formats) != n_layers:
                raise ValueError(f"TQCache: {len(formats)} formats for {n_layers} layers")
            self.detail = " ".join(f"L{i}:{f.name}" for i, f in enumerate(formats))
        self.spec = spec
        self.formats = formats
        if max_cache_len is None:
            max_cache_len = _default_capacity(config)
        if attention_on_codes is None:
            attention_on_codes = getattr(config, "_attn_implementation", None) == ATTN_NAME
        if attention_on_codes and ATTN_NAME not in _registered:
            raise ValueError("TQCache: attention_on_codes needs transformers' AttentionInterface (4.48 or later)")
        rows = _Rows(formats, n_kv, head_dim, int(max_cache_len), seed)
        mean, scale = centring if centring is not None else (None, None)
        order = _gguf_key_order(arch, head_dim)
        layers = [TQLayer(rows, i, attention_on_codes, prefill_on_codes, None if mean is None else mean[i],
                          None if scale is None else scale[i], order) for i in range(len(formats))]
        self.centred_keys = centring is not None
        try:
            super().__init__(layers=layers)
        except TypeError:  # transformers < 4.56: no layer objects in the base class
            super().__init__()
            self.layers = layers
        self.attention_on_codes = attention_on_codes
        self.capacity = int(max_cache_len)  # (transformers 4.5x has a read-only max_cache_len)

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

    def bytes(self) -> int:
        """Bytes of the compressed slots of the positions held (every layer and batch row)."""
        return sum(layer.bytes() for layer in self.layers)

    def bits_per_element(self) -> float:
        """Bits per cached key or value element, slot metadata (norms, scales) included."""
        layer = self.layers[0]
        elements = 2 * sum(l.n_kv_heads * l.head_dim * l.seq_len * len(l.caches) for l in self.layers)
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
    layer, start, _ = tag
    return layer.attention(query, start, scale, window), None


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
