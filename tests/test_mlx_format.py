"""MLX-format checkpoints (mlx-lm's names after ``sanitize``, float and affine 4-bit) of every family.

Each family's tiny transformers model (the same ones the family tests build) is rewritten
here as mlx-lm would save it, by an inverse of ``moestream.mlx_format`` written independently
from mlx-lm's published ``sanitize`` methods (the forward direction: HF -> mlx): stacked
``switch_mlp`` experts, renamed modules, norms stored ``1 + w``, conv weights in mlx's axis
order, DeepSeek's ``kv_b_proj`` split into ``embed_q``/``unembed_out``, gpt-oss's experts
de-interleaved. Then:

* float: moestream's logits equal the transformers reference within 1e-5 relative;
* affine 4-bit (group 32; routers at 8 bits, as mlx-lm's quant predicates): the same
  within 1e-5 of the float MLX checkpoint holding the dequantized weights (the test's own
  numpy packer and dequantizer, ``quant_helpers.mlx_quantize``);
* streaming at budget 0 is ``torch.equal`` to budget ``all`` (three families, 4-bit; gpt-oss in bf16);
* bad checkpoints are refused with a message naming the tensor or field.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moestream.engine import load
from moestream.errors import CheckpointError, MoestreamError

from . import family_helpers as fh
from .helpers import make_qwen3_moe, one_thread, read_all  # noqa: F401 (one_thread: autouse)
from .quant_helpers import mlx_quantize

BITS, GROUP = 4, 32
ROUTER_Q = {"group_size": 64, "bits": 8}
PER_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


# -- the HF-named originals: the family tests' tiny models ------------------------------------------

def build(family: str, path: Path):
    """(transformers reference, HF checkpoint folder) of ``family``."""
    if family == "qwen3_moe":
        return make_qwen3_moe(path, seed=1), path
    if family in ("qwen3_next", "qwen3_5_moe"):
        from .test_family_qwen3_hybrid import make_qwen3_5_moe, make_qwen3_next

        if family == "qwen3_next":
            return make_qwen3_next(path, seed=1), path
        return make_qwen3_5_moe(path, seed=2), path / "ckpt"
    if family in ("deepseek_v3", "kimi_k2", "deepseek_v2", "deepseek_v32", "glm4_moe"):
        from .test_family_deepseek import make_model

        return make_model(path, family, seed=1), path
    if family == "kimi_linear":
        from .test_family_kimi import make_kimi_linear

        return make_kimi_linear(path), path
    if family == "laguna":
        from .test_family_laguna import build as laguna

        return laguna(path, 1), path
    if family == "olmoe":
        from .test_family_olmoe import build as olmoe

        return olmoe(path, 1), path
    import transformers

    cls, mod = {"mixtral": ("Mixtral", "test_family_mixtral"), "gpt_oss": ("GptOss", "test_family_gpt_oss"),
                "minimax_m2": ("MiniMaxM2", "test_family_minimax_m2"),
                "hunyuan_v1_moe": ("HunYuanMoEV1", "test_family_hunyuan_v1_moe")}[family]
    import importlib

    m = importlib.import_module(f"tests.{mod}")
    cfg = getattr(transformers, cls + "Config")(**m.TINY)
    ref = fh.save_reference(getattr(transformers, cls + "ForCausalLM"), cfg, path, seed=1,
                            extra=getattr(m, "redraw", None))
    return ref, path


# -- mlx-lm's sanitize, forward (HF -> mlx), written from mlx_lm/models/*.py ----------------------------

def to_mlx(family: str, t: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """The tensors ``t`` (HF names) as mlx-lm's ``sanitize`` leaves them for ``family``."""
    t = dict(t)
    if family == "qwen3_5_moe":
        out = {}
        for k, v in t.items():
            if k.startswith("model.visual"):
                continue
            if k.startswith("model.language_model."):
                k = "language_model.model." + k[len("model.language_model."):]
            elif not k.startswith("language_model."):
                k = "language_model." + k  # lm_head, mtp.*
            out[k] = v
        t = out
    # stack routed experts: <block>.experts.E.<proj> -> <block>.switch_mlp.<proj> [E, out, in]
    groups: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for k in list(t):
        m = PER_EXPERT.match(k)
        if m:
            groups.setdefault((m[1], PROJ.get(m[3], m[3])), {})[int(m[2])] = t.pop(k)
    for (block, proj), experts in groups.items():
        t[f"{block}.switch_mlp.{proj}.weight"] = torch.stack([experts[e] for e in range(len(experts))])
    if family in ("qwen3_next", "qwen3_5_moe"):
        for k, v in list(t.items()):
            if k.endswith("conv1d.weight"):
                t[k] = v.permute(0, 2, 1).contiguous()  # [C, 1, K] -> [C, K, 1]
            if v.dim() == 1 and k.endswith((".input_layernorm.weight", ".post_attention_layernorm.weight",
                                            "model.norm.weight", ".q_norm.weight", ".k_norm.weight")):
                t[k] = v + 1.0
    if family in ("deepseek_v3", "kimi_k2", "deepseek_v32"):
        heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
        for k in [k for k in t if k.endswith("self_attn.kv_b_proj.weight")]:
            v = t.pop(k).reshape(heads, nope + cfg["v_head_dim"], -1)
            p = k[: -len("kv_b_proj.weight")]
            t[p + "embed_q.weight"] = v[:, :nope, :].transpose(-1, -2).contiguous()
            t[p + "unembed_out.weight"] = v[:, nope:, :].contiguous()
    if family == "laguna":
        for k in list(t):
            if k.endswith("mlp.gate.weight"):
                t[k.replace("mlp.gate.weight", "mlp.gate.proj.weight")] = t.pop(k)
            elif k.endswith("mlp.experts.e_score_correction_bias"):
                t[k.replace("experts.e_score_correction_bias", "gate.e_score_correction_bias")] = t.pop(k)
    if family == "gpt_oss":  # HF keeps x @ W: gate_up [E, H, 2I] (gate even columns), down [E, I, H]
        for k in [k for k in t if k.endswith("mlp.experts.gate_up_proj")]:
            p = k[: -len("gate_up_proj")]
            gu, b = t.pop(k), t.pop(p + "gate_up_proj_bias")
            t[p + "gate_proj.weight"] = gu[:, :, ::2].transpose(1, 2).contiguous()
            t[p + "up_proj.weight"] = gu[:, :, 1::2].transpose(1, 2).contiguous()
            t[p + "gate_proj.bias"], t[p + "up_proj.bias"] = b[:, ::2].contiguous(), b[:, 1::2].contiguous()
            t[p + "down_proj.weight"] = t.pop(p + "down_proj").transpose(1, 2).contiguous()
            t[p + "down_proj.bias"] = t.pop(p + "down_proj_bias")
    if family == "kimi_linear":
        out = {}
        for k, v in t.items():
            k = k.replace(".block_sparse_moe.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
            k = k.replace(".block_sparse_moe.", ".mlp.")
            if (m := re.search(r"\.self_attn\.([qkv])_conv1d\.weight$", k)):
                k, v = k[: m.start()] + f".self_attn.{m[1]}_conv.conv.weight", v.permute(0, 2, 1).contiguous()
            if k.endswith(".A_log"):
                v = v.reshape(-1)
            k = k.replace(".kv_a_proj_with_mqa.", ".kv_a_proj.").replace(".kv_a_layernorm.", ".kv_a_norm.")
            out[k] = v
        t = out
    return t


# modules mlx-lm leaves float: raw-parameter routers (DeepSeek's and GLM's MoEGate)
RAW_ROUTER = ("deepseek_v3", "kimi_k2", "deepseek_v2", "deepseek_v32", "glm4_moe")
ROUTER_8BIT = re.compile(r"\.(mlp\.gate|mlp\.shared_expert_gate|mlp\.gate\.proj|mlp\.router|block_sparse_moe\.gate)$")


def quantize(family: str, t: dict[str, torch.Tensor], tied: bool):
    """mlx-lm's ``quantize_model`` on sanitized tensors: every Linear / Embedding / SwitchLinear /
    MultiLinear weight whose last dim the group divides, routers at 8 bits where mlx-lm's predicate
    says so. Returns (quantized tensors, float tensors holding the dequantized weights, config block)."""
    q, deq, block = {}, {}, {"group_size": GROUP, "bits": BITS}
    for k, v in t.items():
        path = k[: -len(".weight")]
        router = bool(ROUTER_8BIT.search(path))
        skip = (not k.endswith(".weight") or v.dim() < 2 or "norm" in k or "conv" in k
                or (family in RAW_ROUTER and k.endswith("mlp.gate.weight"))
                or (tied and k.endswith("embed_tokens.weight")))
        bits, group = (8, 64) if router else (BITS, GROUP)
        if skip or v.shape[-1] % group:
            q[k] = deq[k] = v
            continue
        packed, scales, biases, dq = mlx_quantize(v, bits, group)
        q[k], q[path + ".scales"], q[path + ".biases"] = packed, scales, biases
        deq[k] = dq
        if router:
            block[path] = dict(ROUTER_Q)
    return q, deq, block


def write_mlx(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quant: dict | None = None,
              metadata: bool = True) -> Path:
    """A model folder as mlx-lm saves it: config (+ quantization), one shard with metadata format mlx."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if quant is not None:
        cfg["quantization"] = cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "mlx"} if metadata else None)
    return dst


FAMILIES = ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3", "kimi_k2", "deepseek_v2", "deepseek_v32",
            "glm4_moe", "kimi_linear", "laguna", "mixtral", "gpt_oss", "olmoe", "minimax_m2", "hunyuan_v1_moe"]
STREAMED = ("qwen3_5_moe", "deepseek_v3")  # and gpt-oss in bf16, below


def logits(path: Path, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    engine = load(path, cache_budget_gb=0.0001, tokenizer=False, workers=2)
    try:
        kv = engine.model.new_kv_cache()
        with torch.inference_mode():
            return torch.cat([engine.model(ids[s : s + chunk], s, kv, all_logits=True)
                              for s in range(0, len(ids), chunk)])
    finally:
        engine.close()


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_build_matches_the_hf_original(family, tmp_path):
    ref, src = build(family, tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    mlx = to_mlx(family, read_all(src), cfg)
    assert any(".switch_mlp." in k or ".mlp.experts.gate_proj." in k for k in mlx)
    path = write_mlx(src, tmp_path / "mlx", mlx)
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0]
    got = logits(path, ids, 16)
    assert rel(got, want) < 1e-5, f"{family}: float MLX build vs transformers {rel(got, want):.2e}"

    # affine 4-bit: equal to the float build holding the dequantized weights
    text = cfg.get("text_config", cfg)
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    qt, deq, block = quantize(family, mlx, tied)
    assert sum(v.dtype == torch.uint32 for v in qt.values()) >= 10
    qpath = write_mlx(src, tmp_path / "mlx4", qt, block)
    dpath = write_mlx(src, tmp_path / "deq", deq)
    got_q, want_q = logits(qpath, ids, 40), logits(dpath, ids, 40)
    assert rel(got_q, want_q) < 1e-5, f"{family}: 4-bit MLX build vs its dequantized weights {rel(got_q, want_q):.2e}"
    if family in STREAMED:
        fh.assert_streaming_exact(qpath)


def test_bf16_4bit_gpt_oss_streams_exactly(tmp_path):
    """bf16, as MLX builds ship: gpt-oss's experts dequantize per call (biases kept), no int4 repacking."""
    _, src = build("gpt_oss", tmp_path / "hf")
    qt, _, block = quantize("gpt_oss", to_mlx("gpt_oss", read_all(src), {}), False)
    qt = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in qt.items()}
    path = write_mlx(src, tmp_path / "mlx4", qt, block)
    fh.assert_streaming_exact(path)


def test_laguna_router_named_as_older_mlx_lm(tmp_path):
    """Older mlx-lm Laguna: router ``mlp.gate.weight`` (a raw parameter) beside ``mlp.gate.e_score_correction_bias``."""
    ref, src = build("laguna", tmp_path / "hf")
    t = to_mlx("laguna", read_all(src), {})
    t = {k.replace("mlp.gate.proj.weight", "mlp.gate.weight"): v for k, v in t.items()}
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0]
    assert rel(logits(write_mlx(src, tmp_path / "mlx", t), ids, 24), want) < 1e-5


def test_inspect_names_the_format(tmp_path):
    from moestream.inspect import inspect

    ref, src = build("qwen3_5_moe", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    qt, _, block = quantize("qwen3_5_moe", to_mlx("qwen3_5_moe", read_all(src), cfg), False)
    r = inspect(str(write_mlx(src, tmp_path / "mlx4", qt, block)))
    assert r.can_stream and r.moe_layers == 4 and r.expert_layout == "stacked"
    assert r.checkpoint_format.startswith("MLX (mlx-lm names")
    assert "affine 4-bit, group 32" in r.checkpoint_format and "affine 8-bit, group 64" in r.checkpoint_format
    assert "format:" in r.to_text()
    assert inspect(str(src)).checkpoint_format == ""  # the Hugging Face release is not MLX
    # without the metadata, mlx-lm's names alone tell (here the language_model.model. prefix)
    bare = inspect(str(write_mlx(src, tmp_path / "bare", qt, block, metadata=False)))
    assert bare.checkpoint_format == r.checkpoint_format


@pytest.fixture(scope="module")
def qwen_mlx4(tmp_path_factory):
    d = tmp_path_factory.mktemp("refuse")
    _, src = build("qwen3_moe", d / "hf")
    qt, _, block = quantize("qwen3_moe", to_mlx("qwen3_moe", read_all(src), {}), False)
    return src, qt, block


def test_bits_that_disagree_with_the_tensors_are_refused(qwen_mlx4, tmp_path):
    src, qt, block = qwen_mlx4
    path = write_mlx(src, tmp_path / "bad", qt, dict(block, bits=8))
    with pytest.raises(MoestreamError, match=r"switch_mlp.*(not affine 8-bit|8 bits)|8-bit"):
        load(path, tokenizer=False)
    path = write_mlx(src, tmp_path / "bad2", qt, None)  # packed tensors, no quantization block
    with pytest.raises(MoestreamError, match="declares no mlx affine quantization"):
        load(path, tokenizer=False)


def test_a_missing_stacked_expert_tensor_names_the_file(qwen_mlx4, tmp_path):
    src, qt, block = qwen_mlx4
    qt = {k: v for k, v in qt.items() if not k.startswith("model.layers.1.mlp.switch_mlp.up_proj.")}
    path = write_mlx(src, tmp_path / "bad", qt, block)
    with pytest.raises(MoestreamError, match=r"bad/model\.safetensors: model\.layers\.1\.mlp: every expert "
                       r"\(stacked\) lacks up"):
        load(path, tokenizer=False)


def test_split_kv_b_that_disagrees_with_the_config_is_refused(tmp_path):
    _, src = build("deepseek_v3", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    mlx = to_mlx("deepseek_v3", read_all(src), cfg)
    path = write_mlx(src, tmp_path / "mlx", mlx)
    c = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(c, qk_nope_head_dim=c["qk_nope_head_dim"] + 2)))
    with pytest.raises(CheckpointError, match=r"embed_q\.weight.*config"):
        load(path, tokenizer=False)


def test_mixed_conv_orders_and_k3_are_refused(tmp_path):
    _, src = build("qwen3_next", tmp_path / "hf")
    t = read_all(src)
    k = next(n for n in t if n.endswith("conv1d.weight"))
    t[k] = t[k].permute(0, 2, 1).contiguous()  # one conv in mlx order, the rest in torch order
    with pytest.raises(CheckpointError, match=r"mlx order \[C, K, 1\].*torch order"):
        load(write_mlx(src, tmp_path / "mixed", t), tokenizer=False)
    k3 = tmp_path / "k3"
    shutil.copytree(tmp_path / "mixed", k3)
    (k3 / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))
    with pytest.raises(CheckpointError, match="mlx-lm has no Kimi K3 model"):
        load(k3, tokenizer=False)
