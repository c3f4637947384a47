"""The hybrid Qwen families (Qwen3-Next, Qwen3.5/3.6 MoE) against transformers, streamed
exactly, and synthesized from their real configs scaled down."""

import json
from pathlib import Path

import pytest
import torch

from moestream.checkpoint import Checkpoint
from moestream.engine import load
from moestream.generation import SamplingParams, generate
from moestream.layout import discover_experts

from . import family_helpers as fh
from .helpers import QWEN_HYBRID_TINY as TINY  # the shapes both tiny models (Qwen3-Next, Qwen3.5) share
from .helpers import ends, one_thread, read_all, redraw_, to_layout, write_checkpoint  # noqa: F401 (autouse)
from .shared_data import CONFIGS

PROMPT = 80  # longer than the DeltaNet chunk (64)


def _randomize(model, seed):
    """Norms, routers, shared-expert gates and DeltaNet time steps away from their init, so nothing hides."""
    torch.manual_seed(seed)
    redraw_(model.named_parameters(),
            (ends("linear_attn.norm.weight"), 1.0, 0.2),  # the gated norm scales by weight
            (lambda name, p: "norm" in name and "visual" not in name, 0.0, 0.2),  # zero-centred: 1 + weight
            (ends("mlp.gate.weight", "shared_expert_gate.weight"), 0.0, 0.5), (ends("dt_bias"), 1.0, 0.3))


def make_qwen3_next(path: Path, seed: int = 0):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(**TINY, intermediate_size=96, norm_topk_prob=True, mlp_only_layers=[2],
                          rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))
    model = Qwen3NextForCausalLM(cfg).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    return model


def make_qwen3_5_moe(path: Path, seed: int = 0):
    """The multimodal class, whose saved names are the published checkpoints' (``model.language_model.*``),
    with a one-block vision tower; plus a fake MTP layer in the checkpoint, as the published ones carry."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[1, 1, 0],
                mrope_interleaved=True)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    cfg = Qwen3_5MoeConfig(text_config=dict(TINY, rope_parameters=rope), vision_config=vision)
    model = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    _randomize(model, seed)
    model.save_pretrained(path / "src")
    tensors = read_all(path / "src")
    for e in range(8):
        for proj, shape in (("gate", (32, 64)), ("up", (32, 64)), ("down", (64, 32))):
            tensors[f"mtp.layers.0.mlp.experts.{e}.{proj}_proj.weight"] = torch.randn(shape)
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    write_checkpoint(path / "src", path / "ckpt", tensors)
    return model


def make_qwen3_5_moe_text(path: Path, seed: int = 0):
    """The text model alone, as a fine-tune or text-only export saves it: ``Qwen3_5MoeForCausalLM.save_pretrained``
    writes ``model_type: qwen3_5_moe_text``, the text config at the top level and the decoder at ``model.layers``."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[1, 1, 0],
                mrope_interleaved=True)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TINY, rope_parameters=rope)).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe_text" and "text_config" not in cfg
    return model


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"])
def family(request, tmp_path_factory):
    """(family name, transformers reference model, checkpoint folder)."""
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_next":
        return request.param, make_qwen3_next(d, seed=1), d
    if request.param == "qwen3_5_moe_text":
        return request.param, make_qwen3_5_moe_text(d, seed=3), d
    return request.param, make_qwen3_5_moe(d, seed=2), d / "ckpt"


def test_logits_match_transformers_whole_and_chunked(family, capsys):
    name, ref, path = family
    ids = torch.randint(0, 300, (PROMPT,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0]
    engine = load(path, cache_budget_gb=0.0001, tokenizer=False, workers=2)
    try:
        err = capsys.readouterr().err
        if name == "qwen3_5_moe":
            assert err.count("not loaded") == 1
            assert "the vision tower (model.visual.*" in err
            assert "the multi-token-prediction layer (mtp.*, 25 tensors)" in err
            assert engine.unused_tensors == []  # every skipped tensor is named by the note
            assert all(lay.block.startswith("model.language_model.layers.") for lay in engine.layout.layers.values())
        if name == "qwen3_5_moe_text":
            assert engine.unused_tensors == [] and "not loaded" not in err
            assert all(lay.block.startswith("model.layers.") for lay in engine.layout.layers.values())
        assert sorted(engine.layout.layers) == ([0, 1, 3] if name == "qwen3_next" else [0, 1, 2, 3])  # 2 is dense
        assert not any("shared_expert" in t for t in engine.layout.expert_tensors)  # the shared expert is resident
        for chunk in (PROMPT, 30, 1):  # 1: the recurrent (decode) form after the first token
            kv = engine.model.new_kv_cache(16)  # small: the KV cache grows
            with torch.inference_mode():
                got = torch.cat([engine.model(ids[s : s + chunk], s, kv, all_logits=True)
                                 for s in range(0, PROMPT, chunk)])
            rel = (got - want).abs().max() / want.abs().max()
            assert rel < 1e-5, f"{name} chunk {chunk}: max relative error {rel:.2e}"
        with pytest.raises(ValueError, match="cannot rewind"):
            engine.model(ids[:4], 10, engine.model.new_kv_cache())
    finally:
        engine.close()


def test_greedy_tokens_match_transformers(family):
    _, ref, path = family
    fh.assert_greedy_matches(path, ref, prompt_len=70, prefill_chunk=48)


def test_streaming_at_a_tiny_budget_is_bit_identical(family, tmp_path):
    """Budget all (per-expert tensors, as saved) against a budget of 1.5 experts, also with the experts fused."""
    name, _, path = family
    with Checkpoint(path) as c:
        one = discover_experts(c.tensors).expert_nbytes(0, 0)
    fused = write_checkpoint(path, tmp_path / "fused", to_layout(read_all(path), "fused", 8))
    prompt = torch.randint(0, 300, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()
    runs = []
    for where, budget in ((path, "all"), (path, str(one * 1.5 / 1e9)), (fused, str(one * 1.5 / 1e9))):
        engine = load(where, cache_budget_gb=budget, tokenizer=False, workers=3)
        try:
            steps = list(generate(engine, prompt, 12, SamplingParams(temperature=1.0, seed=7), stop_at_eos=False,
                                  keep_logits=True, prefill_chunk=40))
            runs.append((steps, engine.cache.stats.misses))
        finally:
            engine.close()
    (ref, ref_misses), *streamed = runs
    assert ref_misses == 0
    for got, misses in streamed:
        assert misses > 0
        assert [s.token for s in got] == [s.token for s in ref]
        assert all(torch.equal(a.logits, b.logits) for a, b in zip(got, ref))


def _scaled_down(cfg: dict) -> dict:
    """A real config with its dims shrunk and its structure (layer types, heads ratios, routing) kept."""
    small = dict(hidden_size=32, head_dim=16, num_attention_heads=4, num_key_value_heads=2, linear_key_head_dim=8,
                 linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=16,
                 num_experts_per_tok=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                 intermediate_size=64)
    return {k: small.get(k, v) for k, v in cfg.items()}


@pytest.mark.parametrize("config", ["Qwen3-Next-80B-A3B.json", "Qwen3.5-35B-A3B.json"])
def test_synth_of_a_scaled_down_real_config_generates(tmp_path, config, capsys):
    from moestream.cli import main

    src = CONFIGS / config
    if not src.is_file():
        pytest.skip(f"{src} not present")
    cfg = json.loads(src.read_text())
    if "text_config" in cfg:
        cfg["text_config"] = _scaled_down(cfg["text_config"])
    else:
        cfg = _scaled_down(cfg)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    assert main(["synth", "--config", str(tmp_path / "c.json"), "--out", str(tmp_path / "m"), "--layers", "4"]) == 0
    with Checkpoint(tmp_path / "m") as c:
        layout = discover_experts(c.tensors)
        assert sorted(layout.layers) == [0, 1, 2, 3] and layout.layers[0].num_experts == 16
        assert not any("shared_expert" in t for t in layout.expert_tensors)
    out = []
    for budget in ("0", "all"):
        args = ["generate", "--model", str(tmp_path / "m"), "--prompt", "Why is the sky blue?", "--max-tokens", "6",
                "--temp", "1", "--seed", "0", "--cache-budget-gb", budget, "--stats-json", str(tmp_path / "s.json")]
        assert main(args) == 0
        assert "checkpoint tensors are not used" not in capsys.readouterr().err
        stats = json.loads((tmp_path / "s.json").read_text())
        assert stats["prompt_tokens"] > 10  # the prompt went through the chat template of a working tokenizer
        out.append(stats["generated_token_ids"])
    assert len(out[0]) == 6 and out[0] == out[1]
    engine = load(tmp_path / "m", cache_budget_gb=0, tokenizer=False)
    try:
        kinds = [layer.linear for layer in engine.model.decoder.layers]
    finally:
        engine.close()
    assert kinds == [True, True, True, False]  # one attention layer in four, as the real config says


@pytest.mark.parametrize("config", ["Qwen3-Next-80B-A3B.json", "Qwen3.5-35B-A3B.json", "Qwen3.5-122B-A10B.json",
                                    "Qwen3.5-397B-A17B.json", "Qwen3.6-35B-A3B.json"])
def test_real_configs_parse(config):
    from moestream.models import family_for

    src = CONFIGS / config
    if not src.is_file():
        pytest.skip(f"{src} not present")
    cfg = json.loads(src.read_text())
    a = family_for(cfg).ModelArgs.from_config(cfg)
    assert a.rotary_dim == 64 and a.head_dim == 256 and a.norm_topk_prob
    assert a.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert a.fused_projections == (cfg["model_type"] == "qwen3_next")
    assert all(a.is_moe_layer(i) for i in range(a.num_hidden_layers))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 9, 130])
def test_depthwise_causal_conv_is_conv1d(dtype, t):
    from moestream.models.hybrid import depthwise_causal_conv

    g = torch.Generator().manual_seed(t)
    window = torch.randn(96, 3 + t, generator=g).to(dtype)
    weight = (torch.randn(96, 4, generator=g) * 0.5).to(dtype)
    want = torch.nn.functional.conv1d(window[None], weight[:, None], groups=96)[0]
    got = depthwise_causal_conv(window, weight)
    if dtype == torch.float32:  # summed in order in float32 (PyTorch's conv1d sums otherwise): the float64 bound
        ref = torch.nn.functional.conv1d(window[None].double(), weight[:, None].double(), groups=96)[0]
        assert (got.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    else:
        assert torch.equal(got, want)
    # each output depends only on its window: the same bits computed one position at a time
    one = torch.cat([depthwise_causal_conv(window[:, i : i + 4], weight) for i in range(t)], dim=1)
    assert torch.equal(one, got)


def test_invariant_to_chunks_capacity_threads_and_batch(family):
    fh.assert_invariant(family[2])


def test_streaming_exact_wherever_the_pieces_lie(family, tmp_path):
    fh.assert_streaming_exact_at_offsets(family[2], tmp_path)
