"""moestream against llama.cpp on the CPU with every expert in RAM, runs interleaved (issue 32's no-cap line).

Each run is a fresh process of ``bench_worker.py`` (the same chat prompt prefilled at once, then the same
continuation fed one token per step, 2 threads); the engines take turns, round after round, so a change in the
machine's load falls on all of them alike. Reported per engine: median decode tok/s, CPU seconds per decoded token
(all threads, user + system: a busy machine's other work counts much less here than in wall time), prefill tok/s,
moestream's CPU split (reads, compiled kernels, the rest), and the load average before each run.

    python benchmarks/cpu_side_by_side.py --moestream-model Q4 --gguf Q4_K_M.gguf --tokenizer Q4 --rounds 3 \\
        --out OUT [--peers-python /work/big/peers/venv/bin/python]

Engines: llama.cpp on the GGUF file (llama-cpp-python from ``benchmarks/peers/setup_peers.sh``; its CPU repack
on and off), moestream on the ``moestream convert`` folder with float and ``--activations q8`` activations, and
moestream on the same GGUF file with float and q8 activations. ``--engines`` picks a subset. The page cache is
kept and both files are read once before the first round (all in RAM: no prefill pays for the disk); with
``--cap 2G`` each run starts from a dropped page cache inside that cgroup cap instead (root). Results:
``OUT/results.json`` and ``OUT/report.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402
from _common import cpu_model, load_average  # noqa: E402
from bench import do_run, make_tokens  # noqa: E402

ENGINES = {  # name -> (engine, model key, worker flags)
    "llama-repack-on": ("llama", "gguf", ["--repack", "on"]),
    "llama-repack-off": ("llama", "gguf", ["--repack", "off"]),
    "ms-4bit-float": ("moestream", "q4", ["--moestream-options", "{}"]),
    "ms-4bit-q8": ("moestream", "q4", ["--moestream-options", json.dumps({"activations": "q8"})]),
    "ms-gguf-float": ("moestream", "gguf", ["--moestream-options", "{}"]),
    "ms-gguf-q8": ("moestream", "gguf", ["--moestream-options", json.dumps({"activations": "q8"})]),
}


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return " ".join(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "f16c")))
    return ""


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def steal_seconds() -> float:
    """CPU seconds the hypervisor took from this VM since boot (/proc/stat's steal column, all CPUs)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--moestream-model", type=Path, required=True, help="a moestream convert --bits 4 folder")
    p.add_argument("--gguf", type=Path, required=True, help="llama.cpp's own Q4_K_M file of the same synth")
    p.add_argument("--tokenizer", type=Path, required=True, help="folder whose tokenizer makes the token ids")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--tokens", type=int, default=48, help="decoded (fed) tokens per run")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument("--peers-python", default="/work/big/peers/venv/bin/python")
    p.add_argument("--limit-s", type=float, default=900.0)
    p.add_argument("--cap", default=None, help="a memory cap (cgroup, e.g. 2G; root): every run from a cold page cache "
                   "inside it, instead of all in RAM")
    p.add_argument("--budget", default="all", help="moestream's --cache-budget-gb (default all; auto in a cap)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        raise SystemExit(f"unknown engine(s) {bad}; choose from {list(ENGINES)}")
    # all in RAM: the page cache is kept (bench.py drops it before each run for its capped rows) and both files are
    # read once first, so no engine's prefill pays for the disk
    cap = bench.parse_size(a.cap) if a.cap else None
    if cap is None:
        bench.drop_caches = lambda: False
        for f in [a.gguf, *sorted(a.moestream_model.glob("*.safetensors"))]:
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass
    tokens = make_tokens(a.tokenizer, a.prompt_tokens, a.tokens)
    tokens_file = a.out / "tokens.json"
    tokens_file.write_text(json.dumps(tokens))
    models = {"q4": a.moestream_model, "gguf": a.gguf}
    runs = []
    for rnd in range(1, a.rounds + 1):
        for name in engines:
            engine, key, flags = ENGINES[name]
            python = a.peers_python if engine == "llama" else sys.executable
            if engine == "moestream":
                flags = [*flags, "--budget", a.budget]
            load, st0 = load_average(), steal_seconds()
            run = do_run(a, f"{name}-{rnd}", engine, python, models[key], flags, a.limit_s, tokens_file,
                         len(tokens["prompt"]), cap, {"config": name, "round": rnd, "load_before": load})
            run["steal_s"] = round(steal_seconds() - st0, 2)  # the host's noise: another tenant's work
            runs.append(run)
            (a.out / "results.json").write_text(json.dumps({"runs": runs}, indent=1, default=str))
    rows = []
    for name in engines:
        rs = [r for r in runs if r["config"] == name and r.get("decode_tok_s")]
        split = [r["cpu_split"] for r in rs if "cpu_split" in r]
        rows.append({
            "config": name, "runs": len(rs), "peak_cap_gb": median(bench.gb(r.get("cap_peak_bytes")) for r in rs),
            "decode_tok_s": median(r["decode_tok_s"] for r in rs),
            "decode_tok_s_all": [round(r["decode_tok_s"], 2) for r in rs],
            "cpu_s_per_token": median(r.get("cpu_s_per_token") for r in rs),
            "cpu_s_per_token_all": [round(r.get("cpu_s_per_token") or 0, 4) for r in rs],
            "prefill_tok_s": median(r.get("prefill_tok_s") for r in rs),
            "split": {k: median(s[k] for s in split) for k in ("reads", "kernels", "rest")} if split else None,
            "load_before": [r["load_before"][0] for r in rs],
            "steal_s": [r.get("steal_s") for r in rs],
            "peak_rss_gb": median(r.get("peak_rss_gb") for r in rs),
        })
    machine = {"cpu": cpu_model(), "flags": cpu_flags(), "cores": os.cpu_count(), "cap": a.cap, "budget": a.budget}
    (a.out / "results.json").write_text(json.dumps({"machine": machine, "rows": rows, "runs": runs}, indent=1,
                                                   default=str))
    where = f"cap {a.cap}, cold page cache, moestream budget {a.budget}" if cap else "no cap, all in RAM"
    lines = [f"CPU: {machine['cpu']} ({machine['cores']} cores; {machine['flags']}); {where}", "",
             "| run | decode tok/s (median; each run) | CPU s / decoded token (median; each) | prefill tok/s | "
             "moestream CPU split reads / kernels / rest | load before each run | CPU s stolen by the host, each run |",
             "| --- | --- | --- | ---: | --- | --- | --- |"]

    def f(x, nd=3):
        return "-" if x is None else f"{x:.{nd}f}"

    for r in rows:
        sp = r["split"]
        split = "-" if not sp else f"{sp['reads']:.3f} / {sp['kernels']:.3f} / {sp['rest']:.3f}"
        lines.append(f"| {r['config']} | {f(r['decode_tok_s'], 2)} ({', '.join(map(str, r['decode_tok_s_all']))}) | "
                     f"{f(r['cpu_s_per_token'])} ({', '.join(map(str, r['cpu_s_per_token_all']))}) | "
                     f"{f(r['prefill_tok_s'], 1)} | {split} | {', '.join(str(x) for x in r['load_before'])} | "
                     f"{', '.join(str(x) for x in r['steal_s'])} |")
    (a.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
