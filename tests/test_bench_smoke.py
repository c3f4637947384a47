"""``benchmarks/bench.py --smoke``: the side-by-side benchmark runs end to end on a tiny model
and writes its table, its results and both plots (peers skipped: they are not installed here)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_smoke_writes_table_and_plots(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench.py"), "--smoke", "--work", str(tmp_path / "work"),
         "--out", str(out), "--peers-dir", str(tmp_path / "no-peers")],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "SKIPPING llama" in r.stdout and "SKIPPING transformers" in r.stdout
    res = json.loads((out / "results.json").read_text())
    runs = {x["name"]: x for x in res["runs"]}
    assert set(runs) == {"moestream-default-2e-05GB", "moestream-best-2e-05GB", "moestream-trained-2e-05GB"}
    assert runs["moestream-trained-2e-05GB"]["init"] == "trained"
    stream = json.loads((out / "tokens.json").read_text())["stream"]
    for run in runs.values():
        assert run["status"] == "finished" and run["decoded"] == len(stream) == 8
        assert 0 <= run["hit_rate"] < 1  # 20 kB holds 6 of the 16 experts of 3 kB: some lookups miss
        assert run["decode_bytes"] > 0 and run["distinct_max"] <= run["experts_per_layer"] == 8
    assert res["compute_s_per_token"] > 0
    report = (out / "report.md").read_text()
    rows = [x for x in report.splitlines() if x.startswith("| moestream")]
    header = next(x for x in report.splitlines() if x.startswith("| run |"))
    assert len(rows) == 3 and all(x.count("|") == header.count("|") for x in rows)
    assert any("`trained` init" in x for x in rows)
    assert "Skipped: llama" in report
    for png in ("decode_vs_budget.png", "hit_rate_vs_budget.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "work" / "tiny-config").exists()  # the checkpoints are deleted unless --keep
    assert not (tmp_path / "work" / "tiny-config-trained").exists()


def test_bench_smoke_quantized_rows_and_targets(tmp_path):
    """``--smoke --quantized --gguf`` without peers: the 4-bit build's capped and all-in-RAM moestream rows, the
    bf16 reference rows in the same cap, and the quantized targets (the llama.cpp ones "not measured"; no
    Q4_K_M file without llama.cpp, so no GGUF rows: test_bench_smoke_gguf_only_rows has them)."""
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench.py"), "--smoke", "--quantized", "--gguf", "--engines",
         "moestream", "--work", str(tmp_path / "work"), "--out", str(out), "--peers-dir", str(tmp_path / "no-peers")],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    q = {x["name"]: x for x in res["runs"] if x.get("section") == "quantized"}
    assert set(q) == {"q4-moestream-0.0007GB", "q4-moestream-1GB", "q4-bf16-moestream-0.0007GB",
                      "q4-bf16-moestream-1GB", "q4-moestream-all"}
    for run in q.values():
        assert run["status"] == "finished" and run["decoded"] == 8 and "quantized run" in run["label"]
        assert run["capped"] == (run["budget"] != "all")
    # the same synth's bf16 and q4 builds: at 0.7 MB a bf16 expert (393 kB) barely fits, q4 ones (111 kB) do
    assert q["q4-moestream-0.0007GB"]["hit_rate"] > q["q4-bf16-moestream-0.0007GB"]["hit_rate"]
    assert q["q4-moestream-all"]["budget_gb"] == "all" and res["quantized"]["compute_s_per_token"] > 0
    assert 0 < res["quantized"]["q4_gb"] < res["checkpoint_gb"] / 2 and res["quantized"]["q4_k_m_gb"] is None
    report = (out / "report.md").read_text()
    lines = report.split("Quantized targets")[1].split("Skipped")[0]
    assert lines.count("vs llama.cpp") == 9 and lines.count("not measured (peer not run)") == 6
    assert lines.count("moestream on the GGUF") == 3 and lines.count("not measured (no run)") == 3
    assert "gguf: no Q4_K_M file" in report.split("Skipped")[1]
    assert lines.count("moestream q4 vs bf16") == 2 and lines.count("(target >= 2.5x): ") == 2
    assert not (tmp_path / "work" / "tiny-q-config-q4").exists()


def test_bench_smoke_gguf_only_rows(tmp_path):
    """``--smoke --gguf-only FILE`` without peers, on a GGUF written by the ``gguf`` package (Q8_0, the bundled
    tokenizer's vocabulary): moestream's rows on that file in the cap at each quantized budget and at budget all
    with no cap, the tokens from ``--model``'s tokenizer, issue 26's target lines (llama.cpp "not measured"),
    and nothing else run or deleted."""
    from moestream.tokenizer import BUNDLED_QWEN3

    from .gguf_helpers import make_model, write_gguf

    f = tmp_path / "tiny.Q8_0.gguf"
    write_gguf(make_model(seed=3, vocab_size=151936, num_hidden_layers=2), f, "Q8_0")
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench.py"), "--smoke", "--gguf-only", str(f), "--model",
         str(BUNDLED_QWEN3), "--work", str(tmp_path / "work"), "--out", str(out), "--peers-dir",
         str(tmp_path / "no-peers")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    runs = {x["name"]: x for x in res["runs"]}
    assert set(runs) == {"q4-gguf-moestream-0.0007GB", "q4-gguf-moestream-1GB", "q4-gguf-moestream-all"}
    for run in runs.values():
        assert run["status"] == "finished" and run["decoded"] == 8 and f"--model {f}" in run["command"]
        assert run["weights"] == "gguf" and run["capped"] == (run["budget"] != "all")
        assert "llama.cpp's Q4_K_M GGUF" in run["label"]
    assert runs["q4-gguf-moestream-all"]["budget_gb"] == "all" and res["quantized"]["gguf_compute_s_per_token"] > 0
    assert res["gguf_only"] and res["layers"] == 2 and res["quantized"]["q4_k_m_gb"] == f.stat().st_size / 1e9
    report = (out / "report.md").read_text()
    lines = report.split("Quantized targets")[1].split("Skipped")[0]
    assert lines.count("moestream on the GGUF") == 3 and lines.count("not measured (peer not run)") == 3
    assert "moestream q4" not in lines and "Targets (measured" not in report
    assert f.exists() and not (tmp_path / "work" / "tiny-config").exists()  # kept; no synth
