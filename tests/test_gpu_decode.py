"""On a CUDA GPU (``pytest -m gpu``, on the lent machine): the fused MoE kernel against float64 at real
widths; every decode step's logits bit-identical between budget all as CUDA graphs, budget all eager,
25% of the experts in VRAM with the host tier and 10% with the disk, on a tiny model and on a 2-layer
synth of Qwen3-30B-A3B's real shapes; transformers' logits on the same checkpoints."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moestream import fused_moe as fm
from moestream.engine import load
from moestream.slot_pool import SlotLayout

from .helpers import make_qwen3_moe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(fm.triton is None, reason="needs Triton")]

CONFIG = Path(__file__).parent / "configs" / "Qwen3-30B-A3B.json"


def pool_views(s, i, h, dtype, g):
    layout = SlotLayout.of([("gate", dtype, (i, h)), ("up", dtype, (i, h)), ("down", dtype, (h, i))])
    storage = torch.empty(s, layout.slot_bytes, dtype=torch.uint8, device="cuda")
    views = layout.views(storage)
    for v in views.values():
        fan_in = v.shape[-1]
        v.copy_((torch.randn(v.shape, generator=g, device="cuda") / fan_in ** 0.5).to(dtype))
    return storage, views, layout


def reference(x, w, idx, views, table):
    """float64 on the GPU, expert by expert, from the slots ``table`` names."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in idx.unique().tolist():
        rows, cols = (idx == e).nonzero(as_tuple=True)
        s = int(table[e])
        gate, up, down = (views[r][s].double() for r in ("gate", "up", "down"))
        xe = x[rows].double()
        y = (F.silu(xe @ gate.T) * (xe @ up.T)) @ down.T
        out.index_add_(0, rows, y * w[rows, cols, None].double())
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("k", [1, 2, 8, 10])
@pytest.mark.parametrize("t", [1, 7, 512])
def test_fused_kernel_against_float64(dtype, tol, k, t):
    """Real widths (H 2048, I 768), odd expert counts, both paths; every element written; repeatable;
    the same bits from other slots."""
    g = torch.Generator("cuda").manual_seed(t * 1000 + k)
    e = 7 if k <= 2 else 33
    h, i, s = 2048, 768, e + 5
    storage, views, layout = pool_views(s, i, h, dtype, g)
    perm = torch.randperm(s, generator=g, device="cuda")[:e]
    table = perm.to(torch.int32)
    x = torch.randn(t, h, generator=g, device="cuda").to(dtype)
    idx = torch.stack([torch.randperm(e, generator=g, device="cuda")[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g, device="cuda")
    out = torch.full((t, h), float("nan"), dtype=dtype, device="cuda")
    fm.fused_moe(x, w, idx, table, views["gate"], views["up"], views["down"], out=out)
    assert not torch.isnan(out).any()
    ref = reference(x, w, idx, views, table)
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < tol, err
    again = fm.fused_moe(x, w, idx, table, views["gate"], views["up"], views["down"])
    assert torch.equal(again, out)  # deterministic: no atomics
    moved = torch.randperm(s, generator=g, device="cuda")[:e]
    storage2 = torch.empty_like(storage)
    storage2[moved] = storage[perm]
    v2 = layout.views(storage2)
    assert torch.equal(fm.fused_moe(x, w, idx, moved.to(torch.int32), v2["gate"], v2["up"], v2["down"]), out)


# -- end to end ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-tiny")
    make_qwen3_moe(path, seed=5, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4)
    return path


@pytest.fixture(scope="module")
def real2(tmp_path_factory):
    """Qwen3-30B-A3B's shapes, 2 layers, bf16 (3.7 GB), random values drawn on the GPU."""
    from moestream.synth import plan_synth, write_synth

    path = tmp_path_factory.mktemp("gpu-real") / "q30-2l"
    write_synth(plan_synth(CONFIG, 2, "bf16", 0, None, "spread", 5.0), path, device="cuda")
    return path


def expert_bytes(path):
    from moestream.checkpoint import Checkpoint
    from moestream.layout import discover_experts

    with Checkpoint(path) as c:
        lay = discover_experts(c.tensors)
        return sum(lay.expert_nbytes(i, e) for i, x in lay.layers.items() for e in range(x.num_experts))


def decode(path, prompt, steps, **kw):
    """Prefill logits [T, vocab], then each decode step's [1, vocab] (float32, CPU); the runner's stats."""
    engine = load(path, tokenizer=False, device="cuda", hotlist=False, learn_experts=False, use_page_cache=False,
                  **kw)
    try:
        runner = engine.model.decode_runner
        assert runner is not None
        kv = engine.model.new_kv_cache()
        outs = []
        with torch.inference_mode():
            outs.append(engine.model(prompt.cuda(), 0, kv, all_logits=True).float().cpu())
            for n, tok in enumerate(steps):
                outs.append(engine.model(torch.tensor([tok], device="cuda"), len(prompt) + n, kv).float().cpu())
        return outs, runner.stats, engine.cache
    finally:
        engine.close()
        torch.cuda.empty_cache()


def budgets(path):
    total = expert_bytes(path)
    return [
        ("all, graphs", dict(cache_budget_gb="all")),
        ("all, eager", dict(cache_budget_gb="all", cuda_graphs=False)),
        ("25% + host tier", dict(cache_budget_gb=str(0.25 * total / 1e9), host_cache_gb="auto")),
        ("25% + host tier, 1 layer ahead", dict(cache_budget_gb=str(0.25 * total / 1e9), host_cache_gb="auto",
                                                prefetch_ahead=1)),
        ("10% + disk", dict(cache_budget_gb=str(0.10 * total / 1e9))),
    ]


PROMPT = torch.randint(0, 300, (23,), generator=torch.Generator().manual_seed(11))
STEPS = [7, 99, 250, 3, 180, 42, 42, 11, 5, 260]


@pytest.mark.parametrize("which", ["tiny", "real2"])
def test_every_budget_gives_the_bits_of_budget_all_as_graphs(which, request):
    path = request.getfixturevalue(which)
    runs = {name: decode(path, PROMPT, STEPS, **kw) for name, kw in budgets(path)}
    ref, st, _ = runs["all, graphs"]
    assert st.captures >= 1 and st.replays >= len(STEPS) - 1 and not st.disabled, st
    assert runs["all, eager"][1].replays == 0
    for name, (out, stats, cache) in runs.items():
        for n, (a, b) in enumerate(zip(ref, out)):
            assert torch.equal(a, b), f"{which}: {name} differs from budget all (graphs) at step {n}"
        if name.startswith(("25", "10")):
            assert stats.replays >= len(STEPS) - 1 and not stats.disabled, (name, stats)  # segmented graphs
            assert cache.stats.misses > 0
    assert runs["25% + host tier"][2].tier_stats.host_hits > 0
    assert runs["25% + host tier, 1 layer ahead"][2].tier_stats.staged > 0  # copies staged between graph segments
    assert runs["10% + disk"][2].tier_stats.disk_reads > 0


@pytest.mark.parametrize("which,rtol", [("tiny", 1e-4), ("real2", 2e-2)])
def test_logits_match_transformers(which, rtol, request):
    """transformers' model on the same checkpoint, the same tokens (prefill and each decode step)."""
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(which)
    ours, _, _ = decode(path, PROMPT, STEPS, cache_budget_gb="all")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype="auto").cuda().eval()
    try:
        ids = torch.cat([PROMPT, torch.tensor(STEPS)]).cuda()[None]
        with torch.inference_mode():
            want = hf(ids).logits[0].float().cpu()
    finally:
        del hf
        torch.cuda.empty_cache()
    got = torch.cat(ours)  # the prefill's rows, then each step's: positions 0..T+steps-1, as ``want``
    assert got.shape == want.shape
    for row in range(got.shape[0]):
        err = float((got[row] - want[row]).norm() / want[row].norm())
        assert err < rtol, (which, row, err)


def test_fused_kernel_decode_and_blocked_paths_give_a_row_the_same_bits():
    """Real widths, 128 experts, top-8: a token computed alone or among few (the decode path: T*K <= 64) and
    in a 512-token chunk (the blocked path, slots grouped by expert) gives the same bits."""
    g = torch.Generator("cuda").manual_seed(9)
    e, k, h, i = 128, 8, 2048, 768
    storage, views, layout = pool_views(e, i, h, torch.bfloat16, g)
    table = torch.arange(e, dtype=torch.int32, device="cuda")
    t = 512
    x = torch.randn(t, h, generator=g, device="cuda").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g, device="cuda")[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g, device="cuda")
    whole = fm.fused_moe(x, w, idx, table, views["gate"], views["up"], views["down"])
    for a, b in [(0, 1), (77, 78), (511, 512), (8, 16), (100, 107), (256, 512)]:
        part = fm.fused_moe(x[a:b], w[a:b], idx[a:b], table, views["gate"], views["up"], views["down"])
        assert torch.equal(part, whole[a:b]), (a, b)


def run_generate(engine, prompt, n, **kw):
    from moestream.generation import GenerationStats, generate

    stats = GenerationStats()
    steps = list(generate(engine, prompt, n, keep_logits=True, stop_at_eos=False, stats=stats, **kw))
    return [s.token for s in steps], [s.logits.cpu() for s in steps], stats


@pytest.mark.parametrize("graphs", [True, False])
def test_generate_100_and_200_tokens_agree_on_the_first_100(real2, graphs):
    """The KV capacity (prompt + max tokens, or the engine's kept storage) never reaches the bits: 100 and
    200 tokens give the same first 100 tokens and logits (issue 31), with the kept KV storage and without."""
    engine = load(real2, cache_budget_gb="all", tokenizer=False, device="cuda", hotlist=False, learn_experts=False,
                  cuda_graphs=graphs)
    try:
        prompt = torch.randint(0, 150000, (61,), generator=torch.Generator().manual_seed(2)).tolist()
        t100, l100, _ = run_generate(engine, prompt, 100)
        t200, l200, _ = run_generate(engine, prompt, 200)
        engine.model.kv_pool = None  # each cache sized by its request, as without the kept storage
        o100, m100, _ = run_generate(engine, prompt, 100)
        o200, m200, _ = run_generate(engine, prompt, 200)
    finally:
        engine.close()
        torch.cuda.empty_cache()
    for toks, logits in ((t200, l200), (o100, m100), (o200, m200)):
        assert toks[:100] == t100
        assert all(torch.equal(a, b) for a, b in zip(logits[:100], l100))


def test_two_requests_replay_the_graphs_captured_once(real2, monkeypatch):
    """The decode graphs are captured once for the engine's life (every expert resident from the load on: a
    residency that changes is another graph): a second and third request (other prompt lengths) replay them.
    The device-side greedy loop gives the plain loop's tokens and logits digest."""
    from moestream import generation

    engine = load(real2, cache_budget_gb="all", tokenizer=False, device="cuda", hotlist=False, learn_experts=False)
    try:
        runner = engine.model.decode_runner
        prompts = [torch.randint(0, 150000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                   for n in (40, 300, 7)]
        runs = [run_generate(engine, p, 24) for p in prompts]
        assert runner.stats.captures == 1 and runner.stats.replays >= 3 * 22, runner.stats
        assert engine.model.kv_pool.made == 1
        monkeypatch.setattr(generation, "PIPELINE_DEVICES", ())
        plain = [run_generate(engine, p, 24) for p in prompts]
        assert runner.stats.captures == 1
    finally:
        engine.close()
        torch.cuda.empty_cache()
    for (t1, l1, s1), (t2, l2, s2) in zip(runs, plain):
        assert t1 == t2 and s1.logits_sha256 == s2.logits_sha256
        assert all(torch.equal(a, b) for a, b in zip(l1, l2))


def test_prefill_chunks_seen_twice_replay_a_graph_with_the_plain_bits(real2):
    """A prefill chunk (every expert resident, a cache of the engine's KV pool) runs eagerly the first time its
    length comes, is captured the second time and replayed after; its logits, the keys it wrote and the decode
    steps after it are the plain forward's bits (the pool set aside: every chunk on the plain path), for a
    512-token chunk at position 0 and an 88-token one at 512."""
    engine = load(real2, cache_budget_gb="all", tokenizer=False, device="cuda", hotlist=False, learn_experts=False)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 150000, (n,), generator=g).tolist() for n in (512, 512, 512, 600, 600, 600)]
    try:
        runner = engine.model.decode_runner
        runs = [run_generate(engine, p, 4) for p in prompts]
        got = {k: getattr(runner.stats, k) for k in ("prefill_eager", "prefill_captures", "prefill_replays")}
        assert got == {"prefill_eager": 4, "prefill_captures": 2, "prefill_replays": 5}, got
        pool, engine.model.kv_pool = engine.model.kv_pool, None
        plain = [run_generate(engine, p, 4) for p in prompts]
        assert runner.stats.prefill_replays == 5 and runner.stats.prefill_eager == 4
        engine.model.kv_pool = pool
    finally:
        engine.close()
        torch.cuda.empty_cache()
    for (t1, l1, _), (t2, l2, _) in zip(runs, plain):
        assert t1 == t2
        assert all(torch.equal(a, b) for a, b in zip(l1, l2))
