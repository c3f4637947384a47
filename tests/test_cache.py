"""The expert cache: budget bound, LRU order, pins, counters, failed reads."""

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moestream.budget import parse_budget
from moestream.cache import ExpertCache
from moestream.checkpoint import Checkpoint
from moestream.errors import BudgetError, ReadError
from moestream.layout import discover_experts
from moestream.store import ExpertStore, PreadReader

from .helpers import make_qwen3_moe


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("m")
    make_qwen3_moe(path, num_hidden_layers=2, num_experts=8)
    c = Checkpoint(path)
    yield c
    c.close()


def make_cache(ckpt, budget_experts, workers=1, reader=None):
    layout = discover_experts(ckpt.tensors)
    store = ExpertStore(ckpt, layout, torch.float32, workers=workers, reader=reader)
    size = layout.expert_nbytes(0, 0)
    budget = None if budget_experts is None else int(budget_experts * size)
    return ExpertCache(store, budget, {i: lay.num_experts for i, lay in layout.layers.items()}), size


def fetch(cache, layer, experts):
    return [e for e, _ in cache.fetch(layer, experts)]


def test_parse_budget():
    assert parse_budget("all") is None and parse_budget("ALL") is None
    assert parse_budget("2") == 2_000_000_000 and parse_budget(0.5) == 500_000_000
    for bad in ("-1", "nan", "inf", "1e300", "lots"):
        with pytest.raises(BudgetError, match="cache-budget-gb"):
            parse_budget(bad)


def test_lru_evicts_least_recently_used_first(ckpt):
    cache, _ = make_cache(ckpt, 3)
    fetch(cache, 0, [0, 1, 2])
    assert cache.keys_lru_first() == [(0, 0), (0, 1), (0, 2)]
    fetch(cache, 0, [0])  # a hit refreshes expert 0
    assert cache.keys_lru_first() == [(0, 1), (0, 2), (0, 0)]
    fetch(cache, 1, [3])  # evicts (0, 1), the least recently used
    assert cache.keys_lru_first() == [(0, 2), (0, 0), (1, 3)]
    # expert 2 is a hit and pinned while the layer runs; the miss evicts (0, 0) instead
    assert fetch(cache, 0, [4, 2]) == [2, 4]  # hits are handed out first
    assert cache.keys_lru_first() == [(1, 3), (0, 2), (0, 4)]
    s = cache.stats
    assert (s.lookups, s.hits, s.misses, s.evictions) == (7, 2, 5, 2)
    assert cache.store.stats.experts_read == 5


def test_budget_smaller_than_one_expert_uses_then_evicts(ckpt):
    cache, size = make_cache(ckpt, 0.5)
    seen = []
    for e, ew in cache.fetch(0, [5, 1, 7]):
        assert cache.pinned() == {(0, e)}
        assert cache.used_bytes <= cache.budget_bytes + size  # only the expert in use is over budget
        seen.append(e)
        assert ew.tensors["gate"].shape == (32, 64)
    assert sorted(seen) == [1, 5, 7]
    assert len(cache) == 0 and cache.used_bytes == 0 and not cache.pinned()


def test_weights_are_the_checkpoint_tensors(ckpt):
    cache, _ = make_cache(ckpt, None, workers=4)
    for e, ew in cache.fetch(1, [6, 0, 3]):
        for role, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            want = ckpt.read_tensor(f"model.layers.1.mlp.experts.{e}.{proj}.weight")
            assert torch.equal(ew.tensors[role], want)


def test_abandoned_fetch_releases_pins(ckpt):
    cache, _ = make_cache(ckpt, 2)
    it = cache.fetch(0, [0, 1, 2, 3])
    next(it)
    it.close()  # the consumer failed mid-layer
    assert not cache.pinned()
    assert cache.used_bytes <= cache.budget_bytes


class FailingReader(PreadReader):
    """Fails every read that touches a chosen expert: raises, or returns short."""

    def __init__(self, bad, mode):
        super().__init__()
        self.bad, self.mode = bad, mode

    def read(self, file, offset, buffers, what):
        if f"expert {self.bad})" in what:
            if self.mode == "eio":
                raise ReadError(f"reading {what} from {file}: [Errno 5] Input/output error")
            buffers = buffers[:-1]  # short: the last piece never arrives
            super().read(file, offset, buffers, what)
            raise ReadError(f"reading {what} from {file}: short read")
        return super().read(file, offset, buffers, what)


@pytest.mark.parametrize("mode", ["eio", "short"])
def test_failed_read_caches_nothing_partial(ckpt, mode):
    cache, _ = make_cache(ckpt, 8, workers=2, reader=FailingReader(6, mode))
    with pytest.raises(ReadError, match=r"expert 6\).*model\.safetensors"):
        fetch(cache, 0, [1, 6])
    assert (0, 6) not in cache and not cache.pinned()
    assert sorted(fetch(cache, 0, [2, 3])) == [2, 3]  # the engine keeps serving other experts
    assert (0, 2) in cache and (0, 3) in cache


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    budget=st.integers(0, 10),
    workers=st.integers(1, 4),
    calls=st.lists(
        st.tuples(st.integers(0, 1), st.lists(st.integers(0, 7), min_size=1, max_size=5, unique=True)),
        min_size=1,
        max_size=12,
    ),
)
def test_cache_matches_a_reference_lru(ckpt, budget, workers, calls):
    """Against a plain LRU model: same contents and order, budget bound, counters adding up.

    A layer's lookups are stamped hits first, then misses, each in request order (not in
    the order reads complete)."""
    cache, size = make_cache(ckpt, budget, workers)
    ref: dict = {}  # key -> stamp of its last lookup
    stamps, clock = {}, itertools.count()
    limit = budget * size
    lookups = misses = 0

    def shrink(pinned):
        for k in sorted(ref, key=stamps.__getitem__):
            if len(ref) * size <= limit:
                break
            if k not in pinned:
                del ref[k]

    for layer, experts in calls:
        hits = [e for e in experts if (layer, e) in ref]
        for e in hits + [e for e in experts if e not in hits]:
            stamps[(layer, e)] = next(clock)
        pinned = {(layer, e) for e in hits}
        lookups += len(experts)
        misses += len(experts) - len(hits)
        for e, _ in cache.fetch(layer, experts):
            key = (layer, e)
            if e not in hits:
                ref[key] = True
                pinned.add(key)
                shrink(pinned)
            assert cache.used_bytes <= limit + len(pinned) * size
            pinned.discard(key)
            shrink(pinned)
        assert cache.keys_lru_first() == sorted(ref, key=stamps.__getitem__)
        assert cache.used_bytes <= limit
    s = cache.stats
    assert s.lookups == lookups == s.hits + s.misses
    assert s.misses == misses == cache.store.stats.experts_read
    assert cache.store.stats.bytes_read == misses * size
    cache.store.close()


def test_memory_of_a_large_layer_stays_bounded(tmp_path, monkeypatch):
    """Streaming a layer's 64 missing experts at budget 0 keeps only a few buffers, recycled."""
    import weakref

    import moestream.store as store_mod

    make_qwen3_moe(tmp_path, num_hidden_layers=1, num_experts=64, num_experts_per_tok=8)
    created = []
    real = store_mod._new_mapping

    def tracked(nbytes):
        m = real(nbytes)
        created.append(weakref.ref(m))
        return m

    monkeypatch.setattr(store_mod, "_new_mapping", tracked)
    with Checkpoint(tmp_path) as c:
        for workers in (1, 3):
            created.clear()
            cache, size = make_cache(c, 0, workers=workers)
            monkeypatch.setattr(store_mod, "MAX_READ_BYTES", size)  # one expert per read
            most = 0
            for e, ew in cache.fetch(0, list(range(64))):
                most = max(most, sum(r() is not None for r in created))
                want = c.read_tensor(f"model.layers.0.mlp.experts.{e}.down_proj.weight")
                assert torch.equal(ew.tensors["down"], want)  # a recycled buffer holds this expert's bytes
            # reads in flight (2 x workers) + the expert in use + the free list (2 x workers)
            assert most <= len(created) <= 4 * workers + 1, (workers, len(created))
            cache.store.close()
