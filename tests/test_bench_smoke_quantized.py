"""``benchmarks/bench.py --smoke`` of the quantized section (``--quantized``, ``--gguf``, ``--gguf-only``): its rows
and targets on a tiny model, peers skipped (they are not installed here). Apart from test_bench_smoke.py so that
the two files' bench runs (minutes on a loaded machine) can go to two test workers."""

import json

from .helpers import bench_smoke


def test_bench_smoke_quantized_rows_and_targets(tmp_path):
    """``--smoke --quantized --gguf`` without peers: the 4-bit build's capped and all-in-RAM moestream rows, the
    bf16 reference rows in the same cap, and the quantized targets (the llama.cpp ones "not measured"; no
    Q4_K_M file without llama.cpp, so no GGUF rows: test_bench_smoke_gguf_only_rows has them)."""
    _, out = bench_smoke(tmp_path, "--quantized", "--gguf", "--engines", "moestream", timeout=600)
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
    _, out = bench_smoke(tmp_path, "--gguf-only", str(f), "--model", str(BUNDLED_QWEN3))
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
