"""Expert parallelism benchmark: 1, 2 and 3 processes (or GPUs), each with its share of one total budget.

One command (it writes the checkpoint when the folder does not exist, and deletes nothing):

    python benchmarks/expert_parallel.py --model /work/big/ep/q30-4l --layers 4 --total-budget-gb 1.2 \\
        --nproc 1 2 3 --out benchmarks/results/expert_parallel_cpu.json

On GPUs (the lead's run: 2 H200s, experts split across their VRAM, against one GPU):

    python benchmarks/expert_parallel.py --model /tmp/q30-12l --layers 12 --device cuda \\
        --total-budget-gb 8 --nproc 1 2 --out expert_parallel_gpu.json
    # or each GPU with the same VRAM budget (2 GPUs hold twice the experts); add --extra --host-cache-gb auto
    # for the one-GPU tiered run

1. ``moestream synth`` of a Qwen3-30B-A3B-shaped checkpoint (bf16, ``spread`` init) with ``--layers``
   layers, when ``--model`` does not exist.
2. A learning run (one process, ``--usage-file``) writes a usage profile; every measured run starts
   from a copy of it, so all of them pin the same hot experts (the 1-process row too) and the
   balanced placement has a profile.
3. For each ``--nproc`` N (and each ``--combine``, ``--placement``): ``moestream generate`` (under
   ``torchrun --nproc-per-node N`` when N > 1) with ``--cache-budget-gb total / N`` per rank,
   ``--no-page-cache`` (reads hit the disk), sampling at temperature 1 with a fixed seed (varied
   tokens, the same in every run), ``OMP_NUM_THREADS`` = cores / N on the CPU. From rank 0's stats
   JSON: decode tok/s, per rank and summed hit rate, GB read, bytes exchanged, seconds in
   collectives, distinct experts per layer; the logits digest, which must equal the 1-process
   run's (CPU and GPU alike).

Prints a table; writes everything to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
CONFIG = Path("/work/shared/models/configs/Qwen3-30B-A3B.json")
PROMPT = ("Expert parallelism splits the experts of every layer between processes; the hidden states travel "
          "to the owners and back.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_avg() -> list[float]:
    return list(os.getloadavg())


def run_one(args, nproc: int, combine: str, placement: str, work: Path, profile: Path) -> dict:
    """One measured ``generate`` run; returns rank 0's stats JSON plus the wall time and load."""
    tag = f"n{nproc}-{combine}-{placement}"
    budget = args.budget_per_rank_gb if args.budget_per_rank_gb is not None else args.total_budget_gb / nproc
    stats = work / f"{tag}.json"
    usage = work / f"{tag}.usage.json"
    shutil.copy(profile, usage)
    gen = ["generate", "--model", str(args.model), "--prompt", PROMPT, "--no-chat-template", "--max-tokens",
           str(args.tokens), "--temp", "1", "--seed", "0", "--cache-budget-gb", f"{budget:.6f}",
           "--device", args.device, "--usage-file", str(usage), "--stats-json", str(stats),
           "--ep-combine", combine, "--ep-placement", placement, "--dist-timeout", "300"]
    if args.device == "cpu":
        gen.append("--no-page-cache")
    gen += args.extra
    env = dict(os.environ)
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    if nproc == 1:
        cmd = [sys.executable, "-m", "moestream", *gen]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(_free_port()), "-m", "moestream", *gen]
    load0 = _load_avg()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{tag} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    d = json.loads(stats.read_text())
    d["wall_seconds"] = wall
    d["load_before"], d["load_after"] = load0, _load_avg()
    d["nproc"], d["combine"], d["placement"] = nproc, combine, placement
    d["command"] = " ".join(cmd[1:])
    return d


def row(d: dict) -> dict:
    """The numbers of one run, summed over ranks."""
    ep = d.get("expert_parallel")
    decoded = max(1, d["generated_tokens"] - 1)
    tokens = d["prompt_tokens"] + d["generated_tokens"]
    if ep is None:
        hit, gb, kb, coll = d["cache_hit_rate"], d["gb_read"], 0.0, 0.0
        distinct, per_rank_gb = d["distinct_experts_per_layer_mean"], [d["gb_read"]]
    else:
        s = ep["sum"]
        hit, gb, kb, coll = s["cache_hit_rate"], s["gb_read"], s["kb_exchanged_per_token"], s["collective_seconds_max"]
        distinct = s["distinct_experts"] / max(1, len(d["distinct_experts_per_layer"]))
        per_rank_gb = [r["gb_read"] for r in ep["per_rank"]]
    return {
        "nproc": d["nproc"], "combine": d["combine"], "placement": d["placement"],
        "decode_tok_s": d["decode_tok_s"], "prefill_tok_s": d["prefill_tok_s"], "hit_rate": hit,
        "gb_read": gb, "mb_read_per_token": gb * 1e3 / tokens, "gb_read_per_rank": per_rank_gb,
        "kb_exchanged_per_token": kb, "collective_seconds": coll, "distinct_experts_per_layer": distinct,
        "decoded_tokens": decoded, "logits_sha256": d["logits_sha256"], "wall_seconds": d["wall_seconds"],
        "load_before": d["load_before"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="checkpoint folder (written by synth when missing)")
    ap.add_argument("--config", type=Path, default=CONFIG, help="config to synthesize (default Qwen3-30B-A3B)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers to synthesize (default 4)")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 3], help="process counts (default 1 2 3)")
    ap.add_argument("--total-budget-gb", type=float, default=1.2, help="expert cache budget over all ranks (GB)")
    ap.add_argument("--budget-per-rank-gb", type=float, default=None,
                    help="give every rank this budget instead of a share of --total-budget-gb (GPUs: each its VRAM)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens to generate per run (default 32)")
    ap.add_argument("--combine", nargs="+", default=["allgather"], help="combines to measure (allgather, alltoall)")
    ap.add_argument("--placement", nargs="+", default=["balanced"], help="placements (balanced, contiguous)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more generate flags, passed on")
    ap.add_argument("--out", type=Path, required=True, help="results JSON")
    args = ap.parse_args(argv)
    work = args.out.parent / (args.out.stem + ".work")
    work.mkdir(parents=True, exist_ok=True)
    result = {"model": str(args.model), "layers": args.layers, "device": args.device,
              "total_budget_gb": args.total_budget_gb, "budget_per_rank_gb": args.budget_per_rank_gb,
              "tokens": args.tokens, "cpu_count": os.cpu_count(),
              "load_start": _load_avg(), "runs": []}
    if not args.model.exists():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "moestream", "synth", "--config", str(args.config), "--out",
                        str(args.model), "--layers", str(args.layers)], cwd=HERE, check=True)
        result["synth_seconds"] = time.perf_counter() - t0
    # the learning run: a usage profile every measured run starts from
    profile = work / "profile.json"
    if not profile.exists():
        subprocess.run([sys.executable, "-m", "moestream", "generate", "--model", str(args.model), "--prompt",
                        "A different prompt, so that the profile is learned on other tokens than those measured.",
                        "--no-chat-template", "--max-tokens", str(args.tokens), "--temp", "1", "--seed", "1",
                        "--cache-budget-gb", str(args.total_budget_gb), "--device", args.device, "--quiet",
                        "--usage-file", str(profile)], cwd=HERE, check=True, capture_output=True)
    ref = None
    for n in args.nproc:
        for combine in (args.combine if n > 1 else ["allgather"]):
            for placement in (args.placement if n > 1 else ["balanced"]):
                d = run_one(args, n, combine, placement, work, profile)
                r = row(d)
                if n == 1:
                    ref = r["logits_sha256"]
                r["logits_equal_to_1_process"] = ref is not None and r["logits_sha256"] == ref
                result["runs"].append({"row": r, "stats": d})
                print(json.dumps(r), flush=True)
    result["load_end"] = _load_avg()
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'procs':>5} {'combine':>9} {'placement':>10} {'decode tok/s':>12} {'hit rate':>8} "
          f"{'MB read/tok':>11} {'KB exch/tok':>11} {'s in coll.':>10} {'distinct/layer':>14} {'== 1 proc':>9}")
    for run in result["runs"]:
        r = run["row"]
        print(f"{r['nproc']:>5} {r['combine']:>9} {r['placement']:>10} {r['decode_tok_s']:>12.2f} "
              f"{r['hit_rate']:>8.1%} {r['mb_read_per_token']:>11.1f} {r['kb_exchanged_per_token']:>11.1f} "
              f"{r['collective_seconds']:>10.2f} {r['distinct_experts_per_layer']:>14.1f} "
              f"{str(r['logits_equal_to_1_process']):>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
