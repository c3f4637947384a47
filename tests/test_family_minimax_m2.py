"""MiniMax-M2 against transformers' MiniMaxM2ForCausalLM, streamed exactly, and synth of a MiniMax-M2-shaped config."""

import pytest

from . import family_helpers as fh
from .family_helpers import *  # noqa: F403 -- the five shared family tests (its __all__), collected here

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2,
            max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("minimax_m2")
    ref = fh.save_tiny("MiniMaxM2", TINY, path, seed=1)
    assert ref.config.rope_parameters["partial_rotary_factor"] == 0.5
    assert ref.model.layers[1].mlp.e_score_correction_bias.abs().min() > 0
    return path, ref


def test_synth_minimax_m2_shape_generates(tmp_path):
    # MiniMax-M2's published config fields, widths scaled down
    cfg = dict(architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", vocab_size=200064, hidden_size=32,
               intermediate_size=16, num_hidden_layers=62, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               rotary_dim=8, num_local_experts=256, num_experts_per_tok=8, rope_theta=5000000, rms_norm_eps=1e-6,
               max_position_embeddings=196608, use_qk_norm=True, scoring_func="sigmoid", tie_word_embeddings=False)
    written = fh.synth_and_generate(tmp_path, cfg)
    assert written["num_hidden_layers"] == 2
