"""``moestream synth`` writes genuine Hugging Face checkpoints; ``generate`` and ``demo`` run end to end."""

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from moestream.engine import load
from moestream.errors import ConfigError, MoestreamError
from moestream.synth import synth

from .helpers import read_all, write_tiny_synth_config
from .shared_data import CONFIGS

SMALL = dict(vocab_size=300, hidden_size=64, num_hidden_layers=3)


def test_synth_is_a_transformers_checkpoint_and_matches(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    cfg = write_tiny_synth_config(tmp_path / "c.json", **SMALL)
    out = synth(cfg, tmp_path / "m", dtype="fp32", shard_gb=0.0002)  # several shards
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    ref = Qwen3MoeForCausalLM.from_pretrained(out).eval()
    ids = torch.arange(1, 30)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    engine = load(out, cache_budget_gb=0, tokenizer=False)
    try:
        with torch.inference_mode():
            got = engine.model(ids, 0, engine.model.new_kv_cache(), all_logits=True)
    finally:
        engine.close()
    assert ((got - want).abs().max() / want.abs().max()) < 1e-5


def test_synth_init_and_determinism(tmp_path):
    cfg = write_tiny_synth_config(tmp_path / "c.json", vocab_size=2000, hidden_size=128, moe_intermediate_size=64,
                                  num_hidden_layers=4)
    a = read_all(synth(cfg, tmp_path / "a", seed=3))
    b = read_all(synth(cfg, tmp_path / "b", seed=3))
    c = read_all(synth(cfg, tmp_path / "c", seed=4))
    p = read_all(synth(cfg, tmp_path / "p", seed=3, init="plain"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    std = lambda t: t.float().std().item()  # noqa: E731
    assert abs(std(a["model.embed_tokens.weight"]) - 1.0) < 0.02
    out_std = 0.02 / math.sqrt(2 * 4)
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.layers.2.mlp.experts.5.down_proj.weight"):
        assert abs(std(a[name]) - out_std) < 0.1 * out_std, name
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.3.mlp.gate.weight",
                 "model.layers.0.mlp.experts.7.up_proj.weight", "lm_head.weight"):
        assert abs(std(a[name]) - 0.02) < 0.002, name
    assert torch.equal(a["model.layers.0.input_layernorm.weight"], torch.ones(128, dtype=torch.bfloat16))
    assert abs(std(p["model.embed_tokens.weight"]) - 0.02) < 0.002
    assert abs(std(p["model.layers.1.self_attn.o_proj.weight"]) - 0.02) < 0.002
    meta = json.loads((tmp_path / "a" / "config.json").read_text())
    assert meta["torch_dtype"] == "bfloat16" and meta["num_hidden_layers"] == 4
    for f in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (tmp_path / "a" / f).is_file()
    with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as st:  # the safetensors library reads it
        assert st.get_tensor("model.norm.weight").shape == (128,)


def test_synth_real_config_layers_and_refusals(tmp_path):
    path = write_tiny_synth_config(tmp_path / "c.json", num_hidden_layers=6, mlp_only_layers=[1, 4])
    cfg = json.loads(path.read_text())
    out = synth(dict(cfg, vocab_size=300), tmp_path / "m", layers=3)
    meta = json.loads((out / "config.json").read_text())
    assert meta["num_hidden_layers"] == 3 and meta["mlp_only_layers"] == [1]
    with safe_open(str(out / "model.safetensors"), "pt") as st:
        keys = set(st.keys())
    assert "model.layers.1.mlp.gate_proj.weight" in keys and "model.layers.2.mlp.experts.7.down_proj.weight" in keys
    assert not any(k.startswith("model.layers.3.") for k in keys)
    with pytest.raises(MoestreamError, match="already exists"):
        synth(cfg, out)
    with pytest.raises(ConfigError, match="--layers 9: must be between 1 and the config's 6 layers"):
        synth(cfg, tmp_path / "n", layers=9)
    with pytest.raises(ConfigError, match="model_type 'mamba' is not supported"):
        synth(dict(cfg, model_type="mamba"), tmp_path / "n")


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory):
    """A tiny model with the real Qwen3 tokenizer and vocabulary, written by the CLI."""
    d = tmp_path_factory.mktemp("cli")
    cfg = write_tiny_synth_config(d / "c.json")
    r = subprocess.run([sys.executable, "-m", "moestream", "synth", "--config", str(cfg), "--out", str(d / "m")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return d / "m"


def cli(args, module="moestream"):
    r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r


def test_generate_cli_streams_and_reports(cli_model, tmp_path):
    runs = {}
    for budget in ("0", "all"):
        stats_file = tmp_path / f"{budget}.json"
        r = cli(["generate", "--model", str(cli_model), "--prompt", "Tell me about disks.", "--max-tokens", "12",
                 "--temp", "1", "--seed", "0", "--cache-budget-gb", budget, "--stats-json", str(stats_file)])
        stats = json.loads(stats_file.read_text())
        runs[budget] = (r, stats)
        for line in ("cache hit rate", "decode", "distinct experts", "MB per decoded token", "peak RSS"):
            assert line in r.stderr
        for key in ("prompt_tokens", "generated_tokens", "generated_token_ids", "prefill_tok_s", "decode_tok_s",
                    "cache_hit_rate", "experts_read", "gb_read", "mb_read_per_decoded_token",
                    "distinct_experts_per_layer_mean", "distinct_experts_per_layer", "resident_weight_gb",
                    "cache_budget_gb", "peak_rss_gb"):
            assert key in stats, key
        assert stats["generated_tokens"] == len(stats["generated_token_ids"]) == 12
        assert stats["prompt_tokens"] > 5
        assert set(stats["distinct_experts_per_layer"]) == {"0", "1"}
        assert 2 <= stats["distinct_experts_per_layer_mean"] <= 8
    streamed, resident = runs["0"][1], runs["all"][1]
    assert streamed["generated_token_ids"] == resident["generated_token_ids"]
    assert runs["0"][0].stdout == runs["all"][0].stdout
    # budget 0 keeps nothing: its only hits are experts prefill read ahead for the next layer
    assert streamed["cache_hits"] == streamed["prefetch_hits"] == streamed["prefill_read_ahead_hits"]
    assert streamed["experts_read"] > 0
    assert resident["cache_hit_rate"] == 1.0 and resident["experts_read"] == 0
    assert resident["cache_budget_gb"] == "all"
    # the same flags through the reference system's module name
    stats_file = tmp_path / "module.json"
    cli(["--model", str(cli_model), "--prompt", "Tell me about disks.", "--max-tokens", "12", "--temp", "1",
         "--seed", "0", "--cache-budget-gb", "0.001", "--stats-json", str(stats_file)],
        module="moestream.stream_generate")
    assert json.loads(stats_file.read_text())["generated_token_ids"] == streamed["generated_token_ids"]


def test_demo_builds_and_proves_identity(tmp_path, monkeypatch, capsys):
    from moestream.cli import demo

    monkeypatch.setattr(demo, "DEMO_CONFIG", write_tiny_synth_config(tmp_path / "c.json"))
    demo.run_demo(tmp_path / "demo", max_tokens=6)
    err = capsys.readouterr().err
    assert "first run" in err and "logits of every step bit-identical to the all-resident run: True" in err
    demo.run_demo(tmp_path / "demo", max_tokens=6)  # second run reuses the checkpoint
    assert "first run" not in capsys.readouterr().err


def test_synth_writes_no_mtp_layer_and_says_so_in_the_config():
    """Synth writes no multi-token-prediction weights, so its config asks for none (llama.cpp's converter
    and loader would look for them)."""
    from moestream.synth import plan_synth

    plan = plan_synth(CONFIGS / "Qwen3.5-35B-A3B.json", layers=2)
    assert plan.config["text_config"]["mtp_num_hidden_layers"] == 0
    assert not any(t.name.startswith("mtp.") for t in plan.tensors)
    plan = plan_synth(CONFIGS / "Qwen3-Next-80B-A3B.json", layers=2)
    assert plan.config.get("mtp_num_hidden_layers", 0) == 0
