#!/usr/bin/env python3
"""Serving benchmark (issue 14, item 8): one workload against any OpenAI-compatible server
(`tqkv serve`, llama-server) at several concurrencies.

The workload is N requests with prompt and output lengths drawn from a fixed seed (a quarter
of them long prompts), sent as token ids to /v1/completions with "stream": true, greedy,
"ignore_eos": true (both servers honour it), so every request generates exactly its max_tokens
and both servers see the same tokens (same GGUF, same vocabulary). Optionally every prompt
starts with the same --system-tokens tokens (a common system prompt: prefix sharing).

Per concurrency C, C client threads take requests from the list in order; reported: request
throughput, output tokens/s (of wall time), time to first token (TTFT: request sent -> first
streamed token) and time per output token after it (TPOT), p50 and p99, as JSON and a
Markdown table row.

    scripts/bench_serve.py --url http://127.0.0.1:8080 --label "tqkv f16" -c 1 8 32 --json out.json
Python standard library only.
"""
import argparse
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse


def workload(n, seed, vocab_lo, vocab_hi, system_tokens, long_frac, short, long, out):
    rng = random.Random(seed)
    system = [rng.randrange(vocab_lo, vocab_hi) for _ in range(system_tokens)]
    reqs = []
    for _ in range(n):
        lo, hi = long if rng.random() < long_frac else short
        plen = rng.randint(lo, hi)
        reqs.append({"prompt": system + [rng.randrange(vocab_lo, vocab_hi) for _ in range(plen)],
                     "max_tokens": rng.randint(*out)})
    return reqs


def one(url, req, model):
    u = urllib.parse.urlparse(url)
    body = json.dumps({"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0,
                       "stream": True, "ignore_eos": True,
                       # llama-server keeps each slot's last prompt and reuses it for a request that
                       # starts the same: a repeated workload would skip its prefills there
                       "cache_prompt": False})
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    first = last = None
    n_events = 0
    usage = None
    buf = b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            line = ev.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                usage = d["usage"]
            ch = d.get("choices") or []
            if ch and ch[0].get("text"):
                now = time.perf_counter()
                first = first or now
                last = now
                n_events += 1
    c.close()
    n_out = usage["completion_tokens"] if usage and usage.get("completion_tokens") else req["max_tokens"]
    if first is None:
        raise RuntimeError("no token streamed")
    return {"ttft": first - t0, "tpot": (last - first) / (n_out - 1) if n_out > 1 else None, "n_out": n_out,
            "end": last - t0, "n_prompt": len(req["prompt"])}


def served_model(url):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.request("GET", "/v1/models")
    r = c.getresponse()
    body = r.read()
    c.close()
    if r.status != 200:
        raise RuntimeError(f"GET /v1/models: HTTP {r.status}: {body[:200]!r}")
    return json.loads(body)["data"][0]["id"]


def pct(xs, p):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = min(len(xs) - 1, max(0, int(round(p / 100.0 * (len(xs) - 1)))))
    return xs[k]


def run(url, reqs, conc, model):
    results = [None] * len(reqs)
    errors = []
    nxt = [0]
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(reqs):
                return
            try:
                results[i] = one(url, reqs[i], model)
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                errors.append(repr(e))

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(conc)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r]
    if not ok:
        raise RuntimeError(f"no request completed: {errors[:3]}")
    out_tok = sum(r["n_out"] for r in ok)
    return {"concurrency": conc, "requests": len(reqs), "completed": len(ok), "errors": errors[:5],
            "wall_s": wall, "req_per_s": len(ok) / wall, "output_tok_per_s": out_tok / wall,
            "prompt_tokens": sum(r["n_prompt"] for r in ok), "output_tokens": out_tok,
            "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in ok], 50), "ttft_p99_ms": 1e3 * pct([r["ttft"] for r in ok], 99),
            "tpot_p50_ms": 1e3 * (pct([r["tpot"] for r in ok], 50) or 0),
            "tpot_p99_ms": 1e3 * (pct([r["tpot"] for r in ok], 99) or 0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--label", default="server")
    ap.add_argument("--model", help="the model id to ask for (default: the server's first, from /v1/models)")
    ap.add_argument("-n", "--requests", type=int, default=32)
    ap.add_argument("-c", "--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--prompt", type=int, nargs=2, default=[32, 384], help="short prompt lengths (uniform)")
    ap.add_argument("--long-prompt", type=int, nargs=2, default=[1024, 1536], help="long prompt lengths (uniform)")
    ap.add_argument("--long-frac", type=float, default=0.25, help="share of long prompts")
    ap.add_argument("--output", type=int, nargs=2, default=[16, 96], help="output lengths (uniform)")
    ap.add_argument("--system-tokens", type=int, default=0, help="a common prefix of this many tokens")
    ap.add_argument("--vocab", type=int, nargs=2, default=[1000, 40000], help="token ids drawn from this range")
    ap.add_argument("--warmup", type=int, default=1, help="requests sent first, not measured")
    ap.add_argument("--json", help="append one JSON line per concurrency to this file")
    a = ap.parse_args()
    if a.model is None:  # servers refuse a model id they do not serve (tqkv: 404 model_not_found)
        a.model = served_model(a.url)
    reqs = workload(a.requests, a.seed, a.vocab[0], a.vocab[1], a.system_tokens, a.long_frac, a.prompt,
                    a.long_prompt, a.output)
    for r in reqs[:a.warmup]:
        one(a.url, {"prompt": r["prompt"][:16], "max_tokens": 2}, a.model)
    print("| server | C | req/s | out tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | done |")
    print("|---|---|---|---|---|---|---|")
    for c in a.concurrency:
        res = run(a.url, reqs, c, a.model)
        res.update(label=a.label, seed=a.seed, system_tokens=a.system_tokens)
        print(f"| {a.label} | {c} | {res['req_per_s']:.2f} | {res['output_tok_per_s']:.1f} | "
              f"{res['ttft_p50_ms']:.0f} / {res['ttft_p99_ms']:.0f} | {res['tpot_p50_ms']:.1f} / {res['tpot_p99_ms']:.1f} | "
              f"{res['completed']}/{res['requests']} |", flush=True)
        if res["errors"]:
            print("errors:", res["errors"], file=sys.stderr)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
