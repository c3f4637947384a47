"""Expert parallelism (moestream/parallel.py): 2 and 3 CPU processes, gloo on loopback, against one process.

Every rank streams its own experts through a tiny budget; greedy and sampled tokens and
every step's logits must be ``torch.equal`` to one process with every expert resident.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moestream.engine import load
from moestream.ep_placement import balanced_owners, contiguous_owners, placement, rank_loads
from moestream.errors import MoestreamError
from moestream.generation import SamplingParams, generate

from .helpers import make_qwen3_moe

PROMPT = [3, 17, 250, 9, 41, 8, 120, 77, 5, 199, 64, 2, 33]
SAMPLINGS = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=1.0, seed=7)}
TOKENS = 10


# -- placement ---------------------------------------------------------------------------------
def test_contiguous_blocks():
    assert contiguous_owners(8, 2) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert contiguous_owners(8, 3) == [0, 0, 0, 1, 1, 1, 2, 2]
    assert contiguous_owners(3, 3) == [0, 1, 2]


def test_balanced_beats_contiguous_on_a_skewed_profile():
    # the first experts carry most of the traffic: contiguous puts them all on rank 0
    load_ = [100.0, 90.0, 80.0, 70.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.0, 0.0]
    for world in (2, 3, 5):
        bal = balanced_owners(load_, world)
        con = contiguous_owners(len(load_), world)
        assert sorted(set(bal)) == list(range(world))  # every rank owns some
        cap = -(-len(load_) // world)
        assert max(bal.count(r) for r in range(world)) <= cap  # memory stays even
        assert max(rank_loads(bal, load_, world)) < max(rank_loads(con, load_, world))
    # greedy LPT by hand for 2 ranks: 100->0, 90->1, 80->1 (90<100), 70->0 (170 vs 170: lower rank)
    assert balanced_owners([100.0, 90.0, 80.0, 70.0], 2) == [0, 1, 1, 0]


def test_placement_every_expert_owned_once_and_fallback():
    nums = {1: 8, 2: 8, 3: 6}
    owners, note = placement(nums, 3, None, "auto")
    assert "contiguous" in note
    assert owners == {layer: contiguous_owners(n, 3) for layer, n in nums.items()}
    owners, note = placement(nums, 3, None, "balanced")
    assert "no usage profile" in note
    profile = {1: [float(e * e) for e in range(8)], 2: [0.0] * 8, 3: [5.0, 0, 0, 0, 0, 1.0]}
    owners, note = placement(nums, 3, profile, "auto")
    assert "balanced" in note
    for layer, n in nums.items():
        assert len(owners[layer]) == n and set(owners[layer]) <= {0, 1, 2}
    assert owners[2] == contiguous_owners(8, 3)  # a layer without traffic stays contiguous
    assert owners[1] == balanced_owners(profile[1], 3)
    with pytest.raises(MoestreamError, match="--ep-placement"):
        placement(nums, 2, None, "random")


# -- multi-process runs ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, path: str, budget: str, out: str, die_at: int | None,
            combine: str, mode: str = "generate", timeout_s: float = 20, options: dict | None = None) -> None:
    """One rank: load with expert parallelism, run every sampling of SAMPLINGS, write tokens and logits."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from moestream.options import EngineOptions
    from moestream.parallel import init_from_env

    res: dict = {}
    options = dict(options or {})
    if "small_exchange" in options:  # 0: every combine sends its headers first (the prefill path)
        import moestream.ep_exchange

        moestream.ep_exchange.SMALL_EXCHANGE = options.pop("small_exchange")
    batched = options.pop("batched", False)
    try:
        opts = EngineOptions.make(budget, device="cpu", dist_timeout=timeout_s, ep_combine=combine, workers=2,
                                  usage_file=f"{out}/usage.json", batched_experts=batched, **options)
        ep = init_from_env(opts)
        engine = load(path, options=opts, tokenizer=False, parallel=ep)  # batched: the GPU's path, on the CPU
        try:
            if mode == "serve":
                res.update(_serve(engine, ep))
                return
            if mode == "diverge":  # each rank forwards other tokens: the combine's header check must catch it
                with torch.inference_mode():
                    engine.model(torch.tensor(PROMPT[rank : rank + 4]), 0, engine.model.new_kv_cache())
                return
            logits = {}
            for name, sampling in SAMPLINGS.items():
                tokens = []
                for i, step in enumerate(generate(engine, PROMPT, TOKENS, sampling, stop_at_eos=False,
                                                  keep_logits=True)):
                    if die_at is not None and rank == world - 1 and i == die_at:
                        os._exit(9)  # a rank dies mid-generation
                    tokens.append(step.token)
                    logits[f"{name}.{i}"] = step.logits.contiguous()
                res[name] = tokens
            res["cancelled_steps"] = _cancelled(engine, rank)
            res["owned"] = len(ep._owned)
            res["pinned_not_owned"] = [k for k in engine.cache.pinned_keys if not ep.owns(k)]
            res["pinned"] = len(engine.cache.pinned_keys)
            res["misses"] = engine.cache.stats.misses
            res["combines"] = ep.stats.combines
            res["bytes_received"] = ep.stats.bytes_received
            save_file(logits, f"{out}/rank{rank}.safetensors")
        finally:
            engine.close()
            ep.close()
    except Exception as e:  # reported to the test, which checks the message
        res["error"] = f"{type(e).__name__}: {e}"
        res["at"] = time.monotonic()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))


def _serve(engine, ep) -> dict:
    """``serve``'s pattern: rank 0 generates now and then (idle longer than the collectives' timeout in
    between, one stream closed early), the others follow until rank 0 shuts down."""
    ep.serving = True
    if ep.rank:
        return {"followed": ep.follow(engine)}
    first = [s.token for s in generate(engine, PROMPT, TOKENS, SamplingParams(), stop_at_eos=False)]
    time.sleep(ep.timeout_s * 1.5)  # idle: the followers wait on the store, not in a collective
    cancelled = _cancelled(engine, 0)
    again = [s.token for s in generate(engine, PROMPT, TOKENS, SamplingParams(), stop_at_eos=False)]
    ep.shutdown()
    return {"greedy": first, "again": again, "cancelled_steps": cancelled}


def _cancelled(engine, rank: int) -> int:
    """Rank 0 stops reading a generation after 2 tokens (a closed stream); the steps each rank saw."""
    gen = generate(engine, PROMPT[:5], TOKENS, SamplingParams(), stop_at_eos=False)
    n = 0
    for _ in gen:
        n += 1
        if rank == 0 and n == 2:
            break
    gen.close()
    return n


def _launch(path: Path, world: int, budget: str, out: Path, die_at: int | None = None,
            combine: str = "allgather", limit: float = 90.0, mode: str = "generate", timeout_s: float = 20,
            options: dict | None = None) -> list[dict]:
    ctx = mp.get_context("forkserver")  # a clean server process (no threads) forks every rank, imports done
    ctx.set_forkserver_preload(["tests.ep_preload", "tests.test_expert_parallel"])
    port = _free_port()
    procs = [ctx.Process(target=_worker,
                         args=(r, world, port, str(path), budget, str(out), die_at, combine, mode, timeout_s,
                               options))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still running after {limit} s (a hang)"
    out_rows = []
    for r in range(world):
        f = out / f"rank{r}.json"
        out_rows.append(json.loads(f.read_text()) if f.exists() else {"exit": procs[r].exitcode})
    return out_rows


def _reference(path: Path, usage: Path, batched: bool = False) -> tuple[dict, dict]:
    """One process, every expert resident, one thread (the ranks run one thread each too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = load(path, cache_budget_gb="all", tokenizer=False, usage_file=usage, batched_experts=batched)
        try:
            tokens, logits = {}, {}
            for name, sampling in SAMPLINGS.items():
                steps = list(generate(engine, PROMPT, TOKENS, sampling, stop_at_eos=False, keep_logits=True))
                tokens[name] = [s.token for s in steps]
                logits.update({f"{name}.{i}": s.logits for i, s in enumerate(steps)})
            assert _cancelled(engine, 0) == 2
            return tokens, logits
        finally:
            engine.close()
    finally:
        torch.set_num_threads(threads)


def _expert_bytes(path: Path) -> int:
    from moestream.checkpoint import Checkpoint
    from moestream.layout import discover_experts

    with Checkpoint(path) as c:
        lay = discover_experts(c.tensors)
        layer = min(lay.layers)
        return lay.expert_nbytes(layer, 0)


def _check_equal(path: Path, rows: list[dict], out: Path, batched: bool = False) -> None:
    ref_usage = out / "reference-usage.json"
    ref_tokens, ref_logits = _reference(path, ref_usage, batched)
    assert len(set(ref_tokens["sampled"])) > 1  # sampling really draws
    # rank 0 saved the whole model's usage profile: the ranks' counts summed, as one process counts them
    assert json.loads((out / "usage.json").read_text())["counts"] == json.loads(ref_usage.read_text())["counts"]
    for r, row in enumerate(rows):
        assert "error" not in row, row
        assert row["cancelled_steps"] == 2  # rank 0 closed its stream: every rank stopped at the same step
        for name in SAMPLINGS:
            assert row[name] == ref_tokens[name], (r, name)
        got = load_file(str(out / f"rank{r}.safetensors"))
        assert set(got) == set(ref_logits)
        for key, want in ref_logits.items():
            assert torch.equal(got[key], want), (r, key)
        assert row["misses"] > 0  # tiny budgets: experts really were read (and evicted)
        assert row["combines"] > 0 and row["bytes_received"] > 0


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen")
    make_qwen3_moe(path, seed=3, num_hidden_layers=3, num_experts=12, num_experts_per_tok=3)
    return path


@pytest.mark.parametrize("world,combine", [(2, "allgather"), (3, "alltoall")])
def test_ranks_bit_identical_to_one_process(qwen, tmp_path, world, combine):
    one = _expert_bytes(qwen)
    options = None
    if world == 3:  # read-ahead and a pin file too: each rank reads ahead and pins its own experts only
        pins = tmp_path / "pins.json"
        pins.write_text(json.dumps({"pin": [[layer, e] for layer in range(3) for e in range(3)]}))
        options = {"prefetch_ahead": 1, "pin_file": str(pins)}
    rows = _launch(qwen, world, str(3 * one / 1e9), tmp_path, combine=combine, options=options)
    _check_equal(qwen, rows, tmp_path)
    assert sum(row["owned"] for row in rows) == 3 * 12  # every expert owned by exactly one rank
    assert all(row["pinned_not_owned"] == [] for row in rows)
    if options:
        assert sum(row["pinned"] for row in rows) > 0


@pytest.mark.parametrize("world", [2, 3])
def test_batched_path_bit_identical_to_one_process_batched(qwen, tmp_path, world):
    """The GPU's batched matmul path (here on the CPU): each rank computes its own experts at the whole
    layer's shapes, so its slots have the bits of the one-process batched run."""
    one = _expert_bytes(qwen)
    rows = _launch(qwen, world, str(3 * one / 1e9), tmp_path, options={"batched": True})
    _check_equal(qwen, rows, tmp_path, batched=True)


def test_deepseek_family_with_shared_experts(tmp_path_factory, tmp_path):
    """A tiny DeepSeek-V3 (sigmoid group routing, correction bias, shared experts, a dense first layer)."""
    from .test_family_deepseek import make_model

    path = tmp_path_factory.mktemp("dsv3")
    make_model(path, "deepseek_v3", seed=2)
    one = _expert_bytes(path)
    rows = _launch(path, 2, str(one / 1e9), tmp_path, options={"small_exchange": 0})  # headers first
    _check_equal(path, rows, tmp_path)
    assert sum(row["owned"] for row in rows) == 3 * 8  # MoE layers 1..3, 8 experts each


def test_dead_rank_fails_the_others_with_a_clear_error(qwen, tmp_path):
    t0 = time.monotonic()
    rows = _launch(qwen, 3, "0", tmp_path, die_at=3, limit=60)
    assert rows[2] == {"exit": 9}
    for r in (0, 1):
        err = rows[r].get("error", "")
        assert "ParallelError" in err and "stopped answering" in err and "rank 2" in err, rows[r]
        assert rows[r]["at"] - t0 < 45  # well within the 20 s timeout plus start-up, not a hang


def test_cli_refuses_chat_under_torchrun(qwen, monkeypatch, capsys):
    from moestream.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["generate", "--model", str(qwen), "--chat"]) == 2
    assert "--chat is not supported under torchrun" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_cli_refuses_a_bad_dist_timeout_in_one_process_too(qwen, capsys, value):
    from moestream.cli import main

    assert main(["generate", "--model", str(qwen), "--prompt", "hi", "--dist-timeout", value]) == 2
    assert "--dist-timeout must be a positive number of seconds" in capsys.readouterr().err


def test_auto_budget_takes_this_ranks_share(tmp_path, monkeypatch):
    from moestream import budget, memory

    from .test_io import fake_root

    gib = 2**30
    root = fake_root(tmp_path, 2, 7 * gib)
    monkeypatch.setattr(memory, "current_rss_bytes", lambda: gib)
    a = budget.auto_cache_budget(resident=10**9, kv_cache=0, kv_tokens=0, reserve=0, experts_total=50 * 10**9,
                                 root=root, share=3)
    assert a.available == 2 * gib  # the 6 GiB this machine's processes may take, split 3 ways
    assert a.budget == 2 * gib - 10**9 and "split between 3 local ranks" in a.source


def test_serve_followers_wait_idle_and_follow_every_request(qwen, tmp_path):
    rows = _launch(qwen, 2, "0", tmp_path, mode="serve", timeout_s=2)
    assert "error" not in rows[0] and "error" not in rows[1], rows
    ref = _reference(qwen, tmp_path / "ref-usage.json")[0]["greedy"]
    assert rows[0]["greedy"] == ref and rows[0]["again"] == ref
    assert rows[0]["cancelled_steps"] == 2
    assert rows[1]["followed"] == 3  # two whole generations and the cancelled one, then the shutdown


@pytest.mark.parametrize("small", [True, False], ids=["one-step", "headers-first"])
def test_ranks_that_diverge_fail_with_a_clear_error(qwen, tmp_path, small):
    options = None if small else {"small_exchange": 0}
    rows = _launch(qwen, 2, "0", tmp_path, mode="diverge", timeout_s=10, options=options)
    for r, row in enumerate(rows):
        assert "ParallelError" in row.get("error", "") and "diverged" in row["error"], row
        assert f"rank {1 - r} diverged from rank {r}" in row["error"]
