"""The plugin against the real vLLM, no GPU needed: the entry point, registration through vLLM's
own plugin loader (idempotent, the kill switch, the allow-list), the version check, and the
classes against vLLM's interfaces. Skipped where vLLM is not importable.
    python -m pytest vllm_plugin/tests/test_plugin.py     (scripts/vllm_cpu_check.sh sets it up)
"""

from __future__ import annotations

import importlib.metadata
import inspect

import pytest

vllm = pytest.importorskip("vllm")

import tqkv_vllm  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
VLLM_DEFAULT = "vllm.v1.attention.backends.turboquant_attn.TurboQuantAttentionBackend"


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """Each test starts from vLLM's own TurboQuant backend and a plugin loader not yet run."""
    import vllm.plugins

    monkeypatch.delenv("TQKV_VLLM", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    AttentionBackendEnum.TURBOQUANT.clear_override()
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    yield
    AttentionBackendEnum.TURBOQUANT.clear_override()


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "tqkv"]
    assert len(ours) == 1 and ours[0].value == "tqkv_vllm:register"


def test_supported_version_installed():
    assert tqkv_vllm.unsupported_reason() is None, tqkv_vllm.unsupported_reason()


def test_vllm_loader_registers_backend():
    from vllm.plugins import load_general_plugins

    assert AttentionBackendEnum.TURBOQUANT.get_path() == VLLM_DEFAULT
    load_general_plugins()
    assert AttentionBackendEnum.TURBOQUANT.get_path() == tqkv_vllm.BACKEND_CLASS
    from tqkv_vllm.backend import TqkvTurboQuantBackend

    assert AttentionBackendEnum.TURBOQUANT.get_class() is TqkvTurboQuantBackend


def test_register_is_idempotent():
    from vllm.v1.attention.backends import registry

    assert tqkv_vllm.register() and tqkv_vllm.register()
    assert registry._ATTN_OVERRIDES == {AttentionBackendEnum.TURBOQUANT: tqkv_vllm.BACKEND_CLASS}


@pytest.mark.parametrize("value", ["0", "off"])
def test_kill_switch(monkeypatch, value):
    from vllm.plugins import load_general_plugins

    monkeypatch.setenv("TQKV_VLLM", value)
    load_general_plugins()
    assert AttentionBackendEnum.TURBOQUANT.get_path() == VLLM_DEFAULT


def test_allow_list_without_tqkv(monkeypatch):
    from vllm.plugins import load_general_plugins

    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    load_general_plugins()
    assert AttentionBackendEnum.TURBOQUANT.get_path() == VLLM_DEFAULT


def test_allow_list_with_tqkv(monkeypatch):
    from vllm.plugins import load_general_plugins

    monkeypatch.setenv("VLLM_PLUGINS", "tqkv")
    load_general_plugins()
    assert AttentionBackendEnum.TURBOQUANT.get_path() == tqkv_vllm.BACKEND_CLASS


@pytest.mark.parametrize("version", ["0.25.1", "0.28.0", "0.33.0", "0.19.0"])
def test_other_versions_refused(version):
    reason = tqkv_vllm.unsupported_reason(version)
    assert reason is not None and version in reason and ">= 0.26.0, < 0.28.0" in reason


@pytest.mark.parametrize("version", ["0.26.0", "0.27.0", "0.27.1", "0.27.2.dev4+gabc"])
def test_tested_versions_accepted(version):
    assert tqkv_vllm.unsupported_reason(version) is None


def test_required_mode_raises_on_unsupported(monkeypatch):
    monkeypatch.setenv("TQKV_VLLM", "1")
    monkeypatch.setattr(tqkv_vllm, "unsupported_reason", lambda: "vLLM 9.9 is not supported")
    with pytest.raises(RuntimeError, match="9.9"):
        tqkv_vllm.register()
    assert AttentionBackendEnum.TURBOQUANT.get_path() == VLLM_DEFAULT


def test_auto_mode_warns_and_keeps_vllm(monkeypatch):
    monkeypatch.setattr(tqkv_vllm, "unsupported_reason", lambda: "vLLM 9.9 is not supported")
    assert tqkv_vllm.register() is False
    assert AttentionBackendEnum.TURBOQUANT.get_path() == VLLM_DEFAULT


def _abstract_names(cls) -> set[str]:
    names = set()
    for base in cls.__mro__:
        for name, member in vars(base).items():
            fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            if getattr(fn, "__isabstractmethod__", False):
                names.add(name)
    return names


def test_classes_implement_vllm_interfaces():
    from vllm.v1.attention.backend import AttentionBackend, AttentionImpl
    from vllm.v1.attention.backends import turboquant_attn as tq

    from tqkv_vllm.backend import TqkvTurboQuantBackend, TqkvTurboQuantImpl

    assert issubclass(TqkvTurboQuantBackend, AttentionBackend) and issubclass(TqkvTurboQuantImpl, AttentionImpl)
    for cls, base in ((TqkvTurboQuantBackend, AttentionBackend), (TqkvTurboQuantImpl, AttentionImpl)):
        assert not inspect.isabstract(cls), cls.__abstractmethods__
        required = _abstract_names(base)
        assert required, f"{base.__name__} declares no abstract methods: the check would be empty"
        for name in required:
            member = inspect.getattr_static(cls, name)
            fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            assert not getattr(fn, "__isabstractmethod__", False), f"{cls.__name__}.{name} is abstract"
    # Everything but the impl class is vLLM's own.
    assert TqkvTurboQuantBackend.get_name() == "TURBOQUANT"
    assert TqkvTurboQuantBackend.get_impl_cls() is TqkvTurboQuantImpl
    assert TqkvTurboQuantBackend.get_builder_cls() is tq.TurboQuantMetadataBuilder
    assert TqkvTurboQuantBackend.supported_kv_cache_dtypes == tq.TurboQuantAttentionBackend.supported_kv_cache_dtypes
    assert TqkvTurboQuantBackend.forward_includes_kv_cache_update is False
    for preset in PRESETS:
        for d in (64, 128, 256):
            assert TqkvTurboQuantBackend.get_kv_cache_shape(7, 16, 4, d, preset) == \
                tq.TurboQuantAttentionBackend.get_kv_cache_shape(7, 16, 4, d, preset)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_slot_sizes_match_vllm(preset, d):
    """The kernels' slot arithmetic (csrc/slot.h) against vLLM's TurboQuantConfig."""
    import torch
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    import tqkv_vllm.ops  # noqa: F401

    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    kb = 8 if cfg.key_fp8 else cfg.key_mse_bits
    assert torch.ops.tqkv_vllm.slot_bytes(kb, cfg.value_quant_bits, d) == cfg.slot_size_aligned
    assert TqkvBackend().get_kv_cache_shape(5, 16, 2, d, preset)[-1] == cfg.slot_size_aligned


def TqkvBackend():
    from tqkv_vllm.backend import TqkvTurboQuantBackend

    return TqkvTurboQuantBackend


def test_ops_trace_under_fake_tensors():
    """torch.compile traces the ops through their fake implementations (tqkv_vllm/ops.py)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tqkv_vllm import ops

    with FakeTensorMode():
        q = torch.empty(2, 8, 128, dtype=torch.bfloat16, device="cuda")
        cache = torch.empty(9, 2, 16, 134, dtype=torch.uint8, device="cuda").transpose(1, 2)
        bt = torch.empty(2, 4, dtype=torch.int32, device="cuda")
        lens = torch.empty(2, dtype=torch.int32, device="cuda")
        cent = torch.empty(16, dtype=torch.float32, device="cuda")
        ws = torch.empty(2, 8, 4, 129, dtype=torch.float32, device="cuda")
        out = torch.empty_like(q)
        assert ops.decode(q, cache, bt, lens, cent, out, ws, 4, 4, True, 0.088, 4) is out
        torch.ops.tqkv_vllm.store(q[:, :2], q[:, :2], cache, lens.long(), None, None, None, 8, 4)
        torch.ops.tqkv_vllm.dequant(cache, bt[0], cent, out, out, 16, 4, 4, True)
    assert ops.MAX_SPLITS >= 32  # vLLM's default tq_max_kv_splits_for_cuda_graph


def test_extension_built_for_another_torch_is_refused(monkeypatch):
    import tqkv_vllm._build_info as info

    monkeypatch.setattr(info, "TORCH_VERSION", "2.99.0+cu999")
    reason = tqkv_vllm.unsupported_reason()
    assert reason is not None and "built against torch 2.99.0" in reason
