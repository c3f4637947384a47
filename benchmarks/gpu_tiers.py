"""GPU tier benchmark: decode speed with experts streamed into a VRAM cache, with and without a
host-RAM tier, against the floor set by the copy and disk rates measured in the same run.

One command on a CUDA machine (it writes the checkpoint when the folder does not exist):

    python benchmarks/gpu_tiers.py --model /tmp/q30-12l --layers 12 --out gpu_tiers.json

1. ``moestream synth`` of a Qwen3-30B-A3B-shaped checkpoint (bf16, ``spread`` init) with
   ``--layers`` layers, timed.
2. Rates: host-to-device copies of expert-sized (9.44 MB) pieces from pinned memory (PyTorch's
   pinned allocator, and the store's registered buffers), and from pageable memory; the best
   disk read rate (O_DIRECT, 16 MiB reads at random aligned offsets, 1 and 8 threads).
3. For each configuration -- every expert resident in VRAM (budget ``all``), VRAM budgets of
   10/25/50/100 % of the expert bytes, each without and with the host tier (``auto``) --
   ``load`` with ``--no-page-cache``, a warm-up prefill of ``--warm`` varied tokens (so the
   tiers start warm, as in a long session), ``--warm-decode`` decode steps, then ``--tokens``
   timed decode steps fed fixed varied token ids (the same for every configuration). Per
   token: ms, VRAM / host / disk hits, bytes host-to-device, bytes from disk; the floor
   ``h2d_bytes / pinned_rate + disk_bytes / disk_rate + t(all resident)`` and the ratio to it.
   Every measured step's logits are compared with the all-resident run's (``torch.equal``).
4. The host-CPU alternative for a host-tier hit: computing one token's 8 experts on the CPU
   from host memory, against copying them.

Prints a table last; writes everything to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from _common import add_decode_args  # noqa: E402

from moestream.direct_io import HugePageBuffer  # noqa: E402
from moestream.engine import load  # noqa: E402

CONFIG = HERE / "benchmarks/configs/Qwen3-30B-A3B.json"


def log(*a):
    print(*a, flush=True)


def synth(out: Path, layers: int) -> float:
    import shutil

    from moestream.synth import plan_synth, write_synth

    shutil.rmtree(out.with_name(out.name + ".partial"), ignore_errors=True)  # a run killed mid-write
    t0 = time.perf_counter()
    plan = plan_synth(CONFIG, layers, "bf16", 0, None, "spread", 5.0)
    write_synth(plan, out)
    os.sync()
    return time.perf_counter() - t0


def h2d_rates(dev: torch.device, piece: int, count: int = 64) -> dict:
    """GB/s of copying ``count`` pieces of ``piece`` bytes host-to-device, by host memory kind."""
    out = {}
    dst = torch.empty(count, piece, dtype=torch.uint8, device=dev)

    def timed(srcs):
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i, s in enumerate(srcs):
                dst[i].copy_(s, non_blocking=True)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        return count * piece / dt / 1e9

    pinned = torch.empty(count, piece, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    out["pinned_alloc"] = timed(list(pinned))
    pageable = torch.empty(count, piece, dtype=torch.uint8).random_(0, 255)
    out["pageable"] = timed(list(pageable))
    from moestream.host_tier import PinnedBufferPool

    pool = PinnedBufferPool(max_free=count)
    bufs = [pool.get(piece) for _ in range(count)]
    for _, t, _ in bufs:
        t.fill_(7)
    out["registered_mmap"] = timed([t for _, t, _ in bufs])
    out["registered_ok"] = not pool.failed
    for m, _, _ in bufs:
        pool.put(m)
    pool.close()
    return out


def disk_rate(shards: list[Path], chunk: int = 16 * 1024 * 1024, threads: int = 8, total: int = 4 << 30) -> float:
    """GB/s of O_DIRECT reads of ``chunk`` bytes at random aligned offsets over ``threads`` threads."""
    sizes = [s.stat().st_size for s in shards]
    n = total // chunk
    jobs = []
    rng = random.Random(threads)
    for _ in range(n):
        i = rng.randrange(len(shards))
        if sizes[i] < chunk:
            continue
        off = rng.randrange(0, (sizes[i] - chunk) // 4096) * 4096
        jobs.append((i, off))
    lock = threading.Lock()

    def worker():
        buf = HugePageBuffer(chunk)
        fds = [os.open(s, os.O_RDONLY | os.O_DIRECT) for s in shards]
        try:
            while True:
                with lock:
                    if not jobs:
                        return
                    i, off = jobs.pop()
                os.preadv(fds[i], [buf.view[:chunk]], off)
        finally:
            for fd in fds:
                os.close(fd)

    nbytes = len(jobs) * chunk
    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return nbytes / (time.perf_counter() - t0) / 1e9


def cpu_vs_copy(engine, dev) -> dict:
    """One token's top-k experts of layer 0: computed on the host CPU from host memory, against copied."""
    from moestream.models.moe import swiglu_expert

    k = engine.model.args.num_experts_per_tok
    ews = engine.store.read_all([(0, e) for e in range(k)])
    x = torch.randn(1, engine.model.args.hidden_size, dtype=engine.dtype)
    for _ in range(2):
        t0 = time.perf_counter()
        for ew in ews.values():
            swiglu_expert(x, ew.tensors)
        cpu = time.perf_counter() - t0
    copier = engine.cache.copier
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for ew in ews.values():
            copier.to_device(ew)
        torch.cuda.synchronize()
        copy = time.perf_counter() - t0
    for ew in ews.values():
        engine.store.release(ew)
    return {"experts": k, "cpu_compute_ms": cpu * 1e3, "h2d_copy_ms": copy * 1e3,
            "torch_threads": torch.get_num_threads()}


def run_config(model: Path, budget, host, tokens: list[int], warm: list[int], warm_decode: int, dev, workers: int,
               profile: Path | None = None, verify: bool = False):
    verified = None
    engine = load(model, cache_budget_gb=budget, host_cache_gb=host, device=str(dev), tokenizer=False,
                  use_page_cache=False, workers=workers, hotlist=False, learn_experts=False, progress=False)
    try:
        c, st = engine.cache, engine.store.stats
        ts = getattr(c, "tier_stats", None)
        kv = engine.model.new_kv_cache(len(warm) + warm_decode + len(tokens) + 8)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        with torch.inference_mode():
            engine.model(torch.tensor(warm, device=dev), 0, kv)
            pos = len(warm)
            for i in range(warm_decode):
                engine.model(torch.tensor([tokens[i % len(tokens)]], device=dev), pos, kv)
                pos += 1
            sync()
            if profile is not None:  # where a decode step's time goes (not part of the timed steps)
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as prof

                with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
                    for i in range(2):
                        engine.model(torch.tensor([tokens[i]], device=dev), pos + i, kv)
                    sync()
                profile.write_text(pr.key_averages().table(sort_by="cpu_time_total", row_limit=40))
                kv.length = pos  # the profiled steps are overwritten by the timed ones
            s0 = (c.stats.lookups, c.stats.hits, ts.host_hits if ts else 0, ts.disk_reads if ts else c.stats.misses,
                  ts.h2d_bytes if ts else 0, st.bytes_read)
            logits, times = [], []
            for tok in tokens:
                t0 = time.perf_counter()
                out = engine.model(torch.tensor([tok], device=dev), pos, kv)
                sync()
                times.append(time.perf_counter() - t0)
                logits.append(out.float().cpu())
                pos += 1
        s1 = (c.stats.lookups, c.stats.hits, ts.host_hits if ts else 0, ts.disk_reads if ts else c.stats.misses,
              ts.h2d_bytes if ts else 0, st.bytes_read)
        if verify and ts is not None:  # the VRAM copies hold the bytes on disk (a sample of them)
            keys = list(c._entries)
            random.Random(1).shuffle(keys)
            bad = 0
            for i in range(0, min(len(keys), 192), 32):
                fresh = engine.store.read_all(keys[i : i + 32])
                for k, f in fresh.items():
                    bad += any(not torch.equal(c._entries[k].tensors[r].cpu(), f.tensors[r]) for r in f.tensors)
                    engine.store.release(f)
            verified = (min(len(keys), 192), bad)
        d = [b - a for a, b in zip(s0, s1)]
        n = len(tokens)
        times.sort()
        res = {
            "budget_gb": None if engine.cache.budget_bytes is None else engine.cache.budget_bytes / 1e9,
            "host_gb": engine.cache.host.budget_bytes / 1e9 if ts else 0.0,
            "ms_per_token": sum(times) / n * 1e3, "median_ms": times[n // 2] * 1e3,
            "tok_s": n / sum(times),
            "vram_hit_rate": d[1] / d[0] if d[0] else 0.0, "host_hit_rate": d[2] / d[0] if d[0] else 0.0,
            "disk_rate_of_lookups": d[3] / d[0] if d[0] else 0.0,
            "h2d_mb_per_token": d[4] / n / 1e6, "disk_mb_per_token": d[5] / n / 1e6,
            "read_gb_s_busy": st.bytes_read / st.busy_seconds / 1e9 if st.busy_seconds else 0.0,
            "verified_experts_bad": verified,
        }
        return res, logits
    finally:
        engine.close()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    add_decode_args(p, layers=12, tokens=24, warm_decode=8)
    p.add_argument("--fractions", default="0.1,0.25,0.5,1.0")
    p.add_argument("--host", default="none,auto", help="host tier settings to try (none, auto or GB)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("gpu_tiers.json"))
    p.add_argument("--skip-rates", action="store_true")
    p.add_argument("--verify", action="store_true", help="compare a sample of the VRAM experts with fresh reads")
    p.add_argument("--no-cudnn-sdp", action="store_true", help="attention without cuDNN's SDPA kernels")
    p.add_argument("--profile", default="", help="config numbers (0: all resident) to profile two decode steps of")
    a = p.parse_args()
    a.profile = {int(x) for x in a.profile.split(",") if x}
    dev = torch.device(a.device)
    if a.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "configs": []}

    def save():
        a.out.write_text(json.dumps(result, indent=1))

    if not a.model.exists():
        result["synth_seconds"] = synth(a.model, a.layers)
        log(f"synth {a.layers} layers: {result['synth_seconds']:.1f} s")
    shards = sorted(a.model.glob("*.safetensors"))
    result["checkpoint_gb"] = sum(s.stat().st_size for s in shards) / 1e9
    from moestream.checkpoint import Checkpoint
    from moestream.layout import discover_experts

    with Checkpoint(a.model) as ck:
        lay = discover_experts(ck.tensors)
        one = lay.expert_nbytes(0, 0)
        experts_bytes = sum(lay.expert_nbytes(i, e) for i, x in lay.layers.items() for e in range(x.num_experts))
    result.update(expert_bytes=one, experts_total_gb=experts_bytes / 1e9)
    if not a.skip_rates:
        if dev.type == "cuda":
            result["h2d_gb_s"] = h2d_rates(dev, one)
            log("h2d GB/s", result["h2d_gb_s"])
        result["disk_gb_s"] = {f"{t}_threads": disk_rate(shards, threads=t) for t in (1, 8)}
        log("disk GB/s", result["disk_gb_s"])
        save()
    rng = random.Random(0)
    vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]
    tokens = [rng.randrange(1000, min(vocab, 150000)) for _ in range(a.tokens)]
    warm = [rng.randrange(1000, min(vocab, 150000)) for _ in range(a.warm)]
    configs = [("all", None)]
    for f in [float(x) for x in a.fractions.split(",")]:
        for h in a.host.split(","):
            configs.append((f"{f * experts_bytes / 1e9:.4f}", None if h == "none" else h))
    configs.append(("all", None))  # again, last: the reference's own repeatability, warm
    ref = None
    for n, (budget, host) in enumerate(configs):
        t0 = time.perf_counter()
        prof = a.out.with_name(f"profile_{n}.txt") if n in a.profile else None
        res, logits = run_config(a.model, budget, host, tokens, warm, a.warm_decode, dev, a.workers, prof, a.verify)
        res["wall_s"] = time.perf_counter() - t0
        res["fraction"] = "all" if budget == "all" else round(float(budget) * 1e9 / experts_bytes, 3)
        res["host"] = host or "none"
        if ref is None:
            ref = logits
        res["logits_equal_all"] = all(torch.equal(x, y) for x, y in zip(logits, ref))
        diffs = [i for i, (x, y) in enumerate(zip(logits, ref)) if not torch.equal(x, y)]
        res["first_unequal_step"] = diffs[0] if diffs else None
        res["max_abs_diff"] = max(float((x - y).abs().max()) for x, y in zip(logits, ref))
        result["configs"].append(res)
        log(json.dumps(res))
        save()
        if dev.type == "cuda" and budget == "all" and not a.skip_rates:
            engine = load(a.model, cache_budget_gb="0", host_cache_gb=None, device=str(dev), tokenizer=False,
                          use_page_cache=False, hotlist=False, learn_experts=False, progress=False)
            try:
                result["cpu_vs_copy"] = cpu_vs_copy(engine, dev)
                log("cpu vs copy", result["cpu_vs_copy"])
            finally:
                engine.close()
    # the floor: copies at the best pinned rate, reads at the best disk rate, compute as all-resident
    pinned = max((v for k, v in result.get("h2d_gb_s", {}).items() if k in ("pinned_alloc", "registered_mmap")),
                 default=0.0)
    disk = max(result.get("disk_gb_s", {}).values(), default=0.0)
    for r in result["configs"]:
        r["read_gb_s_busy"] = round(r["read_gb_s_busy"], 3)
    disk_best = max([disk] + [r["read_gb_s_busy"] for r in result["configs"]])
    compute_ms = min(r["ms_per_token"] for r in result["configs"] if r["fraction"] == "all")
    result.update(pinned_gb_s=pinned, disk_best_gb_s=disk_best, compute_ms_all_resident=compute_ms)
    log(f"\nfloor terms: pinned {pinned:.1f} GB/s, disk {disk_best:.2f} GB/s, "
        f"compute (all resident) {compute_ms:.2f} ms")
    log(f"{'VRAM':>6} {'host':>5} {'tok/s':>7} {'ms/tok':>8} {'floor':>8} {'ratio':>6} {'vram%':>6} {'host%':>6} "
        f"{'disk%':>6} {'H2D MB':>8} {'disk MB':>8} equal")
    for r in result["configs"]:
        floor = (r["h2d_mb_per_token"] * 1e6 / (pinned * 1e9) * 1e3 if pinned else 0.0) + (
            r["disk_mb_per_token"] * 1e6 / (disk_best * 1e9) * 1e3 if disk_best else 0.0) + compute_ms
        r["floor_ms"], r["ratio_to_floor"] = floor, r["ms_per_token"] / floor
        r["ratio_to_all_resident"] = r["ms_per_token"] / compute_ms
        log(f"{str(r['fraction']):>6} {r['host']:>5} {r['tok_s']:7.2f} {r['ms_per_token']:8.2f} {floor:8.2f} "
            f"{r['ratio_to_floor']:6.2f} {100 * r['vram_hit_rate']:6.1f} {100 * r['host_hit_rate']:6.1f} "
            f"{100 * r['disk_rate_of_lookups']:6.1f} {r['h2d_mb_per_token']:8.1f} {r['disk_mb_per_token']:8.1f} "
            f"{r['logits_equal_all']}")
    save()


if __name__ == "__main__":
    main()
