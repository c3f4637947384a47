"""HunYuan MoE V1 against transformers' HunYuanMoEV1ForCausalLM, streamed exactly, and synth."""

import pytest

from . import family_helpers as fh
from .family_helpers import *  # noqa: F403 -- the five shared family tests (its __all__), collected here

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, moe_topk=2, max_position_embeddings=512,
            attention_bias=True)


def redraw(name, p):
    if name.endswith("gate.wg.weight"):
        p.normal_(0.0, 0.5)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("hunyuan")
    ref = fh.save_tiny("HunYuanMoEV1", TINY, path, seed=1, extra=redraw)
    return path, ref


def test_synth_generates(tmp_path):
    cfg = dict(architectures=["HunYuanMoEV1ForCausalLM"], model_type="hunyuan_v1_moe", vocab_size=128167,
               hidden_size=32, intermediate_size=16, num_hidden_layers=32, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, num_experts=[64] * 32, moe_topk=[8] * 32, rope_theta=10000.0,
               rms_norm_eps=1e-5, max_position_embeddings=32768, tie_word_embeddings=True)
    written = fh.synth_and_generate(tmp_path, cfg)
    assert written["moe_topk"] == [8, 8]
