"""The GPU tier (moestream/tiered_cache.py, batched expert compute): its logic on the CPU with the
device as a parameter, and on CUDA where a GPU is present."""

import argparse

import pytest
import torch
import torch.nn.functional as F

from moestream.budget import parse_host_budget, plan_host_budget
from moestream.cache import ExpertCache
from moestream.copy_engine import CopyEngine
from moestream.engine import load
from moestream.errors import BudgetError, ConfigError, MoestreamError
from moestream.host_tier import HostTier, PinnedBufferPool
from moestream.models.moe import swiglu_expert
from moestream.options import EngineOptions
from moestream.pipeline import BatchedSwiGLUKernel, ExpertPipeline, PerExpertKernel
from moestream.store import ExpertWeights
from moestream.tiered_cache import TieredExpertCache, resolve_device

from .helpers import expert_bytes, qwen3_moe_fixture

CUDA = torch.cuda.is_available()


def needs_cuda(test):
    """A CUDA test: in ``pytest -m gpu`` (the lent machine's run), skipped without a GPU (the tier logic is
    tested on the CPU above)."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")(test))


# a tiny float32 model: 4 layers x 16 experts, top-4
tiny = qwen3_moe_fixture("tiny", 5, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4)


PROMPT = torch.randint(0, 300, (23,), generator=torch.Generator().manual_seed(11))
STEPS = [7, 99, 250, 3, 180, 42, 42, 11]


def run(path, device="cpu", batched=None, **kw):
    """Prefill logits and each decode step's logits, with the engine's cache."""
    engine = load(path, tokenizer=False, device=device, hotlist=False, learn_experts=False, batched_experts=batched,
                  **kw)
    try:
        dev = engine.device
        kv = engine.model.new_kv_cache()
        with torch.inference_mode():
            outs = [engine.model(PROMPT.to(dev), 0, kv, all_logits=True).cpu()]
            for i, tok in enumerate(STEPS):
                outs.append(engine.model(torch.tensor([tok], device=dev), len(PROMPT) + i, kv).cpu())
        return outs, engine.cache
    finally:
        engine.close()


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


# -- end to end on the CPU: the tiered cache with a CPU "device" tier ---------------------------


@pytest.fixture(scope="module")
def ref_cpu(tiny):
    out, cache = run(tiny, cache_budget_gb="all")
    assert type(cache) is ExpertCache  # the CPU default is unchanged
    return out


@pytest.mark.parametrize("vram,host,ahead", [(0, 0, 0), (3, 5, 0), (6, 100, 0), (10, 30, 1), (200, 200, 0)])
def test_tiered_cpu_bit_identical_to_plain(tiny, ref_cpu, vram, host, ahead):
    """Any VRAM budget and host tier (and prefetch) give the plain CPU path's bits, and the counters add up."""
    one = expert_bytes(tiny)
    ref = ref_cpu
    out, cache = run(tiny, cache_budget_gb=str(vram * one / 1e9), host_cache_gb=str(host * one / 1e9),
                     prefetch_ahead=ahead)
    assert same(out, ref)
    assert isinstance(cache, TieredExpertCache)
    s, t = cache.stats, cache.tier_stats
    assert s.misses == t.host_hits + t.disk_reads  # a VRAM miss is served by the host tier or the disk
    assert t.h2d_copies == s.misses + s.prefetch_hits  # every expert entering VRAM (read ahead too) is one copy
    assert (s.prefetch_hits > 0) == bool(ahead)
    # each copy: the expert's pieces, from 64 bytes-aligned below the first (its tensors keep their alignment)
    assert t.h2d_copies * one <= t.h2d_bytes < t.h2d_copies * (one + 64)
    assert cache.host.used_bytes <= cache.host.budget_bytes
    if host >= 100 and vram < 16:
        assert t.host_hits > 0
    if host == 0:
        assert t.host_hits == 0 and len(cache.host) == 0


def test_batched_compute_same_bits_for_every_tier_state(tiny, ref_cpu):
    """The batched path gives one set of bits for all budgets and tiers, close to the per-expert chain."""
    one = expert_bytes(tiny)
    ref, _ = run(tiny, cache_budget_gb="all", host_cache_gb="0", batched=True)
    for vram, host in [(0, 0), (3, 40)]:
        out, cache = run(tiny, cache_budget_gb=str(vram * one / 1e9), host_cache_gb=str(host * one / 1e9), batched=True)
        assert same(out, ref), (vram, host)
    for a, b in zip(ref, ref_cpu):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_batched_matches_streamed_on_random_routing():
    """The batched SwiGLU kernel against the per-expert chain on routings with uneven counts."""
    g = torch.Generator().manual_seed(3)
    h, inter, e, k = 16, 24, 6, 3
    experts = {(0, i): {"gate": torch.randn(inter, h, generator=g), "up": torch.randn(inter, h, generator=g),
                        "down": torch.randn(h, inter, generator=g)} for i in range(e)}

    class Fake:
        def fetch(self, layer, needed, counts):
            assert len(set(needed)) == len(needed)
            for x in needed:
                yield x, ExpertWeights((layer, x), experts[(layer, x)], 0)

    for t in (1, 5, 17):
        x = torch.randn(t, h, generator=g)
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=g)
        a = ExpertPipeline(Fake(), {0: BatchedSwiGLUKernel()}).compute(x, w, idx, 0)
        b = ExpertPipeline(Fake(), {0: PerExpertKernel(swiglu_expert)}).compute(x, w, idx, 0)
        want = torch.zeros(t, h, dtype=torch.float64)  # float64, summed in routing order
        for i in range(t):
            for j in range(k):
                ex = experts[(0, int(idx[i, j]))]
                xd = x[i].double()
                y = (F.silu(ex["gate"].double() @ xd) * (ex["up"].double() @ xd)) @ ex["down"].double().t()
                want[i] += w[i, j].double() * y
        for got in (a, b):  # both float32 products in their own order: within 1e-6 of the largest output
            assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()


# -- the parts ---------------------------------------------------------------------------------


class FakeEvent:
    """A copy's event: ``query`` says whether it is done; ``synchronize`` finishes it."""

    def __init__(self, done=False):
        self.is_done, self.waited = done, False

    def query(self):
        return self.is_done

    def synchronize(self):
        self.waited = self.is_done = True


def ew(key, nbytes=10):
    return ExpertWeights(key, {"w": torch.zeros(1)}, nbytes)


def test_host_tier_lru_and_deferred_release():
    released = []
    tier = HostTier(30, released.append, max_pending=2)
    evs = {i: FakeEvent() for i in range(6)}
    for i in range(3):
        tier.copied(ew((0, i)), evs[i])
    assert tier.keys_lru_first() == [(0, 0), (0, 1), (0, 2)] and tier.used_bytes == 30
    assert tier.get((0, 0)) is not None  # now most recently used
    tier.copied(ew((0, 3)), evs[3])  # evicts (0, 1), whose copy is still in flight: release waits
    assert (0, 1) not in tier and released == []
    evs[1].is_done = True
    tier.reap()
    assert [e.key for e in released] == [(0, 1)]
    # protected keys are evicted last
    tier.copied(ew((0, 4)), evs[4], protect={(0, 2), (0, 0)})
    assert (0, 3) not in tier and (0, 2) in tier
    # more pending than max_pending: the host waits for the oldest
    small = HostTier(0, released.append, max_pending=2)
    pend = [FakeEvent() for _ in range(3)]
    for i, e in enumerate(pend):
        small.copied(ew((1, i)), e)  # budget 0: never kept, released after the copy
    assert pend[0].waited and not pend[2].waited
    assert len(small) == 0
    small.close()
    assert all(e.is_done for e in pend)
    assert {(1, 0), (1, 1), (1, 2)} <= {e.key for e in released}


def test_host_tier_refreshes_event_of_held_expert():
    released = []
    tier = HostTier(20, released.append)
    a = ew((0, 0))
    first, second = FakeEvent(True), FakeEvent()
    tier.copied(a, first)
    tier.copied(a, second)  # copied again from the host tier: its buffer must outlive the new copy
    tier.copied(ew((0, 1)), FakeEvent(True))
    tier.copied(ew((0, 2)), FakeEvent(True))  # evicts (0, 0)
    assert released == []
    second.is_done = True
    tier.reap()
    assert released == [a]


def test_pinned_pool_registers_once_and_unregisters_when_dropped():
    reg, unreg = [], []
    pool = PinnedBufferPool(1, register=lambda a, n: reg.append((a, n)) or True, unregister=unreg.append)
    m1, t1, _ = pool.get(5000)
    m2, _, _ = pool.get(5000)
    assert len(reg) == 2 and reg[0][1] == 8192 and t1.numel() == 5000
    pool.put(m1)  # kept for reuse: stays registered
    m3, _, _ = pool.get(5000)
    assert m3 is m1 and len(reg) == 2 and pool.is_pinned(m3)
    pool.put(m3)
    pool.put(m2)  # beyond max_free: unregistered, then dropped
    assert unreg == [reg[1][0]]
    assert pool.registered_bytes == 8192


def test_pinned_pool_failure_warns_and_goes_on(capsys):
    pool = PinnedBufferPool(2, register=lambda a, n: False, unregister=lambda a: None)
    m, t, _ = pool.get(100)
    pool.get(100)
    assert pool.failed and not pool.is_pinned(m) and t.numel() == 100
    assert capsys.readouterr().err.count("could not page-lock") == 1


def test_copy_engine_cpu_one_copy_same_offsets():
    from moestream.store import BufferPool

    m, buf, _ = BufferPool(1).get(256)
    buf.copy_(torch.arange(256, dtype=torch.uint8))
    tensors = {"gate": buf[0:64].view(torch.float32).view(4, 4), "down": buf[128:192].view(torch.float32).view(2, 8)}
    src = ExpertWeights((0, 1), tensors, 256, m)
    ce = CopyEngine("cpu")
    dev, event = ce.to_device(src)
    # one copy of the span the tensors cover (bytes 0-191 of the 256-byte buffer)
    assert event is None and dev.nbytes == 192 and ce.copies == 1 and dev.mapping is None
    for r in tensors:
        assert torch.equal(dev.tensors[r], tensors[r]) and dev.tensors[r].data_ptr() != tensors[r].data_ptr()
    assert dev.tensors["down"].data_ptr() - dev.tensors["gate"].data_ptr() == 128
    # tensors not in one buffer (a cast replaced them): one copy each
    loose = ExpertWeights((0, 2), {"a": torch.ones(3), "b": torch.zeros(2, 2)}, 0)
    dev2, _ = ce.to_device(loose)
    assert dev2.nbytes == 28 and torch.equal(dev2.tensors["b"], loose.tensors["b"])


def test_device_and_host_budget_options(monkeypatch):
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == "cpu"  # MOESTREAM_DEVICE=cpu, set for the tests
    monkeypatch.delenv("MOESTREAM_DEVICE")
    assert resolve_device("auto").type == ("cuda" if CUDA else "cpu")
    with pytest.raises(ConfigError, match="--device"):
        resolve_device("tpu")
    if not CUDA:
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")
    monkeypatch.setattr("moestream.memory.available_bytes", lambda: 10 * 10**9)
    one = 125 * 10**6  # one worker's 2 x 2 experts in flight + the runtime reserve: 1 GB

    def host(value, experts):
        return plan_host_budget(parse_host_budget(value), experts, one, workers=1)

    assert host(None, 5) == 0
    assert host("auto", 100 * 10**9) == 7 * 10**9
    assert host("auto", 10**6) == 10**6
    assert host("2.5", 100 * 10**9) == 25 * 10**8
    with pytest.raises(BudgetError, match="--host-cache-gb"):
        host("lots", 1)
    with pytest.raises(BudgetError, match="memory available"):
        host("50", 100 * 10**9)


def test_cli_refuses_host_tier_on_cpu():
    from moestream.cli import add_engine_args, engine_options

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", "x", "--device", "cpu", "--host-cache-gb", "4"])
    with pytest.raises(MoestreamError, match="--host-cache-gb needs --device cuda"):
        engine_options(args)
    engine_options(p.parse_args(["--model", "x", "--device", "cpu"]))


def test_cli_no_cuda_graphs_is_the_engine_option():
    """--no-cuda-graphs reaches EngineOptions.cuda_graphs (graphs on by default), and the API takes the field."""
    from moestream.cli import add_engine_args, engine_options

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_options(p.parse_args(["--model", "x", "--device", "cpu"])).cuda_graphs is True
    assert engine_options(p.parse_args(["--model", "x", "--device", "cpu", "--no-cuda-graphs"])).cuda_graphs is False
    assert EngineOptions.make("all", cuda_graphs=False).cuda_graphs is False


@pytest.mark.parametrize("value", ["-1", "abc", "nan", "1e12"])
def test_cli_refuses_a_bad_host_tier_size_on_any_device(value):
    from moestream.cli import add_engine_args, engine_options

    p = argparse.ArgumentParser()
    add_engine_args(p)
    with pytest.raises(MoestreamError, match="--host-cache-gb: .* must be a number of GB"):
        engine_options(p.parse_args(["--model", "x", "--device", "cpu", "--host-cache-gb", value]))


# -- on a CUDA GPU -----------------------------------------------------------------------------


@needs_cuda
def test_cuda_tiers_bit_identical_to_all_resident(tiny, ref_cpu):
    """On the GPU: every VRAM budget and host tier gives budget all's logits on the GPU, bit for bit."""
    one = expert_bytes(tiny)
    ref, ref_cache = run(tiny, device="cuda", cache_budget_gb="all")
    assert isinstance(ref_cache, TieredExpertCache)
    for vram, host, ahead in [(0, None, 0), (0, 0, 0), (3, 6, 0), (10, 1000, 1), (200, None, 0)]:
        out, cache = run(tiny, device="cuda", cache_budget_gb=str(vram * one / 1e9),
                         host_cache_gb=None if host is None else str(host * one / 1e9), prefetch_ahead=ahead)
        assert same(out, ref), (vram, host, ahead)
        if host == 1000:
            assert cache.tier_stats.host_hits > 0
    for a, b in zip(ref, ref_cpu):  # the CPU's per-expert float32 path
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@needs_cuda
def test_cuda_read_buffers_are_pinned(tiny):
    engine = load(tiny, cache_budget_gb="0", device="cuda", tokenizer=False, hotlist=False, learn_experts=False)
    try:
        assert isinstance(engine.store.pool, PinnedBufferPool)
        ew = engine.store.read_all([(0, 0)])[(0, 0)]
        assert next(iter(ew.tensors.values())).is_pinned()
        kernel = engine.pipeline.kernels[engine.model.moe_blocks()[0].layer]
        assert type(kernel).__name__ == "FusedSwiGLUKernel"  # the default on CUDA with Triton
        engine.store.release(ew)
    finally:
        engine.close()
    engine = load(tiny, cache_budget_gb="0", device="cuda", tokenizer=False, hotlist=False, learn_experts=False,
                  fused_experts=False)
    try:
        assert isinstance(engine.pipeline.kernels[engine.model.moe_blocks()[0].layer], BatchedSwiGLUKernel)
    finally:
        engine.close()


@needs_cuda
def test_cuda_generate_sampled_same_tokens(tiny):
    """generation.generate on the GPU (KV cache there, sampling on the host): tiers do not change the tokens."""
    from moestream.generation import SamplingParams, generate

    one = expert_bytes(tiny)
    got = []
    for budget, host in [("all", None), (str(2 * one / 1e9), str(40 * one / 1e9))]:
        engine = load(tiny, cache_budget_gb=budget, host_cache_gb=host, device="cuda", tokenizer=False, hotlist=False,
                      learn_experts=False)
        try:
            steps = list(generate(engine, PROMPT.tolist(), 12, SamplingParams(temperature=1.0, seed=4),
                                  stop_at_eos=False, keep_logits=True))
            got.append(([s.token for s in steps], [s.logits.cpu() for s in steps]))
        finally:
            engine.close()
    assert got[0][0] == got[1][0] and same(got[0][1], got[1][1])


def test_pinned_pool_close_unregisters_before_unmapping():
    reg, unreg = set(), []
    pool = PinnedBufferPool(4, register=lambda a, n: reg.add(a) or True, unregister=unreg.append)
    ms = [pool.get(100)[0] for _ in range(3)]
    pool.put(ms[0])
    pool.close()
    assert sorted(unreg) == sorted(reg) and pool.free_buffers == 0 and pool.registered_bytes == 0


def test_describe_tiers_line(tiny):
    engine = load(tiny, cache_budget_gb="0.5", host_cache_gb="1.5", device="cpu", tokenizer=False,
                  hotlist=False, learn_experts=False)
    try:
        assert engine.cache.describe_tiers() == (
            "device cpu: expert cache 0.50 GB in device memory, host tier 1.50 GB pinned")
    finally:
        engine.close()
