"""Eviction policies, pins, the trace simulator and Belady's MIN, and --max-active-experts."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moestream.cache import ExpertCache
from moestream.cachesim import BeladyPolicy, requests_of, simulate, simulate_policy
from moestream.checkpoint import Checkpoint
from moestream.layout import discover_experts
from moestream.pipeline import keep_top_experts
from moestream.policies import LayerCyclePolicy, LFUDecayPolicy, LRUPolicy, make_policy
from moestream.store import ExpertStore

from .helpers import make_qwen3_moe

LAYERS, EXPERTS = 3, 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("m")
    make_qwen3_moe(path, num_hidden_layers=LAYERS, num_experts=EXPERTS, num_experts_per_tok=4)
    c = Checkpoint(path)
    yield c
    c.close()


def make_cache(ckpt, budget_experts, policy="lru", workers=2):
    layout = discover_experts(ckpt.tensors)
    store = ExpertStore(ckpt, layout, torch.float32, workers=workers)
    size = layout.expert_nbytes(0, 0)
    num = {i: lay.num_experts for i, lay in layout.layers.items()}
    cache = ExpertCache(store, int(budget_experts * size), num, policy=make_policy(policy, half_life=48))
    return cache, size


def drain(cache, layer, experts):
    return [e for e, _ in cache.fetch(layer, experts)]


def test_lfu_decay_and_layer_orders():
    lfu = LFUDecayPolicy(half_life=4)
    for k in [(0, 1), (0, 1), (0, 1), (0, 2), (0, 3)]:
        lfu.record(k)
        lfu.admit(k)
    assert lfu.order() == [(0, 2), (0, 3), (0, 1)]  # least frequent first, ties by recency
    for _ in range(12):  # (0, 3) used often lately: old counts of (0, 1) have decayed
        lfu.record((0, 3))
    assert lfu.order()[-1] == (0, 3)
    assert lfu.victim(lambda k: k == (0, 2)) == (0, 1)
    lay = LayerCyclePolicy(half_life=100)
    for layer in (0, 1, 2):
        for e in (0, 1):
            lay.record((layer, e))
            lay.admit((layer, e))
    # layer 2 just ran: its experts are needed furthest ahead, then layer 1's; layer 0 runs next
    assert [k[0] for k in lay.order()] == [2, 2, 1, 1, 0, 0]
    lru = LRUPolicy()
    for k in [(1, 0), (0, 0), (1, 0)]:
        lru.record(k)
        lru.admit(k)
    assert lru.order() == [(0, 0), (1, 0)]


def test_lfu_rescales_before_overflow():
    lfu = LFUDecayPolicy(half_life=1)
    for i in range(3000):  # 2^3000 overflows a float unless rescaled
        lfu.record((0, i % 3))
        lfu.admit((0, i % 3))
    assert lfu.order() == [(0, 0), (0, 1), (0, 2)]


@pytest.mark.parametrize("policy", ["lru", "lfu", "layer"])
def test_simulator_agrees_with_the_cache(ckpt, policy):
    """Replaying the requests the real cache served gives the same hits, for every online policy."""
    rng = random.Random(7)
    records, token = [], 0
    for step in range(14):
        t = 5 if step == 0 else 1  # a prefill of 5 tokens, then decode
        for layer in range(LAYERS):
            rows = [rng.sample(range(EXPERTS) if layer else range(6), 4) for _ in range(t)]
            records.append((token, layer, rows))
        token += t
    reqs, decode = requests_of(records)
    most = max(len(e) for _, e in reqs)
    for budget in (most, most + 5, 2 * EXPERTS):
        cache, size = make_cache(ckpt, budget, policy)
        for layer, experts in reqs:
            drain(cache, layer, experts)
        sim = simulate_policy(policy, reqs, lambda k, s=size: s, budget * size, decode, half_life=48)
        assert (sim.lookups, sim.hits) == (cache.stats.lookups, cache.stats.hits), budget
        cache.store.close()


request_lists = st.lists(
    st.tuples(st.integers(0, 2), st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True)),
    min_size=1, max_size=60,
)


@settings(max_examples=100, deadline=None)
@given(reqs=request_lists, extra=st.integers(0, 10))
def test_belady_is_never_worse(reqs, extra):
    """Belady's MIN is optimal: no online policy gets more hits, at any budget holding a request."""
    cap = max(len(e) for _, e in reqs) + extra
    best = simulate(reqs, lambda k: 1, cap, BeladyPolicy(reqs)).hits
    for name in ("lru", "lfu", "layer"):
        assert best >= simulate(reqs, lambda k: 1, cap, make_policy(name, half_life=8)).hits, name


def test_belady_on_a_cycle():
    """Layers in a cycle bigger than the cache: LRU never hits, MIN keeps what it can."""
    reqs = [(layer, [0, 1]) for _ in range(10) for layer in range(4)]  # 8 experts, cache of 4
    lru = simulate(reqs, lambda k: 1, 4, make_policy("lru"))
    mn = simulate(reqs, lambda k: 1, 4, BeladyPolicy(reqs))
    layer = simulate(reqs, lambda k: 1, 4, make_policy("layer", 8))
    assert lru.hits == 0 and mn.hits > 0 and layer.hits > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    budget=st.integers(0, 12), pins=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 15)), max_size=10),
    policy=st.sampled_from(["lru", "lfu", "layer"]),
    calls=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 15), min_size=1, max_size=5, unique=True)),
                   min_size=1, max_size=10),
)
def test_pins_are_never_evicted_and_the_budget_holds(ckpt, budget, pins, policy, calls):
    cache, size = make_cache(ckpt, budget, policy)
    n = cache.pin(pins, limit_bytes=(budget * size) // 2)
    pinned = set(list(dict.fromkeys(pins))[:n])
    assert cache.pinned_keys == pinned and n <= budget // 2
    assert cache.pinned_bytes == n * size <= cache.budget_bytes
    hits = 0
    for layer, experts in calls:
        hits += sum((layer, e) in pinned for e in experts)
        for _e, _ew in cache.fetch(layer, experts):
            assert cache.used_bytes <= cache.budget_bytes + size  # only the expert in use may be over
        assert pinned <= set(cache._entries) and cache.used_bytes <= cache.budget_bytes
        assert not pinned & set(cache.keys_lru_first())
    assert cache.stats.pinned_hits == hits
    cache.store.close()


def test_pin_takes_over_a_cached_expert(ckpt):
    cache, size = make_cache(ckpt, 4)
    drain(cache, 0, [1, 2])
    read = cache.store.stats.experts_read
    assert cache.pin([(0, 2), (1, 3)]) == 2
    assert cache.store.stats.experts_read == read + 1  # (0, 2) was already cached
    assert cache.keys_lru_first() == [(0, 1)]
    drain(cache, 2, [0, 1, 2, 3])
    assert {(0, 2), (1, 3)} <= set(cache._entries) and cache.used_bytes <= 4 * size
    cache.store.close()


def direct_keep(weights, idx, k, renormalize):
    """Loop version of --max-active-experts for one token at a time."""
    out_w, out_i = [], []
    for w, i in zip(weights.tolist(), idx.tolist()):
        best = sorted(range(len(w)), key=lambda j: -w[j])[:k]
        keep = sorted(best)  # routing order
        kw = [w[j] for j in keep]
        if renormalize:
            kw = [x * sum(w) / sum(kw) for x in kw]
        out_w.append(kw)
        out_i.append([i[j] for j in keep])
    return torch.tensor(out_w, dtype=torch.float64), torch.tensor(out_i)


@pytest.mark.parametrize("renormalize", [True, False])
def test_keep_top_experts(renormalize):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 32, generator=g)
    probs = torch.softmax(logits, -1)
    w, i = torch.topk(probs, 8, dim=-1)
    w = w * 2.5  # a routed scaling factor
    perm = torch.randperm(8, generator=g)  # routing order need not be sorted by weight
    w, i = w[:, perm], i[:, perm]
    kw, ki = keep_top_experts(w, i, 3, renormalize)
    ww, wi = direct_keep(w.double(), i, 3, renormalize)
    assert torch.equal(ki, wi)
    assert torch.allclose(kw.double(), ww, rtol=1e-6)
    if renormalize:
        assert torch.allclose(kw.sum(-1), w.sum(-1), rtol=1e-6)  # the scaling factor survives
    else:
        assert torch.equal(kw, torch.gather(w, 1, torch.topk(w, 3).indices.sort().values))
