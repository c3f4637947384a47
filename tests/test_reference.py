"""moestream's Qwen3-MoE against the transformers reference implementation."""

import pytest
import torch

from moestream.engine import load

from . import family_helpers as fh
from .helpers import make_qwen3_moe, read_all, write_checkpoint

VARIANTS = {
    "base": {},
    "dense-layer-and-sparse-step": {"mlp_only_layers": [0], "decoder_sparse_step": 1},
    "sparse-step-2": {"decoder_sparse_step": 2, "num_hidden_layers": 4},
    "tied-no-renorm-bias": {"tie_word_embeddings": True, "norm_topk_prob": False, "attention_bias": True},
    "sliding-window": {"use_sliding_window": True, "sliding_window": 7},
    "top-4-of-16": {"num_experts": 16, "num_experts_per_tok": 4},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
    ref = make_qwen3_moe(tmp_path, seed=1, **VARIANTS[variant])
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    engine = load(tmp_path, cache_budget_gb=0.0001, tokenizer=False, workers=2)
    try:
        # whole prompt at once, and in chunks of 16 with a KV cache, both against the reference
        for chunk in (40, 16):
            kv = engine.model.new_kv_cache()
            with torch.inference_mode():
                got = torch.cat([engine.model(ids[s : s + chunk], s, kv, all_logits=True) for s in range(0, 40, chunk)])
            rel = (got - want).abs().max() / want.abs().max()
            assert rel < 1e-5, f"{variant} chunk {chunk}: max relative error {rel:.2e}"
    finally:
        engine.close()


@pytest.mark.parametrize("variant", ["base", "tied-no-renorm-bias", "sliding-window"])
def test_greedy_tokens_match_transformers(tmp_path, variant):
    ref = make_qwen3_moe(tmp_path, seed=2, **VARIANTS[variant])
    fh.assert_greedy_matches(tmp_path, ref)


def test_tied_head_is_the_embedding_even_if_the_checkpoint_has_lm_head(tmp_path):
    """transformers ties lm_head to the embedding when tie_word_embeddings is set; so do we."""
    from .helpers import read_all, write_checkpoint

    ref = make_qwen3_moe(tmp_path / "src", seed=3, tie_word_embeddings=True)
    tensors = read_all(tmp_path / "src")
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    path = write_checkpoint(tmp_path / "src", tmp_path / "extra-head", tensors)
    ids = torch.arange(10, 30)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    engine = load(path, cache_budget_gb="all", tokenizer=False)
    try:
        assert "lm_head.weight" in engine.unused_tensors
        with torch.inference_mode():
            got = engine.model(ids, 0, engine.model.new_kv_cache(), all_logits=True)
    finally:
        engine.close()
    assert (got - want).abs().max() / want.abs().max() < 1e-5


@pytest.mark.parametrize("variant", ["base", "sliding-window", "dense-layer-and-sparse-step"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_invariant_to_chunks_capacity_threads_and_batch(tmp_path, variant, dtype):
    """Qwen3-MoE's tokens depend only on their context and position (family_helpers.assert_invariant), in
    float32 and bf16 (where every rounding of a reduction shows)."""
    make_qwen3_moe(tmp_path / "src", seed=4, **VARIANTS[variant])
    path = tmp_path / "src"
    if dtype == "bfloat16":
        path = write_checkpoint(path, tmp_path / "bf16", {k: v.bfloat16() for k, v in read_all(path).items()})
    fh.assert_invariant(path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streaming_exact_wherever_the_pieces_lie(tmp_path, dtype):
    make_qwen3_moe(tmp_path / "src", seed=5)
    path = tmp_path / "src"
    if dtype == "bfloat16":
        path = write_checkpoint(path, tmp_path / "bf16", {k: v.bfloat16() for k, v in read_all(path).items()})
    fh.assert_streaming_exact_at_offsets(path, tmp_path)


@pytest.mark.parametrize("variant", ["base", "sliding-window", "top-4-of-16"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_attention_block_in_one_call_gives_the_op_by_op_bits(tmp_path, variant, dtype):
    """The compiled attention block (q/k/v, q/k norms, rotary, the cache, attention, o in one call) gives every
    position the bits of the same ops one by one, through a cache that grows (capacity 8) and a decode step."""
    from moestream.models import layers

    make_qwen3_moe(tmp_path / "src", seed=6, **VARIANTS[variant])
    path = tmp_path / "src"
    if dtype == "bfloat16":
        path = write_checkpoint(path, tmp_path / "bf16", {k: v.bfloat16() for k, v in read_all(path).items()})
    ids = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(1))
    engine = load(path, cache_budget_gb="all", tokenizer=False, workers=2, learn_experts=False)
    for m in engine.model.modules():  # the layers op by op (the compiled decoder layer has its own test)
        if isinstance(m, layers.DecoderLayer):
            m._plan = False
    try:
        def run():
            kv = engine.model.new_kv_cache(8)
            with torch.inference_mode():
                return torch.cat([engine.model(ids[:13], 0, kv, all_logits=True),
                                  engine.model(ids[13:], 13, kv, all_logits=True),
                                  engine.model(ids[:1], 30, kv, all_logits=True)])

        calls = []
        real = layers.Attention._block
        layers.Attention._block = lambda *a: calls.append(1) or real(*a)
        try:
            fused = run()
        finally:
            layers.Attention._block = real
        assert calls  # the block ran
        layers.Attention._block = lambda *a: None  # the ops one by one
        try:
            plain = run()
        finally:
            layers.Attention._block = real
        assert torch.equal(fused, plain)
    finally:
        engine.close()
