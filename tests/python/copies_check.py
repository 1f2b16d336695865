"""Checks shared by the CPU and CUDA tests of TQCache's GPU path with attention sinks and a recent
window (tqkv.torch's paged cache, the copies kept next to it): a randomly initialised Llama shaped
like SmolLM2-135M (so that the shipped SmolLM2 recipes, tq-4.375 and tq-3.375 with +sink1+wq6+fill,
resolve), greedy decoding with logits, and one layer's attention on the same inputs in two caches."""
import inspect

import torch
import transformers

import tqkv.transformers as tt

# At this capacity the recipes' +fill<B> leaves room for a recent window (7 positions at 512).
CAPACITY = 512


def smol_shaped_llama():
    """SmolLM2-135M's cache shape (llama, 30 layers, 9 heads, 3 kv heads, head_dim 64), small MLP and
    vocabulary, random weights: layers at std 0.02 and embeddings at std 1, so that greedy decoding
    goes through varied tokens without 30 random layers amplifying float rounding into chaos (at std
    0.1 throughout, two float orders of attention drift apart by percents of the logits)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=256, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                   max_position_embeddings=2048, rope_theta=100000.0, initializer_range=0.02,
                                   attn_implementation="tqkv")
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, 1.0)
    return model


def prompt(n=24, batch=1):
    return torch.randint(0, 512, (batch, n), generator=torch.Generator().manual_seed(1))


def greedy_logits(model, ids, cache, n, forced=None):
    """n greedy steps after the prompt ids (or the tokens `forced`, teacher forcing): (tokens, logits
    [n, vocab] float32 on the CPU). The prompt goes in as two chunks (so that the second attends on
    the codes, sinks and window included), then one token per step."""
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens, logits = [], []
    half = ids.shape[1] // 2
    with torch.no_grad():
        model(ids[:, :half], **{kw: cache}, use_cache=True)
        x = ids[:, half:]
        for i in range(n):
            out = model(x, **{kw: cache}, use_cache=True).logits[0, -1].float().cpu()
            logits.append(out)
            tokens.append(int(out.argmax()) if forced is None else forced[i])
            x = torch.tensor([[tokens[-1]]], device=ids.device)
    return tokens, torch.stack(logits)


def check_greedy(want, got, margin=1e-3, rel=1e-2):
    """Teacher-forced logits `got` along the reference's tokens: the argmax equals the reference's
    token except where the reference's top two are within `margin` (a near tie the rounding may
    flip), and the logits agree within rel of their largest magnitude. Returns the relative error."""
    want_tokens, want_logits = want
    _, got_logits = got
    top2 = want_logits.topk(2, -1).values
    for i, t in enumerate(want_tokens):
        if top2[i, 0] - top2[i, 1] > margin * top2[i, 0].abs().clamp(min=1):
            assert int(got_logits[i].argmax()) == t, f"step {i}"
    err = ((got_logits - want_logits).abs().max() / want_logits.abs().max()).item()
    assert err < rel, err
    return err


def layer_outputs(config, spec, device, layer=5, steps=(20, 9, 1, 1, 1, 1, 1, 1, 1, 1)):
    """One layer of a TQCache (attention on the codes; the first chunk on its own keys) fed the same seeded
    keys, values and queries, chunk by chunk: the attention outputs [B, T, n_q_heads, D] of every
    chunk, float32 on the CPU. Chunks and decode steps move the window past the sinks."""
    cache = tt.TQCache(config, spec=spec, max_cache_len=CAPACITY, attention_on_codes=True)
    g = torch.Generator().manual_seed(3)
    n_q, n_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    outs, start = [], 0
    for n in steps:
        k, v = torch.randn(2, n_kv, n, d, generator=g), torch.randn(2, n_kv, n, d, generator=g)
        q = torch.randn(2, n_q, n, d, generator=g)
        kt, vt = cache.update(k.to(device), v.to(device), layer)
        out, _ = tt.tqkv_attention(None, q.to(device), kt, vt, None, scaling=d ** -0.5)
        outs.append(out.float().cpu())
        start += n
    return outs
