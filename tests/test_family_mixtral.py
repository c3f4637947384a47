"""Mixtral against transformers' MixtralForCausalLM, streamed exactly, and synth of the real config."""

import json

import pytest

from . import family_helpers as fh
from .family_helpers import *  # noqa: F403 -- the five shared family tests (its __all__), collected here
from .shared_data import CONFIGS

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
            max_position_embeddings=512, sliding_window=9)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    ref = fh.save_tiny("Mixtral", TINY, path, seed=1)
    return path, ref


def test_checkpoint_is_per_expert_w1_w2_w3(model):
    from moestream.checkpoint import Checkpoint
    from moestream.layout import discover_experts

    with Checkpoint(model[0]) as c:
        assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in c.tensors
        lay = discover_experts(c.tensors)
    assert lay.layers[2].kind == "per-expert" and lay.layers[2].num_experts == 8


def test_full_attention_when_window_null(tmp_path):
    ref = fh.save_tiny("Mixtral", dict(TINY, sliding_window=None), tmp_path, seed=2)
    assert json.loads((tmp_path / "config.json").read_text())["sliding_window"] is None
    fh.assert_logits_match(tmp_path, ref)


def test_synth_real_config_generates(tmp_path):
    cfg = json.load(open(CONFIGS / "Mixtral-8x7B-v0.1.json"))
    cfg.update(hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2)
    written = fh.synth_and_generate(tmp_path, cfg)
    assert written["num_hidden_layers"] == 2
