"""``moestream synth`` of the real DeepSeek-V3 / Kimi K2 configs (and a GLM-4.5-shaped one), scaled down,
gives checkpoints that transformers reads as the same model and ``moestream generate`` runs."""

import json

import pytest
import torch

from moestream.engine import load
from moestream.generation import SamplingParams, generate
from moestream.synth import synth

from .shared_data import CONFIGS

SMALL_MLA = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                 num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
                 v_head_dim=10)
# GLM-4.5-Air's architecture fields (no GLM config is stored under /work/shared/models/configs)
GLM45 = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "head_dim": 128,
    "first_k_dense_replace": 1, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "max_position_embeddings": 131072, "n_group": 1, "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 96, "num_key_value_heads": 8, "num_experts_per_tok": 8,
    "num_hidden_layers": 46, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5,
    "rope_theta": 1000000, "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "use_qk_norm": False,
    "vocab_size": 151552, "eos_token_id": [151329, 151336, 151338],
}


def scaled(name):
    if name == "glm4_moe":
        return dict(GLM45, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, head_dim=16,
                    num_attention_heads=4, num_key_value_heads=2, n_routed_experts=16, vocab_size=2000)
    path = CONFIGS / name
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    cfg = json.loads(path.read_text())
    # the real field layout (rope_scaling yarn, quantization_config, MTP layers), small widths, 16 experts
    small = dict(SMALL_MLA, index_n_heads=4, index_head_dim=16, index_topk=16) if "index_topk" in cfg else SMALL_MLA
    return dict(cfg, **small, n_routed_experts=16, num_experts_per_tok=4, vocab_size=2000)


@pytest.mark.parametrize("name", ["DeepSeek-V3.json", "Kimi-K2-Instruct.json", "DeepSeek-V3.2.json", "glm4_moe"])
def test_synth_is_the_transformers_model(tmp_path, name):
    import transformers

    cfg = scaled(name)
    out = synth(cfg, tmp_path / "m", layers=4, dtype="fp32")
    meta = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in meta and meta["num_hidden_layers"] == 4
    assert meta.get("num_nextn_predict_layers", 0) == 0
    cls = {"glm4_moe": transformers.Glm4MoeForCausalLM, "DeepSeek-V3.2.json": transformers.DeepseekV32ForCausalLM}.get(
        name, transformers.DeepseekV3ForCausalLM)
    if meta["model_type"] == "kimi_k2":  # transformers knows Kimi K2 as the DeepSeek-V3 architecture
        (out / "config.json").write_text(json.dumps(dict(meta, model_type="deepseek_v3")))
    ref = cls.from_pretrained(out).eval()  # reads the published rope_scaling form itself
    (out / "config.json").write_text(json.dumps(meta))
    with torch.no_grad():
        for n, b in ref.named_buffers():  # synth writes zeros; a nonzero bias must be read the same way
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    tensors = {n: b for n, b in ref.named_buffers() if n.endswith("e_score_correction_bias")}
    from safetensors.torch import load_file, save_file

    st = load_file(out / "model.safetensors")
    save_file({**st, **tensors}, out / "model.safetensors")
    ids = torch.arange(1, 40)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    engine = load(out, cache_budget_gb=0, tokenizer=False)
    try:
        dense = cfg["first_k_dense_replace"]
        assert sorted(engine.layout.layers) == list(range(dense, 4))
        with torch.inference_mode():
            got = engine.model(ids, 0, engine.model.new_kv_cache(), all_logits=True)
    finally:
        engine.close()
    assert ((got - want).abs().max() / want.abs().max()) < 1e-5


@pytest.mark.parametrize("name", ["DeepSeek-V3.json", "Kimi-K2-Instruct.json"])
def test_synth_then_generate_cli(tmp_path, name, capsys):

    from moestream.cli import main

    real = json.loads((CONFIGS / name).read_text()) if (CONFIGS / name).is_file() else {}
    cfg = dict(scaled(name), vocab_size=real.get("vocab_size", 2000))  # the real vocabulary: the prompt's ids fit
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    assert main(["synth", "--config", str(cfg_path), "--out", str(tmp_path / "m"), "--layers", "4"]) == 0
    args = ["generate", "--model", str(tmp_path / "m"), "--temp", "1", "--seed", "0", "--max-tokens", "6",
            "--cache-budget-gb", "0", "--stats-json", str(tmp_path / "s.json"), "--prompt", "Hi there"]
    if cfg["vocab_size"] < 151643:
        # DeepSeek-V3's vocabulary is smaller than the bundled Qwen3 tokenizer's: its chat template's special
        # tokens give a clear error, not a crash
        assert main(args) == 2
        assert f"outside the model's vocab_size {cfg['vocab_size']}" in capsys.readouterr().err
        args.append("--no-chat-template")
    assert main(args) == 0
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["generated_tokens"] == 6 and stats["experts_read"] > 0
    assert set(stats["distinct_experts_per_layer"]) == {str(i) for i in range(cfg["first_k_dense_replace"], 4)}


def test_synth_glm_generates(tmp_path):
    out = synth(scaled("glm4_moe"), tmp_path / "m", layers=3)
    engine = load(out, cache_budget_gb=0, tokenizer=False)
    try:
        steps = list(generate(engine, [5, 6, 7], 5, SamplingParams(temperature=1.0, seed=0), stop_at_eos=False))
    finally:
        engine.close()
    assert len(steps) == 5
