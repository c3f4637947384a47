"""The read half of "Cache and I/O": O_DIRECT and its fallback, prefetch ahead, the auto
budget under cgroup limits, wired memory, the I/O stats. No option may change a bit."""

import errno
import json
import os

import pytest
import torch

import moestream.direct_io as direct_io
from moestream import budget as budget_module
from moestream import memory
from moestream.cli import main
from moestream.direct_io import DirectReader
from moestream.engine import load
from moestream.errors import BudgetError
from moestream.generation import GenerationStats, SamplingParams, generate
from moestream.prefetch import Prefetcher
from moestream.store import PreadReader

from .helpers import make_qwen3_moe, read_all, write_checkpoint, write_tiny_synth_config

TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny model (4 layers x 16 experts, top-4) over 2 shards, on a disk that takes O_DIRECT."""
    src = tmp_path_factory.mktemp("src")
    make_qwen3_moe(src, seed=7, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4)
    return write_checkpoint(src, tmp_path_factory.mktemp("io"), read_all(src), shards=2)


def run(path, budget, workers=2, **io):
    """Prefill logits (every position), each step's logits, the tokens, and the engine's counters."""
    engine = load(path, cache_budget_gb=budget, workers=workers, tokenizer=False, **io)
    try:
        prompt = torch.randint(0, 300, (11,), generator=torch.Generator().manual_seed(3)).tolist()
        kv = engine.model.new_kv_cache()
        with torch.inference_mode():
            prefill = engine.model(torch.tensor(prompt), 0, kv, all_logits=True)
        stats = GenerationStats()
        steps = list(generate(engine, prompt, TOKENS, SamplingParams(), stats, stop_at_eos=False, keep_logits=True))
        pf = engine.io.prefetcher
        return dict(
            prefill=prefill, logits=[s.logits for s in steps], tokens=[s.token for s in steps], stats=stats,
            cache=engine.cache.stats, store=engine.store.stats, reader=engine.store.reader, io=engine.io,
            prefetch=None if pf is None else pf.stats,
        )
    finally:
        engine.close()


@pytest.fixture(scope="module")
def reference(model):
    return run(model, "all", use_page_cache=True)


def same(a, b, what):
    assert torch.equal(a["prefill"], b["prefill"]), what
    assert len(a["logits"]) == len(b["logits"]) == TOKENS
    for i, (x, y) in enumerate(zip(a["logits"], b["logits"])):
        assert torch.equal(x, y), f"{what}: step {i} logits differ"
    assert a["tokens"] == b["tokens"], what


def one_expert(path):
    from moestream.checkpoint import Checkpoint
    from moestream.layout import discover_experts

    with Checkpoint(path) as c:
        return discover_experts(c.tensors).expert_nbytes(0, 0)


def test_every_io_option_is_bit_identical(model, reference):
    one = one_expert(model)
    mid = str(one * 20 / 1e9)  # a third of the experts
    configs = [
        ("O_DIRECT, budget 0, 1 worker", "0", 1, dict(use_page_cache=False)),
        ("O_DIRECT, budget all (preload)", "all", 8, dict(use_page_cache=False)),
        ("page cache, prefetch 1", mid, 3, dict(use_page_cache=True, prefetch_ahead=1)),
        ("O_DIRECT, prefetch 2, budget 0", "0", 2, dict(use_page_cache=False, prefetch_ahead=2)),
        ("everything: auto, O_DIRECT, prefetch 3, 8 workers, wired", "auto", 8,
         dict(use_page_cache=False, prefetch_ahead=3, wire_memory=True)),
    ]
    for what, budget, workers, io in configs:
        r = run(model, budget, workers, **io)
        same(r, reference, what)
        if io.get("use_page_cache") is False:
            assert isinstance(r["reader"], DirectReader) and not r["reader"].fallback_files, what
            assert r["reader"].direct_bytes >= r["store"].bytes_read > 0, what
        if budget != "all":
            assert r["stats"].gb_read > 0, what
        if io.get("prefetch_ahead"):
            assert r["prefetch"].issued > 0, what
    assert reference["cache"].misses == 0 and isinstance(reference["reader"], PreadReader)


def test_o_direct_refused_falls_back_and_says_so_once(model, reference, monkeypatch, capsys):
    def refuse(file):
        raise OSError(errno.EINVAL, "Invalid argument", str(file))

    monkeypatch.setattr(direct_io, "_open_direct", refuse)
    r = run(model, str(one_expert(model) * 5 / 1e9), 2, use_page_cache=False, prefetch_ahead=1)
    same(r, reference, "fallback")
    assert len(r["reader"].fallback_files) == 2 and r["reader"].direct_bytes == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "O_DIRECT refused" in line]
    assert len(notes) == 1 and "posix_fadvise DONTNEED" in notes[0]


def test_o_direct_reads_unaligned_ranges_and_reports_short_files(tmp_path):
    data = os.urandom(3 * 4096 + 777)
    f = tmp_path / "blob"
    f.write_bytes(data)
    r = DirectReader(note=lambda s: None)
    try:
        buf = bytearray(20000)
        view = memoryview(buf)
        for offset, lengths in ((0, [1]), (4095, [2, 4096, 3]), (len(data) - 9, [9]), (13, [5000, 0, 7000])):
            parts, pos = [], 0
            for n in lengths:
                parts.append(view[pos : pos + n])
                pos += n + 64
            assert r.read(f, offset, parts, "x") == sum(lengths)
            at = offset
            for p in parts:
                assert bytes(p) == data[at : at + len(p)]
                at += len(p)
        with pytest.raises(Exception, match="short read"):
            r.read(f, len(data) - 5, [view[:10]], "expert (0, 1)")
    finally:
        r.close()


def test_prefetch_counters_add_up(model, reference):
    r = run(model, "0", 2, use_page_cache=True, prefetch_ahead=1)
    same(r, reference, "prefetch counters run")
    c, s, p, st = r["cache"], r["store"], r["prefetch"], r["stats"]
    assert p.hits > 0 and p.issued > 0
    assert p.issued == p.hits + p.wasted + p.outstanding
    assert c.prefetch_hits == p.hits and c.lookups == c.hits + c.misses
    assert s.experts_read - s.prefetch_experts == c.misses  # every demand read is one miss
    assert st.gb_read == pytest.approx(st.gb_read_critical + st.gb_read_prefetch)
    assert st.cache_hit_rate == pytest.approx(
        st.cache_hit_rate_cache + st.cache_hit_rate_prefetch + st.cache_hit_rate_pinned)
    assert st.read_gb_per_s > 0 and st.read_busy_seconds > 0
    assert "prefetch" in st.summary() and "while reading" in st.summary()


class GuessBlock:
    """A MoE block stand-in whose router always guesses ``guess`` (the prefetcher asks a block for ``route`` and
    ``num_experts`` only)."""

    def __init__(self, layer, guess, experts=16):
        self.layer, self.guess, self.num_experts = layer, guess, experts

    def route(self, x):
        return torch.full((1, len(self.guess)), 0.25), torch.tensor([self.guess])


def test_prefetch_switches_itself_off_when_it_wastes_more_than_it_saves(model):
    engine = load(model, cache_budget_gb="0", workers=2, tokenizer=False)
    try:
        cache = engine.cache
        pf = Prefetcher(engine.store, [GuessBlock(0, [0]), GuessBlock(1, [2, 3, 4])], ahead=1, min_decided=6)
        pf.attach(cache)
        for step in range(5):
            pf.plan(0, torch.zeros(1, 64))  # guesses that layer 1 needs experts 2, 3 and 4
            list(cache.fetch(0, [5]))
            assert sorted(e for e, _ in cache.fetch(1, [3, 9])) == [3, 9]  # 1 right, 2 wasted
            assert pf.enabled is (step == 0), step  # 2 hits and 4 wasted after step 1: off
        s = pf.stats
        assert (s.issued, s.hits, s.wasted, s.outstanding) == (6, 2, 4, 0)
        assert s.wasted_bytes == 2 * s.saved_bytes and "switched off" in s.disabled
        assert cache.stats.prefetch_hits == 2 and cache.stats.misses == 5 + 5 + 3  # layer 0, expert 9, expert 3
    finally:
        engine.close()


def test_prefetch_stays_on_when_it_saves(model):
    engine = load(model, cache_budget_gb="0", workers=2, tokenizer=False)
    try:
        pf = Prefetcher(engine.store, [GuessBlock(0, [0]), GuessBlock(1, [2, 3])], ahead=1, min_decided=4)
        pf.attach(engine.cache)
        for _ in range(6):
            pf.plan(0, torch.zeros(1, 64))
            list(engine.cache.fetch(0, [5]))
            assert sorted(e for e, _ in engine.cache.fetch(1, [3, 2])) == [2, 3]
        assert pf.enabled and pf.stats.hits == 12 and pf.stats.wasted == 0
        assert engine.cache.stats.prefetch_hits == 12 and engine.cache.stats.misses == 6
    finally:
        engine.close()


# -- the auto budget and cgroups ----------------------------------------------------------------
def fake_root(tmp_path, version, limit, parent_limit=None, meminfo_gb=64):
    """A fake / with /proc/self/cgroup, /proc/meminfo and a cgroup v1 or v2 memory limit."""
    (tmp_path / "proc/self").mkdir(parents=True)
    kb = meminfo_gb * 2**20
    (tmp_path / "proc/meminfo").write_text(f"MemTotal: {kb} kB\nMemAvailable: {kb} kB\n")
    base = tmp_path / "sys/fs/cgroup"
    if version == 1:
        (tmp_path / "proc/self/cgroup").write_text("5:cpu:/\n4:memory:/jobs/bench\n0::/\n")
        d = base / "memory/jobs/bench"
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (d / "memory.usage_in_bytes").write_text("123\n")
        if parent_limit is not None:
            (d / "memory.stat").write_text(f"cache 0\nhierarchical_memory_limit {parent_limit}\n")
    else:
        (tmp_path / "proc/self/cgroup").write_text("0::/jobs/bench\n")
        d = base / "jobs/bench"
        d.mkdir(parents=True)
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text("123\n")
        (base / "jobs/memory.max").write_text(f"{parent_limit if parent_limit is not None else 'max'}\n")
    return tmp_path


@pytest.mark.parametrize("version", [1, 2])
def test_auto_budget_respects_a_cgroup_limit(tmp_path, version, monkeypatch):
    gib = 2**30
    root = fake_root(tmp_path, version, 6 * gib)
    monkeypatch.setattr(memory, "current_rss_bytes", lambda: gib)
    a = budget_module.auto_cache_budget(resident=2 * 10**9, kv_cache=10**8, kv_tokens=1000, reserve=5 * 10**8,
                                 experts_total=50 * 10**9, root=root)
    assert a.available == 5 * gib  # the limit less this process's RSS, not the 64 GB of meminfo
    assert a.budget == 5 * gib - 2 * 10**9 - 10**8 - 5 * 10**8
    assert f"cgroup v{version}" in a.source and "6.44 GB" in a.describe()
    with pytest.raises(BudgetError, match="no memory left"):
        budget_module.auto_cache_budget(6 * 10**9, 0, 0, 0, 10**9, root=root)


@pytest.mark.parametrize("version", [1, 2])
def test_a_parents_smaller_limit_binds(tmp_path, version, monkeypatch):
    root = fake_root(tmp_path, version, 8 * 2**30, parent_limit=3 * 2**30)
    assert memory.cgroup_limit_bytes(root)[0] == 3 * 2**30
    monkeypatch.setattr(memory, "current_rss_bytes", lambda: 0)
    assert memory.available_with_source(root)[0] == 3 * 2**30


def test_no_cgroup_limit_uses_meminfo(tmp_path):
    root = fake_root(tmp_path, 2, "max", meminfo_gb=4)
    assert memory.cgroup_limit_bytes(root) is None
    assert memory.available_with_source(root) == (4 * 2**30, "MemAvailable 4.29 GB")


def test_load_auto_budget_from_a_fake_cgroup(model, tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "SYSTEM_ROOT", fake_root(tmp_path, 1, 2 * 2**30))
    monkeypatch.setattr(memory, "current_rss_bytes", lambda: 2**30)
    engine = load(model, cache_budget_gb="auto", workers=1, tokenizer=False, use_page_cache=True, context_tokens=100)
    try:
        a = engine.budget.auto
        assert a.available == 2**30 and a.kv_tokens == 100  # the cgroup's 2 GiB less the (faked) 1 GiB RSS
        assert a.kv_cache == 2 * 100 * 4 * 2 * 2 * 16 * 4  # x2 for growth, 4 layers, k+v, 2 heads x 16, fp32
        assert a.reserve > budget_module.RUNTIME_RESERVE and a.resident > 0
        assert engine.cache.budget_bytes == a.budget == min(a.available - a.resident - a.kv_cache - a.reserve,
                                                            a.experts_total)
    finally:
        engine.close()
    monkeypatch.setattr(budget_module, "RUNTIME_RESERVE", 2**30)
    with pytest.raises(BudgetError, match="auto: no memory left.*cgroup v1"):
        load(model, cache_budget_gb="auto", workers=1, tokenizer=False, use_page_cache=True)


def test_page_cache_auto_rule(model, tmp_path, monkeypatch):
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    monkeypatch.setattr(memory, "current_rss_bytes", lambda: 0)
    for limit, direct in ((int(size / 0.5), False), (int(size / 0.7), True)):
        root = tmp_path / str(limit)
        monkeypatch.setattr(memory, "SYSTEM_ROOT", fake_root(root, 2, limit))
        engine = load(model, cache_budget_gb="0", workers=1, tokenizer=False)
        try:
            assert engine.io.use_page_cache is not direct, limit
            assert isinstance(engine.store.reader, DirectReader) is direct
            assert "auto:" in engine.io.page_cache_reason
        finally:
            engine.close()


# -- wired memory -------------------------------------------------------------------------------
def test_wire_memory_refuses_a_low_memlock_limit_clearly(model, monkeypatch):
    monkeypatch.setattr(memory, "memlock_limit", lambda: 64 * 1024)
    monkeypatch.setattr(memory, "has_cap_ipc_lock", lambda root=None: False)
    with pytest.raises(BudgetError, match=r"^wire_memory=True: .*RLIMIT_MEMLOCK.*64 KiB.*ulimit -l.*drop "
                                          r"wire_memory=True$"):  # the API's keyword
        load(model, cache_budget_gb="0.001", workers=1, tokenizer=False, wire_memory=True)


def test_wire_memory_locks_and_unlocks(model):
    if memory.memlock_limit() is not None and not memory.has_cap_ipc_lock():
        pytest.skip("cannot lock more than RLIMIT_MEMLOCK here")
    one = one_expert(model)
    engine = load(model, cache_budget_gb=str(one * 3.5 / 1e9), workers=1, tokenizer=False, wire_memory=True)
    try:
        wired = engine.io.wired
        resident = wired.locked_bytes
        assert resident >= engine.resident_bytes
        list(engine.cache.fetch(0, [0, 1, 2, 3, 4]))  # 5 read, 3 stay cached
        buffer = engine.store.frame((0, 0)).nbytes  # each expert's buffer: its pieces' 4 KiB-rounded span
        assert buffer % 4096 == 0 and one <= buffer < one + 2 * 4096
        assert wired.locked_bytes - resident == 3 * buffer
        list(engine.cache.fetch(1, [0, 1, 2, 3, 4]))
        assert wired.locked_bytes - resident == 3 * buffer  # evicted experts were unlocked
    finally:
        engine.close()


# -- the command line ---------------------------------------------------------------------------
def test_generate_cli_io_options(tmp_path, capsys):
    import argparse
    import io as _io

    from moestream.cli import _add_generate_args, run_generate

    cfg = write_tiny_synth_config(tmp_path / "c.json")
    assert main(["synth", "--config", str(cfg), "--out", str(tmp_path / "m")]) == 0
    parser = argparse.ArgumentParser()
    _add_generate_args(parser)
    runs = {}
    for name, flags in (
        ("ref", ["--cache-budget-gb", "all", "--use-page-cache"]),
        ("io", ["--cache-budget-gb", "auto", "--no-page-cache", "--prefetch-ahead", "1", "--prefetch-workers", "3",
                "--wire-memory"]),
    ):
        stats = tmp_path / f"{name}.json"
        args = parser.parse_args(["--model", str(tmp_path / "m"), "--prompt", "Disks?", "--max-tokens", "6",
                                  "--temp", "1", "--seed", "0", "--stats-json", str(stats), *flags])
        err = _io.StringIO()
        run_generate(args, _io.StringIO(), err)
        runs[name] = (json.loads(stats.read_text()), err.getvalue())
    (ref, _), (io, err) = runs["ref"], runs["io"]
    assert io["generated_token_ids"] == ref["generated_token_ids"]
    assert "cache budget auto:" in err and "GB resident weights" in err and "O_DIRECT" in err
    assert "hits by source" in err and "while reading" in err
    for key in ("cache_hit_rate_prefetch", "cache_hit_rate_pinned", "gb_read_critical", "gb_read_prefetch",
                "read_gb_per_s", "prefetch_issued", "prefetch_wasted_gb"):
        assert key in io
    assert io["read_path"] == "O_DIRECT" and io["prefetch_status"]
    assert parser.parse_args(["--model", "m", "--prompt", "x"]).use_page_cache is None
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "x", "--prefetch-ahead", "-1"]) == 2
    assert "--prefetch-ahead must be at least 0" in capsys.readouterr().err
