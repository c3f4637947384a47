"""``moestream convert``: quantized builds that reload, stay close to the float model, are
byte-for-byte reproducible, and keep every expert in one 4 KiB-aligned range."""

import json

import pytest
import torch

from moestream.checkpoint import Checkpoint
from moestream.cli import main
from moestream.engine import load
from moestream.generation import SamplingParams, generate
from moestream.layout import discover_experts
from moestream.quant.convert import ConvertSpec, convert

from .helpers import make_qwen3_moe, read_all
from .quant_helpers import mlx_dequantize

SHAPE = dict(moe_intermediate_size=64, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2)
# RMS of (quantized - float logits) over RMS of the float logits, on this tiny random model
# (measured on a 3-layer, 8-expert variant: 0.012-0.016 at 8 bits, 0.17-0.22 at 4, 0.41-0.43 at 3, 0.76-0.95 at 2).
RMS_BOUND = {8: 0.05, 4: 0.35, 3: 0.7, 2: 1.3}
SETTINGS = [(b, g) for b in (8, 4, 3, 2) for g in (32, 64)]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("float")
    ref = make_qwen3_moe(path, seed=4, **SHAPE)
    return path, ref


@pytest.fixture(scope="module")
def builds(src, tmp_path_factory):
    root = tmp_path_factory.mktemp("builds")
    return {(b, g): convert(src[0], root / f"e{b}g{g}", ConvertSpec(g, b, b, b, b)) for b, g in SETTINGS}


def logits(path, ids, budget="all"):
    engine = load(path, cache_budget_gb=budget, tokenizer=False, workers=2)
    try:
        with torch.inference_mode():
            return engine.model(ids, 0, engine.model.new_kv_cache(), all_logits=True)
    finally:
        engine.close()


@pytest.mark.parametrize("bits,group", SETTINGS)
def test_convert_reloads_close_to_float(src, builds, bits, group):
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = src[1](ids[None]).logits[0]
    got = logits(builds[bits, group], ids)
    rms = ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
    assert rms < RMS_BOUND[bits], f"{bits}-bit group {group}: logits RMS error {rms:.3f}"
    if (bits, group) == (3, 32):
        assert torch.equal(logits(builds[bits, group], ids, budget="0"), got)


@pytest.mark.parametrize("bits,group", [(3, 64), (8, 32)])
def test_converted_weights_are_nearest_grid_points(src, builds, bits, group):
    """Every expert weight, unpacked by an independent reader, is within half a step of the float one."""
    orig, out = read_all(src[0]), read_all(builds[bits, group])
    checked = 0
    for name, w in orig.items():
        if ".experts." not in name:
            continue
        mod = name[: -len(".weight")]
        deq = mlx_dequantize(out[name], out[mod + ".scales"], out[mod + ".biases"], bits)
        step = out[mod + ".scales"].float().repeat_interleave(group, -1)
        assert ((deq - w).abs() <= step / 2 + 1e-6).all(), name
        checked += 1
    assert checked == 2 * 4 * 3


def test_8bit_greedy_tokens_equal_float(src, builds):
    prompt = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = src[1].generate(prompt[None], max_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, 12:].tolist()
    engine = load(builds[8, 64], cache_budget_gb="0", tokenizer=False)
    try:
        got = [s.token for s in generate(engine, prompt.tolist(), 16, SamplingParams(), stop_at_eos=False)]
    finally:
        engine.close()
    assert got == want


def test_convert_is_reproducible_and_one_range_per_expert(src, builds, tmp_path):
    again = tmp_path / "again"
    assert main(["convert", "--model", str(src[0]), "--out", str(again), "--bits", "4", "--group-size", "32",
                 "--expert-down-bits", "4"]) == 0
    first = builds[4, 32]
    files = sorted(f.name for f in first.iterdir())
    assert files == sorted(f.name for f in again.iterdir())
    for f in files:
        assert (first / f).read_bytes() == (again / f).read_bytes(), f
    with Checkpoint(first) as ckpt:
        layout = discover_experts(ckpt.tensors)
        for lay in layout.layers.values():
            for e, pieces in enumerate(lay.experts):
                spans = sorted((p.offset, p.nbytes, p.file) for p in pieces)
                assert spans[0][0] % 4096 == 0, (lay.layer, e)
                assert len({s[2] for s in spans}) == 1
                for (o, n, _), (o2, _, _) in zip(spans, spans[1:]):
                    assert o + n == o2, (lay.layer, e)
                assert len(pieces) == 9  # gate, up, down with scales and biases


def test_convert_mixed_bits_and_folder_name(src, tmp_path):
    """--expert-bits 2 --attn-bits 4 --expert-down-bits 3: each part at its width, named in the folder."""
    link = tmp_path / "tiny"
    link.symlink_to(src[0])
    assert main(["convert", "--model", str(link), "--expert-bits", "2", "--attn-bits", "4",
                 "--expert-down-bits", "3", "--bits", "8", "--group-size", "32"]) == 0
    out = tmp_path / "tiny-e2g32d3a4o8"
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert q["bits"] == 2 and q["model.layers.0.mlp.switch_mlp.down_proj"]["bits"] == 3
    assert q["model.layers.1.self_attn.q_proj"]["bits"] == 4 and q["lm_head"]["bits"] == 8
    t = read_all(out)
    assert t["model.layers.0.mlp.experts.1.gate_proj.weight"].shape == (64, 64 * 2 // 32)
    assert t["model.layers.0.mlp.experts.1.down_proj.weight"].shape == (64, 64 * 3 // 32)
    assert t["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64 * 4 // 32)
    ids = torch.arange(5, 25)
    assert torch.equal(logits(out, ids), logits(out, ids, budget="0"))


def test_convert_from_fp8(src, tmp_path):
    """An FP8 block-scaled checkpoint converts (its weights dequantized with weight_scale_inv first)."""
    from .quant_helpers import write_fp8

    fp8_dir = tmp_path / "fp8"
    write_fp8(src[0], fp8_dir, block=32)
    out = convert(fp8_dir, tmp_path / "from-fp8", ConvertSpec(32, 8, 8, 8, 8))
    t = read_all(out)
    assert t["model.layers.1.mlp.experts.2.up_proj.weight"].dtype == torch.uint32
    assert not any(k.endswith("_scale_inv") for k in t)
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = src[1](ids[None]).logits[0]
    got = logits(out, ids)
    assert ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item() < 0.1


@pytest.mark.parametrize("bits", [4, 8, 3])
def test_bf16_kernels_stream_exactly(builds, bits):
    """In bf16 the experts compute on their pieces as read (nothing repacked per read, the cache holds the
    stored form) and give the same bits at budget 0 as with every expert resident, near float32."""
    ids = torch.arange(3, 30)
    out = {}
    for budget in ("all", "0"):
        engine = load(builds[bits, 32], cache_budget_gb=budget, tokenizer=False, workers=2, dtype="bf16")
        try:
            assert not hasattr(engine.store, "prepare")
            with torch.inference_mode():
                out[budget] = engine.model(ids, 0, engine.model.new_kv_cache(), all_logits=True)
            if budget == "all":  # the cache holds the stored pieces: packed codes, bf16 scales and biases
                ew = next(iter(engine.cache._entries.values()))
                assert {k.split(".", 1)[-1] for k in ew.tensors} >= {"gate", "scales", "biases"}
                assert ew.tensors["gate"].dtype == torch.uint32
        finally:
            engine.close()
    assert torch.equal(out["all"], out["0"])
    ref = logits(builds[bits, 32], ids)
    rms = ((out["all"].float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    assert rms < 0.05, f"bf16 kernels against the float32 model: RMS {rms:.3f}"


def test_bad_bits_names_the_flag_the_user_gave(tmp_path, capsys):
    from moestream.cli import main

    assert main(["convert", "--model", str(tmp_path), "--bits", "7", "--out", str(tmp_path / "o")]) == 2
    assert "--bits 7: expected one of" in capsys.readouterr().err
    assert main(["convert", "--model", str(tmp_path), "--expert-bits", "7", "--out", str(tmp_path / "o")]) == 2
    assert "--expert-bits 7: expected one of" in capsys.readouterr().err
