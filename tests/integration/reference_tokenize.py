#!/usr/bin/env python3
"""Independent tokenizer references built from a GGUF's tokenizer metadata (read with the
PyPI `gguf` package), none of tqkv's code:
  - byte-level BPE ("gpt2"): Hugging Face `tokenizers` from the vocabulary and merges;
  - SentencePiece ("llama"): Google's `sentencepiece` from a model proto of the pieces,
    scores and types (BPE with byte fallback, user-defined pieces kept whole).

    python3 reference_tokenize.py MODEL.gguf TEXT_FILE [TEXT_FILE ...] -o OUT

writes the ids of the i-th file's text (plain text: no special tokens, no BOS) as int32 to
OUT.i (one tokenizer build for all the files). Supports
byte-level BPE with the pre-tokenizers tqkv implements (tokenizer.ggml.pre: the GPT-2 rule,
"smollm" (digits isolated first) and "qwen2"), each set up as the model's own tokenizer.json
does, and SentencePiece BPE as Gemma's tokenizer.model is (identity normalisation, spaces
escaped to U+2581, the dummy prefix as tokenizer.ggml.add_space_prefix says).
"""
import argparse
import sys

import numpy as np
from gguf import GGUFReader

GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def field(r, key, default=None):
    f = r.fields.get(key)
    return default if f is None else f.contents()


def sentencepiece_encoder(r):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id = int(field(r, "tokenizer.ggml.unknown_token_id", 0))
    m.trainer_spec.bos_id = int(field(r, "tokenizer.ggml.bos_token_id", -1))
    m.trainer_spec.eos_id = int(field(r, "tokenizer.ggml.eos_token_id", -1))
    m.trainer_spec.pad_id = int(field(r, "tokenizer.ggml.padding_token_id", -1))
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = bool(field(r, "tokenizer.ggml.add_space_prefix", True))
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for text, score, typ in zip(field(r, "tokenizer.ggml.tokens"), field(r, "tokenizer.ggml.scores"),
                                field(r, "tokenizer.ggml.token_type")):
        if typ == 4:  # llama.cpp's converter wrote user-defined pieces with U+2581 as spaces
            text = text.replace(" ", "\u2581")
        p = m.pieces.add()
        p.piece, p.score, p.type = text, score, typ  # gguf token types are SentencePiece's
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(m.SerializeToString())
    return lambda text: sp.encode(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("texts", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    r = GGUFReader(a.model)
    kind = field(r, "tokenizer.ggml.model")
    pre = field(r, "tokenizer.ggml.pre", "default")
    if kind == "llama":
        encode, pre = sentencepiece_encoder(r), "sentencepiece"
    elif kind != "gpt2":
        sys.exit(f"reference_tokenize: tokenizer model {kind!r} is not covered")
    else:
        encode = gpt2_encoder(r, pre)
    for i, path in enumerate(a.texts):
        text = open(path, encoding="utf-8").read()
        ids = encode(text)
        np.asarray(ids, dtype=np.int32).tofile(f"{a.out}.{i}")
        print(f"reference_tokenize: {path}: {len(ids)} tokens ({pre})", file=sys.stderr)


def gpt2_encoder(r, pre):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

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
    return lambda text: tok.encode(text, add_special_tokens=False).ids


if __name__ == "__main__":
    main()
