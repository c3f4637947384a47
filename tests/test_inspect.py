"""``moestream inspect``: sizes from checkpoint headers and from a bare config agree with the weights."""

import json

from moestream.cli import main
from moestream.inspect import inspect

from .helpers import TINY, make_qwen3_moe, write_tiny_synth_config


def test_checkpoint_sizes_match_the_reference_weights(tmp_path):
    ref = make_qwen3_moe(tmp_path, seed=3)
    state = ref.state_dict()
    # transformers 5 holds experts fused in memory: [E, 2I, H] and [E, H, I] per layer
    expert = sum(v.numel() * v.element_size() for k, v in state.items() if ".mlp.experts." in k)
    resident = sum(v.numel() * v.element_size() for k, v in state.items() if ".mlp.experts." not in k)
    r = inspect(str(tmp_path))
    assert r.can_stream and r.family == "moestream.models.qwen3_moe"
    assert (r.layers, r.moe_layers, r.experts_per_layer, r.top_k) == (3, 3, 8, 2)
    assert r.expert_bytes == expert
    assert r.resident_bytes == resident
    per = 3 * TINY["moe_intermediate_size"] * TINY["hidden_size"] * 4
    assert r.bytes_per_expert == per
    assert r.active_expert_bytes == 3 * 2 * per
    assert r.unused_bytes == 0


def test_bare_config_agrees_with_the_checkpoint_synth_writes(tmp_path):
    cfg = write_tiny_synth_config(tmp_path / "config.json", num_hidden_layers=3, mlp_only_layers=[1])
    out = tmp_path / "ckpt"
    assert main(["synth", "--config", str(cfg), "--out", str(out)]) == 0
    from_config = inspect(config=cfg)
    from_ckpt = inspect(str(out))
    for name in ("layers", "moe_layers", "experts_per_layer", "top_k", "bytes_per_expert", "expert_bytes",
                 "resident_bytes", "active_expert_bytes"):
        assert getattr(from_config, name) == getattr(from_ckpt, name), name
    assert from_ckpt.moe_layers == 2 and from_ckpt.layers == 3
    # bf16: 2 bytes per weight
    assert from_ckpt.bytes_per_expert == 3 * 16 * 32 * 2


def test_what_cannot_stream_says_why(tmp_path, capsys):
    diffusion = tmp_path / "diffusion.json"
    diffusion.write_text(json.dumps({"model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"]}))
    r = inspect(config=diffusion)
    assert not r.can_stream and "diffusion" in r.reason
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model_type": "no_such_moe"}))
    r = inspect(config=unknown)
    assert not r.can_stream and "'no_such_moe' is not supported" in r.reason
    dense = write_tiny_synth_config(tmp_path / "dense.json", mlp_only_layers=[0, 1])
    r = inspect(config=dense)
    assert not r.can_stream and "no routed experts" in r.reason
    assert main(["inspect", "--config", str(diffusion)]) == 0
    assert "can stream:         no: a diffusion" in capsys.readouterr().out


def test_cli_json_and_bad_config(tmp_path, capsys):
    cfg = write_tiny_synth_config(tmp_path / "config.json")
    assert main(["inspect", "--config", str(cfg), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["can_stream"] and data["experts_per_layer"] == 8
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["inspect", "--config", str(bad)]) == 2
    assert "bad.json: cannot read a JSON config" in capsys.readouterr().err


def test_converted_checkpoint_counts_its_scales_as_resident(tmp_path):
    """After ``moestream convert``, quantized resident linears (weights, scales, biases) are resident, not unused."""
    from moestream.engine import load

    make_qwen3_moe(tmp_path / "f", seed=4)
    out = tmp_path / "q"
    assert main(["convert", "--model", str(tmp_path / "f"), "--out", str(out), "--bits", "4", "--group-size", "32",
                 "--attn-bits", "8"]) == 0
    r = inspect(str(out))
    assert r.can_stream and r.unused_bytes == 0, r.unused_examples
    engine = load(out, cache_budget_gb=0.0001, tokenizer=False, learn_experts=False)
    try:
        assert r.resident_bytes == engine.resident_bytes
    finally:
        engine.close()
