"""tqkv's CUDA kernels behind vLLM's TurboQuant KV-cache presets.

vLLM loads the entry point ``tqkv_vllm:register`` (group ``vllm.general_plugins``) in every
process it starts; ``register`` points vLLM's ``AttentionBackendEnum.TURBOQUANT`` at
``tqkv_vllm.backend.TqkvTurboQuantBackend``, a subclass of vLLM's own TurboQuant backend that
keeps its name, cache spec, slot layout and metadata builder and replaces the Triton store,
decode and continuation-prefill kernels by tqkv's (docs/VLLM.md).

Environment:
  TQKV_VLLM=0      off: vLLM's own kernels run (the kill switch);
  TQKV_VLLM=1      required: an unsupported vLLM or a missing CUDA extension raises;
  unset / auto     on where supported, else a warning and vLLM's own kernels.
vLLM's ``VLLM_PLUGINS`` allow-list names this plugin ``tqkv``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os

__version__ = "0.1.0"

# The vLLM releases whose TurboQuant cache (slot layout, plain Hadamard rotation, centroids,
# store arithmetic) and backend methods this plugin was checked against: 0.26.0 (torch 2.11) to
# 0.27.x (torch 2.13); their Triton store and decode files are identical. 0.25 lays the cache out
# token-major; 0.28 rewrites the backend.
VLLM_MIN = (0, 26, 0)
VLLM_BELOW = (0, 28, 0)
BACKEND_CLASS = "tqkv_vllm.backend.TqkvTurboQuantBackend"

logger = logging.getLogger("vllm.plugins.tqkv")


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as 0.26.0 or 0.27.1.dev3+g1234."""
    out = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        out.append(int(digits) if digits else 0)
    return tuple(out + [0] * (3 - len(out)))


def _text(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def unsupported_reason(vllm_version: str | None = None) -> str | None:
    """Why the plugin cannot serve this environment, or None where it can."""
    if vllm_version is None:
        try:
            vllm_version = importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return "vLLM is not installed"
    release = _release(vllm_version)
    if not VLLM_MIN <= release < VLLM_BELOW:
        return (f"tqkv-vllm {__version__} supports vLLM >= {_text(VLLM_MIN)}, < {_text(VLLM_BELOW)} "
                f"(their TurboQuant cache layout and kernels); found vLLM {vllm_version}")
    if importlib.util.find_spec("tqkv_vllm._C") is None:
        return ("the CUDA extension tqkv_vllm._C was not built (reinstall with nvcc on the PATH: "
                "pip install --no-build-isolation tqkv-vllm)")
    try:
        from ._build_info import TORCH_VERSION as built
        runtime = importlib.metadata.version("torch")
    except (ImportError, importlib.metadata.PackageNotFoundError):
        return None
    if built.split("+")[0] != runtime.split("+")[0]:
        return (f"tqkv_vllm._C was built against torch {built}, this environment has torch {runtime} "
                "(reinstall: pip install --no-build-isolation --force-reinstall tqkv-vllm)")
    return None


def register() -> bool:
    """The vLLM entry point. Idempotent (vLLM calls it in every process, maybe twice); returns
    whether vLLM's TurboQuant backend now resolves to tqkv's."""
    mode = os.environ.get("TQKV_VLLM", "auto").strip().lower()
    if mode in ("0", "off", "false", "no"):
        logger.info("tqkv: TQKV_VLLM=%s, vLLM's own TurboQuant kernels stay", mode)
        return False
    reason = unsupported_reason()
    if reason is not None:
        if mode in ("1", "on", "true", "yes", "require"):
            raise RuntimeError(f"tqkv: {reason} (TQKV_VLLM={mode} requires the plugin)")
        logger.warning("tqkv: %s; vLLM's own TurboQuant kernels stay", reason)
        return False
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if AttentionBackendEnum.TURBOQUANT.get_path() != BACKEND_CLASS:
        register_backend(AttentionBackendEnum.TURBOQUANT, BACKEND_CLASS)
        logger.info("tqkv: vLLM's TurboQuant backend now runs tqkv's CUDA kernels (%s)", BACKEND_CLASS)
    return True
