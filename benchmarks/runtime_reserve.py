"""What a run takes beyond the budget plan's known parts, against the reserve the plan sets aside.

One fresh process per (checkpoint, budget): ``moestream.load`` with the plan's call wrapped to note this process's
RSS when the budget is planned (what ``memory.available_bytes`` already subtracts), then a prefill of ``--prompt``
tokens of the bench text and ``--tokens`` decoded ones. Printed per run (JSON): the RSS at plan time, the resident
weights, the cache's peak, the KV cache the plan counted, the peak RSS, their difference ``growth`` (what the
reserve must cover: read buffers, the load's transients, activations, the allocator) and the reserve the plan set::

    python benchmarks/runtime_reserve.py --model q30-12t-4b --budgets 0.3,1 --out reserve.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"


def one(model: str, budget: str, prompt: int, tokens: int) -> dict:
    from moestream import budget as budget_module
    from moestream import load_plan, memory
    from moestream.engine import load
    from moestream.generation import GenerationStats, generate

    seen = {}
    plan = budget_module.plan_cpu_budget

    def noted(*a, **k):
        seen["rss"] = memory.current_rss_bytes()
        got = plan(*a, **k)
        seen["reserve"], seen["kv"] = got.reserve, got.kv_cache
        return got

    load_plan.plan_cpu_budget = noted
    engine = load(model, budget if budget in ("all", "auto") else float(budget), progress=False, hotlist=False,
                  learn_experts=False, context_tokens=prompt + tokens)
    ids = engine.tokenizer.encode((SHARED / "bench" / "prompt.txt").read_text())
    ids = (ids * (prompt // len(ids) + 1))[:prompt]
    st = GenerationStats()
    for _ in generate(engine, ids, tokens, stats=st):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    resident, held = st.resident_weight_gb * 1e9, st.cache_peak_gb * 1e9
    return {"model": model, "budget": budget, "rss_at_plan_gb": seen["rss"] / 1e9, "resident_gb": resident / 1e9,
            "cache_peak_gb": held / 1e9, "kv_gb": seen["kv"] / 1e9, "peak_rss_gb": peak / 1e9,
            "growth_gb": (peak - seen["rss"] - resident - held) / 1e9, "planned_reserve_gb": seen["reserve"] / 1e9,
            "load_average": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, help="a checkpoint (repeat for several)")
    ap.add_argument("--budgets", default="0.3,1")
    ap.add_argument("--prompt", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # (model, budget): the worker
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1], a.prompt, a.tokens)))
        return
    rows = []
    for model in a.model:
        for b in a.budgets.split(","):
            out = subprocess.run([sys.executable, __file__, "--model", model, "--one", model, b, "--prompt",
                                  str(a.prompt), "--tokens", str(a.tokens)], capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]))
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
