"""The ``trained`` synth init: ordinary weights (transformers reads them, streaming is exact on them) whose
routing on the bench's token stream has the published locality of trained models."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from moestream.cachesim import locality
from moestream.engine import load
from moestream.errors import ConfigError
from moestream.synth import synth
from moestream.traces import load_trace

from .helpers import read_all, write_tiny_synth_config
from .shared_data import CONFIGS, SHARED

BENCH_TEXT = Path(__file__).resolve().parents[1] / "benchmarks/bench_text.py"


def bench_streams() -> tuple[list[int], list[int]]:
    """The bench's token stream (``shared/bench``: the chat-templated prompt, then the continuation), and a long
    run: that stream, then the side-by-side bench's keeper log and its continuation; Qwen3 tokenizer."""
    from transformers import AutoTokenizer

    if not (SHARED / "bench/prompt.txt").is_file():
        pytest.skip("../shared/bench is not present")
    tok = AutoTokenizer.from_pretrained(str(SHARED / "tokenizers/qwen3"), local_files_only=True)

    def chat(text):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False)

    stream = chat((SHARED / "bench/prompt.txt").read_text()) + tok.encode(
        (SHARED / "bench/continuation.txt").read_text(), add_special_tokens=False)
    spec = importlib.util.spec_from_file_location("bench_text", BENCH_TEXT)
    bt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bt)
    keeper = chat(bt.INSTRUCTION + bt.PASSAGE) + tok.encode(bt.CONTINUATION, add_special_tokens=False)
    return stream, stream + keeper


def real_shape(name: str, tmp_path: Path) -> Path:
    """The real config with small experts (routing does not depend on their width) and a tied LM head: the real
    hidden size, experts per layer, top-k and token mixers, cheap to write."""
    src = CONFIGS / name
    if not src.is_file():
        pytest.skip(f"{src} not present")
    cfg = json.loads(src.read_text())
    text = cfg.get("text_config", cfg)
    text["moe_intermediate_size"] = 32
    if "shared_expert_intermediate_size" in text:
        text["shared_expert_intermediate_size"] = 32
    cfg["tie_word_embeddings"] = text["tie_word_embeddings"] = True
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    return path


def routed(model: Path, ids: list[int], tmp_path: Path):
    """The trace of ``ids`` fed through the model in the CLI's prefill chunks (512 tokens: each token's routing is
    the one it gets fed alone, up to rounding), every expert resident."""
    trace = tmp_path / "trace.jsonl"
    engine = load(model, cache_budget_gb="all", tokenizer=False, trace=trace, learn_experts=False)
    try:
        kv = engine.model.new_kv_cache(len(ids) + 1)
        with torch.inference_mode():
            for s in range(0, len(ids), 512):
                engine.model(torch.tensor(ids[s : s + 512]), s, kv)
    finally:
        engine.close()
    return load_trace(trace)


def first(trace, n):
    return [(t, layer, rows[: n - t]) for t, layer, rows in trace.records if t < n]


def test_trained_routing_has_the_locality_of_qwen3_30b_a3b(tmp_path):
    """Qwen3-30B-A3B's shape (hidden 2048, 128 experts, top-8), 2 layers: on the bench's stream, next-token reuse
    40-50%, reuse within 8 tokens 75-85%, a per-layer LRU of 40% of the experts hitting 85-95% in steady state
    (after 64 tokens; kekzl/imp#1359: 45%, 80%, 90-95%), usage skewed but not collapsed; over the long run every
    expert of every layer used."""
    stream, long_run = bench_streams()
    model = synth(real_shape("Qwen3-30B-A3B.json", tmp_path), tmp_path / "m", layers=2, init="trained")
    trace = routed(model, long_run, tmp_path)
    loc = locality(first(trace, len(stream)), trace.num_experts, residencies=(0.4,))
    assert 0.40 <= loc.next_token_reuse <= 0.50, loc
    assert 0.75 <= loc.reuse_within <= 0.85, loc
    assert 0.85 <= loc.lru[0.4] <= 0.95, loc
    assert loc.reuse_distance[50] <= 3, loc
    assert all(0.25 < g < 0.75 for g in loc.gini.values()), loc.gini
    whole = locality(trace.records, trace.num_experts)
    assert whole.distinct == {0: 128, 1: 128}, whole.distinct


def test_trained_routing_of_512_experts(tmp_path):
    """Qwen3-Next's shape (hidden 2048, 512 experts, top-10, Gated DeltaNet first), 2 layers: a per-layer LRU of
    12.5% and 25% of the experts hits within 10 points of 67% and 81% in steady state (ggml-org/llama.cpp#27861)."""
    stream, _ = bench_streams()
    model = synth(real_shape("Qwen3-Next-80B-A3B.json", tmp_path), tmp_path / "m", layers=2, init="trained")
    loc = locality(routed(model, stream, tmp_path).records, residencies=(0.125, 0.25))
    assert abs(loc.lru[0.125] - 0.67) <= 0.10, loc
    assert abs(loc.lru[0.25] - 0.81) <= 0.10, loc
    assert loc.next_token_reuse > 0.15  # spread: about top-k / experts, 2%


TINY_HYBRID = dict(
    vocab_size=400, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=8, max_position_embeddings=512, rms_norm_eps=1e-6, norm_topk_prob=True,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
)


def tiny(family: str, tmp_path: Path) -> tuple[Path, type]:
    if family == "qwen3_moe":
        from transformers import Qwen3MoeForCausalLM

        cfg = write_tiny_synth_config(tmp_path / "c.json", vocab_size=400, hidden_size=64, num_hidden_layers=3,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=8,
                                      num_experts_per_tok=2)
        return cfg, Qwen3MoeForCausalLM
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(**TINY_HYBRID, intermediate_size=96).to_dict()
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    return path, Qwen3NextForCausalLM


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_trained_weights_are_ordinary_weights(family, tmp_path):
    """transformers reads the checkpoint and computes the same logits; streaming at budget 0 is bit-identical to
    every expert resident; the weights depend on the seed and tensor names only."""
    cfg, reference = tiny(family, tmp_path)
    out = synth(cfg, tmp_path / "m", dtype="fp32", init="trained", shard_gb=0.0005)
    again = synth(cfg, tmp_path / "m2", dtype="fp32", init="trained", shard_gb=0.0005)
    a, b = read_all(out), read_all(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    spread = read_all(synth(cfg, tmp_path / "s", dtype="fp32", shard_gb=0.0005))
    changed = sorted(k for k in a if not torch.equal(a[k], spread[k]))
    assert any(k.endswith("embed_tokens.weight") for k in changed) and any("mlp.gate.weight" in k for k in changed)
    assert not any(".experts." in k for k in changed)  # the experts are spread's
    ref = reference.from_pretrained(out).eval()
    ids = torch.randint(0, 400, (70,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    logits = {}
    for budget in (0, "all"):
        engine = load(out, cache_budget_gb=budget, tokenizer=False, learn_experts=False)
        try:
            with torch.inference_mode():
                kv = engine.model.new_kv_cache()
                prefill = engine.model(ids[:60], 0, kv, all_logits=True)
                steps = [engine.model(ids[i : i + 1], i, kv, all_logits=True) for i in range(60, 70)]
            logits[budget] = torch.cat([prefill, *steps])
        finally:
            engine.close()
    assert torch.equal(logits[0], logits["all"])
    assert ((logits[0] - want).abs().max() / want.abs().max()) < 1e-5


def test_synth_cli_writes_a_trained_checkpoint(tmp_path, capsys):
    from moestream.cli import main

    cfg = write_tiny_synth_config(tmp_path / "c.json", vocab_size=400, hidden_size=64)
    assert main(["synth", "--config", str(cfg), "--out", str(tmp_path / "m"), "--init", "trained"]) == 0
    assert main(["synth", "--config", str(cfg), "--out", str(tmp_path / "s")]) == 0
    a, b = read_all(tmp_path / "m"), read_all(tmp_path / "s")
    assert not torch.equal(a["model.layers.1.mlp.gate.weight"], b["model.layers.1.mlp.gate.weight"])
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert torch.equal(a[name], b[name])  # the experts are spread's


def test_trained_refuses_a_family_it_is_not_made_for(tmp_path):
    src = CONFIGS / "Mixtral-8x7B-v0.1.json"
    if not src.is_file():
        pytest.skip(f"{src} not present")
    cfg = json.loads(src.read_text())
    with pytest.raises(ConfigError, match="--init trained: model_type 'mixtral' is not calibrated; it is for "
                                          "qwen3_moe, qwen3_next, qwen3_5_moe"):
        synth(cfg, tmp_path / "m", layers=1, init="trained")
    with pytest.raises(ConfigError, match="--init 'warm': expected spread, plain, trained"):
        synth(write_tiny_synth_config(tmp_path / "c.json"), tmp_path / "n", init="warm")
