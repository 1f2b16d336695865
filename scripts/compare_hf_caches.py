#!/usr/bin/env python3
"""transformers' KV caches side by side with tqkv's TQCache on one model and text (issue 15, item 6).

Every cache runs the same teacher-forced decode: a prompt of --prefill tokens of the text, then
--decode tokens fed one at a time (each step is one generation step: the model reads its cache and
appends one token). Each decode step's next-token distribution is compared with that of
transformers' DynamicCache at float32 (the reference, same model, same tokens):

  bits/elt   bytes the cache holds per cached key or value element, times 8 — quantized codes,
             scales, zero points and the float residual buffer of QuantizedCache included —
             averaged over the decode steps (the residual buffer fills and empties as it goes)
  @16-bit    the same with float32 tensors counted at 2 bytes: what the cache of a float16
             model holds (the float32 model here keeps QuantizedCache's residual and scales in
             float32; TQCache's slots do not depend on the model's dtype)
  KL         mean KL(p_f32 || p_cache) over the decode steps, in nats
  ppl        perplexity of the text's tokens over the decode steps
  top-1      fraction of decode steps whose argmax equals the reference's
  cache MiB  the most bytes the cache held at any step (CPU); on CUDA, the peak of
             torch.cuda.max_memory_allocated above the model's weights
  tok/s      decode steps per second (wall clock, batch 1; the first 4 steps untimed)

Caches: DynamicCache (f32, the reference, and at --dtype), QuantizedCache with the quanto
backend (optimum-quanto) at int4 and int2 and the HQQ backend where hqq imports (transformers'
defaults: groups of 64, a float residual of 128 tokens), and TQCache with attn_implementation
"tqkv" for each --tq spec (the engine's cache layer: a tq-* recipe runs whole, per-layer
formats, key centring, sinks and recent window).

  python3 scripts/compare_hf_caches.py                      # SmolLM2 on the CPU, markdown table
  python3 scripts/compare_hf_caches.py --device cuda --dtype float16 --json out.json

Needs torch, transformers, gguf, accelerate and tqkv; optimum-quanto and hqq for their rows.
"""
import argparse
import gc
import json
import math
import os
import platform
import sys
import time
import warnings

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def tensor_bytes(x, half=False) -> int:
    """Bytes of every tensor inside x: plain tensors, tensor subclasses (quanto's QTensors,
    through __tensor_flatten__), tuples, lists and dicts (HQQ's metadata). half: count float32
    tensors at 2 bytes an element (what a float16 model's cache would hold)."""
    if isinstance(x, torch.Tensor):
        if type(x) is not torch.Tensor and hasattr(x, "__tensor_flatten__"):
            names, _ = x.__tensor_flatten__()
            return sum(tensor_bytes(getattr(x, n), half) for n in names)
        return x.numel() * (2 if half and x.dtype == torch.float32 else x.element_size())
    if isinstance(x, (tuple, list)):
        return sum(tensor_bytes(v, half) for v in x)
    if isinstance(x, dict):
        return sum(tensor_bytes(v, half) for v in x.values())
    return 0


def cache_bytes(cache, half=False) -> int:
    """Bytes a transformers cache holds for its keys and values (or a TQCache's slots, whose
    floats are f16 or f32 by format, not by the model's dtype)."""
    if hasattr(cache, "bits_per_element") and hasattr(cache, "formats"):  # tqkv TQCache
        return cache.bytes()
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += tensor_bytes(getattr(layer, name, None), half)
    for name in ("key_cache", "value_cache", "_quantized_key_cache", "_quantized_value_cache"):  # transformers 4.x
        total += tensor_bytes(getattr(cache, name, None), half)
    return total


def make_quantized(backend, nbits, config):
    import transformers

    try:  # transformers >= 4.56
        return transformers.QuantizedCache(backend=backend, config=config, nbits=nbits)
    except TypeError:  # older: a cache class per backend and a config object
        from transformers.cache_utils import HQQQuantizedCache, QuantizedCacheConfig, QuantoQuantizedCache

        cls = QuantoQuantizedCache if backend == "quanto" else HQQQuantizedCache
        return cls(cache_config=QuantizedCacheConfig(backend=backend, nbits=nbits))


def cache_arg(model):
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def run(model, toks, prefill, make_cache, attn, device, measure_every):
    """Teacher-forced decode; returns log-probs [n_decode, V] (float32, CPU) and statistics."""
    model.set_attn_implementation(attn)
    cache = make_cache()
    kw = cache_arg(model)
    n_layers, n_kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    logps, bits, bits16, peak = [], [], [], 0
    warmup = min(4, toks.shape[0] - prefill - 2)  # steps left out of the timing (lazy set-up, JIT)
    with torch.no_grad():
        out = model(input_ids=toks[None, :prefill], **{kw: cache}, use_cache=True)
        logits = out.logits[0, -1]
        for i in range(prefill, toks.shape[0]):
            if i - prefill == warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            logps.append(torch.log_softmax(logits.float(), -1).cpu())
            if (i - prefill) % measure_every == 0:
                held = cache_bytes(cache)
                peak = max(peak, held)
                elements = 2 * n_layers * n_kv * head_dim * i
                bits.append(8.0 * held / elements)
                bits16.append(8.0 * cache_bytes(cache, half=True) / elements)
            if i + 1 == toks.shape[0]:
                break
            out = model(input_ids=toks[None, i:i + 1], **{kw: cache}, use_cache=True)
            logits = out.logits[0, -1]
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    steps = toks.shape[0] - prefill - 1 - warmup
    stats = {"bits": sum(bits) / len(bits), "bits16": sum(bits16) / len(bits16), "cache_mib": peak / 2**20, "tok_s": steps / seconds}
    if device.type == "cuda":
        stats["cuda_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return torch.stack(logps), stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=os.path.join(REPO, "models"))
    ap.add_argument("--gguf", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--text", default=os.path.join(REPO, "data", "kjv-genesis.txt"))
    ap.add_argument("--prefill", type=int, default=256, help="prompt tokens (default 256)")
    ap.add_argument("--decode", type=int, default=256, help="teacher-forced decode steps (default 256)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (TQCache copies to the CPU on CUDA)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="model dtype for every row but the f32 reference")
    ap.add_argument("--threads", type=int, default=0, help="torch and tqkv threads (0: their defaults)")
    ap.add_argument("--tq", nargs="*", default=["turboquant_4bit_nc", "tq-4.375", "tq-3.375", "tq-2.5"])
    ap.add_argument("--quant", nargs="*", default=["quanto:4", "quanto:2", "hqq:4", "hqq:2"],
                    help="QuantizedCache rows as backend:nbits")
    ap.add_argument("--measure-every", type=int, default=8, help="measure the cache's bytes every N steps")
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args()

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tqkv
    import tqkv.transformers as tt

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
        tqkv.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model_dir, gguf_file=args.gguf)
    toks = tok(open(args.text, encoding="utf-8").read(), add_special_tokens=False,
               return_tensors="pt").input_ids[0, :args.prefill + args.decode + 1].to(device)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, gguf_file=args.gguf, attn_implementation="sdpa",
                                                 dtype=torch.float32).to(device).eval()
    print(f"# loaded {args.gguf} in {time.perf_counter() - t0:.1f} s (transformers {transformers.__version__}, "
          f"torch {torch.__version__}, tqkv {tqkv.__version__}, {args.device})", file=sys.stderr)
    capacity = toks.shape[0] + 1

    def summary(name, logp, stats):
        kl = (ref.exp() * (ref - logp)).sum(-1).mean().item()
        nll = -logp.gather(1, targets[:, None]).mean().item()
        top1 = (logp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        return dict(cache=name, kl=kl, ppl=math.exp(nll), top1=top1, **stats)

    targets = toks[args.prefill:].cpu()  # decode step j predicts token prefill + j
    ref, ref_stats = run(model, toks, args.prefill, transformers.DynamicCache, "sdpa", device, args.measure_every)
    rows = [("DynamicCache f32 (reference)", "sdpa", ref, ref_stats)]
    if args.dtype != "float32":
        model = model.to(getattr(torch, args.dtype))
    cases = []
    if args.dtype != "float32":
        cases.append((f"DynamicCache {args.dtype}", "sdpa", transformers.DynamicCache))
    for q in args.quant:
        backend, nbits = q.split(":")
        try:
            make_quantized(backend, int(nbits), model.config)
        except Exception as e:  # noqa: BLE001 - a backend that does not install or import is left out
            print(f"# {q}: left out ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        cases.append((f"QuantizedCache {backend} int{nbits}", "sdpa",
                      lambda b=backend, n=int(nbits): make_quantized(b, n, model.config)))
    for spec in args.tq:
        def make(spec=spec):
            return tt.TQCache(model.config, spec=spec, max_cache_len=capacity, attention_on_codes=True)
        cases.append((f"TQCache {spec}", "tqkv", make))
    for name, attn, make in cases:
        gc.collect()
        logp, stats = run(model, toks, args.prefill, make, attn, device, args.measure_every)
        rows.append((name, attn, logp, stats))
        print(f"# {name}: {summary(name, logp, stats)}", file=sys.stderr, flush=True)

    results = [dict(summary(name, logp, stats), attn=attn) for name, attn, logp, stats in rows]

    print(f"\n{args.gguf}, {os.path.basename(args.text)}: prompt {args.prefill} tokens, {args.decode} decode steps "
          f"(context {args.prefill}..{args.prefill + args.decode}), device {args.device}, dtype {args.dtype}, "
          f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}\n")
    cuda = device.type == "cuda"
    print("| cache | attention | bits/elt | @16-bit | KL vs f32 | ppl | top-1 | " + ("CUDA peak MiB" if cuda else "cache MiB")
          + " | decode tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        mem = r.get("cuda_peak_mib", r["cache_mib"])
        print(f"| {r['cache']} | {r['attn']} | {r['bits']:.2f} | {r['bits16']:.2f} | {r['kl']:.4f} | {r['ppl']:.3f} | {r['top1']:.3f} | "
              f"{mem:.2f} | {r['tok_s']:.1f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(args=vars(args), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
