"""Laguna against transformers' LagunaForCausalLM, streamed exactly, and synth of the real Laguna configs."""

import json

import pytest

from . import family_helpers as fh
from .family_helpers import *  # noqa: F403 -- the five shared family tests (its __all__), collected here
from .shared_data import CONFIGS

ROPE = {
    "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "beta_fast": 32.0,
                       "original_max_position_embeddings": 64, "beta_slow": 1.0, "partial_rotary_factor": 0.5},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=48, moe_intermediate_size=32,
            shared_expert_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_attention_heads_per_layer=[4, 8, 8, 4],
            layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_experts=8, num_experts_per_tok=2,
            sliding_window=9, moe_routed_scaling_factor=2.5, gating=True, rope_parameters=ROPE,
            max_position_embeddings=512, pad_token_id=0)


def build(path, seed, **overrides):
    return fh.save_tiny("Laguna", {**TINY, **overrides}, path, seed)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("laguna")
    ref = build(path, 1)
    bias = ref.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0  # a nonzero correction bias reaches the checkpoint
    return path, ref


def test_checkpoint_names(model):
    from moestream.checkpoint import Checkpoint
    from moestream.layout import discover_experts

    with Checkpoint(model[0]) as c:
        for name in ("model.layers.1.mlp.experts.e_score_correction_bias",
                     "model.layers.1.mlp.shared_expert.up_proj.weight", "model.layers.0.mlp.up_proj.weight",
                     "model.layers.3.mlp.experts.7.down_proj.weight"):
            assert name in c.tensors, name
        lay = discover_experts(c.tensors)
    assert sorted(lay.layers) == [1, 2, 3]


def test_per_element_gate_softcap_variant(tmp_path):
    ref = build(tmp_path, 2, gating="per-element", moe_router_logit_softcapping=0.5, num_experts=16,
                num_experts_per_tok=4, mlp_layer_types=["sparse", "dense", "sparse", "sparse"])
    fh.assert_logits_match(tmp_path, ref)


@pytest.mark.parametrize("name", ["Laguna-XS.2-FP8", "Laguna-S-2.1-FP8"])
def test_synth_real_config_generates(tmp_path, name):
    cfg = json.load(open(CONFIGS / f"{name}.json"))
    cfg.update(hidden_size=32, intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
               head_dim=8, num_key_value_heads=2, num_attention_heads=4,
               num_attention_heads_per_layer=[4 if h == 48 else 6 for h in cfg["num_attention_heads_per_layer"]])
    written = fh.synth_and_generate(tmp_path, cfg)
    assert "quantization_config" not in written and written["mlp_layer_types"] == ["dense", "sparse"]
