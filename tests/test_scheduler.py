"""The scheduler (moestream/scheduler.py) and the prefix cache (moestream/prefix_cache.py): a sequence run in a
batch, joining and leaving it, its prompt cut into chunks between other sequences' decode steps or taken from the
prefix cache, gives exactly the tokens, logits (``torch.equal``), log-probabilities and text of the same request
run alone by ``generation.generate`` (an independent loop), streamed under a budget below the model's experts and
with every expert resident."""

from __future__ import annotations

import pytest
import torch

from moestream.budget import plan_cpu_budget
from moestream.cli import main
from moestream.engine import load
from moestream.errors import BudgetError, InputError
from moestream.generation import GenerationStats, SamplingParams, generate
from moestream.models.layers import KVCache
from moestream.prefix_cache import PrefixCache, block_keys, prefix_cache_for, prefix_cache_supported
from moestream.scheduler import Request, Scheduler

from .helpers import Wrapped, cli_synth_tiny, write_tiny_synth_config

TEXTS = ["hello there", "Tell me about streaming experts and their caches, please. " * 4, "x", "The cache is",
         "Why is the sky blue? Answer in one line.", "1 2 3 4 5 6 7 8 9 10 11 12"]
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=1.0, seed=3),
             SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=11), SamplingParams(repetition_penalty=1.3),
             SamplingParams(temperature=1.2, min_p=0.05, seed=5, frequency_penalty=0.5), SamplingParams(seed=9)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return cli_synth_tiny(tmp_path_factory.mktemp("sched"))


@pytest.fixture(scope="module")
def streamed(ckpt):
    eng = load(ckpt, cache_budget_gb=0.00005, workers=2, prefix_cache_gb=0.01)  # a few experts: every step reads
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def resident(ckpt):
    eng = load(ckpt, cache_budget_gb="all", workers=2)
    yield eng
    eng.close()


def _requests(engine, n: int, max_tokens=(9, 14, 5, 20, 11, 7), **kw) -> list[Request]:
    tok = engine.tokenizer
    return [Request(tok.encode(TEXTS[i]), max_tokens[i], SAMPLINGS[i], keep_logits=True, logprobs=2, **kw)
            for i in range(n)]


def _solo(engine, r: Request, **kw) -> list:
    """The request alone through generate(), without the prefix cache: the reference."""
    saved, engine.prefix_cache = engine.prefix_cache, None
    try:
        return list(generate(engine, r.ids, r.max_tokens, r.sampling, keep_logits=True, logprobs=r.logprobs,
                             stop=r.stop, stop_at_eos=not r.ignore_eos, **kw))
    finally:
        engine.prefix_cache = saved


def _same(solo: list, got: list, what: str) -> None:
    assert [s.token for s in got] == [s.token for s in solo], what
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(solo, got)), what
    assert [s.logprob for s in got] == [s.logprob for s in solo], what
    assert [s.text for s in got] == [s.text for s in solo], what
    assert [s.finish_reason for s in got] == [s.finish_reason for s in solo], what


def _collect(scheduler: Scheduler, requests: list[Request]) -> dict[int, list]:
    got: dict[int, list] = {i: [] for i in range(len(requests))}
    for i, _, step in scheduler.run(requests):
        got[i].append(step)
    return got


@pytest.mark.parametrize("max_batch, step_tokens", [(6, 512), (3, 8), (2, 5)])
def test_a_batch_gives_every_sequence_its_solo_bits(streamed, resident, max_batch, step_tokens):
    """Six requests (greedy, seeded top-p/top-k/min-p, penalties), a batch of all, of 3 or 2 at a time with prefill
    chunks of at most 8 or 5 tokens between the decode steps, streamed at a budget of a few experts: each equals its
    solo run with every expert resident."""
    reqs = _requests(streamed, 6)
    solo = [_solo(resident, r) for r in reqs]
    sizes = []
    sch = Scheduler(streamed, max_batch, step_tokens=step_tokens, prefix_cache=None)
    sch.observer = lambda seqs, tokens: sizes.append((seqs, tokens))
    got = _collect(sch, reqs)
    for i in range(6):
        _same(solo[i], got[i], f"request {i}")
    assert max(s for s, _ in sizes) == max_batch  # they did run together
    assert max(t for _, t in sizes) <= step_tokens
    assert sch.counts == (0, 0)


def test_sequences_join_after_prefill_and_leave_at_their_end(streamed):
    """max_batch 2 over four requests: at most two run; the third starts only when one has left; a decoding
    sequence gets a token at every step while another's long prompt prefills in chunks of the step's budget."""
    tok = streamed.tokenizer
    long = tok.encode(TEXTS[1])
    reqs = [Request(tok.encode("hi"), 40, ignore_eos=True), Request(long, 3), Request(tok.encode("a b"), 4),
            Request(tok.encode("c"), 2)]
    sch = Scheduler(streamed, max_batch=2, step_tokens=6, prefix_cache=None)
    seqs = [sch.submit(r) for r in reqs]
    log = []
    while sch.has_work():
        steps = sch.step()
        log.append([s.id for s, _ in steps])
        assert len(sch.running) <= 2
    first, second, third = (s.id for s in seqs[:3])
    k1 = next(k for k, ids in enumerate(log) if second in ids)  # the long prompt's first token
    assert k1 == -(-len(long) // 5) - 1 >= 3  # its prefill took steps of 5 tokens (the 6th: seq 0 decoding)
    assert all(first in log[k] for k in range(k1 + 1)), log  # seq 0 decoded in every one of them
    k3 = next(k for k, ids in enumerate(log) if third in ids)
    assert k3 > k1 + 2  # it waited until the long one (3 tokens) had left
    assert all(s.done for s in seqs) and sch.counts == (0, 0)
    for s, r in zip(seqs, reqs):
        assert s.generated == [x.token for x in _solo(streamed, r)]


def test_prompts_arriving_together_share_a_step_and_a_long_one_takes_a_chunk(streamed, resident):
    """Four prompts submitted together prefill in one forward pass (one read of each expert for all of them), the
    long one's share of it capped at ``prefill_chunk``; each answer is still its solo run's."""
    tok = streamed.tokenizer
    prompts = [tok.encode(TEXTS[1]), tok.encode(TEXTS[0]), tok.encode(TEXTS[3]), tok.encode(TEXTS[4])]
    reqs = [Request(p, 5, SAMPLINGS[k], keep_logits=True, logprobs=1) for k, p in enumerate(prompts)]
    sizes = []
    sch = Scheduler(streamed, 4, step_tokens=40, prefill_chunk=8, prefix_cache=None)
    sch.observer = lambda seqs, tokens: sizes.append((seqs, tokens))
    got = _collect(sch, reqs)
    assert sizes[0] == (4, sum(min(len(p), 8) for p in prompts)) and len(prompts[0]) > 8
    for k in range(4):
        _same(_solo(resident, reqs[k]), got[k], f"request {k}")


def test_the_kv_bound_holds_sequences_back_never_refuses_them(streamed, resident):
    """kv_tokens 40: a sequence reserves its prompt plus max_tokens; a waiting one starts only when its reservation
    fits beside the running ones' (in order), one whose reservation exceeds the bound runs when alone; the answers
    are the solo runs'. The server bounds its scheduler by the budget plan's context x sequences."""
    tok = streamed.tokenizer
    reqs = [Request(tok.encode(TEXTS[0]), 15, keep_logits=True), Request(tok.encode(TEXTS[3]), 20, keep_logits=True),
            Request(tok.encode(TEXTS[1]), 5, keep_logits=True), Request(tok.encode("c"), 3, keep_logits=True)]
    assert len(reqs[2].ids) + 5 > 40
    sch = Scheduler(streamed, 4, kv_tokens=40, prefix_cache=None)
    seqs = [sch.submit(r) for r in reqs]
    got: dict[int, list] = {s.id: [] for s in seqs}
    peak = 0
    while sch.has_work():
        for s, step in sch.step():
            got[s.id].append(step)
        reserved = sum(len(s.request.ids) + s.request.max_tokens for s in sch.running)
        assert len(sch.running) == 1 or reserved <= 40
        peak = max(peak, len(sch.running))
    assert peak == 2  # the first two fit together (2 + 15 + 3 + 20 tokens), never three
    for s, r in zip(seqs, reqs):
        _same(_solo(resident, r), got[s.id], "under the KV bound")
    plan = streamed.budget
    assert plan.sequences == 1 and plan.context_tokens == 4096


class EosAfter(Wrapped):
    """The real model with the end-of-sequence token made certain from its ``after``-th call on."""

    def __init__(self, model, eos: int, after: int = 2):
        super().__init__(model)
        self.eos, self.after, self.calls = eos, after, 0

    def forward(self, ids, start, kv, all_logits=False):
        logits = self.inner(ids, start, kv, all_logits)
        self.calls += 1
        if self.calls >= self.after:
            logits[..., self.eos] += 1e4
        return logits


def test_min_tokens_and_ignore_eos(streamed, monkeypatch):
    tok = streamed.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("hello")
    monkeypatch.setattr(streamed, "model", EosAfter(streamed.model, eos))
    sch = Scheduler(streamed, prefix_cache=None)
    plain = [s for _, _, s in sch.run([Request(ids, 10)])]
    assert [s.token for s in plain][-1] == eos and len(plain) == 2 and plain[-1].finish_reason == "stop"
    streamed.model.calls = 0
    held = [s for _, _, s in sch.run([Request(ids, 10, min_tokens=6)])]
    assert len(held) == 7 and eos not in [s.token for s in held[:6]] and held[-1].token == eos
    assert held[:1] == plain[:1]  # the first token was never an EOS: the mask changed nothing there
    streamed.model.calls = 0
    runs = [s for _, _, s in sch.run([Request(ids, 10, ignore_eos=True)])]
    assert len(runs) == 10 and runs[-1].finish_reason == "length" and runs[1].token == eos
    streamed.model.calls = 0
    want = list(generate(streamed, ids, 10, stop_at_eos=False))
    assert [s.token for s in runs] == [s.token for s in want] and [s.text for s in runs] == [s.text for s in want]
    with pytest.raises(InputError, match="min_tokens"):
        sch.submit(Request(ids, 3, min_tokens=4))


def test_cancelling_one_sequence_leaves_the_others_unchanged(streamed, resident):
    reqs = _requests(streamed, 4)
    solo = [_solo(resident, r) for r in reqs]
    sch = Scheduler(streamed, 4, prefix_cache=None)
    seqs = [sch.submit(r) for r in reqs]
    got: dict[int, list] = {s.id: [] for s in seqs}
    while sch.has_work():
        for s, step in sch.step():
            got[s.id].append(step)
            if s is seqs[1] and len(got[s.id]) == 3:
                sch.cancel(s)
    assert len(got[seqs[1].id]) == 3 and seqs[1].stats.finish_reason == "cancelled" and seqs[1].kv is None
    for k in (0, 2, 3):
        _same(solo[k], got[seqs[k].id], f"request {k}")


class FailAt(EosAfter):
    """The real model, raising at its ``at``-th call of forward_batch."""

    def __init__(self, model, at: int):
        super().__init__(model, 0, 10**9)
        self.at = at

    def forward_batch(self, parts, all_logits=False):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("injected read failure")
        return self.inner.forward_batch(parts, all_logits)


def test_a_failed_step_ends_its_sequences_only(streamed, resident, monkeypatch):
    reqs = _requests(streamed, 3)
    monkeypatch.setattr(streamed, "model", FailAt(streamed.model, 3))
    sch = Scheduler(streamed, 2, prefix_cache=None)
    ended = {}
    seqs = [sch.submit(r, on_end=lambda e, i=i: ended.setdefault(i, e)) for i, r in enumerate(reqs)]
    got: dict[int, list] = {s.id: [] for s in seqs}
    while sch.has_work():
        for s, step in sch.step():
            got[s.id].append(step)
    assert isinstance(ended[0], RuntimeError) and isinstance(ended[1], RuntimeError)
    assert ended[2] is None  # it waited while the step failed, then ran
    _same(_solo(resident, reqs[2]), got[seqs[2].id], "the request after the failure")
    with pytest.raises(RuntimeError, match="injected"):
        streamed.model.calls, streamed.model.at = 0, 2
        list(Scheduler(streamed, 2, prefix_cache=None).run(reqs[:2]))


def test_the_prefix_cache_gives_a_fresh_prefills_bits(streamed, resident):
    """A request after another sharing its prompt's start reuses the cached blocks (cached_tokens > 0) and its
    logits, tokens and log-probabilities are those of a fresh prefill; generate() uses the same cache."""
    tok = streamed.tokenizer
    pc = streamed.prefix_cache
    assert pc is not None
    pc.clear()
    base = tok.encode(TEXTS[1])
    turn2 = base + tok.encode(" And what about the budget?")
    reqs = [Request(base, 6, SAMPLINGS[1], keep_logits=True, logprobs=3)]
    sch = Scheduler(streamed, 4)
    _collect(sch, reqs)
    again = [Request(turn2, 8, SAMPLINGS[2], keep_logits=True, logprobs=3), Request(base, 6, keep_logits=True)]
    seqs = [sch.submit(r) for r in again]
    got: dict[int, list] = {s.id: [] for s in seqs}
    while sch.has_work():
        for s, step in sch.step():
            got[s.id].append(step)
    b = pc.block
    assert seqs[0].cached_tokens == len(base) // b * b > 0
    assert seqs[1].cached_tokens == min(len(base) // b * b, len(base) - 1)
    for s, r in zip(seqs, again):
        _same(_solo(resident, r), got[s.id], "after a cached prefix")
    hits = pc.stats.hit_tokens
    stats = GenerationStats()
    st = list(generate(streamed, turn2, 8, SAMPLINGS[2], stats, keep_logits=True, logprobs=3))
    assert stats.prompt_cached_tokens >= len(base) // b * b and pc.stats.hit_tokens > hits
    _same(_solo(resident, again[0]), st, "generate() with the prefix cache")


def test_prefix_cache_lru_and_keys():
    """Chained keys name the whole prefix; blocks are evicted least recently used, a prefix's deepest block first;
    a block whose tokens differ from the lookup's is never handed out."""
    ids = list(range(40))
    keys = block_keys(ids, 8)
    assert len(keys) == 5 and block_keys([99] + ids[1:], 8)[4] != keys[4]  # one token changes every later key
    kv = KVCache(2, 64)
    for layer in range(2):
        kv.update(layer, 0, torch.randn(2, 40, 4), torch.randn(2, 40, 4))
    kv.length = 40
    one = 2 * 2 * 2 * 8 * 4 * 4  # layers x (k, v) x heads x tokens x dim x float32
    pc = PrefixCache(2, 4 * one, block=8)
    assert pc.store(ids, kv) == 5 and pc.used_bytes == 4 * one  # room for four: the fifth evicted the first
    assert pc.lookup(ids, 39)[0] == 0  # the first block was evicted: no run starts the prompt
    pc.clear()
    pc.store(ids[:32], kv)
    n, blocks = pc.lookup(ids, 39)  # a hit touches the chain: its first block most recent, its last least
    assert n == 32 and len(blocks) == 4
    fresh = KVCache(2, 64)
    pc.fill(fresh, 20, blocks)
    assert fresh.length == 20 and torch.equal(fresh.layers[1][0][:, :20], kv.layers[1][0][:, :20])
    other = list(range(100, 140))
    kv2 = KVCache(2, 64)
    for layer in range(2):
        kv2.update(layer, 0, torch.randn(2, 40, 4), torch.randn(2, 40, 4))
    kv2.length = 40
    pc.store(other[:8], kv2)  # evicts the deepest block of the older prefix, not its first
    assert pc.lookup(ids, 39)[0] == 24 and pc.lookup(other, 39)[0] == 8
    assert pc.lookup(ids, 20)[0] == 20 and len(pc.lookup(ids, 20)[1]) == 3  # a limit inside a block: that block too
    pc._blocks[block_keys(ids, 8)[0]].tokens = tuple(range(1, 9))  # as a hash collision would look
    assert pc.lookup(ids, 39)[0] == 0


def test_prefix_cache_only_where_it_is_exact(streamed):
    assert prefix_cache_supported(streamed.model, torch.device("cpu")) is None
    assert "CPU only" in prefix_cache_supported(streamed.model, torch.device("cuda"))

    class Hybrid:
        batchable = False

    assert "cannot be sliced" in prefix_cache_supported(Hybrid(), torch.device("cpu"))
    assert prefix_cache_for(Hybrid(), torch.device("cpu"), 10**9) is None
    assert prefix_cache_for(streamed.model, torch.device("cpu"), 0) is None


def test_the_budget_plan_counts_every_sequence_and_the_prefix_cache(streamed, monkeypatch):
    net = streamed.model
    per = net.kv_bytes_per_token(torch.float32.itemsize)
    one = plan_cpu_budget(net, 10**6, torch.float32, 10**7, 10**5, 2, True, 0, 1000)
    four = plan_cpu_budget(net, 10**6, torch.float32, 10**7, 10**5, 2, True, 0, 1000, sequences=4,
                           prefix_cache=10**8)
    assert one.kv_cache == 2 * 1000 * per and four.kv_cache == 4 * 2 * 1000 * per and four.prefix_cache == 10**8
    from moestream import memory

    need = 4 * 2 * 1000 * per + 10**8
    monkeypatch.setattr(memory, "available_bytes", lambda: need)
    with pytest.raises(BudgetError, match="--max-batch"):
        plan_cpu_budget(net, 10**6, torch.float32, 10**7, 10**5, 2, True, 0, 1000, sequences=4, prefix_cache=10**8)


def test_bad_scheduler_arguments(streamed):
    with pytest.raises(InputError, match="max_batch"):
        Scheduler(streamed, 0)
    with pytest.raises(InputError, match="step_tokens"):
        Scheduler(streamed, 8, step_tokens=4)
    sch = Scheduler(streamed)
    with pytest.raises(InputError, match="empty"):
        sch.submit(Request([], 3))
    with pytest.raises(InputError, match="vocabulary"):
        sch.submit(Request([10**7], 3))
    assert sch.counts == (0, 0)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Qwen3-30B-A3B's widths (hidden 2048, 32/4 heads of 128, experts of 768), 2 layers of 16 experts, top-4."""
    root = tmp_path_factory.mktemp("wide")
    cfg = write_tiny_synth_config(root / "config.json", vocab_size=4096, hidden_size=2048, intermediate_size=6144,
                                  moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
                                  head_dim=128, num_experts=16, num_experts_per_tok=4, eos_token_id=4095)
    assert main(["synth", "--config", str(cfg), "--out", str(root / "wide")]) == 0
    return root / "wide"


def test_at_real_widths_a_batch_and_a_cached_prefix_give_the_solo_bits(wide):
    """At real widths (where the compiled kernels split rows over threads and vectors), four sequences batched and
    streamed from a budget of a third of the experts, one of them after a cached prefix, equal their solo runs
    with every expert resident."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (37, 5, 70, 12)]
    prompts.append(prompts[2][:50] + [7, 8, 9])  # shares 48 tokens (three blocks) with prompt 2
    reqs = [Request(p, m, s, keep_logits=True, logprobs=1)
            for p, m, s in zip(prompts, (6, 9, 4, 7, 5), SAMPLINGS)]
    with load(wide, cache_budget_gb="all", workers=2, tokenizer=False) as whole:
        solo = [_solo(whole, r) for r in reqs]
    with load(wide, cache_budget_gb=0.05, workers=2, tokenizer=False, prefix_cache_gb=0.1) as eng:
        assert eng.cache.budget_bytes < sum(eng.store.cached_nbytes((i, e)) for i in range(2) for e in range(16)) / 2
        sch = Scheduler(eng, 4, step_tokens=40)
        got: dict[int, list] = {i: [] for i in range(5)}
        seqs = {}
        for i, seq, step in sch.run(reqs):
            got[i].append(step)
            seqs[i] = seq
        assert seqs[4].cached_tokens == 48
        for i in range(5):
            _same(solo[i], got[i], f"request {i}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_batch_gives_the_solo_bits(ckpt):
    """On CUDA a lone sequence goes through the model's own path (its decode graphs) and a batch through eager
    forward_batch; the GPU's attention, fused experts and dense projections are row-invariant
    (docs/reliability.md, "Invariance on the GPU"), so both give generate()'s bits alone; the prefix cache is off."""
    with load(ckpt, cache_budget_gb="all", device="cuda", prefix_cache_gb=0.01) as eng:
        assert eng.prefix_cache is None
        reqs = _requests(eng, 4)
        solo = [_solo(eng, r) for r in reqs]
        _same(solo[0], _collect(Scheduler(eng, 1), reqs[:1])[0], "one sequence on CUDA")
        got = _collect(Scheduler(eng, 4), reqs)
        for i in range(4):
            _same(solo[i], got[i], f"request {i} on CUDA")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_batched_decode_steps_replay_one_graph_per_batch_size(ckpt):
    """Loaded for four sequences (``max_batch=4``: four KV sets kept), the scheduler's decode steps of 2-4
    sequences replay CUDA graphs captured once per batch size (DecodeRunner.step_batch), a lone sequence one
    graph for every set; each answer is generate()'s bits alone, and a second round captures nothing new."""
    with load(ckpt, cache_budget_gb="all", device="cuda", max_batch=4) as eng:
        runner = eng.model.decode_runner
        assert runner.graphs and eng.model.kv_pool.max_sets == 4
        reqs = _requests(eng, 5)
        solo = [_solo(eng, r) for r in reqs]
        for round_ in range(2):
            got = _collect(Scheduler(eng, 4), reqs)
            for i in range(5):
                _same(solo[i], got[i], f"request {i}, round {round_}")
            if round_ == 0:
                captures = runner.stats.captures
        assert runner.stats.batch_replays > 20 and runner.stats.captures == captures <= 4, runner.stats


def test_a_hybrid_family_runs_its_batch_one_by_one_and_has_no_prefix_cache(tmp_path):
    """Qwen3-Next (Gated DeltaNet layers: a recurrent state, not batchable, not sliceable): the scheduler's steps run
    its sequences one after the other, each the bits of generate() alone; asking for a prefix cache gives none."""
    from .test_family_qwen3_hybrid import make_qwen3_next

    make_qwen3_next(tmp_path, seed=1)
    with load(tmp_path, cache_budget_gb=0.0001, tokenizer=False, workers=2, prefix_cache_gb=0.01) as eng:
        assert not eng.model.batchable and eng.prefix_cache is None
        g = torch.Generator().manual_seed(3)
        reqs = [Request(torch.randint(0, 300, (n,), generator=g).tolist(), m, s, keep_logits=True, logprobs=1)
                for n, m, s in zip((9, 30, 4), (6, 4, 7), SAMPLINGS)]
        solo = [_solo(eng, r) for r in reqs]
        got = _collect(Scheduler(eng, 3, step_tokens=16), reqs)
        for i in range(3):
            _same(solo[i], got[i], f"request {i}")


def test_batch_generate_gives_each_prompt_its_solo_run(streamed, resident):
    """moestream.batch_generate: text, chat messages and token ids, each with its own sampling, length and stop
    strings, batched: each prompt's tokens, text and log-probabilities are stream_generate's of it alone."""
    import moestream

    tok = streamed.tokenizer
    prompts = ["hello there", [{"role": "user", "content": "Name three rivers."}], tok.encode("The cache is")]
    samplings = [None, SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.0, top_k=20, seed=2)]
    lengths, stops = [8, 12, 6], [[], ["zz"], []]
    got: dict[int, list] = {0: [], 1: [], 2: []}
    for s in moestream.batch_generate(streamed, prompts, max_tokens=lengths, sampling=samplings, logprobs=2,
                                      stop=stops):
        got[s.index].append(s)
        assert s.stats.prompt_tokens > 0
    for i in range(3):
        want = list(moestream.stream_generate(resident, prompts[i], lengths[i], sampling=samplings[i], logprobs=2,
                                              stop=stops[i]))
        assert [s.token for s in got[i]] == [r.token for r in want], i
        assert [s.text for s in got[i]] == [r.text for r in want], i
        assert [s.logprob for s in got[i]] == [r.logprob for r in want], i
        assert got[i][-1].finish_reason == want[-1].finish_reason
    with pytest.raises(InputError, match="max_tokens: 2 values for 3 prompts"):
        list(moestream.batch_generate(streamed, prompts, max_tokens=[1, 2]))
    with pytest.raises(InputError, match="no prompts"):
        list(moestream.batch_generate(streamed, []))


@pytest.mark.parametrize("kw,field", [({"max_tokens": "5"}, "max_tokens"), ({"max_tokens": [5, 2.5]}, "max_tokens"),
                                      ({"min_tokens": "1"}, "min_tokens"), ({"max_batch": 0}, "max_batch"),
                                      ({"max_batch": "2"}, "max_batch"), ({"max_batch": 1.5}, "max_batch"),
                                      ({"ignore_eos": "yes"}, "ignore_eos")])
def test_batch_generate_refuses_wrong_types_by_name(streamed, kw, field):
    """A wrong type is an InputError naming the argument, before anything runs (not a TypeError from inside)."""
    import moestream

    with pytest.raises(InputError, match=field):
        list(moestream.batch_generate(streamed, [[5, 6, 7], [8, 9]], **kw))


def test_generate_refuses_a_max_tokens_that_is_not_a_whole_number(streamed):
    import moestream

    for bad in ("5", 2.5, True):
        with pytest.raises(InputError, match="max_tokens must be a whole number"):
            list(moestream.stream_generate(streamed, [5, 6, 7], max_tokens=bad))
