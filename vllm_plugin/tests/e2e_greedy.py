"""vLLM end to end, with and without the plugin: greedy tokens of vLLM's offline `LLM` with
`kv_cache_dtype=PRESET`, TQKV_VLLM=1 (tqkv's kernels) against TQKV_VLLM=0 (vLLM's own Triton
TurboQuant path), each in a process of its own (the plugin registers at start-up). Prompts long
enough to be prefilled in chunks: with max_num_batched_tokens 96 the continuation chunks take the
short path (a decode per query row), with 512 the long one (dequantize + FlashAttention).
Needs a GPU and a full vLLM of a supported version (scripts/stage_vllm_wheels.sh stages one where
there is no network); writes one JSON line per (preset, chunking) and exits 1 on a mismatch.
    python vllm_plugin/tests/e2e_greedy.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
MARK = "E2E_RESULT "


def prompts(text_file: str) -> list[str]:
    """Four prompts of about 300 to 2400 characters of real text (data/kjv-genesis.txt by default)."""
    path = Path(text_file)
    text = path.read_text() if path.exists() else ("In the beginning God created the heaven and the earth. " * 60)
    return [text[i * 997:i * 997 + n] for i, n in enumerate((300, 900, 1600, 2400))]


def child(args) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    llm = LLM(model=args.model, tokenizer=args.tokenizer or None, kv_cache_dtype=args.preset, max_model_len=4096,
              gpu_memory_utilization=args.gpu_memory, max_num_batched_tokens=args.batched_tokens,
              enable_prefix_caching=False, seed=0)
    outs = llm.generate(prompts(args.text), SamplingParams(temperature=0.0, max_tokens=args.tokens))
    print(MARK + json.dumps(dict(backend=AttentionBackendEnum.TURBOQUANT.get_path(),
                                 tokens=[list(o.outputs[0].token_ids) for o in outs])), flush=True)


def run_child(args, preset: str, batched: int, plugin: bool) -> dict:
    env = dict(os.environ, TQKV_VLLM="1" if plugin else "0")
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--preset", preset, "--batched-tokens",
           str(batched), "--tokens", str(args.tokens), "--text", args.text, "--gpu-memory", str(args.gpu_memory)]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in res.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"{preset} (plugin {plugin}) failed, rc {res.returncode}:\n{res.stderr[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--preset", default="")
    ap.add_argument("--batched-tokens", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--text", default="data/kjv-genesis.txt")
    ap.add_argument("--gpu-memory", type=float, default=0.35)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    bad = 0
    for preset in args.presets.split(","):
        for batched in (96, 512):
            row = dict(preset=preset, max_num_batched_tokens=batched)
            try:
                ours, theirs = run_child(args, preset, batched, True), run_child(args, preset, batched, False)
                row["plugin_backend"], row["vllm_backend"] = ours["backend"], theirs["backend"]
                row["prompts"] = len(ours["tokens"])
                row["equal_prompts"] = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
                row["first_difference"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                           for a, b in zip(ours["tokens"], theirs["tokens"])]
                row["ok"] = ("tqkv_vllm" in ours["backend"] and "tqkv_vllm" not in theirs["backend"]
                             and row["equal_prompts"] == row["prompts"])
            except Exception as e:  # one preset's failure does not hide the others
                row["ok"], row["error"] = False, str(e)[-2000:]
            bad += not row["ok"]
            print(json.dumps(row), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
