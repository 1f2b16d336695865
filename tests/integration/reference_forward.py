#!/usr/bin/env python3
"""Independent reference for the engine's forward pass: a plain NumPy model over a GGUF read
with the PyPI `gguf` package (its own reader and dequantizers, none of tqkv's code). Llama
family (llama, mistral, qwen2) and Gemma 3, written from the models' published definitions
(Hugging Face transformers' modeling_llama / modeling_qwen2 / modeling_gemma3).

    python3 reference_forward.py MODEL.gguf TOKEN_ID [TOKEN_ID ...] -o logits.f32 [--tail N]

writes the logits of every position (or of the last N) as float32 [rows, n_vocab], row-major.
Attention is exact (float64 softmax over the visible positions: all earlier ones, or the
sliding window of Gemma 3's local layers), so this is the f32-cache oracle that
tests/engine/test_model.cpp compares against.
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
    ap.add_argument("--tail", type=int, default=0, help="write only the last N positions' logits")
    a = ap.parse_args()

    r = GGUFReader(a.model)
    arch = field(r, "general.architecture")
    n_layers = int(field(r, f"{arch}.block_count"))
    n_heads = int(field(r, f"{arch}.attention.head_count"))
    n_kv = int(field(r, f"{arch}.attention.head_count_kv", n_heads))
    d = int(field(r, f"{arch}.embedding_length"))
    eps = float(field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))
    base = float(field(r, f"{arch}.rope.freq_base", 10000.0))
    hd = int(field(r, f"{arch}.attention.key_length", d // n_heads))
    gemma = arch == "gemma3"
    if arch not in ("llama", "mistral", "qwen2", "gemma3"):
        sys.exit(f"reference_forward: architecture {arch!r} is not covered")
    tensors = {t.name: t for t in r.tensors}

    def W(name, rows=None):
        t = tensors[name]
        # gguf shapes list ne[0] first; NumPy wants the reverse (rows, cols). t.data holds one
        # row per entry, so a slice of rows dequantizes only those (the 150K+-row vocabularies).
        data = t.data if rows is None else t.data[rows]
        x = quants.dequantize(data, t.tensor_type)
        return np.asarray(x, dtype=np.float64).reshape(-1, int(t.shape[0])) if len(t.shape) == 2 else np.asarray(x, dtype=np.float64)

    def rmsnorm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    toks = np.array(a.tokens)
    n = len(toks)
    pos = np.arange(n, dtype=np.float64)

    def rope_tables(theta):
        inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        ang = pos[:, None] * inv[None, :]  # [n, hd/2]
        return np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x, cs):  # x [n, heads, hd]
        cos, sin = cs
        if arch in ("qwen2", "gemma3"):  # NeoX: rotate (i, i + hd/2)
            x0, x1 = x[..., : hd // 2], x[..., hd // 2:]
            return np.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
        # llama GGUFs pair adjacent coordinates (2i, 2i+1): the converter permuted q/k rows
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    causal = np.triu(np.full((n, n), -np.inf), 1)
    rope_global = rope_tables(base)
    if gemma:
        # Five local layers (sliding window, RoPE base 10000) for every global one. Gemma's
        # RMSNorm multiplies by (1 + w); llama.cpp's converter stores 1 + w in the GGUF.
        window = int(field(r, "gemma3.attention.sliding_window"))
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        local_mask = np.where((j <= i) & (j > i - window), 0.0, -np.inf)
        rope_local = rope_tables(10000.0)

    x = W("token_embd.weight", toks) * (np.sqrt(d) if gemma else 1.0)
    group = n_heads // n_kv
    for l in range(n_layers):
        p = f"blk.{l}."
        local = gemma and (l + 1) % 6 != 0
        mask, cs = (local_mask, rope_local) if local else (causal, rope_global)
        h = rmsnorm(x, W(p + "attn_norm.weight"))
        q = h @ W(p + "attn_q.weight").T
        k = h @ W(p + "attn_k.weight").T
        v = h @ W(p + "attn_v.weight").T
        if p + "attn_q.bias" in tensors:
            q, k, v = q + W(p + "attn_q.bias"), k + W(p + "attn_k.bias"), v + W(p + "attn_v.bias")
        q, k, v = q.reshape(n, n_heads, hd), k.reshape(n, n_kv, hd), v.reshape(n, n_kv, hd)
        if gemma:
            q, k = rmsnorm(q, W(p + "attn_q_norm.weight")), rmsnorm(k, W(p + "attn_k_norm.weight"))
        q, k = rope(q, cs), rope(k, cs)
        o = np.empty((n, n_heads, hd))
        for hh in range(n_heads):
            kv = hh // group
            s = q[:, hh, :] @ k[:, kv, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            o[:, hh, :] = s @ v[:, kv, :]
        o = o.reshape(n, n_heads * hd) @ W(p + "attn_output.weight").T
        if gemma:
            o = rmsnorm(o, W(p + "post_attention_norm.weight"))
        x = x + o
        h = rmsnorm(x, W(p + "ffn_norm.weight"))
        g = h @ W(p + "ffn_gate.weight").T
        u = h @ W(p + "ffn_up.weight").T
        f = ((gelu_tanh(g) if gemma else g / (1 + np.exp(-g))) * u) @ W(p + "ffn_down.weight").T
        if gemma:
            f = rmsnorm(f, W(p + "post_ffw_norm.weight"))
        x = x + f
    if a.tail:
        x = x[-a.tail:]
    h = rmsnorm(x, W("output_norm.weight"))
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    vocab = int(tensors[head].shape[1])
    logits = np.empty((h.shape[0], vocab), dtype=np.float32)
    for r0 in range(0, vocab, 16384):  # the head in slices of rows: bounded memory
        rows = slice(r0, min(vocab, r0 + 16384))
        logits[:, rows] = h @ W(head, rows).T
    logits.tofile(a.out)
    print(f"reference: {n} tokens, {logits.shape[0]} rows of vocab {logits.shape[1]}", file=sys.stderr)


if __name__ == "__main__":
    main()
