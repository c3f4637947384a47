"""Kimi-Linear against transformers' reference; Kimi K3 against a straightforward implementation
written here from its published definition; streaming exactness for both; synth -> generate."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from moestream.engine import load
from moestream.generation import SamplingParams, generate
from moestream.models.kimi_linear import synth_tensors
from moestream.synth import synth

from . import family_helpers as fh
from .helpers import NORMS, ends, redraw_

PROMPT = torch.randint(0, 300, (80,), generator=torch.Generator().manual_seed(0))  # longer than a KDA chunk (64)

KIMI_LINEAR = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=4, topk_group=2, first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "full_attn_layers": [2, 4],
                        "kda_layers": [1, 3]},
)


def make_kimi_linear(path, seed=0):
    """Save a random float32 transformers ``KimiLinearForCausalLM``: layers KDA, MLA, KDA, MLA; layer 0 dense.

    Norms, routers, score-correction biases and the KDA decay parameters are randomized too.
    """
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**KIMI_LINEAR)).eval()
    redraw_(model.named_parameters(), NORMS, (ends("gate.weight"), 0.0, 0.5),
            (ends("e_score_correction_bias", "dt_bias", "A_log"), 0.0, 0.5))
    redraw_(model.named_buffers(), (ends("e_score_correction_bias"), 0.0, 0.3))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi-linear")
    return path, make_kimi_linear(path)


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def prefill(engine, ids, chunk):
    kv = engine.model.new_kv_cache()
    with torch.inference_mode():
        return torch.cat([engine.model(ids[s : s + chunk], s, kv, all_logits=True) for s in range(0, len(ids), chunk)])


def test_kimi_linear_checkpoint_layout(kimi_linear):
    """save_pretrained writes the Hub names: experts block_sparse_moe.experts.E.w1/w3/w2, found by rule."""
    from moestream.checkpoint import Checkpoint
    from moestream.layout import discover_experts

    path, _ = kimi_linear
    with Checkpoint(path) as c:
        lay = discover_experts(c.tensors)
        assert sorted(lay.layers) == [1, 2, 3]
        assert lay.layers[1].block == "model.layers.1.block_sparse_moe" and lay.layers[1].num_experts == 8
        assert [p.source for p in lay.pieces(2, 5)] == [
            f"model.layers.2.block_sparse_moe.experts.5.{w}.weight" for w in ("w1", "w3", "w2")]
        assert not any("shared_experts" in n for n in lay.expert_tensors)
    engine = load(path, cache_budget_gb=0, tokenizer=False)
    try:
        assert engine.unused_tensors == []
        assert [b.renormalize for b in engine.model.moe_blocks()] == [True] * 3
    finally:
        engine.close()


def test_kimi_linear_logits_match_transformers(kimi_linear):
    path, ref = kimi_linear
    with torch.no_grad():
        want = ref(PROMPT[None]).logits[0]
    engine = load(path, cache_budget_gb=0.0001, tokenizer=False, workers=2)
    try:
        for chunk in (80, 24):  # whole (two KDA chunks), and in pieces carrying the KDA and MLA state
            assert rel_err(prefill(engine, PROMPT, chunk), want) < 1e-5, chunk
    finally:
        engine.close()


def test_kimi_linear_greedy_tokens_match_transformers(kimi_linear):
    path, ref = kimi_linear
    fh.assert_greedy_matches(path, ref, prompt=PROMPT[:12])


def run(path, budget, workers=2, chunk=512, sampling=None):
    """Prefill logits in chunks, each decode step's logits and the tokens."""
    sampling = sampling or SamplingParams()
    engine = load(path, cache_budget_gb=budget, workers=workers, tokenizer=False)
    try:
        first = prefill(engine, PROMPT[:24], chunk)
        steps = list(generate(engine, PROMPT[:24].tolist(), 8, sampling, stop_at_eos=False, keep_logits=True,
                              prefill_chunk=chunk))
        return first, [s.logits for s in steps], [s.token for s in steps], engine.cache.stats
    finally:
        engine.close()


def assert_same(a, b):
    assert torch.equal(a[0], b[0])
    assert len(a[1]) == len(b[1]) == 8 and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert a[2] == b[2]


def test_kimi_linear_streaming_is_exact(kimi_linear):
    path, _ = kimi_linear
    ref = run(path, "all", chunk=16)
    assert ref[3].misses == 0
    tiny = run(path, "0.00001", workers=1, chunk=16)  # smaller than one token's experts
    assert tiny[3].misses > 0
    assert_same(tiny, ref)


# ---- Kimi K3 -----------------------------------------------------------------------------

K3_TEXT = dict(
    model_type="kimi_linear", vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    routed_expert_hidden_size=24, latent_moe_use_norm=True, num_hidden_layers=5, num_attention_heads=2,
    num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    mla_use_nope=True, mla_use_output_gate=True, num_experts=8, num_experts_per_token=3, num_shared_experts=2,
    num_expert_group=1, topk_group=1, moe_renormalize=True, moe_router_activation_func="sigmoid",
    routed_scaling_factor=1.5, first_k_dense_replace=1, moe_layer_freq=1, hidden_act="situ",
    activation_situ_beta=4.0, activation_situ_linear_beta=25.0, attn_res_block_size=2, rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    linear_attn_config={"full_attn_layers": [2, 5], "kda_layers": [1, 3, 4], "head_dim": 8, "num_heads": 3,
                        "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
)


def k3_config(**text):
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "text_config": {**K3_TEXT, **text}, "vision_config": {"vt_hidden_size": 16}}


def write_k3(path, seed=7):
    """A tiny random float32 Kimi K3 checkpoint with the published tensor names (and a vision tensor)."""
    cfg = k3_config()
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for t in synth_tensors(cfg):
        if t.init == "norm":
            x = 1.0 + 0.2 * torch.randn(t.shape, generator=g)
        elif t.name.endswith("A_log"):
            x = 0.5 * torch.randn(t.shape, generator=g)
        elif t.name.endswith(("e_score_correction_bias", "dt_bias")) or t.init == "embed":
            x = torch.randn(t.shape, generator=g)
        else:
            x = torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5 * (0.25 if t.init == "out" else 0.5)
        tensors[t.name] = x.contiguous()
    tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(16, 3)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path, tensors


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return write_k3(tmp_path_factory.mktemp("k3"))


def naive_k3(w, c, ids):
    """Kimi K3 logits [T, vocab] straight from the published definition, token by token, every expert dense.

    Written independently of moestream: one plain loop over layers, KDA as its recurrence,
    MLA as softmax attention over full keys, the MoE as a masked sum over all experts.
    """
    p = "language_model.model."
    eps = c["rms_norm_eps"]
    lin = c["linear_attn_config"]
    nh, dk = lin["num_heads"], lin["head_dim"]

    def rms(x, wt, e=eps):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + e) * wt

    def situ_mul(gate, up):
        b, lb = c["activation_situ_beta"], c["activation_situ_linear_beta"]
        return b * torch.tanh(gate / b) * torch.sigmoid(gate) * lb * torch.tanh(up / lb)

    def mlp(x, q, a="gate_proj", b="up_proj", d="down_proj"):
        return situ_mul(x @ w[f"{q}{a}.weight"].T, x @ w[f"{q}{b}.weight"].T) @ w[f"{q}{d}.weight"].T

    def mix(prefix, blocks, name):  # attention residual over depth, per token
        if not blocks:
            return prefix
        v = torch.stack(blocks + [prefix], 1)
        score = (rms(v, w[f"{name}_norm.weight"]) * w[f"{name}_proj.weight"][0]).sum(-1)
        return (score.softmax(-1)[..., None] * v).sum(1)

    n = len(ids)
    hs = w[p + "embed_tokens.weight"][ids]
    blocks = []
    kinds = {i - 1: "mla" for i in lin["full_attn_layers"]} | {i - 1: "kda" for i in lin["kda_layers"]}
    for i in range(c["num_hidden_layers"]):
        q = f"{p}layers.{i}."
        x = rms(mix(hs, blocks, q + "self_attention_res"), w[q + "input_layernorm.weight"])
        if i % c["attn_res_block_size"] == 0:
            blocks.append(hs)
            hs = torch.zeros_like(hs)
        s = q + "self_attn."
        if kinds[i] == "kda":
            out = []
            proj = {z: x @ w[f"{s}{z}_proj.weight"].T for z in "qkv"}
            conv = {z: F.silu(F.conv1d(proj[z].T[None], w[f"{s}{z}_conv1d.weight"], padding=3,
                                       groups=nh * dk)[0, :, :n].T) for z in "qkv"}
            decay = torch.exp(w[s + "A_log"][:nh])[:, None]
            gate_in = (x @ w[s + "f_a_proj.weight"].T @ w[s + "f_b_proj.weight"].T + w[s + "dt_bias"]).view(n, nh, dk)
            log_g = lin["gate_lower_bound"] * torch.sigmoid(decay * gate_in)
            beta = torch.sigmoid(x @ w[s + "b_proj.weight"].T)
            state = torch.zeros(nh, dk, dk)
            for t in range(n):
                qt, kt, vt = (conv[z][t].view(nh, dk) for z in "qkv")
                qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6) / dk**0.5
                kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
                state = state * log_g[t].exp()[:, :, None]
                err = vt - torch.einsum("hkv,hk->hv", state, kt)
                state = state + torch.einsum("hk,hv->hkv", kt, beta[t][:, None] * err)
                o = torch.einsum("hkv,hk->hv", state, qt)
                o = rms(o, w[s + "o_norm.weight"]) * torch.sigmoid((x[t] @ w[s + "g_proj.weight"].T).view(nh, dk))
                out.append(o.reshape(-1))
            attn = torch.stack(out) @ w[s + "o_proj.weight"].T
        else:
            nope, rope, heads = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["num_attention_heads"]
            qq = (rms(x @ w[s + "q_a_proj.weight"].T, w[s + "q_a_layernorm.weight"], 1e-6)
                  @ w[s + "q_b_proj.weight"].T).view(n, heads, nope + rope)
            ckv = x @ w[s + "kv_a_proj_with_mqa.weight"].T
            lat, kr = ckv[:, : c["kv_lora_rank"]], ckv[:, c["kv_lora_rank"]:]
            kv = (rms(lat, w[s + "kv_a_layernorm.weight"], 1e-6) @ w[s + "kv_b_proj.weight"].T).view(n, heads, -1)
            keys = torch.cat([kv[..., :nope], kr[:, None].expand(n, heads, rope)], -1)
            scores = torch.einsum("qhd,khd->hqk", qq, keys) / (nope + rope) ** 0.5
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), kv[..., nope:]).reshape(n, -1)
            attn = (o * torch.sigmoid(x @ w[s + "g_proj.weight"].T)) @ w[s + "o_proj.weight"].T
        hs = hs + attn
        x = rms(mix(hs, blocks, q + "mlp_res"), w[q + "post_attention_layernorm.weight"])
        if i < c["first_k_dense_replace"]:
            hs = hs + mlp(x, q + "mlp.")
            continue
        m = q + "block_sparse_moe."
        scores = torch.sigmoid(x @ w[m + "gate.weight"].T)
        top = (scores + w[m + "gate.e_score_correction_bias"]).topk(c["num_experts_per_token"], -1).indices
        weight = torch.zeros_like(scores).scatter(1, top, scores.gather(1, top))
        weight = weight / weight.sum(-1, keepdim=True) * c["routed_scaling_factor"]
        lat = x @ w[m + "routed_expert_down_proj.weight"].T
        routed = sum(weight[:, e : e + 1] * mlp(lat, f"{m}experts.{e}.", "w1", "w3", "w2")
                     for e in range(c["num_experts"]))
        routed = rms(routed, w[m + "routed_expert_norm.weight"]) @ w[m + "routed_expert_up_proj.weight"].T
        hs = hs + routed + mlp(x, m + "shared_experts.")
    hs = rms(mix(hs, blocks, p + "output_attn_res"), w[p + "norm.weight"])
    return hs @ w["language_model.lm_head.weight"].T


def test_k3_matches_straightforward_implementation(k3, caplog):
    path, tensors = k3
    cfg = json.loads((path / "config.json").read_text())
    ids = PROMPT[:70]
    with torch.no_grad():
        want = naive_k3(tensors, cfg["text_config"], ids)
    with caplog.at_level("WARNING"):
        engine = load(path, cache_budget_gb=0.00001, tokenizer=False)
    try:
        assert "vision tower" in caplog.text and engine.unused_tensors == ["vision_tower.patch_embed.proj.weight"]
        assert sorted(engine.layout.layers) == [1, 2, 3, 4]
        assert engine.layout.pieces(1, 0)[0].shape == (16, 24)  # experts in the latent width
        for chunk in (70, 9):
            assert rel_err(prefill(engine, ids, chunk), want) < 1e-5, chunk
        # decode: each step's logits against the straightforward run over the longer sequence
        steps = list(generate(engine, ids[:12].tolist(), 4, SamplingParams(), stop_at_eos=False, keep_logits=True))
        seq = torch.tensor(ids[:12].tolist() + [s.token for s in steps[:-1]])
        with torch.no_grad():
            full = naive_k3(tensors, cfg["text_config"], seq)
        for j, s in enumerate(steps):
            assert rel_err(s.logits, full[11 + j]) < 1e-5, j
    finally:
        engine.close()


def test_k3_streaming_is_exact(k3):
    path, _ = k3
    ref = run(path, "all", chunk=16, sampling=SamplingParams(temperature=1.0, seed=3))
    tiny = run(path, "0", workers=3, chunk=16, sampling=SamplingParams(temperature=1.0, seed=3))
    assert tiny[3].misses > 0
    assert_same(tiny, ref)


def test_k3_real_config_scaled_down_synth_generate(tmp_path):
    """The published Kimi K3 config, narrowed, through synth (as ``moestream synth``), then ``moestream generate``."""
    real = json.loads((Path(__file__).parent / "configs" / "Kimi-K3.json").read_text())  # as published
    text = real["text_config"]
    lin = dict(text["linear_attn_config"], num_heads=2, head_dim=16)
    real["text_config"] = dict(text, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                               routed_expert_hidden_size=32, num_experts=16, num_experts_per_token=4,
                               num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16,
                               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, linear_attn_config=lin)
    out = synth(real, tmp_path / "m", layers=4)
    meta = json.loads((out / "config.json").read_text())["text_config"]
    assert meta["num_hidden_layers"] == 4 and meta["linear_attn_config"]["full_attn_layers"] == [4]
    assert "quantization_config" not in meta
    r = subprocess.run([sys.executable, "-m", "moestream", "generate", "--model", str(out), "--prompt", "Hello",
                        "--max-tokens", "4", "--temp", "1", "--seed", "0", "--cache-budget-gb", "0.001"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "vision tower" in r.stderr and "cache hit rate" in r.stderr


@pytest.mark.parametrize("which", ["kimi_linear", "k3"])
def test_invariant_to_chunks_capacity_threads_and_batch(which, request):
    path = request.getfixturevalue(which)[0]
    fh.assert_invariant(path)


@pytest.mark.parametrize("which", ["kimi_linear", "k3"])
def test_streaming_exact_wherever_the_pieces_lie(which, request, tmp_path):
    path = request.getfixturevalue(which)[0]
    fh.assert_streaming_exact_at_offsets(path, tmp_path)
