"""compressed-tensors checkpoints: Laguna's block-FP8 scheme (with its Hadamard transform_config) and Kimi K3's
MXFP4 experts, each compressed here by the compressed-tensors library from a tiny random model, then read by
moestream and compared with the model holding the library's decompressed weights."""

import copy
import json
from pathlib import Path

import pytest
import torch

from moestream.checkpoint import Checkpoint
from moestream.engine import load
from moestream.inspect import inspect
from moestream.layout import discover_experts
from moestream.quant import QuantError

from . import ct_helpers as ct
from . import family_helpers as fh

pytest.importorskip("compressed_tensors")

CONFIGS = Path(__file__).parent / "configs"  # copies of the published config.json files


def published(name: str) -> dict:
    """The ``quantization_config`` block of a published config, as it is."""
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    return cfg.get("quantization_config") or cfg["text_config"]["quantization_config"]


@pytest.fixture(scope="module")
def laguna(tmp_path_factory):
    """Tiny Laguna (hidden 256: two 128x128 blocks and two Hadamard blocks) in Laguna-XS.2-FP8's scheme."""
    from transformers import LagunaConfig, LagunaForCausalLM

    from .test_family_laguna import TINY

    base = tmp_path_factory.mktemp("ct-laguna")
    cfg = dict(TINY, hidden_size=256, intermediate_size=96, moe_intermediate_size=64,
               shared_expert_intermediate_size=48)
    fh.save_reference(LagunaForCausalLM, LagunaConfig(**cfg), base / "float", seed=1)
    n = ct.compress(base / "float", base / "fp8", base / "ref", published("Laguna-XS.2-FP8"), linear_router=True)
    assert n == 3 * 8 * 3 + 3 * 3 + 3  # routed experts, shared experts, the dense layer's MLP
    ref = LagunaForCausalLM.from_pretrained(base / "ref", dtype=torch.float32).eval()
    return base / "fp8", ref


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """Tiny Kimi-Linear in Kimi K3's MXFP4 scheme (routed experts quantized, the ignore list float)."""
    from transformers import KimiLinearForCausalLM

    from .test_family_kimi import make_kimi_linear

    base = tmp_path_factory.mktemp("ct-kimi")
    make_kimi_linear(base / "float")
    n = ct.compress(base / "float", base / "mxfp4", base / "ref", published("Kimi-K3"))
    # the routed experts, and the dense layer's MLP: Kimi-Linear stores it as block_sparse_moe.{gate,up,down}_proj,
    # which K3's ignore pattern (mlp.*_proj) does not name, so it is a resident MXFP4 linear here
    assert n == 3 * 8 * 3 + 3
    ref = KimiLinearForCausalLM.from_pretrained(base / "ref", dtype=torch.float32).eval()
    return base / "mxfp4", ref


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """Tiny Kimi K3 (published names under language_model., latent MoE, SiTU experts) in its own MXFP4 scheme.

    No transformers class exists for K3: the reference is moestream's float path (checked against a
    straightforward implementation in test_family_kimi.py) on the decompressed weights.
    """
    from safetensors.torch import save_file

    from moestream.models.kimi_linear import synth_tensors

    from .test_family_kimi import k3_config

    base = tmp_path_factory.mktemp("ct-k3")
    cfg = k3_config(hidden_size=64, routed_expert_hidden_size=32, moe_intermediate_size=32, num_hidden_layers=3,
                    linear_attn_config={"full_attn_layers": [2], "kda_layers": [1, 3], "head_dim": 8, "num_heads": 3,
                                        "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                                        "use_full_rank_gate": True})
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for t in synth_tensors(cfg):
        x = torch.randn(t.shape, generator=g)
        if t.init == "norm":
            x = 1.0 + 0.2 * x
        elif t.name.endswith("A_log"):
            x = 0.5 * x
        elif not t.name.endswith(("e_score_correction_bias", "dt_bias")) and t.init != "embed":
            x = x / t.shape[-1] ** 0.5 * (0.25 if t.init == "out" else 0.5)
        tensors[t.name] = x.contiguous()
    (base / "float").mkdir()
    save_file(tensors, str(base / "float" / "model.safetensors"))
    (base / "float" / "config.json").write_text(json.dumps(cfg))
    ct.compress(base / "float", base / "mxfp4", base / "ref", published("Kimi-K3"), text_config=True)
    return base / "mxfp4", base / "ref"


def test_k3_mxfp4_matches_decompressed_reference(k3):
    path, ref = k3
    with Checkpoint(path) as c:
        names = c.tensors
        assert names["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"].shape == (32, 16)
        # the latent projections and the attention-residual queries are Linear and not ignored: MXFP4 too
        for packed in ("layers.1.block_sparse_moe.routed_expert_down_proj", "layers.1.mlp_res_proj",
                       "output_attn_res_proj"):
            assert names[f"language_model.model.{packed}.weight_packed"].dtype == "U8", packed
        for kept in ("language_model.model.layers.0.mlp.gate_proj.weight", "language_model.lm_head.weight",
                     "language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj.weight",
                     "language_model.model.layers.1.block_sparse_moe.gate.weight"):
            assert names[kept].dtype == "F32", kept  # the ignore list (and the router, no Linear) stay float
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(2))
    outs = []
    for p in (ref, path):
        engine = load(p, cache_budget_gb="0", tokenizer=False, learn_experts=False)
        try:
            kv = engine.model.new_kv_cache()
            with torch.inference_mode():
                outs.append(torch.cat([engine.model(ids[s : s + 8], s, kv, all_logits=True) for s in (0, 8, 16)]))
        finally:
            engine.close()
    want, got = outs
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    r = inspect(str(path))
    assert r.top_k == 3 and r.bytes_per_expert == 3 * (32 * 32 // 2 + 32 * 32 // 32)  # K3's num_experts_per_token


def test_laguna_fp8_stored_form(laguna, capsys):
    path = laguna[0]
    with Checkpoint(path) as c:
        lay = discover_experts(c.tensors)
        dtypes = {p.role: (p.dtype, p.shape) for p in lay.layers[1].experts[0]}
    assert dtypes["gate"] == ("F8_E4M3", (64, 256)) and dtypes["gate.weight_scale"] == ("F32", (1, 2))
    assert dtypes["down"] == ("F8_E4M3", (256, 64)) and dtypes["down.weight_scale"] == ("F32", (2, 1))
    engine = load(path, cache_budget_gb="0", tokenizer=False)
    try:
        from moestream.quant.resident import QuantLinear

        mods = dict(engine.model.named_modules())
        assert isinstance(mods["model.layers.0.mlp.down_proj"], QuantLinear)
        assert isinstance(mods["model.layers.2.mlp.shared_expert.up_proj"], QuantLinear)
        for ignored in ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.g_proj", "lm_head"):
            assert isinstance(mods[ignored], torch.nn.Linear), ignored
        assert engine.store.expert_nbytes((1, 0)) < 3 * 64 * 256 + 512  # fp8 bytes as stored, not float32
    finally:
        engine.close()
    err = capsys.readouterr().err
    assert "transform R1 (hadamard (blocks of 128), weight_output) on re:.*embed_tokens$" in err
    assert "folded into the weights" in err and "online" not in err


def test_laguna_fp8_matches_decompressed_reference(laguna):
    fh.assert_logits_match(*laguna)


def assert_streaming_exact(path: Path, n: int = 23, chunk: int = 7, steps: int = 4):
    """Prefill (in chunks) and ``steps`` sampled decode steps at budget 0 are torch.equal to budget ``all``."""
    from moestream.generation import SamplingParams, generate

    prompt = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(11)).tolist()
    runs = []
    for budget in ("all", "0"):
        engine = load(path, cache_budget_gb=budget, workers=3, tokenizer=False, learn_experts=False)
        try:
            kv = engine.model.new_kv_cache()
            with torch.inference_mode():
                pre = torch.cat([engine.model(torch.tensor(prompt[s : s + chunk]), s, kv, all_logits=True)
                                 for s in range(0, n, chunk)])
            out = [s.logits for s in generate(engine, prompt, steps, SamplingParams(temperature=1.0, seed=4),
                                              stop_at_eos=False, keep_logits=True, prefill_chunk=chunk)]
            runs.append((pre, out, engine.cache.stats.misses))
        finally:
            engine.close()
    (ref, ref_steps, ref_misses), (got, got_steps, misses) = runs
    assert ref_misses == 0 and misses > 0
    assert torch.equal(got, ref) and len(got_steps) == len(ref_steps) == steps
    assert all(torch.equal(a, b) for a, b in zip(got_steps, ref_steps))


def test_laguna_fp8_streaming_bit_identical(laguna):
    assert_streaming_exact(laguna[0], n=16, chunk=6, steps=3)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_fp8_per_channel_and_per_tensor(tmp_path, strategy):
    """Laguna's FP8 scheme with one scale per output row (``weight_scale`` [out, 1]) or one per weight ([1]),
    compressed by the library: logits match its decompressed weights, and streaming is bit-identical."""
    from transformers import LagunaConfig, LagunaForCausalLM

    from .test_family_laguna import TINY

    cfg = dict(TINY, hidden_size=256, intermediate_size=96, moe_intermediate_size=64,
               shared_expert_intermediate_size=48)
    fh.save_reference(LagunaForCausalLM, LagunaConfig(**cfg), tmp_path / "float", seed=2)
    qc = copy.deepcopy(published("Laguna-XS.2-FP8"))
    qc.pop("transform_config", None)
    qc["config_groups"]["group_0"]["weights"].update(strategy=strategy, block_structure=None)
    ct.compress(tmp_path / "float", tmp_path / "fp8", tmp_path / "ref", qc, linear_router=True)
    with Checkpoint(tmp_path / "fp8") as c:
        scale = c.tensors["model.layers.1.mlp.experts.0.gate_proj.weight_scale"]
        assert tuple(scale.shape) == ((64, 1) if strategy == "channel" else (1,))
    ref = LagunaForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    fh.assert_logits_match(tmp_path / "fp8", ref)
    assert_streaming_exact(tmp_path / "fp8", n=10, chunk=4, steps=2)


def test_kimi_mxfp4_matches_decompressed_reference(kimi):
    with Checkpoint(kimi[0]) as c:
        assert c.tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight_packed"].dtype == "U8"
        assert c.tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"].shape == (64, 1)
        assert c.tensors["model.layers.1.block_sparse_moe.gate.weight"].dtype == "F32"
    fh.assert_logits_match(*kimi, n=40, chunk=16)


def test_kimi_mxfp4_streaming_bit_identical(kimi):
    assert_streaming_exact(kimi[0], n=10, chunk=4, steps=2)


def test_inspect_reports_format_modules_and_bytes(laguna, kimi):
    r = inspect(str(laguna[0]))
    assert r.quant_format == "compressed-tensors float-quantized (fp8 e4m3, blocks 128x128)"
    assert "model.layers.*.mlp.experts.*.gate_proj" in r.quantized_modules
    assert "model.layers.*.mlp.shared_expert.down_proj" in r.quantized_modules
    assert not any("self_attn" in m or "lm_head" in m for m in r.quantized_modules)
    # per expert: three fp8 weights and their float32 block scales (1x2, 1x2, 2x1)
    assert r.bytes_per_expert == 3 * 64 * 256 + 3 * 2 * 4
    k = inspect(str(kimi[0]))
    assert k.quant_format == "compressed-tensors mxfp4-pack-quantized (mxfp4)"
    assert k.quantized_modules == ["model.layers.*.block_sparse_moe.down_proj",
                                   "model.layers.*.block_sparse_moe.experts.*.w1",
                                   "model.layers.*.block_sparse_moe.experts.*.w2",
                                   "model.layers.*.block_sparse_moe.experts.*.w3",
                                   "model.layers.*.block_sparse_moe.gate_proj",
                                   "model.layers.*.block_sparse_moe.up_proj"]
    assert k.bytes_per_expert == 3 * (32 * 64 // 2 + 32 * 64 // 32)  # packed nibbles + one uint8 scale per 32
    assert "quantization:       compressed-tensors mxfp4" in k.to_text()


def _with_config(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    (dst / "config.json").unlink()
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("edit, words", [
    (lambda q: q["config_groups"]["group_0"].update(format="pack-quantized"), "'pack-quantized' is not supported"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=32, block_structure=None),
     "strategy 'group'"),
    (lambda q: q["config_groups"]["group_0"].update(
        format="nvfp4-pack-quantized", weights=dict(published("Kimi-K3")["config_groups"]["group_0"]["weights"],
                                                    group_size=16)), "'nvfp4-pack-quantized' is not supported"),
    (lambda q: q["transform_config"]["config_groups"]["R1"]["apply"][1].update(location="input"),
     "online transform"),
])
def test_unsupported_scheme_is_refused_by_name(laguna, tmp_path, edit, words):
    path = _with_config(laguna[0], tmp_path / "m", edit)
    with pytest.raises(QuantError) as e:
        load(path, cache_budget_gb="0", tokenizer=False)
    assert words in str(e.value) and "config.json" in str(e.value)


def test_quantized_tensor_in_ignore_list_is_refused(laguna, tmp_path):
    path = _with_config(laguna[0], tmp_path / "m", lambda q: q["ignore"].append("re:.*shared_expert.*"))
    with pytest.raises(QuantError, match="shared_expert.* is stored quantized but quantization_config leaves"):
        load(path, cache_budget_gb="0", tokenizer=False)


def test_published_schemes_are_the_ones_compressed():
    """The test checkpoints carry the published blocks unchanged (a guard against editing them above)."""
    q = copy.deepcopy(published("Laguna-XS.2-FP8"))
    assert q["config_groups"]["group_0"]["weights"]["block_structure"] == [128, 128]
    assert q["transform_config"]["config_groups"]["R1"]["type"] == "hadamard"
    k = published("Kimi-K3")
    assert k["format"] == "mxfp4-pack-quantized" and k["config_groups"]["group_0"]["weights"]["group_size"] == 32


@pytest.mark.parametrize("name, quantized, kept", [
    ("Laguna-XS.2-FP8", ["model.layers.0.mlp.gate_proj", "model.layers.5.mlp.experts.255.down_proj",
                         "model.layers.5.mlp.shared_expert.up_proj"],
     ["lm_head", "model.layers.5.self_attn.g_proj", "model.layers.5.mlp.gate"]),
    ("Laguna-S-2.1-FP8", ["model.layers.1.mlp.gate_proj", "model.layers.7.mlp.experts.3.up_proj"],
     ["model.layers.0.mlp.gate_proj", "model.layers.7.mlp.shared_expert.down_proj", "model.layers.7.mlp.gate",
      "model.layers.7.self_attn.o_proj"]),
    ("Kimi-K3", ["language_model.model.layers.3.block_sparse_moe.experts.895.w2",
                 "language_model.model.layers.3.block_sparse_moe.routed_expert_up_proj"],
     ["language_model.model.layers.0.mlp.down_proj", "language_model.model.layers.3.self_attn.q_a_proj",
      "language_model.model.layers.3.block_sparse_moe.shared_experts.gate_proj", "language_model.lm_head",
      "vision_tower.encoder.blocks.0.wqkv"]),
])
def test_published_ignore_lists(name, quantized, kept):
    """Which modules each published config quantizes, by the library's matching of targets and ignore."""
    from moestream.quant.compressed import CompressedConfig

    q = CompressedConfig.from_quantization_config(published(name))
    assert all(q.group_for(m) is not None for m in quantized)
    assert all(q.group_for(m) is None for m in kept)
    assert q.scheme(quantized[0]).tag == ("mxfp4" if name == "Kimi-K3" else "fp8 e4m3, blocks 128x128")
