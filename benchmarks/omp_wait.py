"""OpenMP wait policy: moestream's short spin against PASSIVE and endless spinning, side by side.

Each configuration runs in a fresh process (libgomp reads ``OMP_WAIT_POLICY`` when it
loads), alternating, ``--rounds`` times: a ``--prompt``-token prefill and ``--tokens``
sampled decode steps on a checkpoint at budget ``all``. Prints medians (wall and CPU
seconds) and the load average, as a Markdown table for ``docs/benchmarks.md``.

    .venv/bin/python benchmarks/omp_wait.py --model CHECKPOINT [--rounds 3]

moestream's default is ``GOMP_SPINCOUNT=10000`` (a short spin, then sleep; moestream sets it unless
``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is set); ``PASSIVE`` sleeps at once, ``ACTIVE`` spins without
end. Run it on an idle machine and beside other busy jobs: the best one differs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import moestream  # sets GOMP_SPINCOUNT unless a wait is given
import torch
torch.set_num_threads(int(sys.argv[2]))
from moestream.engine import load
from moestream.generation import SamplingParams, generate
eng = load(sys.argv[1], cache_budget_gb="all", tokenizer=False, learn_experts=False)
ids = [(i * 7919) % 150000 for i in range(int(sys.argv[3]))]
t0, c0 = time.perf_counter(), time.process_time()
g = generate(eng, ids, int(sys.argv[4]) + 1, SamplingParams(temperature=1.0, seed=1), stop_at_eos=False)
next(g)
t1, c1 = time.perf_counter(), time.process_time()
n = sum(1 for _ in g)
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"prefill_s": t1 - t0, "prefill_cpu_s": c1 - c0, "decode_s_per_token": (t2 - t1) / n,
                  "decode_cpu_s_per_token": (c2 - c1) / n}))
"""

CONFIGS = [("short spin (moestream's default), 2 threads", None, 2), ("PASSIVE, 2 threads", "PASSIVE", 2),
           ("ACTIVE (endless spin), 2 threads", "ACTIVE", 2), ("PASSIVE, 1 thread", "PASSIVE", 1)]


def env_for(policy: str | None) -> dict:
    """The child's environment: ``policy`` as OMP_WAIT_POLICY, or neither variable (moestream's default)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return env if policy is None else {**env, "OMP_WAIT_POLICY": policy}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=16)
    a = p.parse_args()
    results: dict[str, list[dict]] = {name: [] for name, _, _ in CONFIGS}
    loads = []
    for _ in range(a.rounds):
        for name, policy, threads in CONFIGS:
            loads.append(os.getloadavg()[0])
            out = subprocess.run([sys.executable, "-c", CHILD, a.model, str(threads), str(a.prompt), str(a.tokens)],
                                 env=env_for(policy), capture_output=True, text=True,
                                 check=True)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"load average (1 min) during the runs: {min(loads):.1f}-{max(loads):.1f}; {a.rounds} rounds, medians\n")
    print(f"| OpenMP | prefill {a.prompt} tokens, wall s | prefill CPU s | decode s / token | decode CPU s / token |")
    print("| --- | --- | --- | --- | --- |")
    for name, _, _ in CONFIGS:
        r = results[name]

        def med(k: str, r=r) -> float:
            return statistics.median(x[k] for x in r)

        print(f"| {name} | {med('prefill_s'):.2f} | {med('prefill_cpu_s'):.2f} | {med('decode_s_per_token'):.3f} "
              f"| {med('decode_cpu_s_per_token'):.3f} |")


if __name__ == "__main__":
    main()
