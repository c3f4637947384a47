"""Pieces the benchmark scripts share: timers, the GPU scripts' log, HBM rate, run record and checkpoint,
their common flags. Imported as ``_common`` by a script run as ``python benchmarks/<script>.py``.

Only the standard library is imported here at the top (torch inside the GPU helpers), so a script that
imports moestream before torch, for its OpenMP wait policy, keeps that order.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

T0 = time.perf_counter()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for a result's record."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def log(*a):
    """Print with the seconds since the script started, flushed."""
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def median_ms(fn, runs: int, clock=time.perf_counter, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``runs`` calls by ``clock`` (wall, or CPU time), after
    ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def timed_steps(net, tokens, pos: int, kv) -> tuple[list[float], list[float]]:
    """Decode ``tokens`` one at a time from ``pos`` on the CPU: (CPU seconds, wall seconds) of each step."""
    import torch

    cpu, wall = [], []
    for tok in tokens:
        c0, w0 = time.process_time(), time.perf_counter()
        net(torch.tensor([tok]), pos, kv)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        pos += 1
    return cpu, wall


def add_decode_args(p, *, layers: int, tokens: int, warm_decode: int, tokens_help: str = "timed decode steps"):
    """The GPU decode scripts' common flags: --layers, --tokens, --warm, --warm-decode."""
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--tokens", type=int, default=tokens, help=tokens_help)
    p.add_argument("--warm", type=int, default=256, help="warm-up prefill tokens")
    p.add_argument("--warm-decode", type=int, default=warm_decode)


def hbm_rate(dev) -> float:
    """GB/s of a 2 GB device-to-device copy, counting bytes read and written (median of 10)."""
    import torch

    a = torch.empty(2 << 30, dtype=torch.uint8, device=dev).random_(0, 255)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * (2 << 30) / sorted(times[2:])[5] / 1e9


def prefill_seconds(net, prompt, runs: int) -> list[float]:
    """Seconds of ``runs`` prefills of ``prompt`` on the GPU, each on a fresh KV cache, synchronized."""
    import torch

    out = []
    for _ in range(runs):
        kv = net.new_kv_cache(len(prompt) + 8)
        torch.cuda.synchronize()
        t = time.perf_counter()
        net(prompt, 0, kv)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
        del kv
    return out


def gpu_run(a, dev, config: Path) -> tuple[dict, object]:
    """The start of a GPU script's run: its record (command, device, torch and Triton versions, layers) and
    the function that writes it to ``a.out``; the checkpoint ``a.model`` written first when it does not
    exist (``config`` at ``a.layers``, bf16, ``spread`` init, random values drawn on the GPU), timed."""
    import torch

    res = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "layers": a.layers}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        pass

    def save():
        a.out.write_text(json.dumps(res, indent=1))

    if not a.model.exists():
        from moestream.synth import plan_synth, write_synth

        t = time.perf_counter()
        write_synth(plan_synth(config, a.layers, "bf16", 0, None, "spread", 5.0), a.model, device="cuda")
        res["synth_seconds"] = time.perf_counter() - t
        log(f"synth {a.layers} layers: {res['synth_seconds']:.1f} s")
    return res, save
