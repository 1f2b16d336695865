"""tqkv: compressed transformer KV caches (TurboQuant-style rotation, Lloyd-Max codes, bit
packing) and attention computed directly on them, on NumPy arrays.

The classes and functions live in the C++ extension ``tqkv._core`` (nanobind); this package
re-exports them. Inputs are float32 or float16, C-contiguous, in CPU memory (float32 is read
in place; any DLPack producer on the CPU is read the same way); anything else raises
:class:`tqkv.Error`, a ``ValueError`` carrying the C++ message. Framework layers (torch ops,
a transformers Cache) belong in submodules beside ``_core`` (``tqkv.torch``,
``tqkv.transformers``, which needs torch and transformers) so that ``import tqkv`` keeps
needing NumPy alone.

    >>> import numpy as np, tqkv
    >>> fmt = tqkv.Format("turboquant_4bit_nc"); fmt.slot_bytes(128)
    134
    >>> cache = tqkv.ContiguousCache(n_layers=1, n_kv_heads=2, head_dim=128, capacity=64, formats=fmt)
"""

from ._core import (
    DEFAULT_FORMAT,
    DEFAULT_SEED,
    ContiguousCache,
    Error,
    Format,
    ModelCache,
    PagedCache,
    SlotCodec,
    boundary_layer_formats,
    named_formats,
    num_threads,
    resolve_cache_spec,
    set_num_threads,
    set_simd_level,
    simd_level,
)

__all__ = [
    "DEFAULT_FORMAT",
    "DEFAULT_SEED",
    "ContiguousCache",
    "Error",
    "Format",
    "ModelCache",
    "PagedCache",
    "SlotCodec",
    "boundary_layer_formats",
    "named_formats",
    "num_threads",
    "resolve_cache_spec",
    "set_num_threads",
    "set_simd_level",
    "simd_level",
]
__version__ = "0.1.0"
