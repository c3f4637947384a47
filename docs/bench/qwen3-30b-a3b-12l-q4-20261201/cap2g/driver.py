"""The quantized capped runs at a 2 GiB cap (the issue's earlier measurement's cap): moestream q4 and
llama.cpp Q4_K_M on the same tokens, via bench.do_run; prints a table and writes JSON."""
import json, sys, types
from pathlib import Path
sys.path.insert(0, "/work/wt-bench2/benchmarks"); sys.path.insert(0, "/work/wt-bench2")
import bench
out = Path(sys.argv[2] if len(sys.argv) > 2 else "/work/big/bench/out-q4-2g"); (out / "runs").mkdir(parents=True, exist_ok=True)
a = types.SimpleNamespace(out=out)
tokens = Path("/work/big/bench/out-q4/tokens.json")
n_prompt = len(json.loads(tokens.read_text())["prompt"])
cap = int(float(sys.argv[4]) * 2**30) if len(sys.argv) > 4 else 2 * 2**30
mpy, ppy = "/work/wt-bench2/.venv/bin/python", "/work/big/peers/venv/bin/python"
q4, qg = Path("/work/big/bench/Qwen3-30B-A3B-12l-q4"), Path("/work/big/bench/keep-Qwen3-30B-A3B-12l.q4_k_m.gguf")
bf16 = Path("/work/big/bench/keep-Qwen3-30B-A3B-12l")
runs = []
for b in sys.argv[1].split(","):  # noqa
    runs.append(bench.do_run(a, f"q4-{b}GB", "moestream", mpy, Path(sys.argv[3]) if len(sys.argv) > 3 else q4, ["--budget", b, "--mode", "forced",
               "--usage-file", str(out / f"usage-{b}.json")], 600, tokens, n_prompt, cap, {"label": f"moestream q4 {b} GB"}))
for rp in (("off",) if len(sys.argv) > 5 else ()):
    runs.append(bench.do_run(a, f"llama-q4-repack-{rp}", "llama", ppy, qg, ["--repack", rp], 420, tokens, n_prompt, cap,
               {"label": f"llama.cpp Q4_K_M repack {rp}"}))
(out / "runs.json").write_text(json.dumps(runs, indent=1, default=str))
for r in runs:
    print(r["label"], r["status"], "prefill", r.get("prefill_tok_s"), "decode", r.get("decode_tok_s"), "cpu/tok",
          r.get("cpu_s_per_token"), "peak", r.get("cap_peak_bytes"), "read/tok", r.get("read_gb_per_token"))
