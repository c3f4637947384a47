"""Read-path benchmark: cold decode from a checkpoint bigger than the page cache may hold.

Measures, side by side on one synth checkpoint inside a cgroup memory cap (root needed for
the cgroup and for dropping the page cache):

1. the disk's best O_DIRECT figure: large aligned reads (4 and 16 MiB, random offsets in
   the shards) into 2 MiB-aligned transparent-huge-page buffers, one thread, cold cache;
2. ``moestream generate --no-page-cache`` with and without ``--prefetch-ahead 1``
   (and, with ``--buffered``, the page-cache path for comparison): decode tok/s, MB read
   per token, distinct experts per layer, and the read GB/s while reading experts
   (bytes read / wall time with at least one read in flight), against (1).

Sampled tokens (``--temp 1 --seed 0``): greedy decoding of random weights repeats one token.

    sudo .venv/bin/python benchmarks/read_path.py --model /var/tmp/q30-12l [--cap 6G] [--tokens 32]

The checkpoint is written with ``moestream synth --layers 12`` when the folder does not
exist (a 12-layer Qwen3-30B-A3B shape, about 16 GB); delete it when done (``--delete``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
BIN = HERE / ".venv/bin"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def sh(cmd: str) -> str:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def load_avg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def disk_best(shards: list[Path], total_bytes: int, chunk: int, seed: int = 0) -> float:
    """GB/s of O_DIRECT reads of ``chunk`` bytes at random aligned offsets, one thread, cold cache."""
    sys.path.insert(0, str(HERE))
    from moestream.direct_io import HugePageBuffer

    buf = HugePageBuffer(chunk)
    view = buf.view[:chunk]
    fds = [os.open(s, os.O_RDONLY | os.O_DIRECT) for s in shards]
    sizes = [s.stat().st_size for s in shards]
    rng = random.Random(seed)
    drop_caches()
    done = 0
    t0 = time.perf_counter()
    try:
        while done < total_bytes:
            i = rng.randrange(len(fds))
            off = rng.randrange(0, max(1, sizes[i] - chunk)) // chunk * chunk
            n = os.preadv(fds[i], [view], off)
            if n <= 0:
                raise OSError(f"nothing read from {shards[i]} at {off}")
            done += n
    finally:
        for fd in fds:
            os.close(fd)
    return done / 1e9 / (time.perf_counter() - t0)


def cgroup_run(cmd: list[str], cap: str, name: str) -> tuple[int, int]:
    """Run ``cmd`` inside a new cgroup v1 memory cap; return (exit status, peak bytes charged)."""
    cg = Path("/sys/fs/cgroup/memory") / name
    cg.mkdir()
    try:
        (cg / "memory.limit_in_bytes").write_text(cap)
        r = subprocess.run(["sh", "-c", 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"', "_", str(cg), *cmd])
        peak = int((cg / "memory.max_usage_in_bytes").read_text())
        return r.returncode, peak
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--config", type=Path, default=HERE.parent / "shared/models/configs/Qwen3-30B-A3B.json")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--cap", default="6G")
    p.add_argument("--budget", default="2", help="--cache-budget-gb of the runs (default 2)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--disk-gb", type=float, default=4.0, help="GB read for each disk figure")
    p.add_argument("--buffered", action="store_true", help="also run the page-cache path")
    p.add_argument("--delete", action="store_true", help="delete the checkpoint at the end")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    a = p.parse_args()
    if os.geteuid() != 0:
        print("needs root (cgroup, drop_caches)", file=sys.stderr)
        return 2
    if not a.model.exists():
        subprocess.run([str(BIN / "moestream"), "synth", "--config", str(a.config), "--layers", str(a.layers),
                        "--out", str(a.model)], check=True)
    shards = sorted(a.model.glob("*.safetensors"))
    size = sum(s.stat().st_size for s in shards)
    out: dict = {"checkpoint_gb": size / 1e9, "cap": a.cap, "budget_gb": a.budget, "tokens": a.tokens, "runs": {}}
    print(f"checkpoint {a.model}: {size / 1e9:.2f} GB in {len(shards)} shards; cap {a.cap}", flush=True)

    disk = {}
    for chunk in (4 << 20, 16 << 20):
        disk[chunk >> 20] = disk_best(shards, int(a.disk_gb * 1e9), chunk)
        print(f"disk O_DIRECT {chunk >> 20} MiB reads into huge pages: {disk[chunk >> 20]:.2f} GB/s "
              f"(load {load_avg()})", flush=True)
    best = max(disk.values())
    out["disk_gb_s"] = disk
    out["disk_best_gb_s"] = best

    runs = [("O_DIRECT", ["--no-page-cache"]), ("O_DIRECT + prefetch 1", ["--no-page-cache", "--prefetch-ahead", "1"])]
    if a.buffered:
        runs.append(("page cache", ["--use-page-cache"]))
    for label, flags in runs:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            stats_path = Path(f.name)
        cmd = [str(BIN / "moestream"), "generate", "--model", str(a.model), "--prompt", PROMPT, "--max-tokens",
               str(a.tokens), "--temp", "1", "--seed", "0", "--cache-budget-gb", a.budget, "--stats-json",
               str(stats_path), *flags]
        before = disk_best(shards, int(a.disk_gb * 1e9 / 3), 16 << 20, seed=len(out["runs"]) + 1)
        drop_caches()
        load = load_avg()
        rc, peak = cgroup_run(cmd, a.cap, f"cache-io-bench-{os.getpid()}")
        after = disk_best(shards, int(a.disk_gb * 1e9 / 3), 16 << 20, seed=len(out["runs"]) + 11)
        if rc != 0:
            print(f"{label}: exit status {rc}", file=sys.stderr)
            return 1
        s = json.loads(stats_path.read_text())
        stats_path.unlink()
        s["cap_peak_gb"] = peak / 1e9
        s["load_before"] = load
        s["load_after"] = load_avg()
        s["command"] = " ".join(cmd)
        s["disk_around_gb_s"] = (before, after)  # the disk's O_DIRECT figure just before and after this run
        out["runs"][label] = s

    print()
    print(f"disk best O_DIRECT: {best:.2f} GB/s ({', '.join(f'{k} MiB {v:.2f}' for k, v in disk.items())})")
    print("| run | decode tok/s | MB read / token | read GB/s while reading | of disk best | hit rate: decode "
          "(all tokens: cache / prefetch) | GB read (demand / ahead) | prefetch wasted GB | distinct experts / layer "
          "| peak RSS GB | cap peak GB | load before / after | disk GB/s before / after |")
    print("| --- " * 13 + "|")
    for label, s in out["runs"].items():
        print(f"| {label} | {s['decode_tok_s']:.3f} | {s['mb_read_per_decoded_token']:.0f} | "
              f"{s['read_gb_per_s']:.2f} | {s['read_gb_per_s'] / best:.0%} | {s['decode_hit_rate']:.1%} "
              f"({s['cache_hit_rate_cache']:.1%} / "
              f"{s['cache_hit_rate_prefetch']:.1%}) | {s['gb_read_critical']:.2f} / {s['gb_read_prefetch']:.2f} | "
              f"{s['prefetch_wasted_gb']:.2f} | {s['distinct_experts_per_layer_mean']:.1f} of "
              f"{s['experts_per_layer']} | {s['peak_rss_gb']:.2f} | {s['cap_peak_gb']:.2f} | "
              f"{s['load_before']} / {s['load_after']} | {s['disk_around_gb_s'][0]:.2f} / "
              f"{s['disk_around_gb_s'][1]:.2f} |")
    o = out["runs"]["O_DIRECT"]
    verdict = "hit" if o["read_gb_per_s"] >= 0.85 * best else "miss"
    print(f"\nverdict: {verdict}: {o['read_gb_per_s']:.2f} GB/s while reading = {o['read_gb_per_s'] / best:.0%} "
          f"of the disk's best {best:.2f} GB/s (target 85%)")
    out["verdict"] = verdict
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    if a.delete:
        shutil.rmtree(a.model)
        print(f"deleted {a.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
