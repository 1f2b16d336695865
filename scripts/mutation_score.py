#!/usr/bin/env python3
"""Mutation score: do the tests catch what they claim to?

Applies a fixed list of small faults (FAULTS below: a one-line edit of one product file each) one
at a time to a scratch git worktree of HEAD, never to this checkout; rebuilds only the test binary
that should catch the fault (incrementally: the edited file's object and a link); runs that
binary's named tests; restores the file; and prints a table of what the tests killed and what
survived. A fault whose text is no longer in its file is reported `stale` (the list needs an
update), one that does not compile `no build`; neither counts.

    python3 scripts/mutation_score.py                 # every fault
    python3 scripts/mutation_score.py --only S1,C2    # some
    python3 scripts/mutation_score.py --list          # the faults, nothing run
    python3 scripts/mutation_score.py --markdown      # the table for docs/TESTING.md

The scratch tree (default /tmp/tqkv-mutants, --scratch DIR) is a detached worktree of this
repository, moved to HEAD at each run, with its own release build (CPU only, no bench, tools or
Python module); models/ and data/ are linked from this checkout so that the real-model tests run.
The first run builds it whole (about 20 minutes on 2 cores); later runs rebuild what HEAD changed
and then one object per fault. The last result is in docs/TESTING.md.
"""
import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Fault:
    id: str
    what: str    # the fault, in words
    file: str    # the product file edited, relative to the repository
    find: str    # text that occurs exactly once in the file...
    replace: str  # ...and what it becomes
    target: str  # the test binary (CMake target) that should catch it
    tests: str   # its gtest filter


CORE, CPU, CAPI, ENGINE, SERVE = "tqkv_core_tests", "tqkv_cpu_tests", "tqkv_capi_tests", "tqkv_engine_tests", "tqkv_serve_tests"
BINARY = {CORE: "tests/tqkv_core_tests", CPU: "tests/tqkv_cpu_tests", CAPI: "tests/tqkv_capi_tests",
          ENGINE: "tests/engine/tqkv_engine_tests", SERVE: "tests/serve/tqkv_serve_tests"}

FAULTS = [
    # --- core: packing, codebooks, rotation, codecs (the reference every fast path is held to)
    Fault("C1", "the last code of a block is never packed", "src/core/bitpack.cpp",
          "for (size_t i = 0; i < n; ++i) {\n    const size_t bit", "for (size_t i = 0; i + 1 < n; ++i) {\n    const size_t bit",
          CORE, "BitPack.*:Format.Golden*:Codec.*"),
    Fault("C2", "a code straddling two bytes loses its high bits", "src/core/bitpack.cpp",
          "if ((bit % 8) + bits > 8)", "if ((bit % 8) + bits > 9)", CORE, "BitPack.*:Format.Golden*"),
    Fault("C3", "a value on a threshold goes to the lower level", "src/core/codebook.cpp",
          "if (x >= thresholds_f32[lo + half]) {", "if (x > thresholds_f32[lo + half]) {", CORE, "Codebook.*"),
    Fault("C4", "thresholds 10% off the midpoints", "src/core/codebook.cpp",
          "t[i] = 0.5 * (c[i] + c[i + 1]);", "t[i] = 0.45 * (c[i] + c[i + 1]);", CORE, "Codebook.*"),
    Fault("C5", "the inverse rotation forgets the 1/sqrt(d) scale", "src/core/rotation.cpp",
          "      fwht(x, dim_);\n      for (int i = 0; i < dim_; ++i) x[i] *= scale;\n      if (kind_",
          "      fwht(x, dim_);\n      if (kind_", CORE, "Rotation.*:Codec.*"),
    Fault("C6", "the inverse SRHT forgets the signs", "src/core/rotation.cpp",
          "        for (int i = 0; i < dim_; ++i) x[i] *= signs_[i];\n      return;", "      return;",
          CORE, "Rotation.*:Codec.*"),
    Fault("C7", "norm correction not applied", "src/core/codec.cpp",
          "stored = static_cast<float>(norm / std::sqrt(csq));", "stored = norm;", CORE, "Codec.*"),
    Fault("C8", "uniform values: 2^b levels instead of 2^b - 1", "src/core/codec.cpp",
          "const float levels = static_cast<float>((1 << bits) - 1);", "const float levels = static_cast<float>(1 << bits);",
          CORE, "Codec.*"),
    Fault("C9", "uniform values truncated instead of rounded", "src/core/codec.cpp",
          "std::floor((v[i] - zero) / scale + 0.5f)", "std::floor((v[i] - zero) / scale)", CORE, "Codec.*"),
    # --- CPU kernels and caches
    Fault("K1", "split-KV merge weights exp(M - m) instead of exp(m - M)", "src/cpu/attention_driver.cpp",
          "const float e = std::exp(m - M);", "const float e = std::exp(M - m);", CPU,
          "Attention.*:AttentionSimd.SplitDecode*:PagedAttention.*"),
    Fault("K2", "split-KV merge drops the values' zero-point sum", "src/cpu/attention_driver.cpp",
          "o[i] += e * (acc[i] + zs);", "o[i] += e * acc[i];", CPU, "Attention.*:AttentionSimd.SplitDecode*:PagedAttention.*"),
    Fault("K3", "split-KV merge returns the max as the log-sum-exp", "src/cpu/attention_driver.cpp",
          "lse = M + static_cast<float>(std::log(L));", "lse = M;", CPU, "Attention.*:AttentionSimd.SplitDecode*"),
    Fault("K4", "the scalar kernel reads bf16 with the wrong shift", "src/cpu/kernel-scalar.cpp",
          "static_cast<uint32_t>(p[2 * i] | (p[2 * i + 1] << 8)) << 16;",
          "static_cast<uint32_t>(p[2 * i] | (p[2 * i + 1] << 8)) << 15;", CPU, "AttentionSimd.*"),
    Fault("K5", "the ring keeps one position more than its capacity", "src/cpu/contiguous_cache.cpp",
          "if (seq_len_ - first_pos_ > config_.capacity)", "if (seq_len_ - first_pos_ > config_.capacity + 1)",
          CPU, "ContiguousCache.*"),
    Fault("K6", "boundary layers not capped at half the layers", "src/cpu/contiguous_cache.cpp",
          "skip = std::min(skip, n_layers / 2);", "skip = std::min(skip, n_layers);", CPU, "BoundaryLayers.*"),
    Fault("K7", "a paged store encodes into the wrong slot of its page", "src/cpu/page_pool.cpp",
          "place_slot(g, page, static_cast<int>(s % bs), h,", "place_slot(g, page, static_cast<int>((s + 1) % bs), h,",
          CPU, "PagedCache.*:PagedAttention.*"),
    Fault("K8", "the C API reads a cache with another state", "src/capi/tqkv_c.cpp",
          "  if (state != cache->state) {", "  if (false) {", CAPI, "CApi.*"),
    # --- engine caches
    Fault("W1", "recent window: merge weights swapped", "src/engine/cache/recent_window.cpp",
          "o[i] = (ea * o[i] + eb * w[i]) * inv;", "o[i] = (eb * o[i] + ea * w[i]) * inv;", ENGINE, "RecentWindow*"),
    Fault("W2", "recent window: the merged log-sum-exp is the max", "src/engine/cache/recent_window.cpp",
          "lse[r] = m + std::log(ea + eb);", "lse[r] = m;", ENGINE, "RecentWindow*"),
    # --- engine: model, weights, tokenizer
    Fault("E1", "linear RoPE scaling multiplies the frequencies", "src/engine/core/rope.cpp",
          "        f /= s.factor;\n        break;", "        f *= s.factor;\n        break;", ENGINE, "Rope*"),
    Fault("E2", "RoPE frequencies with half the exponent", "src/engine/core/rope.cpp",
          "std::pow(static_cast<double>(base), -2.0 * i / n_rot)", "std::pow(static_cast<double>(base), -1.0 * i / n_rot)",
          ENGINE, "Rope*:TinyModels.*"),
    Fault("E3", "Q4_0 codes centred on 7", "src/engine/weights/dequant.cpp",
          "y[j] = static_cast<float>((qs[j] & 0x0f) - 8) * d;", "y[j] = static_cast<float>((qs[j] & 0x0f) - 7) * d;",
          ENGINE, "Gguf.*:TinyModels.*"),
    Fault("E4", "BPE merges the pair of highest rank first", "src/engine/gguf/tokenizer.cpp",
          ": static_cast<double>(it->second);", ": -static_cast<double>(it->second);", ENGINE, "Tokenizer*:SmolTokenizer*"),
    Fault("E5", "the last layer's residual add is dropped", "src/engine/model/arch_llama.cpp",
          "      dev.add(x.data(), xn.data(), N * d);", "      (void)0;", ENGINE, "TinyModels.*:Smol.Logits*"),
    Fault("E6", "RMSNorm without its epsilon", "src/engine/device/cpu_device.cpp",
          "1.0 / std::sqrt(ss / d + eps)", "1.0 / std::sqrt(ss / d)", ENGINE, "TinyModels.*:Smol.Logits*:Model.*"),
    Fault("E7", "a NaN in a weight's first element is let through", "src/engine/weights/expand_tensor.cpp",
          "  for (int64_t i : first)  // the parts in order: the first one found is the tensor's first\n    if (i >= 0)",
          "  for (int64_t i : first)  // the parts in order: the first one found is the tensor's first\n    if (i > 0)",
          ENGINE, "NonFiniteWeights.*"),
    Fault("E8", "the layer count is not held to the file's tensors", "src/engine/model/model.cpp",
          "if (static_cast<size_t>(c.n_layers) > f.tensors().size())", "if (false)", ENGINE, "Model.*"),
    # --- sampler
    Fault("S1", "the sampler ignores temperature", "src/engine/core/sampler.cpp",
          "std::exp((c.first - mx) / p_.temperature)", "std::exp(c.first - mx)", ENGINE, "Sampler*"),
    Fault("S2", "top-k keeps one token too many", "src/engine/core/sampler.cpp",
          "std::min(p_.top_k, n) : n;", "std::min(p_.top_k + 1, n) : n;", ENGINE, "Sampler*"),
    Fault("S3", "top-p counts half of each token's mass", "src/engine/core/sampler.cpp",
          "acc += cand_[i].first / sum;", "acc += 0.5 * cand_[i].first / sum;", ENGINE, "Sampler*"),
    Fault("S4", "greedy ties go to the highest id", "src/engine/core/sampler.cpp",
          "if (v[i] > top) {  // false for NaN", "if (v[i] >= top) {  // false for NaN", ENGINE, "Sampler*"),
    # --- scheduler
    Fault("Q1", "a request may hold one position more than the context", "src/serve/scheduler.cpp",
          "const int64_t most = n + max_tokens - 1;", "const int64_t most = n + max_tokens - 2;", SERVE, "Scheduler*"),
    Fault("Q2", "preemption takes the oldest request", "src/serve/scheduler.cpp",
          "const int64_t victim = running_.back();", "const int64_t victim = running_.front();", SERVE, "Scheduler*"),
    Fault("Q3", "admission past max_seqs", "src/serve/scheduler.cpp",
          "n_running() < cfg_.max_seqs", "n_running() <= cfg_.max_seqs", SERVE, "Scheduler*"),
    Fault("Q4", "a shared page is freed while another request holds it", "src/serve/scheduler.cpp",
          "if (--refs_[p] > 0) continue;", "if (--refs_[p] > 1) continue;", SERVE, "Scheduler*"),
    Fault("Q5", "a preempted request goes to the back of the line", "src/serve/scheduler.cpp",
          "waiting_.push_front(id);", "waiting_.push_back(id);", SERVE, "Scheduler*"),
    # --- server request parsing
    Fault("P1", "temperature up to 20 accepted", "src/serve/request_parser.cpp",
          'num_field(body, "temperature", 1.0, 0.0, 2.0)', 'num_field(body, "temperature", 1.0, 0.0, 20.0)',
          SERVE, "RequestParser*"),
    Fault("P2", "a logit_bias key equal to the vocabulary size accepted", "src/serve/request_parser.cpp",
          "id < 0 || id >= n_vocab)", "id < 0 || id > n_vocab)", SERVE, "RequestParser*"),
    Fault("P3", "five stop strings accepted", "src/serve/request_parser.cpp",
          "s->is_array() && s->size() <= 4", "s->is_array() && s->size() <= 5", SERVE, "RequestParser*"),
    Fault("P4", "prompt token ids not held to the vocabulary", "src/serve/request_parser.cpp",
          "t.get<int64_t>() >= tok.n_vocab())", "t.get<int64_t>() > tok.n_vocab())", SERVE, "RequestParser*"),
    Fault("P5", "the developer role is not read as system", "src/serve/request_parser.cpp",
          'if (role == "developer") role = "system";', "", SERVE, "RequestParser*"),
    Fault("P6", "any model name accepted", "src/serve/request_parser.cpp",
          "if (m->get<std::string>() != lim.model)", "if (false)", SERVE, "RequestParser*"),
]


def sh(cmd, cwd, timeout=None, quiet=True):
    """Runs cmd; returns (exit status, seconds, output tail). A timeout counts as status -9."""
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=cwd, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout)
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        rc, out = -9, out.decode(errors="replace") if isinstance(out, bytes) else out
    if not quiet:
        print(out)
    return rc, time.time() - t0, out[-3000:]


def prepare(scratch):
    head = subprocess.check_output(["git", "-C", ROOT, "rev-parse", "HEAD"], text=True).strip()
    if not os.path.exists(os.path.join(scratch, ".git")):
        subprocess.check_call(["git", "-C", ROOT, "worktree", "add", "--detach", scratch, head])
    else:
        subprocess.check_call(["git", "-C", scratch, "checkout", "--quiet", "--force", "--detach", head])
    for d in ("models", "data"):
        src, dst = os.path.join(ROOT, d), os.path.join(scratch, d)
        if os.path.exists(src) and not os.path.lexists(dst):
            os.symlink(os.path.realpath(src), dst)
    build = os.path.join(scratch, "build", "release")
    if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
        rc, _, out = sh("cmake --preset release -DTQKV_CUDA=OFF -DTQKV_BUILD_BENCH=OFF -DTQKV_BUILD_PYTHON=OFF "
                        "-DTQKV_BUILD_TOOLS=OFF -DTQKV_WERROR=OFF", scratch)
        if rc:
            sys.exit("configure failed:\n" + out)
    return head, build


def build(build_dir, target, jobs):
    rc, secs, out = sh(f"cmake --build {build_dir} -j {jobs} --target {target}", build_dir)
    return rc == 0, secs, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scratch", default=os.environ.get("TQKV_MUTANTS_DIR", "/tmp/tqkv-mutants"))
    ap.add_argument("--only", help="comma-separated fault ids")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="print the result as a Markdown table")
    ap.add_argument("--timeout", type=int, default=600, help="seconds a test run may take (then: killed)")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    args = ap.parse_args()
    faults = FAULTS
    if args.only:
        want = set(args.only.split(","))
        faults = [f for f in FAULTS if f.id in want]
    if args.list:
        for f in faults:
            print(f"{f.id:4} {f.file:40} {f.what}")
        return

    start = time.time()
    scratch = os.path.abspath(args.scratch)
    head, build_dir = prepare(scratch)
    env = "TQKV_REQUIRE_REFERENCE=1 "  # the NumPy reference tests must run, not skip
    targets = sorted({f.target for f in faults})
    print(f"scratch {scratch} at {head[:10]}; building {' '.join(targets)}", flush=True)
    for t in targets:
        ok, secs, out = build(build_dir, t, args.jobs)
        if not ok:
            sys.exit(f"the unmutated tree does not build {t}:\n{out}")
    # Every fault's tests pass on the unmutated tree, or a kill would mean nothing.
    for t in targets:
        tests = ":".join(f.tests for f in faults if f.target == t)
        rc, secs, out = sh(f"{env}{BINARY[t]} --gtest_filter='{tests}'", build_dir, args.timeout)
        if rc:
            sys.exit(f"{t} fails unmutated ({tests}):\n{out}")
        print(f"baseline {t}: passes ({secs:.0f} s)", flush=True)

    rows = []
    for f in sorted(faults, key=lambda f: f.file):
        path = os.path.join(scratch, f.file)
        with open(path) as fh:
            original = fh.read()
        if original.count(f.find) != 1:
            rows.append((f, "stale", 0.0))
            continue
        with open(path, "w") as fh:
            fh.write(original.replace(f.find, f.replace))
        try:
            t0 = time.time()
            ok, _, _ = build(build_dir, f.target, args.jobs)
            if not ok:
                result = "no build"
            else:
                rc, _, out = sh(f"{env}{BINARY[f.target]} --gtest_filter='{f.tests}'", build_dir, args.timeout)
                result = "killed" if rc != 0 else "SURVIVED"
                if rc == -9:
                    result = "killed (timeout)"
        finally:
            with open(path, "w") as fh:
                fh.write(original)
        rows.append((f, result, time.time() - t0))
        print(f"{f.id:4} {result:16} {time.time() - t0:5.0f} s  {f.what}", flush=True)

    counted = [r for r in rows if r[1] not in ("stale", "no build")]
    killed = [r for r in counted if r[1].startswith("killed")]
    survived = [r for r in counted if r[1] == "SURVIVED"]
    print()
    if args.markdown:
        print("| fault | what | file | tests run | result |")
        print("|-------|------|------|-----------|--------|")
        for f, result, _ in sorted(rows, key=lambda r: FAULTS.index(r[0])):
            print(f"| {f.id} | {f.what} | `{f.file}` | `{os.path.basename(BINARY[f.target])} {f.tests}` | {result} |")
    else:
        for f, result, secs in sorted(rows, key=lambda r: FAULTS.index(r[0])):
            print(f"{f.id:4} {result:16} {f.file:40} {f.target} {f.tests}")
    stale = len(rows) - len(counted)
    print(f"\n{len(killed)} of {len(counted)} faults killed, {len(survived)} survived"
          + (f", {stale} stale or not building" if stale else "")
          + f"; {datetime.date.today()}, HEAD {head[:10]}, {os.cpu_count()} cores, {platform.machine()},"
          f" {(time.time() - start) / 60:.1f} min")
    if survived:
        print("survivors: " + ", ".join(f.id for f, _, _ in survived))
    sys.exit(1 if survived or stale else 0)


if __name__ == "__main__":
    main()
