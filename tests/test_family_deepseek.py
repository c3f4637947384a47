"""DeepSeek V2/V3, Kimi K2 and GLM-4.5 against the transformers reference implementations."""

import json

import pytest
import torch

from moestream.checkpoint import Checkpoint
from moestream.engine import load
from moestream.generation import SamplingParams, generate
from moestream.layout import discover_experts

from . import family_helpers as fh
from .helpers import GLM4_MOE_TINY, random_family_model, read_all, write_checkpoint

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 64}
MLA = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12,
           qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=1,
           n_shared_experts=2, routed_scaling_factor=2.5, max_position_embeddings=2560, tie_word_embeddings=False)
FAMILIES = {
    # sigmoid + correction bias, 4 groups of 2 (top 2), yarn rope with mscale, interleaved rope
    "deepseek_v3": ("DeepseekV3", dict(MLA, n_group=4, topk_group=2, norm_topk_prob=True, rope_parameters=YARN)),
    # Kimi K2: one group, K2's yarn (beta 1/1, theta 50000), model_type kimi_k2 on disk
    "kimi_k2": ("DeepseekV3", dict(MLA, n_group=1, topk_group=1, norm_topk_prob=True, first_k_dense_replace=2,
                                   rope_parameters=dict(YARN, factor=32.0, beta_fast=1.0, beta_slow=1.0,
                                                        rope_theta=50000.0))),
    # softmax, group-limited greedy, low-rank queries, V2's yarn (mscale 0.707)
    "deepseek_v2": ("DeepseekV2", dict(MLA, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                       rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707))),
    # plain q_proj (q_lora_rank null), greedy top-k, default rope
    "deepseek_v2-lite": ("DeepseekV2", dict(MLA, q_lora_rank=None, topk_method="greedy", n_shared_experts=1,
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # DeepSeek-V3.2: V3 with sparse attention; index_topk 8 < the prompts, so the indexer chooses (16 index heads:
    # a key scores exactly 0, a tie whose top-k order is arbitrary, only if all 16 heads give it relu 0)
    "deepseek_v32": ("DeepseekV32", dict(MLA, n_group=4, topk_group=2, norm_topk_prob=True, rope_parameters=YARN,
                                         index_n_heads=16, index_head_dim=16, index_topk=8)),
    "glm4_moe": ("Glm4Moe", GLM4_MOE_TINY),
}


def make_model(path, family, seed=0, **overrides):
    """Save a random float32 transformers model of ``family`` (its config fields changed by ``overrides``) to
    ``path``; return it.

    Norms, routers and the correction bias are randomized (transformers initializes them
    to 1, small values and 0), so a wrong norm, router or bias use cannot hide.
    """
    model = random_family_model(FAMILIES, family, seed, **overrides)
    model.save_pretrained(path)
    if family == "kimi_k2":
        cfg_path = path / "config.json"
        cfg_path.write_text(json.dumps(dict(json.loads(cfg_path.read_text()), model_type="kimi_k2")))
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, make_model(path, request.param, seed=1), path


def test_bias_changes_the_choice(family):
    """The randomized correction bias is nonzero and matters: without it some token chooses other experts."""
    name, ref, _ = family
    if name.startswith("deepseek_v2"):
        pytest.skip("V2 has no correction bias")
    from moestream.models.moe import sigmoid_group_topk

    gate = ref.model.layers[2].mlp.gate
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    logits = x @ gate.weight.T
    k, a = ref.config.num_experts_per_tok, ref.config
    with_bias = sigmoid_group_topk(logits, k, gate.e_score_correction_bias, a.n_group, a.topk_group)[1]
    without = sigmoid_group_topk(logits, k, None, a.n_group, a.topk_group)[1]
    assert gate.e_score_correction_bias.abs().min() > 0
    assert not torch.equal(with_bias.sort(-1).values, without.sort(-1).values)


def test_logits_match_transformers(family):
    name, ref, path = family
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    engine = load(path, cache_budget_gb=0.0001, tokenizer=False, workers=2)
    try:
        module = {"glm4_moe": "glm4_moe", "deepseek_v32": "deepseek_v32"}.get(name, "deepseek")
        assert type(engine.model).__module__ == "moestream.models." + module
        # whole prompt at once, and in chunks with the KV cache, both against the reference
        for chunk in (40, 16, 7):
            kv = engine.model.new_kv_cache()
            with torch.inference_mode():
                got = torch.cat([engine.model(ids[s : s + chunk], s, kv, all_logits=True) for s in range(0, 40, chunk)])
            rel = (got - want).abs().max() / want.abs().max()
            assert rel < 1e-5, f"{name} chunk {chunk}: max relative error {rel:.2e}"
        if name != "glm4_moe":  # the latent KV cache: the normalized latent and the rope key per token
            a = ref.config
            latent, k_rot = kv.layers[0]
            assert latent.shape[-1] == a.kv_lora_rank and k_rot.shape[-1] == a.qk_rope_head_dim
            index = getattr(a, "index_head_dim", 0)  # V3.2 caches its indexer's keys too
            per_layer = (a.kv_lora_rank + a.qk_rope_head_dim + index) * 4
            assert engine.model.kv_bytes_per_token(4) == a.num_hidden_layers * per_layer
    finally:
        engine.close()


def test_greedy_tokens_match_transformers(family):
    _, ref, path = family
    fh.assert_greedy_matches(path, ref)


def run(path, budget):
    engine = load(path, cache_budget_gb=budget, workers=3, tokenizer=False)
    try:
        prompt = torch.randint(0, 300, (19,), generator=torch.Generator().manual_seed(11)).tolist()
        steps = list(generate(engine, prompt, 12, SamplingParams(temperature=1.0, seed=2), stop_at_eos=False,
                              keep_logits=True, prefill_chunk=8))
        return [s.logits for s in steps], [s.token for s in steps], engine.cache.stats
    finally:
        engine.close()


def test_streaming_bit_identical_to_all_resident(family):
    _, _, path = family
    ref_logits, ref_tokens, ref_stats = run(path, "all")
    logits, tokens, stats = run(path, "0.00001")  # a few experts at most
    assert ref_stats.misses == 0 and stats.misses > 0
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits))


def test_checkpoint_on_disk_and_layout(family):
    """What save_pretrained writes, and that layout discovery finds the routed experts, not the shared ones."""
    name, ref, path = family
    a = ref.config
    tensors = read_all(path)
    with Checkpoint(path) as c:
        lay = discover_experts(c.tensors)
    assert sorted(lay.layers) == list(range(a.first_k_dense_replace, a.num_hidden_layers))
    for i, layer in lay.layers.items():
        assert layer.num_experts == 8 and layer.block == f"model.layers.{i}.mlp"
        assert layer.experts[0][0].shape == (32, 64)
        assert f"model.layers.{i}.mlp.shared_experts.gate_proj.weight" in tensors
        assert not any("shared_experts" in p.source for ex in layer.experts for p in ex)
        assert (f"model.layers.{i}.mlp.gate.e_score_correction_bias" in tensors) == (not name.startswith("deepseek_v2"))
    kinds = {x.kind for x in lay.layers.values()}
    assert kinds == {"per-expert"}, kinds  # transformers 5 saves experts per expert, as the Hub checkpoints
    assert "model.layers.0.mlp.gate_proj.weight" in tensors  # the dense first layer


def test_mtp_layers_are_left_unread(family, tmp_path):
    """A checkpoint with a multi-token-prediction layer after the decoder (DeepSeek-V3's model.layers.61)."""
    name, ref, path = family
    tensors = read_all(path)
    n = ref.config.num_hidden_layers
    last = f"model.layers.{n - 1}."
    for k, v in list(tensors.items()):
        if k.startswith(last):
            tensors[k.replace(last, f"model.layers.{n}.")] = v.clone()
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    mtp = write_checkpoint(path, tmp_path / "mtp", tensors)
    ids = torch.arange(5, 25)
    outs = []
    for p in (path, mtp):
        engine = load(p, cache_budget_gb="all", tokenizer=False)
        try:
            with torch.inference_mode():
                outs.append(engine.model(ids, 0, engine.model.new_kv_cache(), all_logits=True))
            unused = engine.unused_tensors
            assert sorted(engine.layout.layers) == list(range(ref.config.first_k_dense_replace, n))
        finally:
            engine.close()
    assert torch.equal(outs[0], outs[1])
    assert f"model.layers.{n}.eh_proj.weight" in unused
    assert f"model.layers.{n}.mlp.experts.3.down_proj.weight" in unused
    assert all(k.startswith(f"model.layers.{n}.") for k in unused)


def test_invariant_to_chunks_capacity_threads_and_batch(family):
    fh.assert_invariant(family[2])


def test_streaming_exact_wherever_the_pieces_lie(family, tmp_path):
    fh.assert_streaming_exact_at_offsets(family[2], tmp_path)
