"""One user's path through ``moestream serve``: streamed completions timed as a client sees them.

Starts ``moestream serve`` on ``--model`` (any further arguments after ``--`` go to ``serve``), waits for
``/v1/models``, then sends ``--requests`` streaming ``/v1/completions`` requests one after the other, each a
prompt of ``--prompt`` varied token ids (a new prompt per request) and ``max_tokens`` ``--tokens``, greedy,
with ``ignore_eos`` (a random-weight synth may draw its EOS early). Per request: time to the first token,
the time between the first and the last token over the tokens after the first (what a streaming client
sees; the prefill drops out), and how many tokens came. With ``--concurrency 1,8`` it then sends, for each
level N, N such requests at once (threads, each its own prompt) and reports output tokens per second over
the wall time of the round, the client's view of batching (a stand-in for aiperf where it is not
installed). Writes ``--out`` (JSON) and prints a line each::

    python benchmarks/serve_request.py --model /dev/shm/q30-48 --out serve.json -- --device cuda --max-batch 8

The same measure as ``benchmarks/gpu_generate.py``'s "first to last" of ``generate`` in-process, so the two
side by side give the server's own cost (HTTP, SSE framing, detokenization, the request thread).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def wait_ready(url: str, proc: subprocess.Popen, limit_s: float) -> float:
    """Seconds until ``GET url/v1/models`` answers 200; raises RuntimeError when the server exits first or
    ``limit_s`` passes."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        if proc.poll() is not None:
            raise RuntimeError(f"moestream serve exited with {proc.returncode} before it answered")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"moestream serve did not answer within {limit_s:.0f} s")


def one_request(url: str, ids: list[int], tokens: int) -> dict:
    """Stream one completion of prompt ``ids``; arrival time of each text chunk, seconds after sending."""
    body = {"prompt": ids, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    arrivals, usage = [], None
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter() - t0)
    total = time.perf_counter() - t0
    out = {"ttft_s": arrivals[0] if arrivals else None, "chunks": len(arrivals), "total_s": total, "usage": usage}
    n = (usage or {}).get("completion_tokens") or len(arrivals)
    if len(arrivals) >= 2 and n >= 2:
        out["first_to_last_ms_per_token"] = 1000 * (arrivals[-1] - arrivals[0]) / (n - 1)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (varied ids)")
    p.add_argument("--tokens", type=int, default=128, help="max_tokens of each request")
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--concurrency", default="", help="comma list of concurrency levels to run after the serial "
                                                     "requests (e.g. 1,8)")
    p.add_argument("--port", type=int, default=8187)
    p.add_argument("--ready-limit", type=float, default=300, help="seconds the server may take to load")
    p.add_argument("--out", type=Path, default=Path("serve_request.json"))
    p.add_argument("serve_args", nargs="*", help="after --: more arguments for moestream serve")
    a = p.parse_args()
    url = f"http://127.0.0.1:{a.port}"
    cmd = [sys.executable, "-m", "moestream", "serve", "--model", a.model, "--port", str(a.port), *a.serve_args]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    result: dict = {"command": " ".join(cmd), "prompt": a.prompt, "tokens": a.tokens, "requests": []}
    try:
        result["ready_s"] = wait_ready(url, proc, a.ready_limit)
        rng = random.Random(0)
        for i in range(a.requests):
            ids = [rng.randrange(1000, 100000) for _ in range(a.prompt)]
            r = one_request(url, ids, a.tokens)
            result["requests"].append(r)
            print(f"request {i + 1}: time to first token {r['ttft_s']:.3f} s, {r['chunks']} chunks, "
                  f"first to last {r.get('first_to_last_ms_per_token', float('nan')):.2f} ms/token", flush=True)
            a.out.write_text(json.dumps(result, indent=1))
        steps = [r["first_to_last_ms_per_token"] for r in result["requests"] if "first_to_last_ms_per_token" in r]
        if steps:
            result["median_ms_per_token"] = statistics.median(steps)
            print(f"median first to last: {result['median_ms_per_token']:.2f} ms/token "
                  f"({1000 / result['median_ms_per_token']:.0f} tok/s)")
        result["concurrency"] = {}
        for n in [int(c) for c in a.concurrency.split(",") if c]:
            prompts = [[rng.randrange(1000, 100000) for _ in range(a.prompt)] for _ in range(n)]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                runs = list(pool.map(lambda ids: one_request(url, ids, a.tokens), prompts))
            wall = time.perf_counter() - t0
            tokens = sum((r["usage"] or {}).get("completion_tokens") or r["chunks"] for r in runs)
            key = str(n)  # a level asked again (a round with the graphs of its batch sizes captured): "8#2"
            while key in result["concurrency"]:
                key = f"{n}#{int(key.partition('#')[2] or 1) + 1}"
            result["concurrency"][key] = {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
                                          "ttft_p50_s": statistics.median(r["ttft_s"] for r in runs)}
            print(f"concurrency {key}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} output tok/s, "
                  f"time to first token p50 {result['concurrency'][key]['ttft_p50_s']:.3f} s", flush=True)
            a.out.write_text(json.dumps(result, indent=1))
        if a.concurrency:  # the server's own counters: steps, batch sizes, graph replays
            result["metrics"] = [ln for ln in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                                 if ln.startswith("moestream_") and not ln.startswith("moestream_info")]
            a.out.write_text(json.dumps(result, indent=1))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
