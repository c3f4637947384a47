"""``benchmarks/bench.py --smoke``: the side-by-side benchmark runs end to end on a tiny model
and writes its table, its results and both plots (peers skipped: they are not installed here).
Its quantized section's runs are in test_bench_smoke_quantized.py."""

import json

from .helpers import bench_smoke


def test_bench_smoke_writes_table_and_plots(tmp_path):
    r, out = bench_smoke(tmp_path)
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
