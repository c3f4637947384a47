"""``CausalLM.top_k``: every family reads its experts per token from its own config, however the
config spells it, and the engine uses that value (the budget's read-ahead reserve, the
``--max-active-experts`` warning) instead of a guess."""

import json

import pytest
import torch

from moestream.budget import plan_cpu_budget
from moestream.models import family_for

from .shared_data import CONFIGS


def _hf(cls_name: str, **kw) -> dict:
    import transformers

    return getattr(transformers, cls_name)(**kw).to_dict()


TINY = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512)
# (config, the top-k as that config spells it), read here from the config itself
CASES = {
    "qwen3_moe": ("Qwen3-30B-A3B.json", lambda c: c["num_experts_per_tok"]),
    "qwen3_next": ("Qwen3-Next-80B-A3B.json", lambda c: c["num_experts_per_tok"]),
    "qwen3_5_moe": ("Qwen3.5-397B-A17B.json", lambda c: c["text_config"]["num_experts_per_tok"]),
    "deepseek_v3": ("DeepSeek-V3.json", lambda c: c["num_experts_per_tok"]),
    "deepseek_v32": ("DeepSeek-V3.2.json", lambda c: c["num_experts_per_tok"]),
    "kimi_k2": ("Kimi-K2-Instruct.json", lambda c: c["num_experts_per_tok"]),
    "kimi_k3": ("Kimi-K3.json", lambda c: c["text_config"]["num_experts_per_token"]),  # nested, another name
    "mixtral": ("Mixtral-8x7B-v0.1.json", lambda c: c["num_experts_per_tok"]),
    "gpt_oss": ("gpt-oss-20b.json", lambda c: c["num_experts_per_tok"]),
    "laguna": ("Laguna-S-2.1-FP8.json", lambda c: c["num_experts_per_tok"]),
    "hunyuan_v1_moe": (lambda: _hf("HunYuanMoEV1Config", **TINY, intermediate_size=32, num_experts=8, moe_topk=3),
                       lambda c: c["moe_topk"]),
    "olmoe": (lambda: _hf("OlmoeConfig", **TINY, intermediate_size=32, num_experts=8, num_experts_per_tok=3),
              lambda c: c["num_experts_per_tok"]),
    "minimax_m2": (lambda: _hf("MiniMaxM2Config", **TINY, intermediate_size=32, num_local_experts=8,
                               num_experts_per_tok=3), lambda c: c["num_experts_per_tok"]),
    "glm4_moe": (lambda: _hf("Glm4MoeConfig", **TINY, intermediate_size=64, moe_intermediate_size=32,
                             n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=1, n_group=1,
                             topk_group=1), lambda c: c["num_experts_per_tok"]),
}


def _model(cfg: dict):
    family = family_for(cfg)
    cut = family.synth_config(cfg, 2)
    with torch.device("meta"):
        return family.Model(family.ModelArgs.from_config(cut))


@pytest.mark.parametrize("family", sorted(CASES))
def test_top_k_is_the_configs_own(family):
    source, spelled = CASES[family]
    cfg = json.loads((CONFIGS / source).read_text()) if isinstance(source, str) else source()
    model = _model(cfg)
    want = spelled(cfg)
    assert isinstance(want, int) and model.top_k == want
    assert model.experts_per_layer == {b.layer: b.num_experts for b in model.moe_blocks()}


@pytest.mark.parametrize("family", ["hunyuan_v1_moe", "kimi_k3"])
def test_the_read_ahead_reserve_uses_the_models_top_k(family, monkeypatch):
    """The budget's read-ahead staging is ``prefetch_ahead x top_k`` experts: HunYuan's ``moe_topk`` and
    Kimi K3's nested ``num_experts_per_token`` (16), where a guess said 8."""
    source, spelled = CASES[family]
    cfg = json.loads((CONFIGS / source).read_text()) if isinstance(source, str) else source()
    model = _model(cfg)
    monkeypatch.setattr("moestream.memory.available_bytes", lambda: 10**15)
    one = 10**6
    plans = [plan_cpu_budget(model, 0, torch.bfloat16, 100 * one, one, 2, True, ahead, None) for ahead in (0, 2)]
    assert plans[1].reserve - plans[0].reserve == 2 * spelled(cfg) * one
