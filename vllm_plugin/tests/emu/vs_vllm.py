"""tqkv's kernels against vLLM's own Triton kernels, both on the CPU, on the same tensors: tqkv's
run by emu.h (every CUDA thread a std::thread, built here as a shared library from
emu_capi.cpp), vLLM's by Triton's interpreter (TRITON_INTERPRET=1), taken from the installed
vLLM (or TQKV_VLLM_PEER). Every preset at head dims 64, 128, 256:
  store    the bytes of the whole cache identical (both divide in IEEE here: Triton's interpreter
           in NumPy, tqkv's host build; on the GPU both use div.full.f32); FP8 keys are held to
           torch's round-to-nearest-even cast, as the interpreter's FP8 cast is not the GPU's;
  decode   within bf16 tolerance of vLLM's decode (scattered pages, GQA 2, one and three splits,
           the CUDA-core and the tensor-core kernel);
  dequant  within fp16 tolerance of vLLM's _tq_full_dequant_kv followed by its rotation.
This is where the byte contract is checked without a GPU; the GPU run
(tests/test_vs_vllm_gpu.py) is the one that counts for the sm_90 instructions and CUDA graphs.
    python vllm_plugin/tests/emu/vs_vllm.py          (g++ with C++20 and the CUDA headers)
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import ctypes  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

# vLLM switches Triton off where no GPU driver is active (vllm.triton_utils hands out
# placeholders); the interpreter needs no driver, so vLLM's kernel files get Triton itself.
import vllm.triton_utils as _tu  # noqa: E402

_tu.triton, _tu.tl, _tu.HAS_TRITON = triton, tl, True
import vllm_peer  # noqa: E402

PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]


def build_library() -> ctypes.CDLL:
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    out = Path(os.environ.get("TQKV_EMU_LIB", "/tmp/libtqkv_vllm_emu.so"))
    srcs = [HERE / "emu_capi.cpp", HERE / "emu.h", *(HERE.parent.parent / "csrc").glob("*.*")]
    if not out.exists() or out.stat().st_mtime < max(s.stat().st_mtime for s in srcs):
        subprocess.run(["g++", "-std=c++20", "-O2", "-pthread", "-shared", "-fPIC", "-Wno-attributes",
                        "-Wno-unknown-pragmas", f"-I{cuda}/include", f"-I{HERE.parent.parent / 'csrc'}",
                        str(HERE / "emu_capi.cpp"), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    for f in (lib.tqkv_emu_store, lib.tqkv_emu_decode, lib.tqkv_emu_dequant):
        f.restype = ctypes.c_int
    return lib


P = ctypes.c_void_p
I64, I32, F32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float


def ptr(t: torch.Tensor):
    return P(t.data_ptr())


def cache_args(view: torch.Tensor):
    """A [blocks, block_size, heads, slot] uint8 view: pointer, byte strides, block size, heads."""
    return [ptr(view), I64(view.stride(0)), I64(view.stride(1)), I64(view.stride(2)), I32(view.shape[1]),
            I32(view.shape[2])]


class Case:
    def __init__(self, peer, preset: str, d: int):
        self.peer, self.d = peer, d
        self.cfg = peer.config.TurboQuantConfig.from_cache_dtype(preset, d)
        self.kb = 8 if self.cfg.key_fp8 else self.cfg.key_mse_bits
        self.vb = self.cfg.effective_value_quant_bits
        self.nc = bool(self.cfg.norm_correction)
        self.H = peer.hadamard(d, "cpu")
        self.cent = peer.centroids.get_centroids(d, self.cfg.centroid_bits).float()
        c_sorted, _ = self.cent.sort()
        self.mids = (c_sorted[:-1] + c_sorted[1:]) / 2

    def vllm_store(self, k, v, view, slots):
        self.peer.store.triton_turboquant_store(k, v, view, slots, self.H, self.mids, mse_bits=self.cfg.key_mse_bits,
                                                key_packed_size=self.cfg.key_packed_size, value_quant_bits=self.vb,
                                                key_fp8=self.cfg.key_fp8)

    def tqkv_store(self, lib, k, v, view, slots):
        n, hk, d = k.shape
        kf = k.float().reshape(n * hk, d)  # what tqkv_vllm.ops.store computes before its kernel
        norms = kf.norm(dim=1, keepdim=True)
        y = ((kf / (norms + 1e-8)) @ self.H).contiguous()
        kc, vc = k.float().contiguous(), v.float().contiguous()
        rc = lib.tqkv_emu_store(*cache_args(view), I32(n), ptr(slots), ptr(kc), ptr(vc), ptr(y),
                                ptr(norms.squeeze(1).contiguous()), ptr(self.mids), I32(self.kb), I32(self.vb),
                                I32(d))
        assert rc == 0


def kv(n, hq, hk, d, gen):
    qkv = torch.randn(n, (hq + 2 * hk) * d, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
    qkv = qkv.bfloat16()
    return (qkv[:, :hq * d].view(n, hq, d), qkv[:, hq * d:(hq + hk) * d].view(n, hk, d),
            qkv[:, (hq + hk) * d:].view(n, hk, d))


def check_store(lib, case: Case) -> str:
    gen = torch.Generator().manual_seed(case.d + case.kb)
    nb, bs, hk, n = 8, 16, 2, 60
    raw = torch.randint(0, 256, (nb, hk, bs, case.cfg.slot_size_aligned), dtype=torch.uint8, generator=gen)
    _, k, v = kv(n, 4, hk, case.d, gen)
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[::7] = -1
    a, b = raw.clone(), raw.clone()
    case.vllm_store(k, v, a.transpose(1, 2), slots)
    case.tqkv_store(lib, k, v, b.transpose(1, 2), slots)
    assert not torch.equal(a, raw)
    note = ""
    if case.cfg.key_fp8:
        # Triton's interpreter casts float32 -> float8e4nv with another rounding than the GPU's
        # cvt.rn.satfinite.e4m3x2.f32 (seen: about 8% of the bytes), so the FP8 keys are held
        # to torch's round-to-nearest-even cast, which that instruction computes in range.
        fp8 = k.float().to(torch.float8_e4m3fn).view(torch.uint8)
        interp_off = 0
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                field = a.transpose(1, 2)[s // bs, s % bs, :, :case.d]
                interp_off += int((field != fp8[t]).sum())
                field.copy_(fp8[t])
        note = f" (FP8 keys held to torch's cast; the interpreter's differ in {interp_off} bytes)"
    diff = int((a != b).sum())
    return f"store {diff} bytes differ{note}" if diff else ""


def filled(case: Case, lens, hk, bs, gen):
    pages = [math.ceil(n / bs) for n in lens]
    nb = sum(pages) + 3
    raw = torch.randint(0, 256, (nb, hk, bs, case.cfg.slot_size_aligned), dtype=torch.uint8, generator=gen)
    perm = torch.randperm(nb, generator=gen).tolist()
    bt = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
    it = iter(perm)
    for i, p in enumerate(pages):
        for j in range(p):
            bt[i, j] = next(it)
    for i, n in enumerate(lens):
        _, k, v = kv(n, 4, hk, case.d, gen)
        pos = torch.arange(n)
        case.vllm_store(k, v, raw.transpose(1, 2), bt[i, pos // bs].long() * bs + pos % bs)
    return raw, bt


def check_decode(lib, case: Case) -> str:
    gen = torch.Generator().manual_seed(10 * case.d + case.vb)
    hk, group, bs, lens = 2, 2, 16, [1, 40, 77]
    raw, bt = filled(case, lens, hk, bs, gen)
    hq, d = hk * group, case.d
    q = torch.randn(len(lens), hq, d, generator=gen).bfloat16()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    view = raw.transpose(1, 2)
    theirs = case.peer.decode.triton_turboquant_decode_attention(
        query=q, kv_cache=view, block_table=bt, seq_lens=lens_t, Pi=case.H, centroids=case.cent,
        scale=1 / math.sqrt(d), mse_bits=case.cfg.key_mse_bits, key_packed_size=case.cfg.key_packed_size,
        value_quant_bits=case.vb, key_fp8=case.cfg.key_fp8, norm_correction=case.nc, PiT=case.H,
        max_num_kv_splits=4)
    errs = []
    for kernel, splits in ((1, 1), (1, 3), (2, 1), (2, 3)):  # 1: CUDA-core kernel, 2: tensor cores
        out = torch.full((len(lens), hq, d), float("nan"))
        ws = torch.empty(len(lens), hq, splits, d + 1)
        qf = q.float().contiguous()
        rc = lib.tqkv_emu_decode(*cache_args(view), ptr(qf), ptr(out), ptr(bt), I64(bt.stride(0)), ptr(lens_t),
                                 ptr(case.cent), ptr(ws), I32(len(lens)), I32(hq), I32(splits), F32(1 / math.sqrt(d)),
                                 I32(int(case.nc)), I32(case.kb), I32(case.vb), I32(d), I32(kernel))
        assert rc == 0
        err = (out - theirs.float()).abs().max().item()
        if not err <= 2e-2 * max(1.0, theirs.float().abs().max().item()):
            errs.append(f"decode kernel={kernel} splits={splits}: max err {err:.3g}")
    return "; ".join(errs)


def check_dequant(lib, case: Case) -> str:
    gen = torch.Generator().manual_seed(case.d + 99)
    hk, bs, n, d = 2, 16, 50, case.d
    raw, bt = filled(case, [n], hk, bs, gen)
    view = raw.transpose(1, 2)
    alloc = math.ceil(n / bs) * bs
    k_buf = torch.zeros(1, hk, alloc, d, dtype=torch.float16)
    v_buf = torch.zeros_like(k_buf)
    cfg, row = case.cfg, bt[0:1]
    case.peer.decode._tq_full_dequant_kv[(alloc, hk)](
        view, row, case.cent, k_buf, v_buf, k_buf.stride(0), k_buf.stride(1), k_buf.stride(2), v_buf.stride(0),
        v_buf.stride(1), v_buf.stride(2), view.stride(0), view.stride(1), view.stride(2), row.stride(0), HEAD_DIM=d,
        BLOCK_SIZE=bs, NUM_KV_HEADS=hk, MSE_BYTES=d if cfg.key_fp8 else math.ceil(d * cfg.key_mse_bits / 8),
        KPS=cfg.key_packed_size, VQB=case.vb, VAL_DATA_BYTES=math.ceil(d * case.vb / 8), MSE_BITS=cfg.key_mse_bits,
        KEY_FP8=int(cfg.key_fp8), BLOCK_D=d, NORM_CORRECTION=int(case.nc), FP8_E4B15=0)
    k_ref = k_buf[0, :, :n].float()
    if not cfg.key_fp8:
        k_ref = k_ref @ case.H
    k_ref, v_ref = k_ref.transpose(0, 1), v_buf[0, :, :n].float().transpose(0, 1)
    k_out = torch.empty(n, hk, d)
    v_out = torch.empty_like(k_out)
    rc = lib.tqkv_emu_dequant(*cache_args(view), ptr(row), ptr(case.cent), I32(n), I32(int(case.nc)), ptr(k_out),
                              ptr(v_out), I32(case.kb), I32(case.vb), I32(d))
    assert rc == 0
    ek, ev = (k_out - k_ref).abs().max().item(), (v_out - v_ref).abs().max().item()
    mk, mv = k_ref.abs().max().item(), v_ref.abs().max().item()
    bad = []
    if not ek <= 2e-3 * max(1.0, mk):
        bad.append(f"dequant keys max err {ek:.3g}")
    if not ev <= 2e-3 * max(1.0, mv):
        bad.append(f"dequant values max err {ev:.3g}")
    return "; ".join(bad)


def main() -> int:
    peer = vllm_peer.load()
    lib = build_library()
    failures = 0
    for preset in PRESETS:
        for d in (64, 128, 256):
            case = Case(peer, preset, d)
            problems = [p for p in (check_store(lib, case), check_decode(lib, case), check_dequant(lib, case)) if p]
            failures += bool(problems)
            print(f"{preset:20s} d={d:3d}: {'; '.join(problems) or 'ok'}", flush=True)
    print(f"vLLM {peer.version}: {12 - failures}/12 (preset, head dim) pairs agree")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
