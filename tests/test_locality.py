"""Locality statistics of routing traces against hand-computed values; the public trace formats
cache-sim replays (JSON lines, FLAME-MoE parquet), and malformed ones refused naming the line."""

import json
import math
import sys

import pytest

from moestream.cachesim import gini, locality, lru_hits, requests_of, routes_by_layer, simulate
from moestream.cli import main
from moestream.errors import MoestreamError
from moestream.policies import make_policy
from moestream.traces import load_trace

# layer 0, 5 experts, top-2: tokens 0-3 route to [1,2] [2,3] [4,1] [2,4]; layer 1 routes every token to [0,1]
# (tokens 0-1 as one prefill record of two rows, then one record per token)
RECORDS = [
    (0, 0, [[1, 2], [2, 3]]), (0, 1, [[0, 1], [0, 1]]),
    (2, 0, [[4, 1]]), (2, 1, [[0, 1]]),
    (3, 0, [[2, 4]]), (3, 1, [[0, 1]]),
]


def test_statistics_on_a_hand_written_trace():
    assert routes_by_layer(RECORDS) == {0: [[1, 2], [2, 3], [4, 1], [2, 4]], 1: [[0, 1]] * 4}
    loc = locality(RECORDS, {0: 5, 1: 5}, residencies=(0.2, 0.4), warmup=0)
    # layer 0, tokens 1-3: distances 2:1 3:never | 4:never 1:2 | 2:2 4:1; layer 1: six selections at distance 1
    assert loc.next_token_reuse == pytest.approx((2 + 6) / 12)
    assert loc.reuse_within == pytest.approx((4 + 6) / 12)
    assert loc.reuse_distance == {50: 1, 90: math.inf, 99: math.inf}  # sorted: 1 x8, 2 x2, never x2
    assert loc.distinct == {0: 4, 1: 2}
    # layer 0 counts over its 5 experts [0, 2, 3, 1, 2] -> sorted 0 1 2 2 3: (-4*0 - 2*1 + 0 + 2*2 + 4*3) / (5*8)
    assert loc.gini[0] == pytest.approx(14 / 40)
    assert loc.gini[1] == pytest.approx(gini([4, 4, 0, 0, 0]))
    # per-layer LRU of 2 experts (40% of 5): layer 0 hits 2 of 8 (token 1's 2, token 3's 4), layer 1 hits 6 of 8;
    # of 1 expert (20%): layer 0 hits token 1's 2 only, layer 1 keeps expert 1 and hits it 3 times
    assert lru_hits([[1, 2], [2, 3], [4, 1], [2, 4]], 2) == (2, 8)
    assert lru_hits([[1, 2], [2, 3], [4, 1], [2, 4]], 2, warmup=2) == (1, 4)  # tokens 2-3 counted: 4 hits at 3
    assert locality(RECORDS, {0: 5, 1: 5}, residencies=(0.4,)).warmup == 2  # at most half the tokens
    assert loc.lru == {0.2: pytest.approx((1 + 3) / 16), 0.4: pytest.approx((2 + 6) / 16)}
    assert locality(RECORDS, {0: 5, 1: 5}, window=1, warmup=0).reuse_within == loc.next_token_reuse


def test_gini_bounds():
    assert gini([3, 3, 3, 3]) == 0.0
    assert gini([0, 0, 0, 8]) == pytest.approx(3 / 4)  # all on one of n: (n - 1) / n
    assert gini([0, 0]) == 0.0


def test_prefetch_and_pins_replayed_by_hand():
    """Prefetch depth 1 and a pinned expert, a cache of 3 experts, LRU, traced by hand."""
    reqs = [(0, [0, 1]), (1, [0, 1]), (0, [0, 2]), (1, [1, 2])]
    ahead = [[(1, [0, 2])], [], [(1, [1, 2])], []]
    # request 0 (layer 0): (1,0) (1,2) predicted, read ahead; (0,0) (0,1) missed: 4 reads
    # request 1 (layer 1): (1,0) claimed (a hit), (1,1) missed, (1,2) wasted; the cache of 3 evicts (0,0), the LRU
    # request 2 (layer 0): (1,1) predicted but cached, (1,2) read ahead; (0,0) (0,2) missed, evicting (0,1) (1,0)
    # request 3 (layer 1): (1,1) a hit, (1,2) claimed
    r = simulate(reqs, lambda k: 1, 3, make_policy("lru"), [True] * 4, ahead=ahead, depth=1)
    assert (r.lookups, r.hits, r.prefetch_hits, r.wasted) == (8, 3, 2, 1)
    assert r.reads == 4 + 1 + 3 + 0 and r.decode_hit_rate == 3 / 8
    # the same with (1,1) pinned in a cache of 4: its lookups hit and never enter the policy
    p = simulate(reqs, lambda k: 1, 4, make_policy("lru"), [True] * 4, pinned=[(1, 1)])
    assert (p.hits, p.pinned_hits) == (2 + 1, 2)  # (0,0) at request 2 and both lookups of (1,1)
    nothing = simulate(reqs, lambda k: 1, 4, make_policy("lru"), [True] * 4)
    assert nothing.hits == 2  # (0,0) at request 2, (1,1) at request 3


def test_chunk_read_ahead_replayed_by_hand():
    """Prefill chunks read the next layer's most used experts ahead (window 2), as Prefetcher._plan_chunk; then
    decode reads ahead at depth 1. A cache of 4 experts with (1,3) pinned, LRU, traced by hand."""
    reqs = [(0, [0, 1]), (1, [0, 3, 1]), (0, [1, 2]), (1, [2, 3])]
    decode = [False, False, True, True]
    ahead = [[(1, [1])], [], [(1, [2, 0])], []]  # request 0's is the decode-style guess a chunk does not read
    chunk = [[(1, [3, 0, 2, 1])], [], None, None]  # the chunk order; [] at the last layer; None: one token
    # request 0 (layer 0, chunk): (1,3) is pinned, so (1,0) (1,2) fill the window of 2 ((1,1) is not read);
    #   (0,0) (0,1) missed: 4 reads
    # request 1 (layer 1, chunk): (1,0) claimed, (1,3) a pinned hit, (1,1) missed, (1,2) wasted; evicts (0,0)
    # request 2 (layer 0, decode): (1,2) predicted and read ahead, (1,0) predicted but cached; (0,1) a hit,
    #   (0,2) missed, evicting (1,0)
    # request 3 (layer 1, decode): (1,2) claimed, (1,3) a pinned hit
    r = simulate(reqs, lambda k: 1, 4, make_policy("lru"), decode, pinned=[(1, 3)], ahead=ahead, depth=1,
                 chunk=chunk, window=2)
    assert (r.lookups, r.hits, r.prefetch_hits, r.pinned_hits, r.wasted, r.reads) == (9, 5, 2, 2, 1, 4 + 1 + 2)
    assert (r.chunk_issued, r.chunk_hits, r.chunk_wasted) == (2, 1, 1)
    assert (r.decode_lookups, r.decode_hits, r.decode_prefetch_hits, r.decode_reads) == (4, 3, 1, 2)
    # a trace without chunk records (older traces) replays its chunks from ahead, as before: request 0 reads (1,1)
    # ahead, claimed at request 1 where (1,0) is missed; nothing is wasted
    old = simulate(reqs, lambda k: 1, 4, make_policy("lru"), decode, pinned=[(1, 3)], ahead=ahead, depth=1)
    assert (old.hits, old.prefetch_hits, old.wasted, old.reads, old.chunk_issued) == (5, 2, 0, 3 + 1 + 2, 0)
    assert simulate(reqs, lambda k: 1, 4, make_policy("lru"), decode, pinned=[(1, 3)], ahead=ahead, depth=1,
                    chunk=[None] * 4, window=2) == old
    # window 0: chunks read nothing ahead (the engine's GPU tiers), nor their decode-style guesses
    none = simulate(reqs, lambda k: 1, 4, make_policy("lru"), decode, pinned=[(1, 3)], ahead=ahead, depth=1,
                    chunk=chunk, window=0)
    assert (none.prefetch_hits, none.chunk_issued, none.reads) == (1, 0, 2 + 2 + 2)


def test_chunk_waste_does_not_switch_decode_read_ahead_off():
    """The switch-off counts decode reads ahead only (Prefetcher._judge): two chunk reads ahead wasted leave it on."""
    reqs = [(0, [0]), (1, [0]), (0, [0]), (1, [3])]
    chunk = [[(1, [1, 2])], [], None, None]
    ahead = [[], [], [(1, [3])], []]
    r = simulate(reqs, lambda k: 1, 10, make_policy("lru"), [False, False, True, True], ahead=ahead, depth=1,
                 min_decided=1, chunk=chunk, window=2)
    assert (r.chunk_issued, r.chunk_wasted, r.prefetch_hits, r.decode_prefetch_hits) == (2, 2, 1, 1)


def test_moestream_trace_chunk_records(tmp_path):
    """A moestream trace's chunk records and window are read (and cut with the tokens); older traces have neither;
    a malformed chunk is refused naming the line."""
    head = {"format": "moestream-trace", "version": 1, "num_experts": {"0": 4, "1": 4}, "ahead": 2}
    recs = [{"token": 0, "layer": 0, "experts": [[0, 1], [1, 2]], "ahead": [[1, [1, 2]]], "chunk": [[1, [2, 1, 0]]]},
            {"token": 0, "layer": 1, "experts": [[0, 1], [1, 3]], "ahead": [], "chunk": []},
            {"token": 2, "layer": 0, "experts": [[3, 1]], "ahead": [[1, [0, 1]]]},
            {"token": 2, "layer": 1, "experts": [[2, 1]], "ahead": []}]
    new, old = tmp_path / "new.jsonl", tmp_path / "old.jsonl"
    new.write_text("\n".join(json.dumps(x) for x in [{**head, "chunk_window": 6}, *recs]) + "\n")
    old.write_text("\n".join(json.dumps(x) for x in [head, *({k: v for k, v in r.items() if k != "chunk"}
                                                          for r in recs)]) + "\n")
    tr = load_trace(new)
    assert tr.chunk == [[(1, [2, 1, 0])], [], None, None] and tr.chunk_window == 6 and tr.has_chunk
    assert load_trace(new, max_tokens=2).chunk == [[(1, [2, 1, 0])], []]
    o = load_trace(old)
    assert o.chunk == [None] * 4 and o.chunk_window == 0 and not o.has_chunk and o.ahead == tr.ahead
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(x) for x in [head, recs[0], {**recs[1], "chunk": [[1, ["x"]]]}]) + "\n")
    with pytest.raises(MoestreamError, match="line 3 is not a routing record"):
        load_trace(bad)


def test_public_json_lines_traces(tmp_path):
    a = tmp_path / "experts.jsonl"  # one token per line, the token field named
    a.write_text("\n".join(json.dumps({"token": t, "layer": layer, "experts": rows[0], "weights": [0.6, 0.4]})
                           for t, layer, rows in [(0, 0, [[1, 2]]), (0, 1, [[0, 1]]), (1, 0, [[2, 3]]),
                                                  (1, 1, [[0, 1]]), (2, 0, [[4, 1]]), (2, 1, [[0, 1]]),
                                                  (3, 0, [[2, 4]]), (3, 1, [[0, 1]])]) + "\n")
    b = tmp_path / "selected.jsonl"  # layers written one after the other, no token field; a two-token row list
    lines = [{"layer": 0, "selected_ids": [[1, 2], [2, 3]]}, {"layer": 0, "selected_ids": [4, 1]},
             {"layer": 0, "selected_ids": [2, 4]}] + [{"layer": 1, "selected_ids": [0, 1]}] * 4
    b.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    want = locality(RECORDS, {0: 5, 1: 5})
    for path in (a, b):
        tr = load_trace(path)
        assert tr.format == "jsonl" and tr.tokens == 4 and not tr.has_ahead
        assert routes_by_layer(tr.records) == routes_by_layer(RECORDS)
        got = locality(tr.records, {0: 5, 1: 5})
        assert (got.next_token_reuse, got.reuse_within, got.lru) == (want.next_token_reuse, want.reuse_within,
                                                                      want.lru)
    assert [(t, layer) for t, layer, _r in load_trace(a).records[:3]] == [(0, 0), (0, 1), (1, 0)]  # pass order
    assert load_trace(a).num_experts == {0: 5, 1: 2}  # inferred: largest id + 1
    reqs, decode = requests_of(load_trace(a).records)
    assert reqs[:2] == [(0, [1, 2]), (1, [0, 1])] and all(decode)


@pytest.mark.parametrize("line, why", [
    ('{"token": 2, "layer": 0, "experts": [1, "x"]}', "experts holds"),
    ('{"token": 2, "experts": [1, 2]}', "'layer'"),
    ('{"token": 2, "layer": 0}', "no expert ids"),
    ('{"token": -1, "layer": 0, "experts": [1]}', "not a position"),
    ("[1, 2]", "not a JSON object"),
    ("{not json", "line 3 is not a routing record"),
])
def test_malformed_json_lines_are_refused_naming_the_line(tmp_path, line, why):
    path = tmp_path / "t.jsonl"
    path.write_text('{"token": 0, "layer": 0, "experts": [1, 2]}\n{"token": 1, "layer": 0, "experts": [2, 3]}\n'
                    + line + "\n")
    with pytest.raises(MoestreamError, match="line 3 is not a routing record") as e:
        load_trace(path)
    assert why in str(e.value) and str(path) in str(e.value)
    (tmp_path / "u.jsonl").write_text('{"hello": 1}\n')
    with pytest.raises(MoestreamError, match="line 1 is neither a moestream trace header nor a routing record"):
        load_trace(tmp_path / "u.jsonl")


def test_flame_moe_parquet_traces(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "iter_0540"
    folder.mkdir()
    per_layer = {2: [[1, 2], [2, 3], [4, 1], [2, 4]], 3: [[0, 1]] * 4}  # FLAME-MoE's MoE layers start at 2
    for layer, rows in per_layer.items():
        table = pa.table({"scores": pa.array([[0.6, 0.4]] * 4, pa.list_(pa.float16())),
                          "indices": pa.array(rows, pa.list_(pa.int16()))})
        pq.write_table(table, folder / f"layer_{layer:02d}.parquet")
    tr = load_trace(folder)
    assert tr.format == "flame-moe" and tr.tokens == 4
    assert routes_by_layer(tr.records) == per_layer
    assert [(t, layer) for t, layer, _r in tr.records[:3]] == [(0, 2), (0, 3), (1, 2)]  # forward-pass order
    got, want = locality(tr.records, {2: 5, 3: 5}), locality(RECORDS, {0: 5, 1: 5})
    assert (got.next_token_reuse, got.reuse_within, got.gini[2]) == (want.next_token_reuse, want.reuse_within,
                                                                      want.gini[0])
    assert routes_by_layer(load_trace(folder, max_tokens=2).records) == {2: [[1, 2], [2, 3]], 3: [[0, 1]] * 2}
    one = load_trace(folder / "layer_03.parquet")  # a single layer file
    assert routes_by_layer(one.records) == {3: [[0, 1]] * 4}
    # cache-sim replays it by residency (no expert sizes in the format) and refuses GB budgets, naming why
    assert main(["cache-sim", "--trace", str(folder), "--residency", "0.2,0.5,1"]) == 0
    assert main(["cache-sim", "--trace", str(folder), "--budgets", "1"]) == 2
    # malformed: a null row, a missing column
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(pa.table({"indices": pa.array([[1, 2], None, [3, 4]], pa.list_(pa.int16()))}),
                   bad / "layer_02.parquet")
    with pytest.raises(MoestreamError, match=r"layer_02.parquet: row 1 is not a routing record"):
        load_trace(bad)
    pq.write_table(pa.table({"experts": pa.array([[1, 2]], pa.list_(pa.int16()))}), bad / "layer_02.parquet")
    with pytest.raises(MoestreamError, match=r"no 'indices' column .*columns: \['experts'\]"):
        load_trace(bad)


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "layer_02.parquet").write_bytes(b"PAR1")
    with pytest.raises(MoestreamError, match="needs pyarrow; install it with: pip install pyarrow"):
        load_trace(tmp_path / "layer_02.parquet")


def test_cache_sim_cli_on_json_lines(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    lines = [{"layer": layer, "token": t0 + j, "experts": row} for t0, layer, rows in RECORDS
             for j, row in enumerate(rows)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["cache-sim", "--trace", str(path), "--residency", "0.4"]) == 0
    out = capsys.readouterr().out
    assert "next-token reuse 66.7%, reuse within 8 tokens 83.3%" in out
    assert "usage Gini" in out and "per-layer LRU hit rate" in out
    assert main(["cache-sim", "--trace", str(path), "--residency", "0.4", "--prefetch", "1"]) == 2
    assert "records no predictions" in capsys.readouterr().err
    assert main(["cache-sim", "--trace", str(path)]) == 2  # neither --budgets nor --residency
    assert main(["cache-sim", "--trace", str(path), "--residency", "1.5"]) == 2


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_cache_sim_refuses_a_half_life_not_above_zero(tmp_path, capsys, value):
    """--half-life must be a finite number of lookups above 0: -1, nan and inf used to end in a ValueError
    traceback from the LFU policy, and 0 was silently replaced by the default."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"layer": layer, "token": t0 + j, "experts": row}) + "\n"
                            for t0, layer, rows in RECORDS for j, row in enumerate(rows)))
    assert main(["cache-sim", "--trace", str(path), "--residency", "0.4", "--half-life", value]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"moestream: error: --half-life {float(value)}: give a number of lookups above 0", err
    assert main(["cache-sim", "--trace", str(path), "--residency", "0.4", "--half-life", "0.5"]) == 0
