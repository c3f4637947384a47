"""Prefill and decode of one checkpoint through two source trees, runs interleaved: the cost of a change.

Each run is a fresh process of ``python -m moestream ...``'s engine from one tree (``PYTHONPATH=<tree>``):
load at the budget, prefill ``--prompt`` tokens of the bench text (``../shared/bench/prompt.txt`` then
``continuation.txt``, repeated as needed), then decode ``--tokens`` fed tokens one by one (the text's last
tokens: the same varied tokens in every run).
Per run: prefill wall and CPU seconds, decode wall and CPU seconds per token (medians over the steps). The
trees alternate (A, B, A, B, ...) so the machine's drift hits both alike; the summary gives each tree's
median over its runs, the ratio B / A, the load average before and after, and the CPU model and flags::

    python benchmarks/tree_compare.py --model /tmp/q30-2l-4bit --a /tmp/base --b . --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"

WORKER = r"""
import json, statistics, sys, time
import moestream  # noqa: F401  (before torch: its OpenMP wait policy is read when torch loads)
import torch
from moestream.engine import load
model, budget, n_prompt, n_tokens, shared = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
sys.path.insert(0, sys.argv[6])  # this checkout's benchmarks/, whichever tree is measured
from _common import timed_steps
engine = load(model, budget, workers=2, hotlist=False, learn_experts=False, progress=False)
tok = engine.tokenizer
text = open(shared + "/bench/prompt.txt").read() + open(shared + "/bench/continuation.txt").read()
ids = tok.encode(text)
cont = ids[-n_tokens:]  # the continuation's last tokens, fed one per step
prompt = (ids * (n_prompt // len(ids) + 1))[:n_prompt]
net = engine.model
out = {}
with torch.inference_mode():
    kv = net.new_kv_cache(n_prompt + n_tokens + 1)
    c0, w0 = time.process_time(), time.perf_counter()
    for s in range(0, len(prompt), 512):
        net(torch.tensor(prompt[s : s + 512]), s, kv)
    out["prefill_wall_s"], out["prefill_cpu_s"] = time.perf_counter() - w0, time.process_time() - c0
    cpu, wall = timed_steps(net, cont, len(prompt), kv)
out["decode_wall_s"], out["decode_cpu_s"] = statistics.median(wall), statistics.median(cpu)
out["threads"] = torch.get_num_threads()
out["moestream"] = moestream.__file__  # which tree was measured
engine.close()
print(json.dumps(out))
"""


def cpu_info() -> str:
    model, flags = "", ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and not model:
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            have = set(line.split(":", 1)[1].split())
            flags = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512vbmi",
                                         "avx512_bf16", "avx512_vnni", "avx512fp16", "amx_tile") if f in have)
    return f"{model} ({flags})"


def one_run(tree: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
    got = subprocess.run([sys.executable, "-c", WORKER, args.model, args.budget, str(args.prompt), str(args.tokens),
                          str(SHARED), str(Path(__file__).resolve().parent)],
                         env=env, cwd=tree, capture_output=True, text=True, timeout=3600)
    # cwd: ``python -c`` puts it first on sys.path, before PYTHONPATH (run from a checkout, it was measured twice)
    if got.returncode:
        raise SystemExit(f"{tree}: {got.stderr[-2000:]}")
    out = json.loads(got.stdout.strip().splitlines()[-1])
    if not Path(out["moestream"]).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"{tree}: the run imported {out['moestream']}, not this tree's moestream")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--a", required=True, help="the first tree (the baseline)")
    ap.add_argument("--b", required=True, help="the second tree")
    ap.add_argument("--budget", default="all")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", help="write the runs and the summary here")
    args = ap.parse_args()
    load0 = os.getloadavg()
    runs = {"a": [], "b": []}
    for _ in range(args.runs):
        for name in ("a", "b"):
            r = one_run(getattr(args, name), args)
            runs[name].append(r)
            print(name, json.dumps(r), flush=True)
    summary = {"cpu": cpu_info(), "load_before": load0, "load_after": os.getloadavg(), "model": args.model,
               "budget": args.budget, "prompt": args.prompt, "tokens": args.tokens}
    for key in ("prefill_wall_s", "prefill_cpu_s", "decode_wall_s", "decode_cpu_s"):
        a = statistics.median(r[key] for r in runs["a"])
        b = statistics.median(r[key] for r in runs["b"])
        summary[key] = {"a": a, "b": b, "b_over_a": b / a}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
