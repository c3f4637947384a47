"""gpt-oss against transformers' GptOssForCausalLM, streamed exactly, and synth of the real gpt-oss-20b config."""

import json

import pytest
import torch

from . import family_helpers as fh
from .family_helpers import *  # noqa: F403 -- the five shared family tests (its __all__), collected here
from .shared_data import CONFIGS

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
            max_position_embeddings=512, sliding_window=9, swiglu_limit=1.5, pad_token_id=0)


def redraw(name, p):
    if name.endswith(("gate_up_proj", "down_proj")):
        p.normal_(0.0, 0.3)  # expert activations large enough that the SwiGLU clamp binds


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    ref = fh.save_tiny("GptOss", TINY, path, seed=1, extra=redraw)
    assert ref.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert ref.config.rope_parameters["rope_type"] == "yarn"
    return path, ref


def test_checkpoint_layout_and_clamp(model):
    from moestream.checkpoint import Checkpoint
    from moestream.layout import discover_experts

    path, ref = model
    with Checkpoint(path) as c:
        assert c.tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)  # [E, H, 2I]
        lay = discover_experts(c.tensors)
        pieces = lay.pieces(1, 5)
        assert [(p.role, p.shape) for p in pieces] == [
            ("gate_up", (64, 64)), ("down", (32, 64)), ("down.bias", (64,)), ("gate_up.bias", (64,))]
        experts = ref.model.layers[1].mlp.experts
        for p, want in zip(pieces, (experts.gate_up_proj[5], experts.down_proj[5], experts.down_proj_bias[5],
                                    experts.gate_up_proj_bias[5])):
            got = torch.frombuffer(bytearray(open(p.file, "rb").read()[p.offset : p.offset + p.nbytes]),
                                   dtype=torch.float32).view(p.shape)
            assert torch.equal(got, want.detach())
    # the clamp binds on these weights: some gate_up activations exceed the limit
    h = ref.model.layers[1].post_attention_layernorm(ref.model.embed_tokens(torch.arange(40)))
    assert (h @ experts.gate_up_proj[0]).abs().max() > TINY["swiglu_limit"]


def test_synth_real_config_generates(tmp_path):
    cfg = json.load(open(CONFIGS / "gpt-oss-20b.json"))
    cfg.update(hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    written = fh.synth_and_generate(tmp_path, cfg)
    assert "quantization_config" not in written and len(written["layer_types"]) == 2
