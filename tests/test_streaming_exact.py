"""Streaming is bit-identical to every expert resident, whatever the budget or reader count."""

import pytest
import torch

from moestream.engine import load
from moestream.generation import SamplingParams, generate

from .helpers import make_qwen3_moe, read_all, write_checkpoint, write_tiny_synth_config


@pytest.fixture(scope="module", params=["random", "trained"])
def sharded(request, tmp_path_factory):
    """A tiny model (4 layers x 16 experts, top-4) split over 3 shards: transformers' random init with norms and
    routers randomized, or ``moestream synth --init trained`` (routing that reuses experts over time)."""
    if request.param == "trained":
        from moestream.synth import synth

        cfg = write_tiny_synth_config(tmp_path_factory.mktemp("cfg") / "c.json", vocab_size=300, hidden_size=64,
                                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                      head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32)
        out = synth(cfg, tmp_path_factory.mktemp("trained") / "m", dtype="fp32", init="trained", shard_gb=0.0008)
        assert len(list(out.glob("*.safetensors"))) == 3
        return out
    src = tmp_path_factory.mktemp("src")
    make_qwen3_moe(src, seed=5, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4)
    return write_checkpoint(src, tmp_path_factory.mktemp("sharded"), read_all(src), shards=3)


def run(path, budget, workers, sampling, chunk=512):
    """Prefill logits, each decode step's logits and the tokens, for one configuration."""
    engine = load(path, cache_budget_gb=budget, workers=workers, tokenizer=False)
    try:
        prompt = torch.randint(0, 300, (23,), generator=torch.Generator().manual_seed(11)).tolist()
        kv = engine.model.new_kv_cache()
        with torch.inference_mode():
            prefill = torch.cat([engine.model(torch.tensor(prompt[s : s + chunk]), s, kv, all_logits=True)
                                 for s in range(0, len(prompt), chunk)])
        steps = list(generate(engine, prompt, 24, sampling, stop_at_eos=False, keep_logits=True, prefill_chunk=chunk))
        return prefill, [s.logits for s in steps], [s.token for s in steps], engine.cache.stats
    finally:
        engine.close()


def expert_bytes(path):
    from moestream.checkpoint import Checkpoint
    from moestream.layout import discover_experts

    with Checkpoint(path) as c:
        lay = discover_experts(c.tensors)
        return lay.expert_nbytes(0, 0), lay.layers[0].num_experts


SAMPLINGS = [SamplingParams(), SamplingParams(temperature=1.0, seed=4)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_budgets_and_workers_bit_identical(sharded, sampling):
    one, per_layer = expert_bytes(sharded)
    ref_prefill, ref_steps, ref_tokens, ref_stats = run(sharded, "all", 8, sampling)
    assert ref_stats.misses == 0  # budget all: everything was preloaded
    configs = [
        (0, 1),  # nothing fits: each expert is read, used, evicted
        (one * 3 / 1e9, 1),  # smaller than one token's experts of one layer (top-4)
        (one * 3 / 1e9, 8),
        (one * per_layer * 1.5 / 1e9, 3),  # a middle value
        (one * per_layer * 4 / 1e9, 2),  # everything fits, read on demand
    ]
    for budget, workers in configs:
        prefill, steps, tokens, stats = run(sharded, str(budget), workers, sampling)
        assert torch.equal(prefill, ref_prefill), (budget, workers)
        assert len(steps) == len(ref_steps) == 24
        for i, (a, b) in enumerate(zip(steps, ref_steps)):
            assert torch.equal(a, b), f"budget {budget} workers {workers}: step {i} logits differ"
        assert tokens == ref_tokens
        assert stats.misses > 0


def test_chunked_prefill_streams_exactly(sharded):
    """Prefill in chunks of 5 at a tiny budget equals chunks of 5 with every expert resident."""
    a = run(sharded, "all", 4, SamplingParams(), chunk=5)
    b = run(sharded, "0", 4, SamplingParams(), chunk=5)
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_logits_digest_tells_bit_identical_runs_apart(sharded):
    """``GenerationStats.logits_sha256`` is equal across budgets and changes with any logit (max-active-experts)."""
    from moestream.generation import GenerationStats

    def digest(budget, **options):
        engine = load(sharded, cache_budget_gb=budget, workers=2, tokenizer=False, learn_experts=False, **options)
        try:
            prompt = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(2)).tolist()
            stats = GenerationStats()
            steps = list(generate(engine, prompt, 6, SamplingParams(), stats, stop_at_eos=False, keep_logits=True))
            import hashlib

            want = hashlib.sha256(b"".join(s.logits.view(torch.int32).numpy().tobytes() for s in steps)).hexdigest()
            assert stats.logits_sha256 == want
            return stats.logits_sha256
        finally:
            engine.close()

    full = digest("all")
    assert digest("0") == full
    assert digest("0", max_active_experts=3) != full
