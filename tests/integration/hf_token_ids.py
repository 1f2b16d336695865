#!/usr/bin/env python3
"""Independent tokenizer reference: Hugging Face `tokenizers` built from a GGUF's vocabulary
and merges (read with the PyPI `gguf` package), none of tqkv's code.

    python3 hf_token_ids.py MODEL.gguf TEXT_FILE [TEXT_FILE ...] -o OUT

writes the ids of the i-th file's text (plain text: no special tokens, no BOS) as int32 to
OUT.i (one tokenizer build for all the files). Supports
byte-level BPE with the pre-tokenizers tqkv implements (tokenizer.ggml.pre: the GPT-2 rule,
"smollm" (digits isolated first) and "qwen2"), each set up as the model's own tokenizer.json
does.
"""
import argparse
import sys

import numpy as np
from gguf import GGUFReader
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def field(r, key, default=None):
    f = r.fields.get(key)
    return default if f is None else f.contents()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("texts", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    r = GGUFReader(a.model)
    kind = field(r, "tokenizer.ggml.model")
    pre = field(r, "tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        sys.exit(f"hf_token_ids: tokenizer model {kind!r} is not covered")
    tokens = field(r, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
        split = [pre_tokenizers.Split(Regex(QWEN2), behavior="isolated", invert=False)]
    elif pre == "smollm":
        split = [pre_tokenizers.Digits(individual_digits=True),
                 pre_tokenizers.Split(Regex(GPT2), behavior="isolated", invert=False)]
    else:
        split = [pre_tokenizers.Split(Regex(GPT2), behavior="isolated", invert=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(split + [byte_level])
    tok.decoder = decoders.ByteLevel()
    for i, path in enumerate(a.texts):
        text = open(path, encoding="utf-8").read()
        ids = tok.encode(text, add_special_tokens=False).ids
        np.asarray(ids, dtype=np.int32).tofile(f"{a.out}.{i}")
        print(f"hf_token_ids: {path}: {len(ids)} tokens ({pre})", file=sys.stderr)


if __name__ == "__main__":
    main()
