"""``moestream convert``: quantized builds that reload, stay close to the float model, are
byte-for-byte reproducible, and keep every expert in one 4 KiB-aligned range."""

import json
from pathlib import Path

import pytest
import torch

from moestream.checkpoint import Checkpoint
from moestream.cli import main
from moestream.convert import ConvertSpec, convert
from moestream.engine import load
from moestream.generation import SamplingParams, generate
from moestream.layout import discover_experts
from moestream.quant.formats import QuantError
from moestream.quant.resident import QuantLinear

from .helpers import make_qwen3_moe, read_all, write_checkpoint
from .quant_helpers import mlx_dequantize
from .shared_data import CONFIGS

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


@pytest.fixture(scope="module")
def real_width_q4(tmp_path_factory):
    """The real Qwen3-30B-A3B config (hidden 2048, top-8 routing) cut to 2 layers of 32 experts of width 128 and a
    512-token vocabulary, synthesized in bf16 and converted to 4 bits: a quantized router at the real width."""
    from moestream.synth import synth

    root = tmp_path_factory.mktemp("real-width")
    cfg = json.loads((Path(__file__).parent / "configs" / "Qwen3-30B-A3B.json").read_text())  # as published
    cfg.update(num_experts=32, moe_intermediate_size=128, vocab_size=512)
    (root / "config.json").write_text(json.dumps(cfg))
    src = synth(root / "config.json", root / "bf16", layers=2)
    assert main(["convert", "--model", str(src), "--bits", "4", "--out", str(root / "q4")]) == 0
    yield root / "q4"


def test_prefetch_ahead_on_a_quantized_router_at_real_width(real_width_q4):
    """--prefetch-ahead predicts with the next layer's router through its forward (the router is quantized:
    its ``weight`` holds packed words, not a float matrix to read the expert count from): the run streams with
    read-ahead hits and every step's
    logits are ``torch.equal`` to the same model with every expert resident."""
    prompt = [5, 17, 101, 300, 42]
    got = {}
    for budget, ahead in (("all", 0), ("0.004", 1)):
        engine = load(real_width_q4, cache_budget_gb=budget, tokenizer=False, workers=2, prefetch_ahead=ahead,
                      dtype="bf16", hotlist=False, learn_experts=False)
        try:
            got[budget] = [s.logits for s in generate(engine, prompt, 4, SamplingParams(), stop_at_eos=False,
                                                      keep_logits=True)]
            router = engine.model.decoder.layers[1].mlp.gate
            assert isinstance(router, QuantLinear) and not router.weight.is_floating_point()  # packed words
            if ahead:
                stats = engine.io.prefetcher.stats
                assert stats.hits > 0 and engine.io.prefetcher.enabled, stats
        finally:
            engine.close()
    assert len(got["all"]) == len(got["0.004"]) == 4
    assert all(torch.equal(a, b) for a, b in zip(got["all"], got["0.004"]))


def _assert_near_and_streamed_exact(ref, out):
    """The build ``out``'s logits of 24 ids within 5 % RMS of the float model ``ref``'s, and the same bits at
    budget 0 as at the default."""
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    got = logits(out, ids)
    assert ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item() < 0.05
    assert torch.equal(logits(out, ids, budget="0"), got)


def test_deepseek_converts_with_its_router_and_kv_b_proj_float(tmp_path):
    """DeepSeek-V3 (MLA, biased sigmoid router): the 8-bit build loads and stays near the float model; the router
    and MLA's kv_b_proj (used as a matrix, not a linear) stay float, every other linear is quantized."""
    from .test_family_deepseek import make_model

    # a latent rank of 32 (a multiple of the group): kv_b_proj [heads x (nope + v), rank] could be quantized
    ref = make_model(tmp_path / "ds", "deepseek_v3", kv_lora_rank=32)
    out = convert(tmp_path / "ds", tmp_path / "q8", ConvertSpec(32, 8, 8, 8, 8))
    t = read_all(out)
    assert t["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float32
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert t["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.uint32
    _assert_near_and_streamed_exact(ref, out)


def test_a_biased_float32_router_stays_float(tmp_path):
    """GLM-4.5's router (``gate.weight`` with ``gate.e_score_correction_bias``, float32 sigmoid routing) is kept
    float by convert, as mlx-lm keeps it: the 8-bit build loads, routes and stays near the float model."""
    from .test_family_deepseek import make_model

    ref = make_model(tmp_path / "glm", "glm4_moe")
    out = convert(tmp_path / "glm", tmp_path / "q8", ConvertSpec(32, 8, 8, 8, 8))
    t = read_all(out)
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.float32 and "model.layers.1.mlp.gate.scales" not in t
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert q["model.layers.1.mlp.gate"] is False and q["bits"] == 8
    assert t["model.layers.1.mlp.shared_experts.up_proj.weight"].dtype == torch.uint32  # the rest is quantized
    _assert_near_and_streamed_exact(ref, out)
    # a build that quantizes such a router anyway is refused by name at load, not a traceback mid-forward
    from .quant_helpers import write_mlx

    write_mlx(tmp_path / "glm", tmp_path / "mlx", 8, 32, num_experts=8)
    with pytest.raises(QuantError, match=r"tensor model.layers.1.mlp.gate.weight is quantized, but this linear also "
                                         r"holds e_score_correction_bias"):
        load(tmp_path / "mlx", tokenizer=False)


def test_bits_16_writes_the_float_model_in_the_streaming_layout(src, tmp_path):
    """--bits 16 ("16 keeps it float"): every tensor, routers included, keeps the source's float values, config.json
    declares no quantization, each expert is one 4 KiB-aligned range, and generate gives the source's logits exactly.
    16 for the experts alone keeps them float beside quantized attention."""
    out = tmp_path / "f16"
    assert main(["convert", "--model", str(src[0]), "--bits", "16", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization" not in cfg and "quantization_config" not in cfg
    orig, got = read_all(src[0]), read_all(out)
    assert {k for k in got if not k.startswith("moestream.pad.")} == set(orig)
    assert all(torch.equal(got[k], orig[k]) for k in orig)
    with Checkpoint(out) as ckpt:
        for lay in discover_experts(ckpt.tensors).layers.values():
            for pieces in lay.experts:
                spans = sorted((p.offset, p.nbytes) for p in pieces)
                assert spans[0][0] % 4096 == 0 and all(o + n == o2 for (o, n), (o2, _) in zip(spans, spans[1:]))
    ids = torch.arange(3, 30)
    assert torch.equal(logits(out, ids, budget="0"), logits(src[0], ids))
    mixed = convert(src[0], tmp_path / "e16a4", ConvertSpec(32, 16, 16, 4, 16))
    q = json.loads((mixed / "config.json").read_text())["quantization"]
    assert q["bits"] == 4 and q["model.layers.0.mlp.switch_mlp.up_proj"] is False and q["lm_head"] is False
    t = read_all(mixed)
    assert t["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.float32
    assert t["model.layers.1.self_attn.q_proj.weight"].dtype == torch.uint32
    with torch.no_grad():
        want = src[1](ids[None]).logits[0]
    got = logits(mixed, ids)
    assert ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item() < 0.35
    assert torch.equal(logits(mixed, ids, budget="0"), got)


@pytest.mark.parametrize("family", ["hunyuan_v1_moe", "mixtral"])
def test_routers_of_other_names_take_8_bits_and_route_through_their_forward(tmp_path, family):
    """HunYuan's router ``mlp.gate.wg`` and Mixtral's ``block_sparse_moe.gate`` are routers too: 8 bits like the
    others, and HunYuan's routes through the quantized linear's forward (it cast the hidden states to the packed
    words' uint32): its routing equals the top-k of a float64 product of the dequantized router weight (float32
    compute), and in bf16 the router, computed by the CPU kernels on its packed words, routes too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import family_helpers as fh
    from .quant_helpers import mlx_dequantize

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    extra = (dict(num_experts=32, moe_topk=2) if family == "hunyuan_v1_moe"
             else dict(num_local_experts=32, num_experts_per_tok=2))
    cfg = AutoConfig.for_model(family, **common, **extra)
    fh.save_reference(lambda c: AutoModelForCausalLM.from_config(c), cfg, tmp_path / "f", seed=1,
                      extra=lambda n, p: p.normal_(0.0, 0.5) if n.endswith("gate.wg.weight") else None)
    out = convert(tmp_path / "f", tmp_path / "q", ConvertSpec(32, 4, 4, 4, 4))
    t = read_all(out)
    name = "model.layers.1.mlp.gate.wg" if family == "hunyuan_v1_moe" else "model.layers.1.block_sparse_moe.gate"
    assert json.loads((out / "config.json").read_text())["quantization"][name] == {"group_size": 32, "bits": 8}
    w = mlx_dequantize(t[name + ".weight"], t[name + ".scales"], t[name + ".biases"], 8).double()
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    for dtype in ("fp32", "bf16"):
        engine = load(out, cache_budget_gb="all", tokenizer=False, dtype=dtype, learn_experts=False)
        try:
            layer = engine.model.decoder.layers[1]
            block = layer.mlp if family == "hunyuan_v1_moe" else layer.block_sparse_moe
            with torch.inference_mode():
                _, idx = block.route(x.to(engine.dtype))
            if dtype == "fp32":
                want = torch.topk(x.double() @ w.T, 2, dim=-1).indices
                assert torch.equal(idx.sort(-1).values, want.sort(-1).values)
            else:  # (the bf16 kernels' values are checked in test_quant_native.py)
                router = block.gate.wg if family == "hunyuan_v1_moe" else block.gate
                assert idx.shape == (6, 2) and not router.weight.is_floating_point()  # packed words, and it routed
        finally:
            engine.close()


def test_convert_refuses_every_bad_argument_before_its_first_progress_line(src, tmp_path, capsys):
    """Each refusal is one line on stderr and nothing else -- no "writing X: ... GB to go" printed before it --
    and nothing is created: a --shard-gb not a size (nan was a ValueError traceback, inf an OverflowError, 0 and
    -1 refused only after the progress line), an --out that exists, an --out in a missing folder (its parents
    were created silently), and an input already quantized."""
    q4 = tmp_path / "q4"
    assert main(["convert", "--model", str(src[0]), "--bits", "4", "--group-size", "32", "--out", str(q4)]) == 0
    capsys.readouterr()
    o = tmp_path / "o"
    missing = tmp_path / "no" / "such" / "o"
    cases = [(["--model", str(src[0]), "--out", str(o), "--shard-gb", v],
              f"--shard-gb {float(v)}: expected a size in GB above 0 and below 1000000")
             for v in ("nan", "inf", "0", "-1")]
    cases += [
        (["--model", str(src[0]), "--out", str(q4)], f"{q4}: already exists; choose another --out or delete it"),
        (["--model", str(src[0]), "--out", str(missing)],
         f"--out {missing}: {missing.parent} is not an existing folder (convert makes only the last folder)"),
        (["--model", str(q4), "--out", str(o)],
         f"{q4}: tensor 'lm_head.weight' is U32: convert reads float or fp8 checkpoints"),
    ]
    for args, message in cases:
        assert main(["convert", "--bits", "4", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.splitlines() == [f"moestream: error: {message}"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q4"]  # no o, no .o.partial, no no/such/


def test_synth_and_convert_check_shard_gb_with_one_function(tmp_path):
    """synth and convert refuse the same --shard-gb values with the same words (one check, shared)."""
    from moestream.checkpoint import shard_bytes
    from moestream.errors import ConfigError
    from moestream.synth import plan_synth

    assert shard_bytes(5.0) == 5_000_000_000 and shard_bytes(0.001) == 1_000_000
    cfg = json.loads((Path(__file__).parent / "configs" / "Qwen3-30B-A3B.json").read_text())
    for bad in (float("nan"), float("inf"), 0.0, -1.0, 1e6):
        with pytest.raises(ConfigError, match=r"^--shard-gb .*: expected a size in GB above 0 and below 1000000$"):
            shard_bytes(bad)
        with pytest.raises(ConfigError, match=r"^--shard-gb .*: expected a size in GB above 0 and below 1000000$"):
            plan_synth(cfg, layers=1, shard_gb=bad)
    assert plan_synth(cfg, layers=1, shard_gb=0.5).shard_bytes == 500_000_000


def test_gpt_oss_converts_with_gate_and_up_de_interleaved(tmp_path):
    """A float gpt-oss (synthesized from gpt-oss-20b's config, experts fused for x @ W with gate and up in
    interleaved columns, and biases) converts: was a KeyError 'gate'. Each expert is written as separate gate,
    up and down linears with their biases (as mlx-lm and llama.cpp write it), one 4 KiB-aligned range; the float
    build's logits equal the source's, the 8-bit build's stay as close as any model's, and it streams exactly."""
    cfg = json.load(open(CONFIGS / "gpt-oss-20b.json"))
    cfg.update(hidden_size=128, intermediate_size=128, num_local_experts=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    synth = tmp_path / "synth"
    assert main(["synth", "--config", str(tmp_path / "config.json"), "--out", str(synth), "--layers", "2",
                 "--dtype", "fp32"]) == 0
    tensors = read_all(synth)  # synth's expert biases are zeros: random ones, so a wrong split shows
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith("_proj_bias")]:
        tensors[name] = torch.randn(tensors[name].shape, generator=gen) * 0.5
    src = write_checkpoint(synth, tmp_path / "oss", tensors)
    ids = torch.arange(3, 40)
    want = logits(src, ids)
    f16 = tmp_path / "oss-f16"
    assert main(["convert", "--model", str(src), "--bits", "16", "--out", str(f16)]) == 0
    got, orig = read_all(f16), read_all(src)
    experts = "model.layers.1.mlp.experts."
    gate_up, bias = orig[experts + "gate_up_proj"][2], orig[experts + "gate_up_proj_bias"][2]
    assert torch.equal(got["model.layers.1.mlp.experts.2.gate_proj.weight"], gate_up[:, 0::2].T)
    assert torch.equal(got["model.layers.1.mlp.experts.2.up_proj.weight"], gate_up[:, 1::2].T)
    assert torch.equal(got["model.layers.1.mlp.experts.2.up_proj.bias"], bias[1::2])
    assert torch.equal(got["model.layers.1.mlp.experts.2.down_proj.weight"],
                       orig["model.layers.1.mlp.experts.down_proj"][2].T)
    with Checkpoint(f16) as ckpt:
        for lay in discover_experts(ckpt.tensors).layers.values():
            assert [p.role for p in lay.experts[0]] == ["gate", "up", "down", "down.bias", "gate.bias", "up.bias"]
            for pieces in lay.experts:
                spans = sorted((p.offset, p.nbytes) for p in pieces)
                assert spans[0][0] % 4096 == 0 and all(o + n == o2 for (o, n), (o2, _) in zip(spans, spans[1:]))
    float_build = logits(f16, ids, budget="0")
    assert (float_build - want).abs().max() <= 1e-5 * want.abs().max()
    q8 = tmp_path / "oss-q8"
    assert main(["convert", "--model", str(src), "--bits", "8", "--out", str(q8)]) == 0
    got = logits(q8, ids)
    assert ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item() < RMS_BOUND[8]
    assert torch.equal(logits(q8, ids, budget="0"), got)
    assert main(["inspect", "--model", str(q8)]) == 0


def test_dequantize_resident_swaps_in_float_modules_with_the_stored_values(builds):
    """The GPU's load step on the CPU: each quantized embedding and linear becomes a frozen float module whose
    weight is the stored form dequantized (an embedding's rows as its own lookup gives them)."""
    from torch import nn

    from moestream.quant.resident import QuantEmbedding, dequantize_resident

    engine = load(builds[4, 32], cache_budget_gb="all", tokenizer=False, workers=2)
    try:
        net = engine.model
        quant = {n: m for n, m in net.named_modules() if isinstance(m, QuantLinear | QuantEmbedding)}
        assert any(isinstance(m, QuantEmbedding) for m in quant.values())
        want = {}
        for n, m in quant.items():
            if isinstance(m, QuantEmbedding):
                want[n] = m.forward(torch.arange(m.fmt.out_features)).float()
            else:
                want[n] = m.dense_weight(torch.float32)
        assert dequantize_resident(net, torch.float32) == len(quant)
        for n, w in want.items():
            dense = net.get_submodule(n)
            assert type(dense) is (nn.Embedding if "embed" in n else nn.Linear), n
            assert torch.equal(dense.weight, w) and not dense.weight.requires_grad, n
    finally:
        engine.close()
