#!/usr/bin/env python3
"""PyTorch bf16 SDPA (enable_gqa=True) decode timings on the shapes of bench_cuda.cpp.

Prints CSV lines `d,n_q_heads,n_kv_heads,batch,ctx,microseconds` (median of 20 runs, L2 flushed
before each, CUDA events) for tqkv_cuda_bench --sdpa.
"""
import statistics
import sys

import torch
import torch.nn.functional as F


def shapes():
    for d, hq, hkv in ((128, 32, 8), (64, 9, 3), (256, 4, 1)):
        for batch in (1, 16, 64):
            for ctx in (4096, 32768):
                yield d, hq, hkv, batch, ctx


def main():
    torch.manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}", file=sys.stderr)
    for d, hq, hkv, batch, ctx in shapes():
        q = torch.randn(batch, hq, 1, d, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(batch, hkv, ctx, d, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(batch, hkv, ctx, d, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        times = []
        for _ in range(20):
            flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1000.0)
        print(f"{d},{hq},{hkv},{batch},{ctx},{statistics.median(times):.1f}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
