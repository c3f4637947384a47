"""Hot lists, pin files, usage profiles, routing traces and --max-active-experts, end to end.

Every option but --max-active-experts leaves the output bit-identical to every expert
resident; bad files are ignored with a warning naming them and are left intact.
"""

import json

import pytest
import torch

from moestream.cachesim import requests_of, simulate_policy
from moestream.cli import main
from moestream.engine import load
from moestream.generation import SamplingParams, generate
from moestream.traces import load_trace
from moestream.usage import DECAY, default_profile_path, read_trace

from .helpers import expert_bytes, qwen3_moe_fixture, write_tiny_synth_config

PROMPT = torch.randint(0, 300, (13,), generator=torch.Generator().manual_seed(3)).tolist()


# a tiny model: 3 layers x 16 experts, top-4, renormalized
model = qwen3_moe_fixture("model", 9, num_hidden_layers=3, num_experts=16, num_experts_per_tok=4)


def run(path, budget, tokens=10, **kw):
    """Prefill logits, each step's logits and tokens, the engine's cache stats."""
    engine = load(path, cache_budget_gb=budget, tokenizer=False, **kw)
    try:
        kv = engine.model.new_kv_cache()
        with torch.inference_mode():
            prefill = engine.model(torch.tensor(PROMPT), 0, kv, all_logits=True)
        steps = list(generate(engine, PROMPT, tokens, SamplingParams(temperature=1.0, seed=1), stop_at_eos=False,
                              keep_logits=True))
        return prefill, [s.logits for s in steps], [s.token for s in steps], engine.cache
    finally:
        engine.close()


def same(a, b):
    return torch.equal(a[0], b[0]) and a[2] == b[2] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_every_option_is_exact(model, tmp_path, capsys):
    one = expert_bytes(model)
    ref = run(model, "all", learn_experts=False)
    hot = model / "hot_experts.json"
    hot.write_text(json.dumps({"pin": [[0, 3], [1, 5], [2, 0], [0, 7], [1, 1], [2, 9]]}))
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps({"pin": [[2, 4], [0, 0]]}))
    try:
        mid = str(one * 12 / 1e9)
        configs = [  # hot lists and profiles pin only when asked (--hot-fraction)
            dict(cache_budget_gb=mid, cache_policy="lfu", hot_fraction=0.5),
            dict(cache_budget_gb=mid, cache_policy="layer", trace=tmp_path / "t.jsonl", hot_fraction=0.5),
            dict(cache_budget_gb=str(one * 5 / 1e9), pin_file=pins, hotlist=False,
                 hot_fraction=0.5),  # profile from the runs above
            dict(cache_budget_gb=mid, cache_policy="layer", pin_file=pins, trace=tmp_path / "t2.jsonl", workers=3,
                 hot_fraction=0.5),
        ]
        for kw in configs:
            budget = kw.pop("cache_budget_gb")
            got = run(model, budget, **kw)
            assert same(got, ref), kw
            cache = got[3]
            assert cache.stats.misses > 0 and cache.peak_bytes <= cache.budget_bytes + one
            if kw.get("pin_file"):
                assert cache.pinned_keys >= {(2, 4), (0, 0)}
        err = capsys.readouterr().err
        assert "pinned 6 hot experts" in err and "hot_experts.json" in err  # the hot list, budget of 12
        assert "pinned 2 of 2 experts from" in err
        assert str(default_profile_path(model, "x").parent) in err  # the learned profile was used
    finally:
        hot.unlink()


def test_usage_profile_is_learned_and_merged(model, tmp_path, capsys):
    prof = tmp_path / "u.json"
    first = run(model, "0.0001", tokens=3, usage_file=prof)[3].usage
    data = json.loads(prof.read_text())
    assert data["counts"] == {str(k): v.tolist() for k, v in first.items()}
    _, _, _, cache = run(model, str(expert_bytes(model) * 8 / 1e9), tokens=3, usage_file=prof, hot_fraction=0.5)
    assert len(cache.pinned_keys) == 4  # half of the budget, the hottest first
    hottest = sorted(((c, (int(layer), e)) for layer, row in data["counts"].items() for e, c in enumerate(row)),
                     key=lambda t: (-t[0], t[1]))
    assert cache.pinned_keys == {k for _, k in hottest[:4]}
    merged = json.loads(prof.read_text())["counts"]
    for layer, row in merged.items():
        want = [DECAY * a + b for a, b in zip(data["counts"][layer], cache.usage[int(layer)].tolist())]
        assert row == want
    assert "pinned 4 hot experts" in capsys.readouterr().err
    run(model, "0.0001", tokens=2, usage_file=prof, learn_experts=False)
    assert json.loads(prof.read_text())["counts"] == merged  # not learning: left alone


def test_hot_lists_and_profiles_pin_nothing_unless_asked(model, tmp_path, capsys):
    """By default (--hot-fraction 0) the hot list is not pinned (a note says so) and the learned profile is counted
    and saved but not pinned; --hot-fraction F pins up to F of the budget."""
    prof = tmp_path / "u.json"
    run(model, "0.0001", tokens=3, usage_file=prof)
    assert prof.exists()
    hot = model / "hot_experts.json"
    hot.write_text(json.dumps({"pin": [[0, 3], [1, 5], [2, 0], [0, 7]]}))
    try:
        budget = str(expert_bytes(model) * 8 / 1e9)
        capsys.readouterr()
        _, _, _, cache = run(model, budget, tokens=2, usage_file=prof)
        err = capsys.readouterr().err
        assert not cache.pinned_keys and "not pinned: --hot-fraction is 0" in err and "pinned" not in err.replace(
            "not pinned", "")
        _, _, _, cache = run(model, budget, tokens=2, usage_file=prof, hot_fraction=0.25)
        assert len(cache.pinned_keys) == 2 and {(0, 3), (1, 5)} == cache.pinned_keys  # the hot list's first two
        assert "up to 25% of the cache budget" in capsys.readouterr().err
    finally:
        hot.unlink()
    assert main(["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "1", "--hot-fraction", "1.5",
                 "--no-chat-template"]) == 2
    assert "--hot-fraction 1.5: give a share of the budget between 0 and 1" in capsys.readouterr().err


BAD = {
    "not JSON": "{\"pin\": [[0, 1]",
    "wrong shape": json.dumps({"pin": [[0, 1, 2]]}),
    "expert out of range": json.dumps({"pin": [[0, 16]]}),
    "not a MoE layer": json.dumps({"pin": [[7, 1]]}),
    "another model": json.dumps({"model_id": "0123456789abcdef", "pin": [[0, 1]]}),
    "bools": json.dumps({"pin": [[True, 1]]}),
}


@pytest.mark.parametrize("kind", ["hotlist", "pin_file", "profile"])
def test_bad_files_are_ignored_and_left_intact(model, tmp_path, capsys, kind):
    budget = str(expert_bytes(model) * 6 / 1e9)
    for what, text in BAD.items():
        path = model / "hot_experts.json" if kind == "hotlist" else tmp_path / "f.json"
        if kind == "profile":
            text = text.replace('"pin"', '"counts"') if what != "another model" else json.dumps(
                {"format": "moestream-usage", "model_id": "0123456789abcdef", "counts": {}})
        path.write_text(text)
        try:
            kw = {"usage_file": path} if kind == "profile" else {"learn_experts": False}
            kw["hot_fraction"] = 0.5
            if kind == "pin_file":
                kw["pin_file"] = path
            engine = load(model, cache_budget_gb=budget, tokenizer=False, **kw)
            try:
                if kind == "profile":  # the profile is saved (or not) at close
                    list(generate(engine, PROMPT[:3], 1, SamplingParams()))
                assert not engine.cache.pinned_keys, what
            finally:
                engine.close()
            err = capsys.readouterr().err
            assert str(path) in err and "warning" in err, what
            assert path.read_text() == text, what  # never rewritten
        finally:
            path.unlink()


def test_max_active_experts(model, capsys):
    """Keeps the K best by routing weight, renormalized to the full top-k's sum; warns; changes the output."""
    ref = run(model, "all", tokens=3, learn_experts=False)
    engine = load(model, cache_budget_gb="all", tokenizer=False, max_active_experts=2, learn_experts=False)
    try:
        assert "max_active_experts=2: each token keeps" in capsys.readouterr().err  # the API's keyword
        block = engine.model.moe_blocks()[1]
        x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            got = block(x)
        # direct: softmax top-4, renormalized (norm_topk_prob), keep the 2 largest, rescale to sum 1
        probs = torch.softmax(x @ block.gate.weight.T, -1)
        want = torch.zeros_like(x)
        ckpt = engine.checkpoint
        for t in range(6):
            w, i = torch.topk(probs[t], 4)
            w = w / w.sum()
            w2, pos = torch.topk(w, 2)
            w2 = w2 / w2.sum()
            for wt, e in zip(w2, i[pos].tolist()):
                g, u, d = (ckpt.read_tensor(f"model.layers.1.mlp.experts.{e}.{p}_proj.weight") for p in ("gate", "up",
                                                                                                         "down"))
                want[t] += wt * (torch.nn.functional.silu(x[t] @ g.T) * (x[t] @ u.T)) @ d.T
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    finally:
        engine.close()
    got = run(model, "all", tokens=3, max_active_experts=2, learn_experts=False)
    assert not torch.equal(got[0], ref[0])
    capsys.readouterr()
    same_k = run(model, "all", tokens=3, max_active_experts=4, learn_experts=False)  # = top-k: exact, no warning
    assert same(same_k, ref) and "--max-active-experts" not in capsys.readouterr().err
    above = run(model, "all", tokens=3, max_active_experts=9, learn_experts=False)  # > top-k: exact, says no effect
    assert same(above, ref) and "above the model's top-k 4" in capsys.readouterr().err


def test_trace_replays_to_the_cache_hits(model, tmp_path):
    budget_experts = 16  # more than any layer request of the 13-token prefill
    trace = tmp_path / "t.jsonl"
    _, _, _, cache = run(model, str(expert_bytes(model) * budget_experts / 1e9), tokens=6, trace=trace,
                         learn_experts=False, workers=3)
    header, records = read_trace(trace)
    assert header["top_k"] == 4 and header["num_experts"] == {"0": 16, "1": 16, "2": 16}
    # the first forward in run() is a prefill outside generate(); then generate's prefill and 5 decode steps
    assert [r[0] for r in records[::3]] == [0, 13, 26, 27, 28, 29, 30]
    assert [len(r[2]) for r in records[::3]] == [13, 13, 1, 1, 1, 1, 1]
    reqs, decode = requests_of(records)
    size = expert_bytes(model)
    sim = simulate_policy("lru", reqs, lambda k: size, budget_experts * size, decode)
    # a replay has no read-ahead: the experts prefill read ahead (hits of the cache) are its misses, read early
    assert cache.stats.prefetch_hits > 0
    assert (sim.lookups, sim.hits) == (cache.stats.lookups, cache.stats.hits - cache.stats.prefetch_hits)
    # replaying the prefill chunks' reads ahead (on by default, without --prefetch-ahead) gives the cache's hits
    tr = load_trace(trace)
    chunked = simulate_policy("lru", reqs, lambda k: size, budget_experts * size, decode, chunk=tr.chunk,
                              window=tr.chunk_window)
    assert (chunked.lookups, chunked.hits, chunked.prefetch_hits) == (
        cache.stats.lookups, cache.stats.hits, cache.stats.prefetch_hits)
    assert chunked.chunk_hits == cache.prefetcher.stats.chunk_hits == cache.stats.prefetch_hits


@pytest.mark.parametrize("ahead", [1, 2])
def test_trace_replays_prefetch_and_pins_to_the_cache_hits(model, tmp_path, ahead):
    """The trace records what the prefetcher predicts (decode's next layers' guesses, prefill chunks' read-ahead
    order and window); replaying it reads ahead, claims and wastes as the engine did, so the simulated hits,
    prefetch hits and pinned hits are the cache's, and its chunk counts the prefetcher's."""
    budget_experts, size = 16, expert_bytes(model)
    pins = [[0, 3], [2, 5], [1, 0]]
    pin_file = tmp_path / "pins.json"
    pin_file.write_text(json.dumps({"pin": pins}))
    trace = tmp_path / "t.jsonl"
    _, _, _, cache = run(model, str(size * budget_experts / 1e9), tokens=8, trace=trace, learn_experts=False,
                         prefetch_ahead=ahead, pin_file=pin_file, workers=3)
    tr = load_trace(trace)
    assert tr.header["ahead"] == 2 and tr.has_ahead
    assert [len(a) for a in tr.ahead[:3]] == [2, 1, 0]  # the next two MoE layers, fewer near the last
    # prefill's chunks record the next layer's experts in read-ahead order, and the window (2 per reader thread)
    assert tr.chunk_window == 2 * 3 and tr.has_chunk
    assert [None if c is None else [layer for layer, _ in c] for c in tr.chunk[:3]] == [[1], [2], []]
    assert all((c is None) == (len(rows) == 1) for c, (_t, _l, rows) in zip(tr.chunk, tr.records))
    reqs, decode = requests_of(tr.records)
    sim = simulate_policy("lru", reqs, lambda k: size, budget_experts * size, decode,
                          pinned=[tuple(p) for p in pins], ahead=tr.ahead, depth=ahead, chunk=tr.chunk,
                          window=tr.chunk_window)
    pf = cache.prefetcher.stats
    assert cache.stats.prefetch_hits > 0 and cache.stats.pinned_hits > 0
    assert pf.chunk_hits > 0 and pf.hits > pf.chunk_hits  # both prefill's and decode's reads ahead were claimed
    assert (sim.lookups, sim.hits, sim.prefetch_hits, sim.pinned_hits) == (
        cache.stats.lookups, cache.stats.hits, cache.stats.prefetch_hits, cache.stats.pinned_hits)
    assert (sim.chunk_issued, sim.chunk_hits, sim.chunk_wasted) == (pf.chunk_issued, pf.chunk_hits, pf.chunk_wasted)
    assert (sim.wasted, sim.reads) == (pf.wasted, cache.stats.misses + pf.issued)  # every read, ahead or not


def test_cli_hotlist_and_cache_sim(tmp_path, capsys):
    from moestream.synth import synth

    cfg = write_tiny_synth_config(tmp_path / "c.json", num_hidden_layers=2)
    m = synth(cfg, tmp_path / "m", dtype="fp32")
    out = tmp_path / "hot.json"
    assert main(["hotlist", "--model", str(m), "--out", str(out), "--max-tokens", "2", "--cache-budget-gb", "0"]) == 0
    pins = json.loads(out.read_text())["pin"]
    assert pins and all(0 <= e < 8 and layer in (0, 1) for layer, e in pins)
    trace = tmp_path / "t.jsonl"
    assert main(["generate", "--model", str(m), "--prompt", "hi", "--max-tokens", "3", "--quiet", "--trace", str(trace),
                 "--pin-file", str(out), "--cache-policy", "lfu", "--max-active-experts", "1",
                 "--cache-budget-gb", "0.00005", "--no-learn-experts"]) == 0
    err = capsys.readouterr().err
    assert "--max-active-experts 1" in err and "pinned" in err
    assert main(["cache-sim", "--trace", str(trace), "--budgets", "0,0.00003,1"]) == 0
    table = capsys.readouterr().out
    assert "| lru (decode) | lfu (decode) | layer (decode) | belady (decode) |" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "%" in line]
    assert len(rows) == 3 and rows[-1].startswith("| 1 | 16 (all) |")
    assert main(["cache-sim", "--trace", str(tmp_path / "c.json"), "--budgets", "1"]) == 2  # not a trace
    # a run that learns, then a hot list made from its profile
    assert main(["generate", "--model", str(m), "--prompt", "hello there", "--max-tokens", "2", "--quiet",
                 "--cache-budget-gb", "0"]) == 0
    capsys.readouterr()
    assert main(["hotlist", "--model", str(m), "--out", str(out), "--cache-budget-gb", "0"]) == 0
    assert "from usage profile" in capsys.readouterr().out
    assert json.loads(out.read_text())["pin"]
