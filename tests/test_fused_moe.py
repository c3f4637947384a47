"""The GPU decode path's logic on the CPU: the fused MoE kernel (under Triton's interpreter), the
VRAM slot pool and its layer protocol, the device-side grouping, the static decode path and its
graph segments. The same on a GPU, at real shapes, with CUDA graphs: test_gpu_decode.py."""

import math

import pytest
import torch

from moestream import fused_moe as fm
from moestream.copy_engine import CopyEngine
from moestream.decode_graph import DecodeRunner, StaticDecodeKV, graph_unsupported, plan_segments
from moestream.engine import load
from moestream.models import ops
from moestream.models.layers import KVCache, KVPool
from moestream.slot_pool import SlotLayout, SlotPool, expert_slot_layout
from moestream.store import ExpertStore
from moestream.tiered_cache import TieredExpertCache

from .helpers import expert_bytes, qwen3_moe_fixture

interpreted = pytest.mark.skipif(fm.triton is None or not fm.interpreted(),
                                 reason="needs Triton's interpreter (pip install triton; TRITON_INTERPRET=1)")


def random_experts(s, i, h, dtype, g):
    """A slot pool's views over one uint8 storage, filled with random experts."""
    layout = SlotLayout.of([("gate", dtype, (i, h)), ("up", dtype, (i, h)), ("down", dtype, (h, i))])
    storage = torch.zeros(s, layout.slot_bytes, dtype=torch.uint8)
    views = layout.views(storage)
    for role, v in views.items():
        v.copy_((torch.randn(v.shape, generator=g) / (1 if role != "down" else math.sqrt(i))).to(dtype))
    return storage, views


def routing(t, k, e, g):
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])


# -- the device-side grouping ------------------------------------------------------------------


@pytest.mark.parametrize("t,k,e,bm", [(1, 1, 3, 16), (7, 3, 7, 16), (40, 4, 9, 16), (64, 8, 33, 32), (5, 2, 64, 16)])
def test_align_blocks_places_every_slot_once_in_blocks_of_one_expert(t, k, e, bm):
    g = torch.Generator().manual_seed(t * 31 + e)
    flat = routing(t, k, e, g).reshape(-1)
    tk = flat.numel()
    rows, bexp = fm.align_blocks(flat, e, bm)
    nblocks = -(-tk // bm) + min(e, tk)
    assert rows.shape == (nblocks * bm,) and bexp.shape == (nblocks,)
    blocks, experts = rows.view(nblocks, bm).tolist(), bexp.tolist()
    seen, last_e, ended = [], -1, False
    for b, ex in zip(blocks, experts):
        if ex == e:  # past the end: padding only, and only at the end
            ended = True
            assert all(r == tk for r in b)
            continue
        assert not ended and ex >= last_e  # experts ascending, each in consecutive blocks
        real = [r for r in b if r < tk]
        assert real and all(int(flat[r]) == ex for r in real)
        assert b[: len(real)] == real  # padding only after the slots
        seen += real
        last_e = ex
    assert sorted(seen) == list(range(tk))
    for ex in range(e):  # ascending slot order within an expert
        mine = [r for r in seen if int(flat[r]) == ex]
        assert mine == sorted(mine)


def test_block_rows_are_one_size_for_every_call():
    """A slot's bits must not depend on how many tokens share the call: one block size for all."""
    assert {fm.block_m(t, 8, 128) for t in (1, 7, 512, 4096)} == {fm.BLOCK_M}
    rows = fm.one_row_blocks(3, 4, "cpu")
    assert rows.tolist() == [0, 3, 3, 3, 1, 3, 3, 3, 2, 3, 3, 3] and fm.one_row_blocks(3, 4, "cpu") is rows


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slot_has_the_same_bits_in_a_decode_step_and_in_a_prefill_chunk(dtype):
    """The decode path (T*K <= 64: one slot per block) and the blocked path (slots grouped by expert) run the
    same kernels with the same tiles: a token's output is bit-identical alone, among few tokens (decode
    path) and in a chunk of many (blocked path), wherever it sits in the chunk."""
    g = torch.Generator().manual_seed(7)
    h, i, e, k = 48, 40, 9, 4
    _, views = random_experts(e + 3, i, h, dtype, g)
    table = torch.randperm(e + 3, generator=g)[:e].to(torch.int32)
    t = 30  # 120 slots: the blocked path
    x = torch.randn(t, h, generator=g).to(dtype)
    idx = routing(t, k, e, g)
    w = torch.rand(t, k, generator=g)
    whole = fm.fused_moe(x, w, idx, table, views["gate"], views["up"], views["down"])
    for a, b in [(0, 1), (7, 8), (29, 30), (3, 10), (16, 30)]:  # decode-sized (<= 16 tokens) and blocked parts
        part = fm.fused_moe(x[a:b], w[a:b], idx[a:b], table, views["gate"], views["up"], views["down"])
        assert torch.equal(part, whole[a:b]), (a, b)


# -- the kernel, under the interpreter ---------------------------------------------------------


@interpreted
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.5e-2)])
@pytest.mark.parametrize("t,k,e", [(1, 1, 3), (1, 2, 5), (3, 4, 7), (40, 2, 9), (17, 5, 11)])
def test_fused_kernel_matches_float64(dtype, tol, t, k, e):
    """Both paths (rows: T*K <= 64; blocks: above), odd widths (masks), against float64 expert by expert;
    every output element written (a NaN-poisoned buffer); the bits independent of the slots."""
    g = torch.Generator().manual_seed(t * 100 + k * 10 + e)
    h, i, s = 48, 40, e + 4
    storage, views = random_experts(s, i, h, dtype, g)
    perm = torch.randperm(s, generator=g)[:e]
    table = perm.to(torch.int32)
    x = torch.randn(t, h, generator=g).to(dtype)
    idx = routing(t, k, e, g)
    w = torch.rand(t, k, generator=g)
    out = torch.full((t, h), float("nan"), dtype=dtype)
    got = fm.fused_moe(x, w, idx, table, views["gate"], views["up"], views["down"], out=out)
    assert got is out and not torch.isnan(out).any()
    ref = fm.reference_moe(x, w, idx, {ex: {r: v[perm[ex]] for r, v in views.items()} for ex in range(e)})
    assert float((out.double() - ref).norm() / ref.norm()) < tol
    # the same experts in other slots: the same bits
    moved = torch.randperm(s, generator=g)[:e]
    storage2 = torch.zeros_like(storage)
    storage2[moved] = storage[perm]
    views2 = SlotLayout.of([("gate", dtype, (i, h)), ("up", dtype, (i, h)), ("down", dtype, (h, i))]).views(storage2)
    again = fm.fused_moe(x, w, idx, moved.to(torch.int32), views2["gate"], views2["up"], views2["down"])
    assert torch.equal(again, out)


@interpreted
def test_fused_kernel_checks_shapes():
    g = torch.Generator().manual_seed(0)
    _, views = random_experts(4, 8, 16, torch.float32, g)
    with pytest.raises(ValueError, match="width"):
        fm.fused_moe(torch.randn(1, 32), torch.rand(1, 1), torch.zeros(1, 1, dtype=torch.int64),
                     torch.zeros(4, dtype=torch.int32), views["gate"], views["up"], views["down"])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_is_the_norm(dtype):
    """One launch of RMSNorm's function (float32 norm, rounded, times the weight), against float64."""
    from moestream.models.layers import RMSNorm

    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data = torch.randn(48, generator=g).to(dtype)
    x = (3 * torch.randn(3, 5, 48, generator=g)).to(dtype)
    got = fm.rms_norm(x, norm.weight, norm.eps)
    xd = x.double()
    want = norm.weight.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert got.dtype == norm(x).dtype and got.shape == x.shape
    eps = torch.finfo(dtype).eps
    assert float(((got.double() - want).abs() / (want.abs() + 1e-3)).max()) < 2 * eps
    torch.testing.assert_close(got, norm(x), rtol=2 * eps, atol=1e-6)


# -- the slot pool -----------------------------------------------------------------------------


# a tiny float32 model: 2 layers x 8 experts, top-2
tiny = qwen3_moe_fixture("fused-tiny", 7, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)


def open_store(path):
    from moestream.checkpoint import Checkpoint
    from moestream.layout import discover_experts

    ck = Checkpoint(path)
    layout = discover_experts(ck.tensors)
    return ck, ExpertStore(ck, layout, torch.float32, "cpu", 2)


def test_slot_layout_is_the_store_buffer_layout(tiny):
    """A read buffer goes into its slot in one copy, and the slot's views hold the expert's tensors."""
    ck, store = open_store(tiny)
    try:
        keys = [(layer, e) for layer in store.layout.layers for e in range(8)]
        layout = expert_slot_layout(store, keys)
        assert layout is not None and layout.slot_bytes % 256 == 0
        assert layout.slot_bytes >= store.cached_nbytes(keys[0])
        # the store lays each buffer out like the file (pieces at their file offsets modulo 4 KiB,
        # another shift per layer here): the slot holds the pieces as they lie relative to the first
        shifts = set()
        for key in [(0, 5), (1, 3)]:
            ew = store.read_all([key])[key]
            offs = {r: t.storage_offset() * t.element_size() for r, t in ew.tensors.items()}
            shift = min(offs.values())
            shifts.add(shift)
            for role, dtype, shape, off in layout.roles:
                t = ew.tensors[role]
                assert (t.dtype, tuple(t.shape), offs[role] - shift) == (dtype, shape, off)
        assert len(shifts) == 2, "the tiny checkpoint should hold its layers at two shifts"
        span = max(off + math.prod(shape) * 4 for _, _, shape, off in layout.roles)
        pool = SlotPool(layout, 3, {0: 8, 1: 8}, "cpu")
        slot = pool.take((1, 3))
        copier = CopyEngine("cpu")
        copier.copy_into(ew, pool.row(slot), pool.tensors(slot))
        assert copier.h2d_bytes == span  # one copy of the buffer's span
        for role, t in pool.tensors(slot).items():
            assert torch.equal(t, ew.tensors[role])
        # separate tensors (another layout) go piece by piece, to the same result
        parts = type(ew)((1, 3), {r: t.clone() for r, t in ew.tensors.items()}, ew.nbytes)
        pool.storage.zero_()
        copier.copy_into(parts, pool.row(slot), pool.tensors(slot))
        for role, t in pool.tensors(slot).items():
            assert torch.equal(t, ew.tensors[role])
        store.release(ew)
    finally:
        store.close()
        ck.close()


def test_slot_pool_table():
    layout = SlotLayout.of([("gate", torch.float32, (2, 4)), ("up", torch.float32, (2, 4)),
                            ("down", torch.float32, (4, 2))])
    pool = SlotPool(layout, 2, {0: 3, 2: 5}, "cpu")
    assert pool.table.shape == (3, 5) and bool((pool.table == -1).all())
    a, b = pool.take((2, 4)), pool.take((0, 1))
    assert {a, b} == {0, 1} and pool.free_slots == 0
    with pytest.raises(RuntimeError, match="no free VRAM slot"):
        pool.take((0, 2))
    with pytest.raises(ValueError, match="already holds"):
        pool.take((2, 4))
    assert int(pool.table[2, 4]) == -1  # not published yet
    pool.flush()
    assert int(pool.table[2, 4]) == a and int(pool.table[0, 1]) == b and not pool.dirty
    assert pool.give((2, 4)) == a and pool.free_slots == 1
    pool.flush()
    assert int(pool.table[2, 4]) == -1
    assert pool.take((0, 2)) == a  # the freed slot serves the next expert
    assert pool.views["down"].shape == (2, 4, 2) and pool.views["gate"].stride(0) == layout.slot_bytes // 4


def slot_cache(path, budget_experts, host_experts=0):
    ck, store = open_store(path)
    one = store.cached_nbytes((0, 0))
    budget = None if budget_experts is None else budget_experts * one
    cache = TieredExpertCache(store, budget, {0: 8, 1: 8}, device="cpu", host_budget_bytes=host_experts * one,
                              slots=True)
    return ck, store, cache, one


def test_held_layer_stays_in_its_slots_until_end_layer(tiny):
    """A layer's experts are never evicted between its fetch and its kernel, even over the budget; after
    end_layer the cache is back within budget and the evicted slots are -1 in the table."""
    ck, store, cache, one = slot_cache(tiny, budget_experts=2)
    try:
        assert cache.pool.capacity == 8  # one layer's experts at least
        needed = [5, 1, 7, 2, 0, 3]
        cache.hold(0, needed)
        got = {e: {r: t.clone() for r, t in ew.tensors.items()} for e, ew in cache.fetch(0, needed)}
        cache.ready()
        assert set(got) == set(needed) and len(cache) == 6  # over the budget while held
        for e in needed:
            slot = int(cache.pool.table[0, e])
            assert slot == cache.pool.slot_of[(0, e)]
            for role, t in cache.pool.tensors(slot).items():
                assert torch.equal(t, got[e][role])  # nothing overwritten by a later expert of the layer
        cache.end_layer()
        assert cache.used_bytes <= 2 * one and len(cache) == 2
        cache.pool.flush()
        resident = {e for (layer, e) in cache.pool.slot_of}
        assert all((int(cache.pool.table[0, e]) >= 0) == (e in resident) for e in range(8))
        # the next layer refills freed slots; each expert's bytes are its own
        cache.hold(1, [4, 6])
        fresh = store.read_all([(1, 4), (1, 6)])
        for e, ew in cache.fetch(1, [4, 6]):
            for role, t in ew.tensors.items():
                assert torch.equal(t, fresh[(1, e)].tensors[role])
        cache.end_layer()
        for ew in fresh.values():
            store.release(ew)
    finally:
        cache.close()
        store.close()
        ck.close()


def test_pins_leave_one_layer_of_slots_free(tiny):
    ck, store, cache, one = slot_cache(tiny, budget_experts=10)
    try:
        assert cache.pool.capacity == 10
        keys = [(layer, e) for layer in (0, 1) for e in range(8)]
        assert cache.pin(keys) == 2  # 10 slots, 8 kept for a layer
        cache.hold(0, list(range(8)))
        assert len(list(cache.fetch(0, list(range(8))))) == 8  # a whole layer still fits
        cache.end_layer()
    finally:
        cache.close()
        store.close()
        ck.close()


def test_stage_copies_host_tier_experts_ahead(tiny):
    """Experts held by the host tier enter VRAM before their layer asks; the layer then hits."""
    ck, store, cache, one = slot_cache(tiny, budget_experts=8, host_experts=16)
    try:
        cache.hold(1, [0, 1, 2])
        list(cache.fetch(1, [0, 1, 2]))
        cache.ready()
        cache.end_layer()
        for e in range(8):  # fill VRAM with layer 0, pushing layer 1's experts to the host tier only
            cache.hold(0, [e])
            list(cache.fetch(0, [e]))
            cache.end_layer()
        assert (1, 0) not in cache._entries and (1, 0) in cache.host
        assert cache.stage([(1, 0), (1, 1), (1, 5)]) == 2  # (1, 5) was never read: not staged
        hits = cache.stats.hits
        cache.hold(1, [0, 1])
        list(cache.fetch(1, [0, 1]))
        cache.ready()
        cache.end_layer()
        assert cache.stats.hits == hits + 2 and cache.tier_stats.staged == 2
    finally:
        cache.close()
        store.close()
        ck.close()


def test_all_resident_counts_routing_from_the_device_log(tiny):
    ck, store, cache, one = slot_cache(tiny, budget_experts=None)
    try:
        cache.preload([(layer, e) for layer in (0, 1) for e in range(8)])
        assert cache.all_resident and cache.pool.capacity == 16
        cache.log_routing(0, torch.tensor([[1, 2], [2, 5]]))
        cache.log_routing(1, torch.tensor([[7, 0]]))
        ids = torch.tensor([3, 3, 4], dtype=torch.int64)
        cache.log_pending([(0, 3)], ids, None)
        assert cache.stats.lookups == 3 + 2 + 2 and cache.stats.hits == 7
        assert cache.usage[0].tolist() == [0, 1, 2, 2, 1, 1, 0, 0] and cache.usage[1].tolist()[7] == 1
        assert not cache._log and not cache._pending  # folded once
    finally:
        cache.close()
        store.close()
        ck.close()


# -- the static decode path ----------------------------------------------------------------------


def test_segments_and_the_cpu_path(tiny):
    engine = load(tiny, tokenizer=False, device="cpu", hotlist=False, learn_experts=False)
    try:
        assert graph_unsupported(engine.model) is None
        assert plan_segments(engine.model) == [0, 1]
        assert engine.model.decode_runner is None and engine.model.kv_pool is None  # the CPU path is untouched
    finally:
        engine.close()


def test_families_that_cannot_take_the_static_path_say_why():
    from moestream.models import family_for

    cfg = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
           "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
           "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
           "v_head_dim": 8, "n_group": 1, "topk_group": 1, "rope_theta": 10000.0}
    fam = family_for(cfg, "config.json")
    with torch.device("meta"):
        net = fam.Model(fam.ModelArgs.from_config(cfg))
    assert graph_unsupported(net)


@pytest.mark.parametrize("window", [None, 5])
def test_static_kv_writes_at_the_device_position_and_attends_over_what_it_sees(window):
    """The static step writes its key and value at the position held on the device and attends over the
    positions up to it: the plain path's bits (the CPU's kernels), whatever the cache's capacity or what
    lies past the position."""
    g = torch.Generator().manual_seed(1)
    for cap in (12, 40):
        kv = KVCache(1, cap)
        kv.update(0, 0, torch.randn(2, cap, 4, generator=g), torch.randn(2, cap, 4, generator=g))
        for pos in (0, 3, 9, 11):
            skv = StaticDecodeKV(kv, torch.tensor([pos]))
            q = torch.randn(4, 1, 4, generator=g)
            k, v = torch.randn(2, 1, 4, generator=g), torch.randn(2, 1, 4, generator=g)
            out = skv.attend(0, pos, q, k, v, 0.5, window)
            keys, values = kv.layers[0]
            assert keys.shape == (2, cap, 4) and torch.equal(keys[:, pos], k[:, 0])
            assert torch.equal(values[:, pos], v[:, 0])
            want = ops.attend(q, keys[:, : pos + 1].clone(), values[:, : pos + 1].clone(), pos, 0.5, window)
            assert torch.equal(out, want)


def test_kv_pool_gives_successive_caches_the_same_tensors():
    """A request's KV cache takes the pool's kept tensors (so a decode graph captured over them replays for
    the next request); caches alive at once get their own; past the pool's capacity a cache grows on its own."""
    pool = KVPool(32, sets=2)
    k = torch.randn(2, 5, 4)

    def ptr(kv):
        kv.update(0, 0, k, k)
        return kv.layers[0][0].data_ptr()

    a = pool.new_cache(1, 8)
    first = ptr(a)
    assert a.layers[0][0].shape == (2, 32, 4)
    del a
    b = pool.new_cache(1, 8)
    assert ptr(b) == first  # the same storage for the next request
    c = pool.new_cache(1, 8)
    d = pool.new_cache(1, 8)  # two sets at most: this one allocates its own
    assert ptr(c) not in (first,) and d.storage is None and pool.made == 2
    e = pool.new_cache(1, 8)  # the CPU's attention block takes its storage through reserve
    del c
    f = pool.new_cache(1, 8)
    keys, _ = f.reserve(0, 5, k, 2, 4)
    assert keys.data_ptr() not in (first,) and keys.shape == (2, 32, 4) and e.storage is None
    version = b.version
    b.update(0, 5, torch.randn(2, 40, 4), torch.randn(2, 40, 4))  # past the capacity: grows, the prefix kept
    assert b.layers[0][0].shape[1] >= 45 and torch.equal(b.layers[0][0][:, :5], k) and b.version > version


def run_steps(engine, prompt, steps):
    kv = engine.model.new_kv_cache()
    outs = []
    with torch.inference_mode():
        outs.append(engine.model(prompt, 0, kv, all_logits=True).cpu())
        for i, tok in enumerate(steps):
            outs.append(engine.model(torch.tensor([tok]), len(prompt) + i, kv).cpu())
    return outs


PROMPT = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3))  # 80 slots: the blocked path
STEPS = [5, 77, 291, 5]


def test_static_decode_steps_match_the_plain_path(tiny):
    """The static path (the position on the device, the whole cache's tensors) computes the model's decode
    steps: the plain path's bits, and it declines a step with no KV cache to decode into."""
    engine = load(tiny, tokenizer=False, device="cpu", hotlist=False, learn_experts=False, cache_budget_gb="all")
    try:
        ref = run_steps(engine, PROMPT, STEPS)
        runner = DecodeRunner(engine.model, engine.pipeline, engine.cache, graphs=True)  # no CUDA: eager
        assert not runner.graphs
        engine.model.decode_runner = runner
        got = run_steps(engine, PROMPT, STEPS)
        assert runner.stats.eager == len(STEPS)
        for a, b in zip(ref, got):
            assert torch.equal(a, b)  # the same CPU kernels: attention's bits do not depend on the span it reads
        kv = engine.model.new_kv_cache()
        with torch.inference_mode():
            engine.model(torch.tensor([3]), 0, kv)
        assert runner.stats.declined == 1
    finally:
        engine.model.decode_runner = None
        engine.close()


# -- the pipeline on the fused kernel, end to end (interpreter) ----------------------------------


def fused_run(path, **kw):
    engine = load(path, tokenizer=False, device="cpu", hotlist=False, learn_experts=False, fused_experts=True, **kw)
    try:
        assert engine.model.decode_runner is not None
        assert all(type(k).__name__ == "FusedSwiGLUKernel" for k in engine.pipeline.kernels.values())
        return run_steps(engine, PROMPT, STEPS), engine.cache, engine.model.decode_runner.stats
    finally:
        engine.close()


@pytest.fixture(scope="module")
def fused_ref(tiny):
    return fused_run(tiny, cache_budget_gb="all")


@interpreted
def test_fused_pipeline_all_resident_needs_no_host_routing(tiny, fused_ref):
    out, cache, stats = fused_ref
    plain = load(tiny, tokenizer=False, device="cpu", hotlist=False, learn_experts=False, cache_budget_gb="all")
    try:
        ref = run_steps(plain, PROMPT, STEPS)
        for a, b in zip(ref, out):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert cache.stats.lookups == plain.cache.stats.lookups and cache.stats.misses == 0
        assert [u.tolist() for u in cache.usage.values()] == [u.tolist() for u in plain.cache.usage.values()]
    finally:
        plain.close()
    assert stats.eager == len(STEPS)


@interpreted
@pytest.mark.parametrize("vram,host,ahead", [(3, 16, 0), (0, 0, 0), (4, 16, 1)])
def test_fused_pipeline_same_bits_for_every_budget(tiny, fused_ref, vram, host, ahead):
    """VRAM slots below a layer's needs, the host tier, the disk and the lookahead copies: the bits of
    budget all, and the counters add up."""
    one = expert_bytes(tiny)
    out, cache, _ = fused_run(tiny, cache_budget_gb=str(vram * one / 1e9), host_cache_gb=str(host * one / 1e9),
                              prefetch_ahead=ahead)
    ref = fused_ref[0]
    assert all(torch.equal(a, b) for a, b in zip(ref, out))
    s, t = cache.stats, cache.tier_stats
    assert s.lookups == fused_ref[1].stats.lookups
    assert s.misses == t.host_hits + t.disk_reads
    assert t.h2d_copies == s.misses + s.prefetch_hits + t.staged
    if ahead:
        assert t.staged > 0


@interpreted
@pytest.mark.parametrize("renorm", [True, False])
def test_fused_router_is_softmax_topk(renorm):
    """The one-launch router: softmax top-k's experts in its order, its weights to float32 rounding."""
    from moestream.models.moe import softmax_topk

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 48, generator=g)  # distinct values (equal ones may come in another order)
    w, idx = fm.softmax_topk(logits, 8, renorm)
    rw, ridx = softmax_topk(logits, 8, renorm)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and torch.equal(idx, ridx)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
    wb, ib = fm.softmax_topk(logits.to(torch.bfloat16), 8, renorm)
    assert wb.dtype == torch.bfloat16 and ib.shape == (9, 8)
    assert torch.equal(fm.softmax_topk(logits[4:5], 8, renorm)[0], w[4:5])


@interpreted
def test_static_prefill_chunks_match_the_plain_path(tiny):
    """Prefill chunks on the static path (DecodeRunner.prefill: the chunk's start on the device, a cache of the
    engine's KV pool; on the GPU a CUDA graph from a length's second time on) give the plain forward's logits and
    keys, for a first chunk and a later one; a cache outside the pool takes the plain path."""
    from moestream.models.layers import KVCache

    engine = load(tiny, tokenizer=False, device="cpu", hotlist=False, learn_experts=False, fused_experts=True,
                  cache_budget_gb="all")
    try:
        model = engine.model
        runner = model.decode_runner
        layers = len(model.decoder.layers)

        def chunks(kv):
            with torch.inference_mode():
                outs = [model(PROMPT[:25], 0, kv), model(PROMPT[25:], 25, kv), model(torch.tensor([7]), 40, kv)]
            return [o.cpu() for o in outs], kv

        model.decode_runner = None
        ref, ref_kv = chunks(KVCache(layers, 64))
        model.decode_runner = runner
        model.kv_pool = KVPool(96, sets=2)
        got, kv = chunks(model.new_kv_cache())
        assert runner.stats.prefill_eager == 2 and kv.length == 41, runner.stats
        for a, b in zip(ref, got):
            assert torch.equal(a, b)
        for (k0, v0), (k1, v1) in zip(ref_kv.layers, kv.layers):
            assert torch.equal(k0[:, :41], k1[:, :41]) and torch.equal(v0[:, :41], v1[:, :41])
        with torch.inference_mode():
            model(PROMPT[:25], 0, KVCache(layers, 64))  # a cache of its own
        assert runner.stats.prefill_eager == 2
    finally:
        engine.close()


@interpreted
def test_a_batched_decode_step_gives_each_sequence_its_solo_bits(tiny):
    """The scheduler's decode steps of several sequences on the static batched path (DecodeRunner.step_batch:
    the pool's stacked KV sets, the batched attention kernel, the fused experts over every row; on the GPU one
    graph per batch size) give each sequence generate()'s tokens and logits alone, sequences joining and
    leaving the batch; a cache outside the pool's sets sends the step to forward_batch, with the same bits."""
    from moestream.generation import SamplingParams, generate
    from moestream.scheduler import Request, Scheduler

    engine = load(tiny, tokenizer=False, device="cpu", hotlist=False, learn_experts=False, fused_experts=True,
                  cache_budget_gb="all")
    try:
        runner = engine.model.decode_runner
        engine.model.kv_pool = KVPool(96, sets=3)
        g = torch.Generator().manual_seed(8)
        reqs = [Request(torch.randint(0, 300, (n,), generator=g).tolist(), m, s, keep_logits=True)
                for n, m, s in ((5, 6, SamplingParams()), (30, 9, SamplingParams(temperature=1.0, seed=4)),
                                (12, 4, SamplingParams()), (3, 2, SamplingParams(temperature=0.8, seed=2)))]
        solo = [list(generate(engine, r.ids, r.max_tokens, r.sampling, keep_logits=True, stop_at_eos=False))
                for r in reqs]
        got: dict[int, list] = {i: [] for i in range(len(reqs))}
        for i, _, step in Scheduler(engine, 4, step_tokens=16).run(reqs):  # 4 running, 3 sets: one cache of its own
            got[i].append(step)
        assert runner.stats.batch_eager > 0 and runner.stats.batch_declined > 0, runner.stats
        for i in range(len(reqs)):
            assert [s.token for s in got[i]] == [s.token for s in solo[i]], i
            assert all(torch.equal(a.logits, b.logits) for a, b in zip(solo[i], got[i])), i
    finally:
        engine.close()
