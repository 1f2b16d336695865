#!/usr/bin/env python3
"""Writes the seed inputs of the GGUF fuzzer into tests/engine/fuzz_corpus/: small valid
files that reach every metadata type, array kind, tensor type and the tokenizer loader, so
the fuzzer starts from deep inside the format. Regenerate: python3 tests/integration/make_fuzz_seeds.py
"""
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import quants

out_dir = os.path.join(os.path.dirname(__file__), "..", "engine", "fuzz_corpus")
os.makedirs(out_dir, exist_ok=True)
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
