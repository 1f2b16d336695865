#!/usr/bin/env python3
"""Writes two tiny random GGUF models for the engine's architecture tests:

  tiny_llama.gguf  llama, weights in Q4_K, Q6_K, Q5_0, Q5_1, Q8_0, F16 (adjacent-pair RoPE)
  tiny_qwen2.gguf  qwen2, Q/K/V biases, weights in Q4_0, Q4_1, BF16, F32 (NeoX-halves RoPE),
                   with an untied output.weight

    python3 make_tiny_models.py OUT_DIR

tests/engine/test_model.cpp runs them through the engine and through reference_forward.py.
Generated at test time, not stored: the weights are seeded random numbers.
"""
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import quants

D, HEADS, KV_HEADS, FF, VOCAB, LAYERS = 256, 4, 2, 256, 256, 2
HD = D // HEADS


def write(path, arch, types, bias, tied):
    rng = np.random.default_rng(11 if arch == "llama" else 12)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)

    def mat(name, rows, cols, qtype, scale=None):
        x = (rng.standard_normal((rows, cols)) * (scale or 1.0 / np.sqrt(cols))).astype(np.float32)
        if qtype == T.F32:
            w.add_tensor(name, x)
        elif qtype == T.F16:
            w.add_tensor(name, x.astype(np.float16))
        elif qtype in (T.Q4_K, T.Q6_K):
            # No quantizer for K-quants in the gguf package: random codes with small scales.
            block = 144 if qtype == T.Q4_K else 210
            raw = rng.integers(0, 256, size=(rows, cols // 256 * block), dtype=np.uint8)
            offs = (0, 2) if qtype == T.Q4_K else (208,)
            s = 0.02 / np.sqrt(cols / 256)
            for b in range(cols // 256):
                for o in offs:
                    raw[:, b * block + o: b * block + o + 2] = np.array([s], dtype=np.float16).view(np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)
        else:
            w.add_tensor(name, quants.quantize(x, qtype), raw_dtype=qtype)

    def vec(name, n, base):
        w.add_tensor(name, (base + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", VOCAB, D, types[0], scale=1.0)
    vec("output_norm.weight", D, 1.0)
    if not tied:
        mat("output.weight", VOCAB, D, types[1])
    for l in range(LAYERS):
        p = f"blk.{l}."
        t = types[(l + 1) % len(types):] + types[:(l + 1) % len(types)]
        vec(p + "attn_norm.weight", D, 1.0)
        vec(p + "ffn_norm.weight", D, 1.0)
        mat(p + "attn_q.weight", D, D, t[0])
        mat(p + "attn_k.weight", KV_HEADS * HD, D, t[1])
        mat(p + "attn_v.weight", KV_HEADS * HD, D, t[2])
        mat(p + "attn_output.weight", D, D, t[3])
        mat(p + "ffn_gate.weight", FF, D, t[4 % len(t)])
        mat(p + "ffn_up.weight", FF, D, t[5 % len(t)])
        mat(p + "ffn_down.weight", D, FF, t[6 % len(t)])
        if bias:
            vec(p + "attn_q.bias", D, 0.0)
            vec(p + "attn_k.bias", KV_HEADS * HD, 0.0)
            vec(p + "attn_v.bias", KV_HEADS * HD, 0.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


out = sys.argv[1]
os.makedirs(out, exist_ok=True)
write(os.path.join(out, "tiny_llama.gguf"), "llama", [T.Q8_0, T.Q4_K, T.Q6_K, T.Q5_0, T.Q5_1, T.F16], False, True)
write(os.path.join(out, "tiny_qwen2.gguf"), "qwen2", [T.F32, T.Q4_0, T.Q4_1, T.BF16], True, False)
