"""GGUF files of the hybrid Qwen architectures (``qwen3next``, ``qwen35moe``) and ``gpt-oss``, written as
llama.cpp's convert_hf_to_gguf.py writes them (tests/gguf_helpers.py: its renames, transformations and
metadata keys, gguf's tensor-name map and quantizers) from tiny random transformers models: moestream's
logits against transformers on the weights the file holds, streaming at budget 0 bit-identical to budget
all, and a missing metadata key named."""

import gguf
import pytest
import torch

from moestream.engine import load
from moestream.errors import CheckpointError
from moestream.generation import SamplingParams, generate
from moestream.inspect import inspect
from moestream.sources import NAMES, hf_config, hf_name, open_gguf

from .gguf_helpers import make_gpt_oss, make_hybrid, reference, write_gpt_oss_gguf, write_hybrid_gguf
from .helpers import one_thread  # noqa: F401 (autouse: one intra-op thread)
from .test_gguf import logits, want_logits


def _check(model, held, path, family):
    want = want_logits(model, held)
    got, engine = logits(path, "all")
    assert engine.family.__name__ == f"moestream.models.{family}"
    assert engine.unused_tensors == []
    rel = (got.double() - want).abs().max() / want.abs().max()
    assert rel < 1e-5, f"max relative error {rel:.2e}"
    tiny, _ = logits(path, "0")
    assert torch.equal(tiny, got), "streaming at budget 0 differs from budget all"
    return engine


@pytest.mark.parametrize("family, qtype, variant", [
    ("qwen3_next", "F32", ""), ("qwen3_next", "Q8_0", ""),
    ("qwen3_next", "Q8_0", "legacy"),  # in_proj_qkvz as one ssm_in, as conversions before attn_qkv + attn_gate
    ("qwen3_next", "F16", "interval"),  # layer kinds from full_attention_interval only
    ("qwen3_next", "F32", "mtp"),  # a multi-token-prediction block after the decoder's: not loaded, named
    ("qwen3_next", "Q8_0", "mixed"),  # attn_gate in F16 beside a Q8_0 attn_qkv: in_proj_qkvz merged as float32
    ("qwen3_5_moe", "F32", ""),
    ("qwen3_5_moe", "Q8_0", ""),  # value heads of 16: out_proj's Q8_0 blocks straddle heads
    ("qwen3_5_moe", "Q8_0", "wide"),  # value heads of 32: whole blocks move
])
def test_hybrid_qwen(family, qtype, variant, tmp_path):
    """Qwen3-Next / Qwen3.5 MoE: norms stored + 1, ssm_a = -exp(A_log), conv squeezed, Qwen3-Next's qkvz
    split (or not), Qwen3.5's value heads tiled; all undone at read."""
    shape = {}
    if variant == "wide":
        shape = dict(linear_key_head_dim=32, linear_value_head_dim=32)
    elif variant == "interval":
        shape = dict(layer_types=None, full_attention_interval=2)
    model = make_hybrid(family, seed=11, **shape)
    path = tmp_path / f"{family}-{qtype}.gguf"
    held = write_hybrid_gguf(model, path, qtype, legacy=variant == "legacy", recurrent_layers=variant != "interval",
                             interval=2 if variant == "interval" else 4, mtp=variant == "mtp",
                             types={"attn_gate": "F16"} if variant == "mixed" else None)
    engine = _check(model, held, path, family)
    if variant == "mtp":
        assert engine.checkpoint.config["num_hidden_layers"] == 4
        assert {n for n in engine.checkpoint.tensors if n.startswith("mtp.")} == {
            "mtp.blk.4.nextn.eh_proj.weight", "mtp.blk.4.nextn.enorm.weight", "mtp.blk.4.attn_norm.weight",
            "mtp.blk.4.ffn_gate_inp.weight"}
    arch = "qwen35moe" if family == "qwen3_5_moe" else "qwen3next"
    assert engine.checkpoint.source_format.architecture == arch
    assert engine.checkpoint.config["layer_types"] == ["linear_attention", "full_attention"] * 2
    tensors = engine.checkpoint.tensors
    if qtype == "Q8_0":  # rows and whole blocks move as stored; nothing is dequantized
        fused = "in_proj_qkvz" if family == "qwen3_next" else "in_proj_qkv"
        for proj in (fused, "out_proj"):
            want = "F32" if variant == "mixed" and proj == fused else "GGML_Q8_0"
            assert tensors[f"model.layers.0.linear_attn.{proj}.weight"].dtype == want
    # value heads of 16 in Q8_0 blocks of 32: out_proj stays tiled and its input follows
    straddles = family == "qwen3_5_moe" and qtype == "Q8_0" and variant != "wide"
    orders = engine.checkpoint.source_format.input_orders
    assert sorted(orders) == (["model.layers.0.linear_attn.out_proj", "model.layers.2.linear_attn.out_proj"]
                              if straddles else [])
    assert (engine.model.model.layers[0].linear_attn.out_order is not None) == straddles


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gpt_oss(qtype, tmp_path):
    """gpt-oss: sinks, biases, YaRN, a sliding window of 5 over 16 tokens, experts de-interleaved into gate
    and up with their biases (MXFP4 experts are another type's work)."""
    model = make_gpt_oss(seed=12)
    path = tmp_path / f"gpt-oss-{qtype}.gguf"
    held = write_gpt_oss_gguf(model, path, qtype)
    with torch.no_grad():  # the clamp of the fixed SwiGLU limit binds in this model
        h = model.model.embed_tokens(torch.arange(16))
        assert (h @ held["model.layers.0.mlp.experts.gate_up_proj"][0]).abs().max() > 7.0
    engine = _check(model, held, path, "gpt_oss")
    cfg = engine.checkpoint.config
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2 and cfg["sliding_window"] == 5
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["rope_parameters"]["truncate"] is False
    got = inspect(str(path))  # gate, up [I, H] and down [H, I] as stored, with their float32 biases
    inter, hidden = 32, 64
    weight = inter * hidden * 4 if qtype == "F32" else inter * hidden // 32 * 34
    assert got.can_stream and got.bytes_per_expert == 3 * weight + (2 * inter + hidden) * 4


@pytest.mark.parametrize("arch, key", [("qwen3next", "ssm.state_size"), ("qwen35moe", "ssm.inner_size"),
                                       ("gpt-oss", "attention.sliding_window")])
def test_a_missing_key_is_named(arch, key, tmp_path):
    path = tmp_path / "m.gguf"
    if arch == "gpt-oss":
        write_gpt_oss_gguf(make_gpt_oss(seed=1), path)
    else:
        write_hybrid_gguf(make_hybrid("qwen3_5_moe" if arch == "qwen35moe" else "qwen3_next", seed=1), path)
    ckpt = open_gguf(path)
    meta = dict(ckpt.source_format.metadata)
    del meta[f"{arch}.{key}"]
    with pytest.raises(CheckpointError, match=rf"m\.gguf: metadata '{arch}\.{key}' is missing"):
        hf_config(meta, ckpt.tensors, path)


@pytest.mark.parametrize("arch, model_arch", [("qwen3next", gguf.MODEL_ARCH.QWEN3NEXT),
                                              ("qwen35moe", gguf.MODEL_ARCH.QWEN35MOE),
                                              ("gpt-oss", gguf.MODEL_ARCH.GPT_OSS)])
def test_names_are_the_gguf_packages(arch, model_arch):
    """Every llama.cpp name moestream maps is one the gguf package lists for the architecture."""
    known = {gguf.TENSOR_NAMES[t].format(bid=3) for t in gguf.MODEL_TENSORS[model_arch]}
    assert model_arch == gguf.MODEL_ARCH(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch))
    for key in NAMES[arch]:
        assert key.format(i=3) in known, key
    assert "blk.3.ssm_a" in known or arch == "gpt-oss"  # the bare A tensor, mapped by its own rule


# what convert_hf_to_gguf.py's Qwen3NextModel, Qwen3_5MoeTextModel and GptOssModel write for each Hugging Face
# module (llama.cpp name -> Hugging Face name, before the transformations undone at open), checked by hand
# against files from llama.cpp's own converter (docs/gguf.md): the table moestream's names, derived from gguf's
# map, must equal
_HYBRID_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj", "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj", "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
    "blk.{i}.attn_qkv": "model.layers.{i}.linear_attn.in_proj_qkv",
    "blk.{i}.attn_gate": "model.layers.{i}.linear_attn.in_proj_z",
    "blk.{i}.ssm_conv1d": "model.layers.{i}.linear_attn.conv1d",
    "blk.{i}.ssm_dt": "model.layers.{i}.linear_attn.dt_proj",
    "blk.{i}.ssm_norm": "model.layers.{i}.linear_attn.norm", "blk.{i}.ssm_out": "model.layers.{i}.linear_attn.out_proj",
    "blk.{i}.ffn_gate_inp": "model.layers.{i}.mlp.gate",
    "blk.{i}.ffn_gate_exps": "model.layers.{i}.mlp.switch_mlp.gate_proj",
    "blk.{i}.ffn_up_exps": "model.layers.{i}.mlp.switch_mlp.up_proj",
    "blk.{i}.ffn_down_exps": "model.layers.{i}.mlp.switch_mlp.down_proj",
    "blk.{i}.ffn_gate_shexp": "model.layers.{i}.mlp.shared_expert.gate_proj",
    "blk.{i}.ffn_up_shexp": "model.layers.{i}.mlp.shared_expert.up_proj",
    "blk.{i}.ffn_down_shexp": "model.layers.{i}.mlp.shared_expert.down_proj",
    "blk.{i}.ffn_gate_inp_shexp": "model.layers.{i}.mlp.shared_expert_gate",
}
EXPECTED_NAMES = {
    "qwen3next": {**_HYBRID_NAMES, "blk.{i}.ssm_in": "model.layers.{i}.linear_attn.in_proj_qkvz",
                  "blk.{i}.ssm_ba": "model.layers.{i}.linear_attn.in_proj_ba"},
    "qwen35moe": {**_HYBRID_NAMES, "blk.{i}.ssm_beta": "model.layers.{i}.linear_attn.in_proj_b",
                  "blk.{i}.ssm_alpha": "model.layers.{i}.linear_attn.in_proj_a"},
    "gpt-oss": {
        "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
        "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
        "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
        "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj", "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
        "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
        "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
        "blk.{i}.attn_sinks": "model.layers.{i}.self_attn.sinks",
        "blk.{i}.ffn_gate_inp": "model.layers.{i}.mlp.router",
        "blk.{i}.ffn_gate_exps": "model.layers.{i}.mlp.switch_mlp.gate_proj",
        "blk.{i}.ffn_up_exps": "model.layers.{i}.mlp.switch_mlp.up_proj",
        "blk.{i}.ffn_down_exps": "model.layers.{i}.mlp.switch_mlp.down_proj",
    },
}


@pytest.mark.parametrize("arch", list(EXPECTED_NAMES))
def test_derived_names_are_what_the_converter_writes(arch):
    assert NAMES[arch] == EXPECTED_NAMES[arch]
    assert hf_name("blk.3.ssm_a", arch) is None  # the bare A tensor: no rule, _adapt_hybrid reads it by name
    assert hf_name("blk.3.ffn_gate_up_exps.weight", arch) is None  # fused gate/up: kept by name, refused


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "gpt_oss"])
def test_decode_steps_match_transformers(kind, tmp_path):
    """Token-by-token decode (DeltaNet's recurrent step with the stored out_proj order; gpt-oss's sliding
    window sliding past the prompt): each step's logits against transformers on the whole sequence, and the
    same bits at budget 0 as at budget all."""
    path = tmp_path / f"{kind}.gguf"
    if kind == "gpt_oss":
        model = make_gpt_oss(seed=13)
        held = write_gpt_oss_gguf(model, path, "Q8_0")
    else:
        model = make_hybrid(kind, seed=13)
        held = write_hybrid_gguf(model, path, "Q8_0")
    prompt = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    runs = []
    for budget in ("all", "0"):
        engine = load(path, cache_budget_gb=budget, tokenizer=False, workers=2, dtype="float32")
        try:
            runs.append(list(generate(engine, prompt, 6, SamplingParams(temperature=0.0), stop_at_eos=False,
                                      keep_logits=True)))
        finally:
            engine.close()
    steps, tiny = runs
    tokens = [s.token for s in steps]
    assert tokens == [s.token for s in tiny] and all(torch.equal(a.logits, b.logits) for a, b in zip(steps, tiny))
    with torch.no_grad():
        want = reference(model, held).double()(torch.tensor(prompt + tokens)[None]).logits[0]
    for i, step in enumerate(steps):
        row = want[len(prompt) - 1 + i]
        assert (step.logits.double() - row).abs().max() / row.abs().max() < 1e-5, f"step {i}"
