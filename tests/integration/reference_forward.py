#!/usr/bin/env python3
"""Independent reference for the engine's forward pass: a plain NumPy Llama over a GGUF read
with the PyPI `gguf` package (its own reader and dequantizers, none of tqkv's code).

    python3 reference_forward.py MODEL.gguf TOKEN_ID [TOKEN_ID ...] -o logits.f32

writes the logits of every position as float32 [n_tokens, n_vocab], row-major. Attention is
exact (float64 softmax over all previous positions), so this is the f32-cache oracle that
tests/engine/reference_test.cpp compares against.
"""
import argparse
import sys

import numpy as np
from gguf import GGUFReader
from gguf import quants


def field(r, key, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    return f.contents()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("tokens", type=int, nargs="+")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()

    r = GGUFReader(a.model)
    arch = field(r, "general.architecture")
    n_layers = int(field(r, f"{arch}.block_count"))
    n_heads = int(field(r, f"{arch}.attention.head_count"))
    n_kv = int(field(r, f"{arch}.attention.head_count_kv", n_heads))
    d = int(field(r, f"{arch}.embedding_length"))
    eps = float(field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))
    base = float(field(r, f"{arch}.rope.freq_base", 10000.0))
    hd = d // n_heads
    tensors = {t.name: t for t in r.tensors}

    def W(name):
        t = tensors[name]
        # gguf shapes list ne[0] first; NumPy wants the reverse (rows, cols).
        x = quants.dequantize(t.data, t.tensor_type)
        return np.asarray(x, dtype=np.float64).reshape([int(s) for s in reversed(t.shape)])

    def rmsnorm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    toks = np.array(a.tokens)
    n = len(toks)
    pos = np.arange(n, dtype=np.float64)
    inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[:, None] * inv[None, :]  # [n, hd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):  # x [n, heads, hd]; llama GGUFs pair adjacent coordinates (2i, 2i+1)
        if arch == "qwen2":
            x0, x1 = x[..., : hd // 2], x[..., hd // 2:]
            return np.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    emb = W("token_embd.weight")
    x = emb[toks]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    group = n_heads // n_kv
    for l in range(n_layers):
        p = f"blk.{l}."
        h = rmsnorm(x, W(p + "attn_norm.weight"))
        q = h @ W(p + "attn_q.weight").T
        k = h @ W(p + "attn_k.weight").T
        v = h @ W(p + "attn_v.weight").T
        if p + "attn_q.bias" in tensors:
            q, k, v = q + W(p + "attn_q.bias"), k + W(p + "attn_k.bias"), v + W(p + "attn_v.bias")
        q = rope(q.reshape(n, n_heads, hd))
        k = rope(k.reshape(n, n_kv, hd))
        v = v.reshape(n, n_kv, hd)
        o = np.empty((n, n_heads, hd))
        for hh in range(n_heads):
            kv = hh // group
            s = q[:, hh, :] @ k[:, kv, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            o[:, hh, :] = s @ v[:, kv, :]
        x = x + o.reshape(n, d) @ W(p + "attn_output.weight").T
        h = rmsnorm(x, W(p + "ffn_norm.weight"))
        g = h @ W(p + "ffn_gate.weight").T
        u = h @ W(p + "ffn_up.weight").T
        x = x + (g / (1 + np.exp(-g)) * u) @ W(p + "ffn_down.weight").T
    h = rmsnorm(x, W("output_norm.weight"))
    head = W("output.weight") if "output.weight" in tensors else emb
    logits = (h @ head.T).astype(np.float32)
    logits.tofile(a.out)
    print(f"reference: {n} tokens, vocab {logits.shape[1]}", file=sys.stderr)


if __name__ == "__main__":
    main()
