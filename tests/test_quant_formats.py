"""Published quantized formats, read as they are: each tiny checkpoint (written by the
independent writers in quant_helpers from a float transformers model) matches transformers
run on its dequantized weights, and streams bit-identically at any budget."""

import pytest
import torch

from moestream.engine import load

from .helpers import make_qwen3_moe
from .quant_helpers import assert_refused, reference_model, write_fp8, write_mlx, write_mxfp4

SHAPE = dict(moe_intermediate_size=64, hidden_size=64, num_experts=8, num_experts_per_tok=2)


def logits(path, budget, ids, dtype="auto"):
    engine = load(path, cache_budget_gb=budget, tokenizer=False, workers=2, dtype=dtype)
    try:
        with torch.inference_mode():
            return engine.model(ids, 0, engine.model.new_kv_cache(), all_logits=True), engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("float")
    make_qwen3_moe(path, seed=7, **SHAPE)
    return path


WRITERS = {
    "mlx-4bit-g32": lambda s, d: write_mlx(s, d, 4, 32, 8),
    "mlx-3bit-g64": lambda s, d: write_mlx(s, d, 3, 64, 8),
    "mlx-2bit-g32-down6": lambda s, d: write_mlx(s, d, 2, 32, 8, down_bits=6),
    "mlx-5bit-g32-float-attn": lambda s, d: write_mlx(s, d, 5, 32, 8, quantize_attention=False),
    "mlx-8bit-g64": lambda s, d: write_mlx(s, d, 8, 64, 8),
    "fp8-blocks": lambda s, d: write_fp8(s, d, block=32),
    "mxfp4": lambda s, d: write_mxfp4(s, d, 8),
}


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_published_format_matches_dequantized_reference(src, tmp_path, fmt):
    ref_tensors = WRITERS[fmt](src, tmp_path / fmt)
    ref = reference_model(src, ref_tensors)
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    got, engine = logits(tmp_path / fmt, "all", ids)
    assert engine.dtype == torch.float32
    rel = (got - want).abs().max() / want.abs().max()
    assert rel < 1e-5, f"{fmt}: max relative error {rel:.2e}"
    tiny, _ = logits(tmp_path / fmt, "0", ids)
    assert torch.equal(tiny, got), f"{fmt}: streaming at budget 0 differs from budget all"


def _rewrite(path, drop=(), **config):
    import json

    from safetensors.torch import save_file

    from .helpers import read_all

    tensors = {k: v for k, v in read_all(path).items() if k not in drop}
    save_file(tensors, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(config)
    (path / "config.json").write_text(json.dumps(cfg))


def test_wrong_group_size_is_refused_naming_the_tensor(src, tmp_path):
    write_mlx(src, tmp_path, 4, 32, 8)
    _rewrite(tmp_path, quantization={"group_size": 64, "bits": 4})
    assert_refused(tmp_path, "model.layers.0.mlp.switch_mlp.gate_proj.weight", "group_size")


def test_wrong_bits_is_refused_naming_the_tensor(src, tmp_path):
    write_mlx(src, tmp_path, 4, 32, 8)
    _rewrite(tmp_path, quantization={"group_size": 32, "bits": 2})
    assert_refused(tmp_path, "switch_mlp.gate_proj.weight")


def test_missing_scales_are_refused_naming_the_tensor(src, tmp_path):
    write_mlx(src, tmp_path, 4, 32, 8)
    _rewrite(tmp_path, drop={"model.layers.1.mlp.switch_mlp.up_proj.scales"})
    assert_refused(tmp_path, "model.layers.1.mlp.switch_mlp.up_proj.weight", "scales is missing")


def test_missing_resident_scales_and_undeclared_quantization_areassert_refused(src, tmp_path):
    write_mlx(src, tmp_path / "a", 4, 32, 8)
    _rewrite(tmp_path / "a", drop={"model.layers.0.self_attn.k_proj.biases"})
    assert_refused(tmp_path / "a", "model.layers.0.self_attn.k_proj.weight", "biases is missing")
    write_mlx(src, tmp_path / "b", 4, 32, 8)
    _rewrite(tmp_path / "b", quantization=None, quantization_config=None)
    assert_refused(tmp_path / "b", "switch_mlp.gate_proj.weight", "declares no mlx affine quantization")


def test_fp8_missing_scale_inv_isassert_refused(src, tmp_path):
    write_fp8(src, tmp_path, block=32)
    _rewrite(tmp_path, drop={"model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"})
    assert_refused(tmp_path, "model.layers.2.mlp.experts.3.down_proj.weight")


def test_mxfp4_scales_of_wrong_shape_areassert_refused(src, tmp_path):
    from safetensors.torch import save_file

    from .helpers import read_all

    write_mxfp4(src, tmp_path, 8)
    t = read_all(tmp_path)
    name = "model.layers.0.mlp.experts.down_proj_scales"
    t[name] = t[name][:, :, :1].contiguous()
    save_file(t, str(tmp_path / "model.safetensors"))
    assert_refused(tmp_path, "model.layers.0.mlp.experts.down_proj_blocks")


def test_cli_prints_one_line(src, tmp_path, capsys):
    from moestream.cli import main

    write_mlx(src, tmp_path, 4, 32, 8)
    _rewrite(tmp_path, quantization={"group_size": 64, "bits": 4})
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--cache-budget-gb", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "switch_mlp.gate_proj.weight" in err[0]


@pytest.mark.parametrize("qc", [{"quant_method": "fp8", "weight_block_size": [128, 128]},
                                {"quant_method": "compressed-tensors", "config_groups": {}}])
def test_float_tensors_under_a_quantized_config_load_as_float(src, tmp_path, qc):
    """`moestream synth` keeps a published config's quantization_config but writes float tensors."""
    import shutil

    shutil.copytree(src, tmp_path / "c")
    _rewrite(tmp_path / "c", quantization_config=qc)
    ids = torch.arange(4, 20)
    got, engine = logits(tmp_path / "c", "0", ids)
    want, _ = logits(src, "0", ids)
    assert torch.equal(got, want)
