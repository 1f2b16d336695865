"""vLLM's own TurboQuant code for the tests: its Triton store and decode kernels, its centroids,
config and Hadamard matrix, taken from an installed vLLM or, on a machine without vLLM, from the
Python files of the vLLM wheel that scripts/fetch_vllm_kernels.sh unpacks into a git-ignored
folder (TQKV_VLLM_PEER=<folder holding vllm/>).

Nothing of vLLM is rewritten here. Two things are needed to import its files without the
wheel's compiled libraries: `vllm._C_stable_libtorch` (vLLM's compiled custom ops, which
vllm/platforms/cuda.py imports for their side effect of registering ops; the Triton kernels call
none of them) is given as an empty module, and the Hadamard builder is taken out of
turboquant_attn.py by name (that module imports all of vLLM's configuration).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass
class Peer:
    version: str
    root: Path  # the folder that holds vllm/
    store: Any  # vllm.v1.attention.ops.triton_turboquant_store
    decode: Any  # vllm.v1.attention.ops.triton_turboquant_decode
    centroids: Any  # vllm/model_executor/layers/quantization/turboquant/centroids.py
    config: Any  # .../turboquant/config.py (TurboQuantConfig)
    hadamard: Callable[[int, str], Any]  # turboquant_attn._build_hadamard_cached(d, device)


def _load_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return mod


def _function_from(path: Path, name: str, env: dict) -> Callable:
    """One top-level function of a vLLM file, compiled from vLLM's own source."""
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            node.decorator_list = []  # @functools.cache: the tests call it a few times
            code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec")
            exec(code, env)
            return env[name]
    raise LookupError(f"{name} not in {path}")


def load(root: str | os.PathLike | None = None) -> Peer:
    root = Path(root or os.environ.get("TQKV_VLLM_PEER", "")) if (root or os.environ.get("TQKV_VLLM_PEER")) else None
    if root is not None:
        if not (root / "vllm" / "v1" / "attention" / "ops" / "triton_turboquant_store.py").exists():
            raise FileNotFoundError(f"no vLLM TurboQuant files under {root} (scripts/fetch_vllm_kernels.sh)")
        sys.path.insert(0, str(root))
        sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
        pkg = root / "vllm"
    else:
        spec = importlib.util.find_spec("vllm")
        if spec is None:
            raise ModuleNotFoundError("vLLM is neither installed nor staged (TQKV_VLLM_PEER)")
        pkg = Path(spec.origin).parent
    import vllm

    store = importlib.import_module("vllm.v1.attention.ops.triton_turboquant_store")
    decode = importlib.import_module("vllm.v1.attention.ops.triton_turboquant_decode")
    tq = pkg / "model_executor" / "layers" / "quantization" / "turboquant"
    centroids = _load_file(tq / "centroids.py", "tqkv_peer_centroids")
    config = _load_file(tq / "config.py", "tqkv_peer_config")
    import functools
    import math

    import torch

    env = {"torch": torch, "math": math, "functools": functools}
    hadamard = _function_from(pkg / "v1" / "attention" / "backends" / "turboquant_attn.py", "_build_hadamard_cached",
                              env)
    return Peer(getattr(vllm, "__version__", "?"), pkg.parent, store, decode, centroids, config, hadamard)
