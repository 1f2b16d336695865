#!/usr/bin/env python3
"""Writes the seed inputs of the GGUF fuzzers, so that each starts from deep inside its format:

  gguf   tests/engine/fuzz_corpus/: small valid files that reach every metadata type, array
         kind, tensor type and the tokenizer loader (fuzz_gguf.cpp)
  model  tests/engine/fuzz_corpus_model/: whole tiny models that load (fuzz_model.cpp): Llama
         in F32 and in every 32-element block type, Qwen2 with biases, a sliding window and
         YaRN, Llama 3's rope_freqs, Gemma 3, and the K-quants

Regenerate: python3 tests/integration/make_fuzz_seeds.py [gguf] [model]   (both by default)
"""
import sys
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import quants

out_dir = os.path.join(os.path.dirname(__file__), "..", "engine", "fuzz_corpus")
rng = np.random.default_rng(5)


def write(name, fill):
    path = os.path.join(out_dir, name)
    w = gguf.GGUFWriter(path, "llama")
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def kv_types(w):
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 1.5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 2.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "h\u00e9")
    w.add_array("t.arr_i", [1, 2, 3])
    w.add_array("t.arr_f", [0.5, 1.5])
    w.add_array("t.arr_s", ["a", "bc"])
    w.add_array("t.arr_b", [True, False])


def tiny_model(w):
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.embedding_length", 32)
    w.add_uint32("llama.attention.head_count", 2)
    w.add_uint32("llama.feed_forward_length", 64)
    w.add_uint32("llama.context_length", 64)
    toks = ["<|im_end|>", "a", "b", "\u0120", "ab", "\u0120a"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(toks)
    w.add_token_types([3, 1, 1, 1, 1, 1])
    w.add_token_merges(["a b", "\u0120 a"])
    w.add_eos_token_id(0)
    w.add_chat_template("{{'<|im_start|>' + message['content'] + '<|im_end|>'}}")
    x = rng.standard_normal((2, 256)).astype(np.float32)
    w.add_tensor("token_embd.weight", x[:, :32].copy())
    for t in (T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        w.add_tensor("w." + t.name, quants.quantize(x, t) if t != T.F16 else x.astype(np.float16), raw_dtype=t)
    for t, block in ((T.Q4_K, 144), (T.Q6_K, 210)):
        raw = rng.integers(0, 256, size=(2, block), dtype=np.uint8)
        w.add_tensor("w." + t.name, raw, raw_dtype=t)


def spm_model(w):
    toks = ["<unk>", "<s>", "</s>", "<0x41>", "\u2581", "h", "\u2581h"]
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_types([2, 3, 3, 6, 1, 1, 1])
    w.add_token_scores([0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -1.5])
    w.add_bos_token_id(1)


# --- model seeds ---------------------------------------------------------------------------
model_dir = os.path.join(os.path.dirname(__file__), "..", "engine", "fuzz_corpus_model")
HEADS, KV, VOCAB = 2, 1, 8  # the fuzzer works best on small inputs: few, narrow tensors


def model_seed(name, arch, types, layers=1, d=32, ff=32, bias=False, tied=True, gemma=False, down=None, extra=None):
    """A tiny whole model: matrix weights in `types` (cycled; ffn_down in `down` if given), F32
    norms, a GPT-2 tokenizer; `extra(writer)` adds metadata. Block types need d and ff in
    multiples of 32 (256 for the K-quants' ffn_down)."""
    D, HD = d, d // HEADS
    rng = np.random.default_rng(len(name))
    path = os.path.join(model_dir, name)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(ff)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-6)
    if extra:
        extra(w)
    toks = ["<|im_end|>", "a", "b", "\u0120", "ab", "\u0120a", "h", "1"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(toks)
    w.add_token_types([3, 1, 1, 1, 1, 1, 1, 1])
    w.add_token_merges(["a b", "\u0120 a"])
    w.add_eos_token_id(0)
    it = iter(range(10 ** 6))

    def mat(tname, rows, cols, t=None):
        t = t or types[next(it) % len(types)]
        x = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        if t == T.F32:
            w.add_tensor(tname, x)
        elif t == T.F16:
            w.add_tensor(tname, x.astype(np.float16))
        elif t in (T.Q4_K, T.Q6_K):  # no K-quant quantizer in the gguf package: random codes, small scales
            block = 144 if t == T.Q4_K else 210
            raw = rng.integers(0, 256, size=(rows, cols // 256 * block), dtype=np.uint8)
            for b in range(cols // 256):
                for o in ((0, 2) if t == T.Q4_K else (208,)):
                    raw[:, b * block + o: b * block + o + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
            w.add_tensor(tname, raw, raw_dtype=t)
        else:
            w.add_tensor(tname, quants.quantize(x, t), raw_dtype=t)

    def vec(tname, n, base=1.0):
        w.add_tensor(tname, (base + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", VOCAB, D)
    vec("output_norm.weight", D)
    if not tied:
        mat("output.weight", VOCAB, D)
    for l in range(layers):
        p = f"blk.{l}."
        vec(p + "attn_norm.weight", D)
        mat(p + "attn_q.weight", HEADS * HD, D)
        mat(p + "attn_k.weight", KV * HD, D)
        mat(p + "attn_v.weight", KV * HD, D)
        mat(p + "attn_output.weight", D, HEADS * HD)
        vec(p + "ffn_norm.weight", D)
        mat(p + "ffn_gate.weight", ff, D)
        mat(p + "ffn_up.weight", ff, D)
        mat(p + "ffn_down.weight", D, ff, down)
        if bias:
            vec(p + "attn_q.bias", HEADS * HD, 0.0)
            vec(p + "attn_k.bias", KV * HD, 0.0)
            vec(p + "attn_v.bias", KV * HD, 0.0)
        if gemma:
            vec(p + "attn_q_norm.weight", HD)
            vec(p + "attn_k_norm.weight", HD)
            vec(p + "post_attention_norm.weight", D)
            vec(p + "post_ffw_norm.weight", D)
    if arch == "llama" and "rope_freqs" in name:
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, HD // 2).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_model_seeds():
    os.makedirs(model_dir, exist_ok=True)
    model_seed("seed_llama_f32.gguf", "llama", [T.F32], d=8, ff=16)

    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(2.0)
        w.add_key_length(16)

    model_seed("seed_llama_blocks.gguf", "llama", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.F16, T.BF16], layers=2,
               tied=False, extra=linear)

    def window_yarn(w):
        w.add_sliding_window(16)
        w.add_sliding_window_pattern([True, False])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(32)
        w.add_rope_dimension_count(16)

    model_seed("seed_qwen2_window_yarn.gguf", "qwen2", [T.Q4_0, T.Q8_0], layers=2, bias=True, tied=False,
               extra=window_yarn)
    model_seed("seed_llama_rope_freqs.gguf", "llama", [T.F16], d=16, ff=16,
               extra=lambda w: w.add_rope_freq_base(500000.0))

    def gemma(w):
        w.add_sliding_window(8)
        w.add_rope_freq_base_swa(10000.0)

    model_seed("seed_gemma3.gguf", "gemma3", [T.Q4_0, T.F16], gemma=True, extra=gemma)
    model_seed("seed_llama_q4_k.gguf", "llama", [T.Q4_0], ff=256, down=T.Q4_K)
    model_seed("seed_llama_q6_k.gguf", "llama", [T.Q4_0], ff=256, down=T.Q6_K)
    print("model seeds in", os.path.normpath(model_dir))


kinds = sys.argv[1:] or ["gguf", "model"]
if "gguf" in kinds:
    os.makedirs(out_dir, exist_ok=True)
    write("seed_kv_types.gguf", kv_types)
    write("seed_tiny_model.gguf", tiny_model)
    write("seed_spm.gguf", spm_model)
    # Version 2 has the same layout as 3 for little-endian files: patch the version field.
    p = write("seed_v2.gguf", spm_model)
    with open(p, "r+b") as f:
        f.seek(4)
        f.write((2).to_bytes(4, "little"))
    # A file that stops in the middle of the tensor table.
    with open(os.path.join(out_dir, "seed_tiny_model.gguf"), "rb") as f:
        data = f.read()
    with open(os.path.join(out_dir, "seed_truncated.gguf"), "wb") as f:
        f.write(data[: len(data) // 3])
    print("seeds in", os.path.normpath(out_dir))
if "model" in kinds:
    write_model_seeds()
