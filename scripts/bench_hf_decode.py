"""Decode speed of a transformers model with TQCache (attn_implementation="tqkv": tqkv.torch's
store and decode kernels on the paged compressed cache) against DynamicCache with SDPA, on a GPU,
at a long context and a batch: issue 15 item 6's goal (8K context, batch >= 8, TQCache at least
as fast). Random weights (no download on the GPU machine), bf16, in a model config named below.

  python3 scripts/bench_hf_decode.py --config smollm2 --ctx 8192 --batch 8 --steps 32 --json out.json

Per case: prefill the batch's ctx tokens (one forward, only the last logits), then `steps`
greedy decode steps, each a full model forward; tok/s = batch * steps / decode seconds
(CUDA-synchronised wall time after two warm-up steps, which the timing excludes).
"""
import argparse
import json
import time

import torch
import transformers

import tqkv.transformers as tt

CONFIGS = {
    # SmolLM2-135M's shape: head_dim 64, 9 query / 3 kv heads, 30 layers.
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True),
    # A head_dim-128 shape (Llama-3.2-1B's: 16 layers, 32 query / 8 kv heads).
    "hd128": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=500000.0),
}


def kw(model):
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def run(model, make_cache, ids, steps):
    cache = make_cache()
    name = kw(model)
    with torch.no_grad():
        out = model(input_ids=ids, **{name: cache}, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        times = []
        for i in range(steps + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=tok, **{name: cache}, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    decode = sum(times[2:])
    return ids.shape[0] * steps / decode, torch.cuda.max_memory_allocated() / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="smollm2")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--tq", nargs="*", default=["turboquant_4bit_nc", "k4v4+skip0"])
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIGS[args.config], max_position_embeddings=args.ctx + args.steps + 8)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.ctx), device="cuda")
    cap = args.ctx + args.steps + 4
    cases = [("DynamicCache (sdpa)", "sdpa", transformers.DynamicCache)]
    for spec in args.tq:
        cases.append((f"TQCache {spec} (tqkv)", "tqkv",
                      lambda s=spec: tt.TQCache(model.config, spec=s, max_cache_len=cap)))
    rows = []
    for name, attn, make in cases:
        model.set_attn_implementation(attn)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        tps, mib = run(model, make, ids, args.steps)
        row = dict(case=name, config=args.config, ctx=args.ctx, batch=args.batch, steps=args.steps,
                   decode_tok_s=round(tps, 1), peak_mib=round(mib))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           transformers=transformers.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
