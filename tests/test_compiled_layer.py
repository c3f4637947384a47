"""The compiled decoder layer (moestream.quant.native.decoder_layer, csrc/capi.cpp ms_decoder_layer) and the
compiled softmax router (ms_route_softmax).

The router against a float64 softmax top-k at the real expert counts (Qwen3-30B-A3B's 128 of 8, Qwen3-Next's 512
of 10, 256 of 8) and odd ones, a token's bits alone or among others, on every compiled path. The layer against
the same model's ops one by one (``DecoderLayer._plan = False``): the same logits with ``torch.equal``, float32,
bf16 and 4-bit (float and q8 activations), a prompt in chunks and decode steps, at budget ``all`` and budgets whose
experts are read and evicted (the layer stops after routing and the pipeline goes on), with the cache's counters
the same; and at Qwen3-30B-A3B's widths (hidden 2048, 32 query heads on 4 of 128, 128 experts of 768) one call
against its parts called one by one."""

import ctypes

import pytest
import torch

from moestream.convert import ConvertSpec, convert
from moestream.engine import load
from moestream.models import layers
from moestream.pipeline import sum_slots
from moestream.quant import native

from .helpers import make_qwen3_moe, read_all, write_checkpoint
from .test_quant_native import PATHS, on

pytestmark = pytest.mark.skipif(not native.paths(), reason="the CPU kernels are not built here")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("e,k", [(128, 8), (512, 10), (256, 8), (3, 1), (17, 5)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_route_softmax_against_float64_and_row_free(path, e, k, norm, dtype):
    """The experts of the k largest logits (a tie: the lower index first), their weights within a few float32
    ulp of float64's softmax (then one rounding to the logits' dtype); a token's routing alone, among 37 others
    or from a strided view: the same bits."""
    with on(path):
        logits = (torch.randn(37, e, generator=_gen(e + k)) * 3).to(dtype)
        w, idx = native.route_softmax(logits, k, norm)
        assert w.dtype == dtype and idx.dtype == torch.int64 and w.shape == (37, k)
        # the k largest logits in descending order (bf16 draws tie: equal values in ascending index)
        chosen = logits.double().gather(1, idx)
        assert torch.equal(chosen, torch.topk(logits.double(), k, dim=-1).values)
        ties = chosen[:, 1:] == chosen[:, :-1]
        assert (idx[:, 1:] > idx[:, :-1])[ties].all()
        p = torch.softmax(logits.double(), dim=-1).gather(1, idx)
        want_w = p / p.sum(-1, keepdim=True) if norm else p
        tol = 2 ** -8 if dtype == torch.bfloat16 else (e + 8) * 2 ** -24  # a float32 sum of e terms, exp_c, division
        assert ((w.double() - want_w).abs() <= tol * want_w.abs() + 1e-30).all()
        for i in (0, 5, 36):
            wi, ii = native.route_softmax(logits[i : i + 1], k, norm)
            assert torch.equal(wi, w[i : i + 1]) and torch.equal(ii, idx[i : i + 1])
        wide = torch.zeros(37, e + 7, dtype=dtype)
        wide[:, 3 : 3 + e] = logits
        ws, is_ = native.route_softmax(wide[:, 3 : 3 + e], k, norm)
        assert torch.equal(ws, w) and torch.equal(is_, idx)


def test_route_softmax_ties_take_the_lower_index():
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.5]])
    w, idx = native.route_softmax(logits, 3, True)
    assert idx.tolist() == [[1, 2, 3]]
    assert torch.equal(w, torch.full((1, 3), 1.0 / 3.0).float()) or (w - 1 / 3).abs().max() < 1e-7


def test_every_path_routes_with_the_same_bits():
    logits = torch.randn(9, 128, generator=_gen(3)) * 4
    got = {}
    for p in PATHS:
        if p in native.paths():
            with native.use(p):
                got[p] = native.route_softmax(logits, 8, True)
    first = next(iter(got.values()))
    assert all(torch.equal(first[0], w) and torch.equal(first[1], i) for w, i in got.values())


# -- the layer in a model --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled-layer")
    make_qwen3_moe(root / "f32", seed=21, num_hidden_layers=3)
    make_qwen3_moe(root / "window", seed=22, num_hidden_layers=2, use_sliding_window=True, sliding_window=7,
                   norm_topk_prob=False)
    make_qwen3_moe(root / "dense", seed=24, num_hidden_layers=4, mlp_only_layers=[1])
    out = {"f32": root / "f32", "window": root / "window", "dense": root / "dense"}
    bf16 = {k: v.bfloat16() for k, v in read_all(root / "f32").items()}
    out["bf16"] = write_checkpoint(root / "f32", root / "bf16", bf16)
    out["4bit"] = convert(root / "f32", root / "4bit", ConvertSpec(32, 4, 4, 4, 4))
    return out


IDS = torch.randint(0, 300, (30,), generator=_gen(5))


def _run(path, budget, compiled: bool, calls: list | None = None, stacks: list | None = None, **kw):
    """Logits of a prompt in chunks 0..13, 13..30 (a cache of capacity 8 that grows) and 4 decode steps; the
    cache's counters."""
    engine = load(path, cache_budget_gb=budget, tokenizer=False, workers=2, learn_experts=False, hotlist=False,
                  **kw)
    real_one, real_stack = native.run_layer, native.decoder_stack
    stacks = [] if stacks is None else stacks
    if calls is not None:  # each compiled layer's status: 0 whole, 1 stopped after routing
        def one(call):
            got = real_one(call)
            calls.append(got)
            return got

        def stack(cs):
            done, stopped = real_stack(cs)
            calls.extend([0] * done + [1] * stopped)
            stacks.append(len(cs))
            return done, stopped
        native.run_layer, native.decoder_stack = one, stack
    try:
        for m in engine.model.modules():
            if isinstance(m, layers.DecoderLayer):
                m._plan = None if compiled else False
        kv = engine.model.new_kv_cache(8)
        with torch.inference_mode():
            out = [engine.model(IDS[:13], 0, kv, all_logits=True), engine.model(IDS[13:], 13, kv, all_logits=True)]
            for i in range(4):
                out.append(engine.model(IDS[i : i + 1], 30 + i, kv, all_logits=True))
        s = engine.cache.stats
        counters = (s.lookups, s.hits, s.misses, s.evictions, {k: v.tolist() for k, v in engine.cache.usage.items()})
        return torch.cat(out), counters
    finally:
        native.run_layer, native.decoder_stack = real_one, real_stack
        engine.close()


@pytest.mark.parametrize("model", ["f32", "bf16", "window", "dense", "4bit", "4bit-q8"])
@pytest.mark.parametrize("budget", ["all", "half", "none"])
def test_the_decoder_layer_in_one_call_gives_the_op_by_op_bits(models, model, budget):
    """The same logits and cache counters as the ops one by one; at budget all every layer call computes the
    whole layer (consecutive layers in one stack call; a dense layer between them runs its ops), at smaller
    budgets some (or every) call stops after routing for the pipeline to read."""
    path = models[model.split("-")[0]]
    kw = {"activations": "q8"} if model.endswith("q8") else {}
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    gb = {"all": "all", "half": size * 0.3 / 1e9, "none": 1e-9}[budget]
    calls: list = []
    stacks: list = []
    fast, fast_counts = _run(path, gb, True, calls, stacks, **kw)
    plain, plain_counts = _run(path, gb, False, **kw)
    assert torch.equal(fast, plain)
    assert fast_counts == plain_counts
    assert calls and None not in calls
    if budget == "all":
        assert set(calls) == {0}
        assert len(calls) == 6 * (2 if model == "window" else 3)
        if model != "dense":
            assert stacks and all(s == (2 if model == "window" else 3) for s in stacks)
    if budget == "none":
        assert set(calls) == {1}
    if budget == "half":
        assert 0 in calls and 1 in calls


def test_the_compiled_layer_equals_budget_all_when_streamed(models):
    """Streaming through the compiled layer (a budget below the experts: reads, evictions, the table's entries
    let go) gives budget all's logits."""
    path = models["bf16"]
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    want, _ = _run(path, "all", True)
    for frac in (0.15, 0.4):
        got, counts = _run(path, size * frac / 1e9, True)
        assert counts[3] > 0  # evicted
        assert torch.equal(got, want)


def test_a_layer_the_compiled_call_does_not_cover_runs_its_ops(tmp_path):
    """Attention biases (no kernel view): the layer declines and computes op by op, still the reference bits."""
    make_qwen3_moe(tmp_path, seed=23, num_hidden_layers=2, attention_bias=True)
    calls: list = []
    fast, _ = _run(tmp_path, "all", True, calls)
    plain, _ = _run(tmp_path, "all", False)
    assert torch.equal(fast, plain)
    assert not calls


# -- real widths ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["bf16", "4bit-q8"])
def test_the_decoder_layer_at_real_widths_gives_its_parts_bits(path, kind):
    """Qwen3-30B-A3B's layer widths (hidden 2048, 32 query heads on 4 key heads of 128, a router of 128 experts,
    top 8, experts of 768; four distinct experts behind the 128 table entries): one call against its parts called
    one by one (RMSNorm, the attention block, the add, RMSNorm, the router's linear, route_softmax, moe, the
    routing-order sum, the add), for a prompt of 5 tokens after 40 cached and one token after them."""
    from .test_invariant_kernels import stored

    H, HQ, HKV, D, E, K, INTER = 2048, 32, 4, 128, 128, 8, 768
    dt = torch.bfloat16
    g = _gen(7)
    act = "q8" if kind.endswith("q8") else None

    def lin(out_f, in_f, seed):
        if kind == "bf16":
            w = (torch.randn(out_f, in_f, generator=_gen(seed)) * 0.03).to(dt)
            return native.float_spec(w), w
        t, lf, _ = stored("affine-4-64-bf16", out_f, in_f, seed)
        if act:
            from moestream.quant.formats import with_activations

            lf = with_activations(lf, "q8")
        return native.linear_spec(lf, t), t

    with on(path):
        attn = [lin(HQ * D, H, 1), lin(HKV * D, H, 2), lin(HKV * D, H, 3), lin(H, HQ * D, 4)]
        gate = lin(E, H, 5)
        experts = []
        for j in range(4):
            specs = (lin(INTER, H, 10 + 3 * j)[0], lin(INTER, H, 11 + 3 * j)[0], lin(H, INTER, 12 + 3 * j)[0])
            experts.append(native.ExpertCall(specs))
        keep = (attn, gate, experts)
        table = (ctypes.c_void_p * (2 * E))()
        for e in range(E):
            c = experts[e % 4]
            table[2 * e], table[2 * e + 1] = ctypes.addressof(c.c_fields), ctypes.addressof(c.c_ptrs)
        w1 = (torch.randn(H, generator=g) * 0.2 + 1).to(dt)
        w2 = (torch.randn(H, generator=g) * 0.2 + 1).to(dt)
        qn = (torch.randn(D, generator=g) * 0.2 + 1).to(dt)
        kn = (torch.randn(D, generator=g) * 0.2 + 1).to(dt)
        args = native.LayerArgs(tuple(a[0] for a in attn), gate[0], w1, w2, 1e-6, qn, kn, 1e-6, HQ, HKV, D,
                                D ** -0.5, None, K, True)
        cap = 64
        for start, t in ((40, 5), (45, 1)):
            h = (torch.randn(t, H, generator=g) * 2).to(dt)
            pos = torch.arange(start, start + t, dtype=torch.float64)
            inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
            ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)
            cos, sin = ang.cos().to(dt), ang.sin().to(dt)
            base_k = (torch.randn(HKV, cap, D, generator=g)).to(dt)
            base_v = (torch.randn(HKV, cap, D, generator=g)).to(dt)
            k1, v1 = base_k.clone(), base_v.clone()
            status, out, extra = native.decoder_layer(h, args, cos, sin, k1, v1, start, table)
            assert status == 0
            # the parts one by one
            k2, v2 = base_k.clone(), base_v.clone()
            x1 = native.rms_norm(h, w1, 1e-6)
            a = native.attention_block(x1, args.attn, qn, kn, 1e-6, cos, sin, k2, v2, start, HQ, HKV, D, D ** -0.5)
            h1 = h + a
            x2 = native.rms_norm(h1, w2, 1e-6)
            logits = native._call(native.library().ms_linear, native.selected(), [gate[0]], x2, E, None)
            wts, idx = native.route_softmax(logits, K, True)
            flat = idx.reshape(-1).tolist()
            order = list(dict.fromkeys(flat))
            rows = [[s for s, e in enumerate(flat) if e == x] for x in order]
            slots = torch.empty(t * K, H, dtype=dt)
            native.moe(x2, [experts[e % 4] for e in order], rows, K, wts.reshape(-1), out=slots)
            want = h1 + sum_slots(slots.view(t, K, H))
            assert torch.equal(out, want)
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
            assert extra[0] == order and extra[1] == [len(r) for r in rows]
        del keep


def _logits(engine, compiled: bool):
    for m in engine.model.modules():
        if isinstance(m, layers.DecoderLayer) and (not compiled or m._plan is False):
            m._plan = None if compiled else False
    with torch.inference_mode():
        return engine.model(IDS[:9], 0, engine.model.new_kv_cache(), all_logits=True)


def test_a_replaced_weight_storage_parameter_or_setting_makes_a_new_plan(models):
    """After a first forward, a projection's storage replaced (``weight.data = ...``, the old one freed and
    overwritten), a norm's parameter, the router and an eps changed: the compiled layer computes with the new
    ones (a new plan), the bits of the op-by-op path."""
    import gc
    from functools import partial

    from moestream.models.moe import softmax_topk

    engine = load(models["f32"], cache_budget_gb="all", tokenizer=False, workers=2, learn_experts=False)
    try:
        _logits(engine, True)
        lay = [m for m in engine.model.modules() if isinstance(m, layers.DecoderLayer)]
        o = lay[0].self_attn.o_proj
        o.weight.data = o.weight.data.clone() * 1.5
        g = lay[1].mlp.gate
        g.weight.data = g.weight.data.clone() * -1.0
        gc.collect()
        junk = [torch.full((64, 64), float("nan")) for _ in range(500)]  # over the freed storage
        lay[1].input_layernorm.weight = torch.nn.Parameter(lay[1].input_layernorm.weight * 2, requires_grad=False)
        lay[2].mlp.router = partial(softmax_topk, top_k=1, norm_topk_prob=False)
        lay[2].post_attention_layernorm.eps = lay[2].input_layernorm.eps = 1e-2
        fast = _logits(engine, True)
        assert all(m._plan for m in lay)  # compiled, from new plans
        plain = _logits(engine, False)
        del junk
        assert torch.equal(fast, plain) and not fast.isnan().any()
    finally:
        engine.close()


def test_read_ahead_with_every_expert_resident_keeps_the_compiled_layer(models):
    """``--prefetch-ahead 1`` at budget all (nothing to read ahead): decode steps still run compiled, the bits of
    the op-by-op path."""
    calls: list = []
    fast, counts = _run(models["bf16"], "all", True, calls, prefetch_ahead=1)
    plain, plain_counts = _run(models["bf16"], "all", False, prefetch_ahead=1)
    assert torch.equal(fast, plain) and counts == plain_counts
    assert calls.count(0) == 6 * 3
