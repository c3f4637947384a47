"""OLMoE against transformers' OlmoeForCausalLM, streamed exactly, and synth of an OLMoE-1B-7B-shaped config."""

import pytest

from . import family_helpers as fh
from .family_helpers import *  # noqa: F403 -- the five shared family tests (its __all__), collected here

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
            clip_qkv=0.8, pad_token_id=0, eos_token_id=1)


def build(path, seed, **overrides):
    return fh.save_tiny("Olmoe", {**TINY, **overrides}, path, seed)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("olmoe")
    ref = build(path, 1)
    assert not ref.config.norm_topk_prob  # the default: top-k weights not renormalized
    return path, ref


def test_renormalized_biased_tied_variant(tmp_path):
    ref = build(tmp_path, 2, norm_topk_prob=True, attention_bias=True, tie_word_embeddings=True, clip_qkv=None,
                num_experts=16, num_experts_per_tok=4)
    fh.assert_logits_match(tmp_path, ref)


def test_synth_olmoe_1b_7b_shape_generates(tmp_path):
    # OLMoE-1B-7B-0924's config with its widths scaled down
    cfg = dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", vocab_size=50304, hidden_size=64,
               intermediate_size=32, num_hidden_layers=16, num_attention_heads=4, num_key_value_heads=4,
               num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, rms_norm_eps=1e-5, rope_theta=10000.0,
               clip_qkv=None, max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=50279)
    written = fh.synth_and_generate(tmp_path, cfg)
    assert written["num_hidden_layers"] == 2
