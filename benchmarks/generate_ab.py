"""``moestream generate`` through two source trees, runs interleaved: a change measured on the user's path.

Each run is a fresh ``python -m moestream generate ... --stats-json`` process of one tree (``PYTHONPATH=<tree>``,
started from an empty folder: ``python -m`` puts the working folder first on ``sys.path``, so run from a checkout
it would import that checkout whatever ``PYTHONPATH`` says). The trees alternate (A, B, A, B, ...) per model, so
the machine's drift falls on both alike. Per run: decode and prefill tok/s, CPU seconds per decoded token and
its split (compiled kernels, of which experts, the rest), and the generated tokens' digest (greedy runs of one
tree give one digest). The summary gives each tree's median per model, the ratio B / A, the load average before
each run, and the CPU model and flags::

    python benchmarks/generate_ab.py --a /tmp/base --b . --model q30-12t-4b --model q30-12t-Q4_K_M.gguf \\
        --tokenizer q30-12t-4b --prompt-file prompt.txt --rounds 3 -- --activations q8 --no-chat-template

Arguments after ``--`` go to every ``generate`` (``--cache-budget-gb all --max-tokens 64 --temp 0`` are given
unless overridden there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import cpu_model, load_average

KEYS = ("decode_tok_s", "prefill_tok_s", "cpu_s_per_decoded_token", "cpu_compiled_s_per_token",
        "cpu_kernels_s_per_token", "cpu_rest_s_per_token")


def run(tree: Path, model: str, a, extra: list[str], where: Path) -> dict:
    out = where / "stats.json"
    cmd = [sys.executable, "-m", "moestream", "generate", "--model", model, "--prompt-file", str(a.prompt_file),
           "--stats-json", str(out), "--quiet", "--cache-budget-gb", "all", "--max-tokens", "64", "--temp", "0"]
    if a.tokenizer:
        cmd += ["--tokenizer", a.tokenizer]
    load = load_average()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r = subprocess.run(cmd + extra, cwd=where, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{tree}: generate failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    s = json.loads(out.read_text())
    row = {k: s.get(k) for k in KEYS}
    row.update(load=load, digest=hashlib.sha256(r.stdout.encode()).hexdigest()[:12])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, type=Path, help="the first tree (the baseline)")
    p.add_argument("--b", required=True, type=Path, help="the second tree")
    p.add_argument("--model", action="append", required=True, help="a model to run (repeatable)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--prompt-file", required=True, type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, help="write the runs and the summary here")
    a, extra = p.parse_known_args()
    extra = [x for x in extra if x != "--"]
    a.prompt_file = a.prompt_file.resolve()
    trees = {"a": a.a.resolve(), "b": a.b.resolve()}
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(1, a.rounds + 1):
            for name, tree in trees.items():
                for model in a.model:
                    row = {"tree": name, "model": model, "round": rnd, **run(tree, model, a, extra, Path(tmp))}
                    runs.append(row)
                    print(json.dumps(row), flush=True)
    summary = {}
    for model in a.model:
        med = {n: {k: statistics.median(r[k] for r in runs if r["tree"] == n and r["model"] == model and r[k]
                                        is not None) for k in KEYS} for n in trees}
        summary[model] = {"a": med["a"], "b": med["b"],
                          "b_over_a": {k: med["b"][k] / med["a"][k] if med["a"][k] else None for k in KEYS}}
        print(f"{model}: decode {med['a']['decode_tok_s']:.2f} -> {med['b']['decode_tok_s']:.2f} tok/s, CPU per "
              f"token {med['a']['cpu_s_per_decoded_token']:.4f} -> {med['b']['cpu_s_per_decoded_token']:.4f} s, "
              f"the rest {med['a']['cpu_rest_s_per_token']:.4f} -> {med['b']['cpu_rest_s_per_token']:.4f} s")
    if a.json:
        a.json.write_text(json.dumps({"cpu": cpu_model(), "trees": {k: str(v) for k, v in trees.items()},
                                      "args": extra, "runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
