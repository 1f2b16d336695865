"""Decode attention side by side on one GPU: tqkv's kernel (the plugin's decode), vLLM's Triton
TurboQuant decode (taken from vLLM, tests/vllm_peer.py) and a bf16 FlashAttention decode over an
uncompressed cache of the same shape, for every preset at batch x context.

tqkv's column is the plugin's default kernel (tensor cores for these GQA groups); the one beside
it, its CUDA-core kernel. Each call is captured in a CUDA graph (as vLLM runs its decode steps)
and replayed; the time is the median of CUDA-event intervals around single replays, with the L2
cache flushed before each.
The caches hold random bytes in vLLM's layout (head-major pages, a scattered block table): the
time of these kernels does not depend on the values.
The bf16 baseline is flash_attn_with_kvcache where the flash-attn package is installed, else
torch's scaled_dot_product_attention (flash backend, GQA) over contiguous K/V; vLLM's own
FlashAttention build needs its compiled wheel and is not staged.

    TQKV_VLLM_PEER=.peer/vllm-0.26.0 python vllm_plugin/bench/bench_decode.py --out bench.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import vllm_peer  # noqa: E402
from tqkv_vllm import ops  # noqa: E402

PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]


def graph_of(fn):
    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_us(g: torch.cuda.CUDAGraph, iters: int, flush: torch.Tensor) -> float:
    times = []
    for _ in range(iters):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def bf16_decode(b, ctx, hq, hk, d, gen):
    """The uncompressed baseline: (callable, name)."""
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    try:
        from flash_attn import flash_attn_with_kvcache

        k = torch.randn(b, ctx, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        return (lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True)), "flash_attn_with_kvcache"
    except ImportError:
        pass
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k = torch.randn(b, hk, ctx, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    qt = q.transpose(1, 2)
    # The first SDPA backend that takes GQA at this shape (no K/V expansion: same bytes as vLLM's).
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        def run(backend=backend):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(qt, k, v, enable_gqa=True)
        try:
            run()
            return run, f"torch SDPA ({backend.name.lower()}, bf16, GQA)"
        except RuntimeError:
            continue
    return (lambda: torch.nn.functional.scaled_dot_product_attention(qt, k, v, enable_gqa=True)), "torch SDPA (bf16)"


def report(rows, version, dev, fa_name, args) -> str:
    head = (f"Decode attention, {dev}, {time.strftime('%Y-%m-%d')}: {args.hq} query / {args.hk} kv heads, head dim "
            f"{args.d}, block size {args.block_size}, bf16 queries; CUDA-graph replays, L2 flushed, median of "
            f"{args.iters} (vLLM Triton: of {max(3, args.iters // 4)}). vLLM {version}; bf16 baseline: {fa_name}.\n\n")
    table = ("| preset | batch | context | tqkv µs | (CUDA cores) | vLLM Triton µs | bf16 µs | × Triton | × bf16 |\n"
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    for r in rows:
        table += (f"| {r['preset']} | {r['batch']} | {r['context']} | {r['tqkv_us']:.1f} | {r['tqkv_scalar_us']:.1f} | "
                  f"{r['vllm_triton_us']:.1f} | {r['bf16_us']:.1f} | {r['vs_triton']:.2f} | {r['vs_bf16']:.2f} |\n")
    return head + table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hk", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="", help="markdown table here (and a .json beside it)")
    args = ap.parse_args()

    peer = vllm_peer.load()
    hq, hk, d, bs = args.hq, args.hk, args.d, args.block_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dev = torch.cuda.get_device_name()
    rows, baseline = [], {}
    for b in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            fa, fa_name = bf16_decode(b, ctx, hq, hk, d, gen)
            baseline[(b, ctx)] = time_us(graph_of(fa), args.iters, flush)
            del fa
            torch.cuda.empty_cache()
            for preset in args.presets.split(","):
                cfg = peer.config.TurboQuantConfig.from_cache_dtype(preset, d)
                kb = 8 if cfg.key_fp8 else cfg.key_mse_bits
                vb, nc = cfg.effective_value_quant_bits, bool(cfg.norm_correction)
                H = peer.hadamard(d, "cuda")
                cent = peer.centroids.get_centroids(d, cfg.centroid_bits).cuda().float()
                pages = math.ceil(ctx / bs)
                nb = b * pages
                raw = torch.randint(0, 256, (nb, hk, bs, cfg.slot_size_aligned), dtype=torch.uint8, device="cuda",
                                    generator=gen)
                cache = raw.transpose(1, 2)
                bt = torch.randperm(nb, device="cuda", generator=gen).to(torch.int32).view(b, pages)
                lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
                q = torch.randn(b, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
                splits = ops.num_splits(b, hk, q.device, cap=32)  # as the plugin: vLLM's split cap
                ws = torch.empty(b, hq, splits, d + 1, dtype=torch.float32, device="cuda")
                out = torch.empty_like(q)
                mid = torch.empty(b, hq, 32, d + 1, dtype=torch.float32, device="cuda")
                obuf = torch.empty_like(q)
                lse = torch.empty(b, hq, dtype=torch.float32, device="cuda")

                def ours(kernel=0):
                    ops.decode(q, cache, bt, lens, cent, out, ws, kb, vb, nc, 1 / math.sqrt(d), splits, kernel)

                def theirs():
                    peer.decode.triton_turboquant_decode_attention(
                        query=q, kv_cache=cache, block_table=bt, seq_lens=lens, Pi=H, centroids=cent,
                        scale=1 / math.sqrt(d), mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
                        value_quant_bits=vb, key_fp8=cfg.key_fp8, norm_correction=nc, PiT=H, mid_o_buf=mid,
                        output_buf=obuf, lse_buf=lse, max_num_kv_splits=32)

                t_ours = time_us(graph_of(ours), args.iters, flush)
                t_scalar = time_us(graph_of(lambda: ours(ops.KERNELS["scalar"])), args.iters, flush)
                t_theirs = time_us(graph_of(theirs), max(3, args.iters // 4), flush)
                t_fa = baseline[(b, ctx)]
                row = dict(preset=preset, batch=b, context=ctx, tqkv_us=t_ours, tqkv_scalar_us=t_scalar,
                           vllm_triton_us=t_theirs, bf16_us=t_fa,
                           vs_triton=t_theirs / t_ours, vs_bf16=t_fa / t_ours, splits=splits,
                           cache_gb=raw.numel() / 1e9)
                rows.append(row)
                if args.out:  # after every row, so that a run cut short keeps what it measured
                    Path(args.out).write_text(report(rows, peer.version, dev, fa_name, args))
                    Path(args.out).with_suffix(".json").write_text(json.dumps(dict(device=dev, rows=rows), indent=1))
                print(f"{preset:20s} B={b:3d} ctx={ctx:6d}  tqkv {t_ours:9.1f} us ({t_scalar:9.1f})  "
                      f"vLLM Triton {t_theirs:10.1f} us  bf16 {t_fa:9.1f} us  {row['vs_triton']:6.2f}x Triton  "
                      f"{row['vs_bf16']:5.2f}x bf16", flush=True)
                raw = cache = None  # frees the cache before the next one (the closures hold the names)
                torch.cuda.empty_cache()

    print(report(rows, peer.version, dev, fa_name, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
