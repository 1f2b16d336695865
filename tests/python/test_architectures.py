"""Every architecture feature the engine claims, held logit by logit to transformers.

Each case is a tiny random-weight model built from a config with transformers (no download),
saved, converted to GGUF by llama.cpp's own converter (scripts/fetch_llama_converter.sh puts it
in build/llama-converter; TQKV_LLAMA_CONVERTER names another folder), and run by the engine
(`tqkv logits`, f32 cache, CPU) at every position of a few hundred tokens: its log-probabilities
must equal transformers' (eager attention, float32) within TOL. The engine runs each model as one
prefill, in chunks, and one decode step at a time, so every path it takes is checked.

Needs torch, transformers and sentencepiece (skipped without them, a failure when
TQKV_REQUIRE_TORCH=1, as CI sets), the converter and the tqkv CLI (TQKV_CLI, else
build/release/tqkv).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, find_cli, require_module

torch = require_module("torch")
transformers = require_module("transformers")
spm = require_module("sentencepiece")

N_TOKENS = 300
# float32 on both sides, the same weights: what is left is summation order and transformers forming
# RoPE angles in float32 — 1.4e-5 to 3.2e-4 in log-probabilities across the cases, measured. A wrong RoPE
# frequency, scale or window moves them by 0.1-20 nats (see test_scaling_is_seen).
TOL = 1e-3
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which "
         "but have an they you were her she there been one all we their has would when if so no what up "
         "out who them some more into only time these two may first then do any like my now over such "
         "our man me even most made after also did many off before must well back through years much "
         "where your way down should because each just those people how too little state good very make "
         "world still own see men work long get here between both life being under never day same another "
         "know while last might us great old year off come since against go came right used take three").split()


def converter_dir():
    path = os.environ.get("TQKV_LLAMA_CONVERTER") or os.path.join(REPO, "build", "llama-converter")
    if os.path.exists(os.path.join(path, "convert_hf_to_gguf.py")):
        return path
    msg = f"llama.cpp's converter is not in {path} (bash scripts/fetch_llama_converter.sh fetches it)"
    if os.environ.get("TQKV_REQUIRE_TORCH") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory):
    """A small SentencePiece model (BPE, byte fallback) trained on seeded word salad: the
    converter needs a tokenizer; the logits are compared on token ids, so any one serves."""
    d = tmp_path_factory.mktemp("spm")
    rng = np.random.default_rng(5)
    text = d / "text.txt"
    text.write_text("\n".join(" ".join(rng.choice(WORDS, 12)) for _ in range(2000)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(d / "tokenizer"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, minloglevel=2)
    return d / "tokenizer.model"


def randomize(model, seed, qk_gain=3.0):
    """Weights of unit-scale activations (transformers' init, std 0.02, leaves attention nearly
    uniform and RoPE almost invisible): N(0, 1/fan_in) matrices, q/k ones `qk_gain` times larger
    so attention is sharp, norms 1 +- 0.2."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                base = 0.0 if "norm" in name and model.config.model_type.startswith("gemma") else 1.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name else
                        0.5 * torch.randn(p.shape, generator=g))
            else:
                gain = qk_gain if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * gain / np.sqrt(p.shape[1]))


# Two layers of 4 heads over 2 kv heads, d 128; each family's defaults on top, each case's on those.
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 4096}


def llama(**kw):
    return transformers.LlamaConfig(**{**SHAPE, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                                       "rope_theta": 10000.0, **kw})


def mistral(**kw):
    return transformers.MistralConfig(**{**SHAPE, "num_attention_heads": 8, "sliding_window": None,
                                         "rope_theta": 1e6, **kw})


def qwen2(**kw):
    return transformers.Qwen2Config(**{**SHAPE, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                                       "rope_theta": 1e6, **kw})


def gemma3(**kw):
    # Seven layers: the sixth is global, the others slide over 48 positions.
    return transformers.Gemma3TextConfig(**{**SHAPE, "num_hidden_layers": 7, "num_key_value_heads": 1,
                                            "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 48,
                                            "rms_norm_eps": 1e-6, "rope_theta": 1e6, **kw})


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 128}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
LINEAR = {"rope_type": "linear", "factor": 4.0}

# name -> (config factory, transformers class, the factory's arguments)
CASES = {
    "llama": (llama, "LlamaForCausalLM", {}),
    "llama3_scaling": (llama, "LlamaForCausalLM", {"rope_theta": 500000.0, "rope_scaling": LLAMA3}),
    "llama_linear": (llama, "LlamaForCausalLM", {"rope_scaling": LINEAR}),
    "llama_yarn": (llama, "LlamaForCausalLM", {"rope_scaling": YARN}),
    "llama_mha": (llama, "LlamaForCausalLM", {"num_key_value_heads": 4}),
    "llama_mqa_tied": (llama, "LlamaForCausalLM", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "mistral": (mistral, "MistralForCausalLM", {}),
    "qwen2_bias_tied": (qwen2, "Qwen2ForCausalLM", {}),
    "qwen2_untied": (qwen2, "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "qwen2_yarn": (qwen2, "Qwen2ForCausalLM", {"rope_scaling": YARN}),
    "gemma3": (gemma3, "Gemma3ForCausalLM", {}),
    "gemma3_linear": (gemma3, "Gemma3ForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
}


def hf_model(name, vocab, bos, eos, scaled=True):
    """The case's transformers model (eval, float32, eager attention), seeded random weights;
    scaled=False: the same weights without the RoPE scaling."""
    make, arch, kw = CASES[name]
    config = make(**{k: v for k, v in kw.items() if scaled or k != "rope_scaling"})
    config.vocab_size, config.bos_token_id, config.eos_token_id = vocab, bos, eos
    config.architectures = [arch]
    config._attn_implementation = "eager"
    model = getattr(transformers, arch)(config).eval()
    randomize(model, seed=sum(map(ord, name)))
    return model


def build(name, tokenizer_model, tmp_path):
    """The case's transformers model and its GGUF, written by llama.cpp's converter."""
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    model = hf_model(name, sp.get_piece_size(), sp.bos_id(), sp.eos_id())
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    (hf_dir / "tokenizer.model").write_bytes(tokenizer_model.read_bytes())
    gguf = tmp_path / f"{name}.gguf"
    conv = converter_dir()
    out = subprocess.run([sys.executable, os.path.join(conv, "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(gguf),
                          "--outtype", "f32"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return model, gguf


def reference_logprobs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def engine_logprobs(gguf, ids, tmp_path, step=0, extra=()):
    out = tmp_path / f"logits_{step}.f32"
    run = subprocess.run([find_cli(), "logits", "-m", str(gguf), "--tokens", ",".join(map(str, ids)), "-o", str(out),
                          "--step", str(step), "-t", "2", *extra], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    x = np.fromfile(out, dtype=np.float32).astype(np.float64).reshape(len(ids), -1)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def token_ids(vocab, seed=3):
    return np.random.default_rng(seed).integers(3, vocab, N_TOKENS).tolist()


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(name, tokenizer_model, tmp_path):
    model, gguf = build(name, tokenizer_model, tmp_path)
    ids = token_ids(model.config.vocab_size)
    ref = reference_logprobs(model, ids)
    for step in (0, 64, 1):  # one prefill, chunks, decode steps
        got = engine_logprobs(gguf, ids, tmp_path, step)
        err = np.abs(got - ref).max(axis=1)
        worst = int(err.argmax())
        assert err[worst] < TOL, f"{name}, step {step}: |log p - ref| {err[worst]:.3g} at position {worst}"
        assert (got.argmax(1) == ref.argmax(1)).mean() > 0.98


@pytest.mark.parametrize("name", ["llama3_scaling", "qwen2_yarn", "llama_linear", "gemma3_linear"])
def test_scaling_is_seen(name, tokenizer_model):
    """The test can see the feature: the same weights without the scaling are far from the
    reference (the engine gave exactly that before it read the scaling: up to 20 nats off)."""
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    args = (sp.get_piece_size(), sp.bos_id(), sp.eos_id())
    ids = token_ids(args[0])
    ref = reference_logprobs(hf_model(name, *args), ids)
    without = reference_logprobs(hf_model(name, *args, scaled=False), ids)
    assert np.abs(without - ref).max() > 50 * TOL
