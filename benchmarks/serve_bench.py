"""Serving many users: ``moestream serve --max-batch N`` under aiperf at several concurrencies (issue 34).

For each concurrency a fresh ``moestream serve`` process (the same flags, a cold expert cache) is started and
aiperf (NVIDIA's load tester for OpenAI-compatible endpoints; install it into a venv of its own:
``python -m venv /work/aiperf-venv && /work/aiperf-venv/bin/pip install aiperf``) sends streamed chat requests
of ``--isl`` synthetic prompt tokens and exactly ``--osl`` output tokens (``ignore_eos``, ``min_tokens``).
Recorded per concurrency: aiperf's output tok/s and time to first token (p50), and from the server's
``/metrics`` the expert bytes read per output token (``moestream_disk_read_bytes_total`` over
``moestream_generated_tokens_total``, prefill included) and the batch sizes its steps ran.

``--single-stream`` also measures, in this process and side by side (alternating, medians), one sequence's
decode speed through ``generation.generate`` (the loop before the scheduler) and through the scheduler
(what the server runs now): the issue asks for the second within 5% of the first.

    python benchmarks/serve_bench.py --model /work/sv-bench/q30-2l --cache-budget-gb 1 \\
        --aiperf /work/aiperf-venv/bin/aiperf --tokenizer /work/shared/tokenizers/qwen3 \\
        --out benchmarks/results/serve_cpu_q30_2l.json --single-stream

Writes one JSON object (the command, the machine, each level's figures, the ratios against concurrency 1).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import cpu_model, load_average  # noqa: E402
from bench import Cap, drop_caches, parse_size  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m[1]) if m else 0.0


def batch_histogram(text: str) -> dict[str, float]:
    """The cumulative counts of moestream_batch_size_bucket by upper bound."""
    return {m[1]: float(m[2]) for m in re.finditer(r'^moestream_batch_size_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)}


def start_server(args, port: int, cap: Cap | None = None) -> subprocess.Popen:
    """``moestream serve`` on ``port`` (inside ``cap``'s cgroup when given), once /health answers."""
    cmd = [sys.executable, "-m", "moestream", "serve", "--model", args.model, "--port", str(port),
           "--cache-budget-gb", args.cache_budget_gb, "--max-batch", str(args.max_batch), "--max-queue", "256",
           "--max-context", str(args.max_context), "--model-name", "bench", "--no-hotlist", "--no-learn-experts",
           "--prefix-cache-gb", str(args.prefix_cache_gb)]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    if cap is not None:
        cmd = cap.wrap(cmd)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise SystemExit("the server did not start in 10 minutes")
        time.sleep(0.5)


def run_aiperf(args, port: int, concurrency: int, requests: int, where: Path) -> dict:
    """One aiperf profile; returns its JSON export's metrics."""
    cmd = [args.aiperf, "profile", "--model", "bench", "--url", f"http://127.0.0.1:{port}", "--endpoint-type", "chat",
           "--streaming", "--concurrency", str(concurrency), "--request-count", str(requests),
           "--synthetic-input-tokens-mean", str(args.isl), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(args.osl), "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{args.osl}",
           "--tokenizer", args.tokenizer, "--artifact-dir", str(where), "--ui-type", "none",
           "--random-seed", "0", "--request-timeout-seconds", "3600"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"aiperf failed ({done.returncode}): {done.stderr[-3000:]}{done.stdout[-2000:]}")
    found = sorted(where.rglob("profile_export_aiperf.json"))
    if not found:
        raise SystemExit(f"no profile_export_aiperf.json under {where}: {done.stdout[-2000:]}")
    return json.loads(found[-1].read_text())


def figure(export: dict, name: str, stat: str) -> float | None:
    """A metric's statistic from aiperf's JSON export (its layout: {"records": {name: {stat: v}}} or flat)."""
    for holder in (export.get("records"), export.get("metrics"), export):
        if isinstance(holder, dict) and isinstance(holder.get(name), dict) and stat in holder[name]:
            return holder[name][stat]
    return None


def level(args, concurrency: int) -> dict:
    port = free_port()
    cap = None
    if args.cap:  # the server alone in the cgroup (aiperf outside it), from a dropped page cache
        cap = Cap(parse_size(args.cap), f"moestream-serve-bench-{os.getpid()}-{concurrency}")
        if cap.dir is None:
            raise SystemExit("--cap needs root and a cgroup memory controller")
        drop_caches()
    try:
        proc = start_server(args, port, cap)
    except BaseException:  # the server refused or did not start: the cgroup goes with it
        if cap is not None:
            cap.close()
        raise
    url = f"http://127.0.0.1:{port}"
    try:
        before = httpx.get(url + "/metrics").text
        load0 = load_average()
        with tempfile.TemporaryDirectory(prefix=f"aiperf-c{concurrency}-") as where:
            t0 = time.perf_counter()
            export = run_aiperf(args, port, concurrency, args.requests_per_stream * concurrency, Path(where))
            wall = time.perf_counter() - t0
        after = httpx.get(url + "/metrics").text
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        peak, kills = (cap.peak(), cap.oom_kills()) if cap is not None else (None, 0)
        if cap is not None:
            cap.close()
    tokens = metric(after, "moestream_generated_tokens_total") - metric(before, "moestream_generated_tokens_total")
    read = metric(after, "moestream_disk_read_bytes_total") - metric(before, "moestream_disk_read_bytes_total")
    h0, h1 = batch_histogram(before), batch_histogram(after)
    steps = metric(after, "moestream_batch_size_count") - metric(before, "moestream_batch_size_count")
    seqs = metric(after, "moestream_batch_size_sum") - metric(before, "moestream_batch_size_sum")
    return {
        "concurrency": concurrency,
        "requests": args.requests_per_stream * concurrency,
        "output_tok_s": figure(export, "output_token_throughput", "avg"),
        "ttft_p50_ms": figure(export, "time_to_first_token", "p50"),
        "ttft_avg_ms": figure(export, "time_to_first_token", "avg"),
        "inter_token_latency_p50_ms": figure(export, "inter_token_latency", "p50"),
        "request_latency_p50_ms": figure(export, "request_latency", "p50"),
        "output_tokens_server": tokens,
        "expert_bytes_read": read,
        "expert_mb_read_per_output_token": read / tokens / 1e6 if tokens else None,
        "scheduler_steps": steps,
        "mean_sequences_per_step": seqs / steps if steps else None,
        "steps_by_batch_size_le": {k: h1.get(k, 0) - h0.get(k, 0) for k in h1},
        "wall_s": round(wall, 1),
        "cap": args.cap, "cap_peak_gb": None if peak is None else round(peak / 2**30, 3), "oom_kills": kills,
        "load_average_before": load0,
        "load_average_after": load_average(),
    }


def single_stream(args) -> dict:
    """Decode tok/s of one sequence, generate() vs the scheduler, alternating, in this process."""
    sys.path.insert(0, str(ROOT))
    from moestream.engine import load  # noqa: I001  (before torch: moestream's OpenMP wait policy)
    import torch

    from moestream.generation import GenerationStats, generate
    from moestream.scheduler import Request, Scheduler

    budget = args.cache_budget_gb if args.cache_budget_gb in ("all", "auto") else float(args.cache_budget_gb)
    g = torch.Generator().manual_seed(1)
    with load(args.model, cache_budget_gb=budget, hotlist=False, learn_experts=False) as engine:
        ids = torch.randint(0, 150000, (args.isl,), generator=g).tolist()
        plain, sched = [], []
        for _ in range(args.single_stream_rounds):
            stats = GenerationStats()
            list(generate(engine, ids, args.osl, stats=stats, stop_at_eos=False))
            plain.append(stats.decode_tok_s)
            s = Scheduler(engine, 1)
            seq = s.submit(Request(ids, args.osl, ignore_eos=True))
            while s.has_work():
                s.step()
            sched.append(seq.stats.decode_tok_s)
    p, q = statistics.median(plain), statistics.median(sched)
    return {"generate_decode_tok_s": plain, "scheduler_decode_tok_s": sched, "generate_median": p,
            "scheduler_median": q, "scheduler_over_generate": q / p if p else None}


def step_scale(args) -> list[dict]:
    """In this process, without HTTP or a load tester on the same cores: B sequences decoding together (after
    64-token prompts), the median of 12 steps' time, decode tok/s and expert MB read per step, B = 1, 4, 8.
    ``--device cuda --profile DIR``: also the steps with CUDA graphs off and the GPU time per kernel
    of the batch-8 steps (torch.profiler's table, graphs off so each kernel is seen)."""
    sys.path.insert(0, str(ROOT))
    from moestream.engine import load  # noqa: I001  (before torch: moestream's OpenMP wait policy)
    import torch

    from moestream.scheduler import Request, Scheduler

    budget = args.cache_budget_gb if args.cache_budget_gb in ("all", "auto") else float(args.cache_budget_gb)
    g = torch.Generator().manual_seed(0)
    out = []
    graphs = (True, False) if args.device == "cuda" and args.profile else (True,)
    for graphed in graphs:
        with load(args.model, cache_budget_gb=budget, hotlist=False, learn_experts=False, device=args.device,
                  max_batch=args.max_batch, cuda_graphs=graphed) as engine:
            for b in (1, 4, 8):
                sch = Scheduler(engine, b)
                for _ in range(b):
                    sch.submit(Request(torch.randint(0, 150000, (64,), generator=g).tolist(), 40, ignore_eos=True))
                while sch.waiting or any(s.state != "decode" for s in sch.running):
                    sch.step()
                for _ in range(3):
                    sch.step()
                times, read0 = [], engine.store.stats.bytes_read
                for _ in range(12):
                    t0 = time.perf_counter()
                    sch.step()
                    times.append(time.perf_counter() - t0)
                step = statistics.median(times)
                read = (engine.store.stats.bytes_read - read0) / 12
                out.append({"batch": b, "cuda_graphs": graphed, "step_ms": 1000 * step, "decode_tok_s": b / step,
                            "expert_mb_read_per_step": read / 1e6, "expert_mb_read_per_token": read / 1e6 / b})
                print(json.dumps(out[-1]), flush=True)
                if args.profile and b == 8 and not graphed:
                    from torch.profiler import ProfilerActivity, profile
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        for _ in range(6):
                            sch.step()
                    args.profile.mkdir(parents=True, exist_ok=True)
                    (args.profile / "step8_profile.txt").write_text(
                        prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
                    (args.profile / "step8_profile_cpu.txt").write_text(
                        prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
                sch.close()
    return out


def second_turn(args) -> dict:
    """Time to first token of a chat's second turn after ``--history`` tokens, with the prefix cache holding the
    first turn, against a fresh prompt of only the new turn's ``--new-turn`` tokens (medians of alternating runs)."""
    sys.path.insert(0, str(ROOT))
    from moestream.engine import load  # noqa: I001  (before torch: moestream's OpenMP wait policy)
    import torch

    from moestream.generation import GenerationStats, generate

    budget = args.cache_budget_gb if args.cache_budget_gb in ("all", "auto") else float(args.cache_budget_gb)
    g = torch.Generator().manual_seed(2)
    with load(args.model, cache_budget_gb=budget, hotlist=False, learn_experts=False, prefix_cache_gb=2) as engine:
        history = torch.randint(0, 150000, (args.history,), generator=g).tolist()
        cached, fresh = [], []
        t0 = time.perf_counter()
        list(generate(engine, history, 1))  # turn 1: its blocks go to the prefix cache
        first = time.perf_counter() - t0  # the whole history prefilled: what turn 2 would cost without the cache
        for _ in range(args.single_stream_rounds):
            new = torch.randint(0, 150000, (args.new_turn,), generator=g).tolist()
            stats = GenerationStats()
            t0 = time.perf_counter()
            next(iter(generate(engine, history + new, 1, stats=stats)))
            cached.append(time.perf_counter() - t0)
            assert stats.prompt_cached_tokens >= args.history // 16 * 16, stats.prompt_cached_tokens
            t0 = time.perf_counter()
            next(iter(generate(engine, new, 1)))
            fresh.append(time.perf_counter() - t0)
    a, b = statistics.median(cached), statistics.median(fresh)
    return {"history_tokens": args.history, "new_tokens": args.new_turn, "ttft_second_turn_s": cached,
            "ttft_new_turn_alone_s": fresh, "ratio_median": a / b, "ttft_history_prefilled_s": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache-budget-gb", default="1")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--prefix-cache-gb", type=float, default=0.0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--requests-per-stream", type=int, default=3, help="requests per concurrent stream (default 3)")
    ap.add_argument("--isl", type=int, default=256, help="prompt tokens (default 256)")
    ap.add_argument("--osl", type=int, default=64, help="output tokens (default 64)")
    ap.add_argument("--aiperf", default="aiperf")
    ap.add_argument("--cap", default=None, help="a memory cap for the server (cgroup, e.g. 5G; root): each level "
                    "starts from a dropped page cache inside it")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--single-stream", action="store_true")
    ap.add_argument("--single-stream-rounds", type=int, default=3)
    ap.add_argument("--second-turn", action="store_true", help="time a second chat turn's first token (prefix cache)")
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--new-turn", type=int, default=64)
    ap.add_argument("--skip-serve", action="store_true", help="only the in-process measurements")
    ap.add_argument("--step-scale", action="store_true", help="in-process decode speed and reads at batch 1, 4, 8")
    ap.add_argument("--device", default="cpu", help="device of the in-process runs (default cpu)")
    ap.add_argument("--profile", type=Path, default=None, help="with --step-scale on cuda: kernel tables here")
    ap.add_argument("--threads", type=int, default=0,
                    help="OMP_NUM_THREADS for the server and the in-process runs (default: as inherited). On a "
                    "machine whose cores other processes keep busy, one thread avoids a kernel call waiting a "
                    "time slice for its second thread")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported (the in-process runs)
    result = {"command": " ".join(sys.argv), "cpu": cpu_model(), "cores": os.cpu_count(), "model": args.model,
              "cache_budget_gb": args.cache_budget_gb, "max_batch": args.max_batch, "isl": args.isl, "osl": args.osl,
              "threads": args.threads or os.environ.get("OMP_NUM_THREADS") or "default",
              "levels": []}
    for c in [] if args.skip_serve else args.concurrency:
        r = level(args, c)
        result["levels"].append(r)
        print(json.dumps(r), flush=True)
    base = result["levels"][0] if result["levels"] else {}
    for r in result["levels"]:
        if base["output_tok_s"] and r["output_tok_s"]:
            r["output_tok_s_vs_first"] = r["output_tok_s"] / base["output_tok_s"]
        if base["expert_mb_read_per_output_token"] and r["expert_mb_read_per_output_token"]:
            r["expert_bytes_per_token_vs_first"] = r["expert_mb_read_per_output_token"] / \
                base["expert_mb_read_per_output_token"]
    if args.single_stream:
        result["single_stream"] = single_stream(args)
        print(json.dumps(result["single_stream"]), flush=True)
    if args.step_scale:
        result["step_scale"] = step_scale(args)
        print(json.dumps(result["step_scale"]), flush=True)
    if args.second_turn:
        result["second_turn"] = second_turn(args)
        print(json.dumps(result["second_turn"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
