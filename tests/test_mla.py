"""Multi-head Latent Attention and YaRN rope against transformers' DeepSeek-V3 modules."""

import math

import pytest
import torch

from moestream.models.layers import KVCache
from moestream.models.mla import MLAttention
from moestream.models.rope import ScaledRotaryEmbedding, mla_softmax_scale, rope_inv_freq, rope_parameters

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 64}


def tiny_config(**overrides):
    from transformers import DeepseekV3Config

    cfg = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
               kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
               max_position_embeddings=2560, rope_parameters=dict(YARN), attention_bias=False)
    cfg.update(overrides)
    c = DeepseekV3Config(**cfg)
    c._attn_implementation = "eager"
    return c


def reference(cfg, seed):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    torch.manual_seed(seed)
    attn = DeepseekV3Attention(cfg, 0).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    return attn, DeepseekV3RotaryEmbedding(cfg)


def ours(cfg, attn):
    params = rope_parameters(cfg.to_dict())
    m = MLAttention(
        cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
        cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank, bias=cfg.attention_bias,
        scale=mla_softmax_scale(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, params),
        rope="interleaved" if cfg.rope_interleave else "half",
    )
    m.load_state_dict(attn.state_dict(), strict=True)
    inv_freq, factor = rope_inv_freq(params, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
    return m.eval(), ScaledRotaryEmbedding(inv_freq, factor)


@pytest.mark.parametrize("variant", [
    {}, {"q_lora_rank": None}, {"rope_interleave": False}, {"attention_bias": True},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
])
def test_mla_matches_deepseek_v3_attention(variant):
    cfg = tiny_config(**variant)
    attn, rotary = reference(cfg, seed=0)
    m, our_rotary = ours(cfg, attn)
    t = 37
    x = torch.randn(1, t, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = attn(x, rotary(x, pos), mask)[0][0]
    for chunk in (t, 8, 1):
        kv = KVCache(1, capacity=4)
        got = []
        with torch.inference_mode():
            for s in range(0, t, chunk):
                cos, sin = our_rotary(torch.arange(s, min(t, s + chunk)), torch.float32)
                got.append(m(x[0, s : s + chunk], cos, sin, kv, 0, s))
        got = torch.cat(got)
        rel = (got - want).abs().max() / want.abs().max()
        assert rel < 1e-5, f"{variant} chunk {chunk}: {rel:.2e}"
        latent, k_rot = kv.layers[0]
        assert latent.shape[-1] == cfg.kv_lora_rank and k_rot.shape[-1] == cfg.qk_rope_head_dim
    # the cache holds the latent and the rope key only, per token
    assert kv.nbytes == latent.shape[1] * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert m.cache_bytes_per_token(2) == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2


@pytest.mark.parametrize("params", [
    YARN,
    dict(YARN, factor=32.0, beta_fast=1.0, beta_slow=1.0, rope_theta=50000.0),  # Kimi K2's
    dict(YARN, mscale=0.707, mscale_all_dim=0.707),  # DeepSeek V2's
    dict(YARN, mscale=None, mscale_all_dim=None),
    dict(YARN, truncate=False),
])
def test_yarn_inverse_frequencies_and_softmax_scale(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    cfg = tiny_config(rope_parameters={k: v for k, v in params.items() if v is not None})
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    ours_params = rope_parameters(cfg.to_dict())
    got_freq, got_factor = rope_inv_freq(ours_params, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
    assert torch.equal(got_freq, want_freq)
    assert got_factor == pytest.approx(want_factor, rel=1e-12)
    assert mla_softmax_scale(20, ours_params) == pytest.approx(yarn_apply_mscale(cfg.rope_parameters, 20**-0.5))
    if params.get("mscale_all_dim") == 1.0:  # DeepSeek-V3's factor-40 yarn raises the softmax scale by mscale^2
        m = 0.1 * math.log(params["factor"]) + 1
        assert mla_softmax_scale(20, ours_params) == pytest.approx(20**-0.5 * m * m)


def test_rope_parameters_reads_the_published_form():
    real = {"rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "mscale_all_dim": 1.0,
                                                  "original_max_position_embeddings": 4096}}
    p = rope_parameters(real)
    assert p["rope_type"] == "yarn" and p["rope_theta"] == 10000.0 and p["factor"] == 40
    assert rope_parameters({"rope_theta": 5.0})["rope_type"] == "default"
