"""Tiny GGUF files for the tests, written by the ``gguf`` package (llama.cpp's own Python writer) from a
transformers Qwen3-MoE model, independently of moestream: names from ``gguf``'s tensor-name map,
weights quantized by ``gguf.quants.quantize`` where it has a quantizer (random blocks of the type where it
has none: the K-quants) and read back by ``gguf.quants.dequantize`` for the reference."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize, quantize

from .helpers import GLM4_MOE_TINY, NORMS, QWEN_HYBRID_TINY, ROUTERS, ends, has, random_family_model, redraw_

# bytes of each block that hold float16 scales (ggml-common.h), set to finite values in random blocks
_F16_FIELDS = {"Q2_K": (80, 84), "Q3_K": (108, 110), "Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210),
               "IQ4_NL": (0, 2), "IQ4_XS": (0, 2), "IQ2_XXS": (0, 2), "IQ2_XS": (0, 2), "IQ2_S": (0, 2),
               "IQ3_XXS": (0, 2), "IQ3_S": (0, 2), "IQ1_S": (0, 2), "TQ1_0": (52, 54), "TQ2_0": (64, 66)}
# scales that are no plain float16 field: MXFP4's e8m0 byte, IQ1_M's float16 spread over 4 nibbles
_OTHER_SCALES = ("MXFP4", "IQ1_M")
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
RANDOM_TYPES = (*_F16_FIELDS, *_OTHER_SCALES)  # random blocks (gguf.quants quantizes none of the IQ1-IQ3 types)
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
           "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")  # blocks of 256

# a shape whose every linear takes a multiple of 256 inputs (the K-quants' block)
K_SHAPE = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64)


def _add_shape(w: gguf.GGUFWriter, cfg) -> None:
    """The metadata of the transformers config ``cfg``'s shape: blocks, context, widths, heads."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)


def _finish(w: gguf.GGUFWriter) -> None:
    """Write the header, the metadata and the tensors of ``w`` to its file, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_model(seed: int = 0, family: str = "qwen3_moe", **overrides):
    """A random float32 transformers Qwen3MoeForCausalLM (or MixtralForCausalLM; norms and routers randomized too)."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from .helpers import TINY

    torch.manual_seed(seed)
    if family == "mixtral":
        args = {k: v for k, v in TINY.items() if k not in ("moe_intermediate_size", "num_experts", "norm_topk_prob")}
        args = {**args, "intermediate_size": 32, "num_local_experts": 8, "rope_theta": 1e6, **overrides}
        model = MixtralForCausalLM(MixtralConfig(**args)).eval()
    elif family == "olmoe":
        args = {k: v for k, v in TINY.items() if k not in ("moe_intermediate_size", "norm_topk_prob", "head_dim")}
        args = {**args, "intermediate_size": 32, "norm_topk_prob": False, **overrides}
        model = OlmoeForCausalLM(OlmoeConfig(**args)).eval()
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY, **overrides})).eval()
    redraw_(model.named_parameters(), NORMS, ROUTERS)
    return model


def _random_blocks(shape: tuple[int, ...], qtype: str, std: float, rng) -> np.ndarray:
    """Random ``qtype`` blocks for a float weight of ``shape`` whose dequantized values have about ``std``."""
    qt = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    if qtype in _OTHER_SCALES:
        return _random_other(raw, shape, qtype, qt, std, rng)
    a, b = _F16_FIELDS[qtype]
    # scales proportional to 1: measure the spread, then scale every block's d (and dmin) to the target
    raw[..., a:b] = np.ones((*raw.shape[:-1], (b - a) // 2), np.float16).view(np.uint8)
    unit = dequantize(raw.reshape(*shape[:-1], -1), qt).std()
    d = (std / unit) * rng.uniform(0.5, 1.5, (*raw.shape[:-1], (b - a) // 2))
    raw[..., a:b] = d.astype(np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


def _iq1_m_d(raw: np.ndarray, d: np.ndarray) -> None:
    """Set IQ1_M blocks' float16 ``d`` (the top nibbles of its 4 scale words, lowest first) in place."""
    bits = d.astype(np.float16).view(np.uint16)
    sc = raw[..., 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
    for i in range(4):
        sc[..., i] |= ((bits >> np.uint16(4 * i)) & np.uint16(0xF)) << np.uint16(12)
    raw[..., 48:56] = sc.view(np.uint8)


def _random_other(raw, shape, qtype, qt, std, rng) -> np.ndarray:
    lead = raw.shape[:-1]
    if qtype == "MXFP4":  # e8m0: the nearest power of two, spread over 3 octaves
        raw[..., 0] = 128
        unit = dequantize(raw.reshape(*shape[:-1], -1), qt).std()
        raw[..., 0] = 128 + int(np.round(np.log2(std / unit))) + rng.integers(-1, 2, lead)
    else:
        _iq1_m_d(raw, np.ones(lead))
        unit = dequantize(raw.reshape(*shape[:-1], -1), qt).std()
        _iq1_m_d(raw, (std / unit) * rng.uniform(0.5, 1.5, lead))
    return raw.reshape(*shape[:-1], -1)


def encode(arr: np.ndarray, qtype: str, rng) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """(data for GGUFWriter.add_tensor, its raw ggml type) of float32 ``arr`` stored as ``qtype``."""
    qt = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return arr.astype(np.float32), qt
    if qtype == "F16":
        return arr.astype(np.float16), qt
    if qtype in RANDOM_TYPES:
        return _random_blocks(arr.shape, qtype, float(arr.std()), rng), qt
    return quantize(arr.astype(np.float32), qt), qt


def decode(data: np.ndarray, qt: gguf.GGMLQuantizationType) -> torch.Tensor:
    """The float32 values the file holds (``gguf.quants.dequantize``)."""
    if qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return torch.from_numpy(data.astype(np.float32))
    return torch.from_numpy(np.ascontiguousarray(dequantize(data, qt)))


def llama_permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): the q/k row order its rotary embedding wants."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, qtype: str = "F32", *, types: dict | None = None, tie: bool = False,
               split_max_tensors: int = 0, seed: int = 0, arch: str | None = None, extra=None,
               per_expert: bool = False) -> dict[str, torch.Tensor]:
    """Write ``model`` (transformers Qwen3-MoE, or Mixtral as llama.cpp's ``llama`` architecture with its q/k
    rows permuted as convert_hf_to_gguf.py does) as a GGUF file at ``path``; return the weights it holds.

    2-D and 3-D weights are stored as ``qtype`` (``types`` maps a GGUF tensor kind such as
    ``ffn_down_exps`` to another type), norms and routers as F32, as llama.cpp's quantizer leaves them.
    ``tie``: no ``output`` tensor. ``split_max_tensors``: a split set of files of at most that many tensors.
    ``extra(writer)`` adds more metadata (a tokenizer). ``per_expert``: one tensor per expert
    (``blk.N.ffn_gate.E.weight``, as llama.cpp wrote Mixtral before it stacked them).
    Returns Hugging Face name -> float32 weight as the file holds it (transformers' own names: fused
    ``mlp.experts.gate_up_proj``).
    """
    cfg = model.config
    mixtral, olmoe = cfg.model_type == "mixtral", cfg.model_type == "olmoe"
    rng = np.random.default_rng(seed)
    model_arch = gguf.MODEL_ARCH.LLAMA if mixtral else gguf.MODEL_ARCH.OLMOE if olmoe else gguf.MODEL_ARCH.QWEN3MOE
    names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch or gguf.MODEL_ARCH_NAMES[model_arch], split_max_tensors=split_max_tensors)
    _add_shape(w, cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]) if getattr(cfg, "rope_parameters", None)
                         else float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts if mixtral else cfg.num_experts)
    if olmoe:
        w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if not (mixtral or olmoe):  # llama.cpp's LlamaModel and OlmoeModel write the experts' width as
        # feed_forward_length only
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if extra is not None:
        extra(w)
    held: dict[str, torch.Tensor] = {}
    for hf, t in model.state_dict().items():
        if tie and hf == "lm_head.weight":
            continue
        parts = {hf: t}
        if hf.endswith("mlp.experts.gate_up_proj"):  # convert_hf_to_gguf splits it into gate and up [E, I, H]
            stem = hf[: -len("gate_up_proj")]
            half = t.shape[1] // 2
            parts = {stem + "gate_proj.weight": t[:, :half], stem + "up_proj.weight": t[:, half:]}
        elif hf.endswith("mlp.experts.down_proj"):
            parts = {hf + ".weight": t}
        perm = None
        if mixtral and hf.endswith(("q_proj.weight", "k_proj.weight")):
            kv = None if hf.endswith("q_proj.weight") else cfg.num_key_value_heads
            perm = llama_permute(torch.arange(t.shape[0]), cfg.num_attention_heads, kv)  # file row r holds row perm[r]
            parts = {hf: t[perm]}
        got = {}
        for name, v in parts.items():
            g = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert g is not None, name
            kind = g.split(".")[-2]
            want = "F32" if v.dim() == 1 or kind == "ffn_gate_inp" else (types or {}).get(kind, qtype)
            data, qt = encode(v.float().numpy(), want, rng)
            w.add_tensor(g, data, raw_dtype=qt)
            got[name] = decode(data, qt).reshape(v.shape)
        if per_expert and ".experts." in hf:  # rewrite the stacked tensors just written as one per expert
            for name, v in parts.items():
                g = names.get_name(name, try_suffixes=(".weight",))
                info = w.tensors[-1].pop(g)
                for e in range(v.shape[0]):
                    one = np.ascontiguousarray(info.tensor[e])
                    w.add_tensor(g.replace("_exps.weight", f".{e}.weight"), one, raw_dtype=info.dtype)
        if perm is not None:
            held[hf] = torch.empty_like(got[hf])
            held[hf][perm] = got[hf]  # back in Hugging Face order for the reference
        elif hf.endswith("mlp.experts.gate_up_proj"):
            held[hf] = torch.cat([got[n] for n in parts], dim=1)
        else:
            held[hf] = next(iter(got.values()))
    if tie:
        held["lm_head.weight"] = held["model.embed_tokens.weight"]
    _finish(w)
    return held


def reference(model, held: dict[str, torch.Tensor]):
    """transformers' model of ``model``'s class and config holding the weights ``held`` (float32; its
    experts computed by the eager loop, which also runs in float64)."""
    import copy

    cfg = copy.deepcopy(model.config)
    cfg._experts_implementation = "eager"
    ref = type(model)(cfg).eval()
    ref.load_state_dict({k: v.float() for k, v in held.items()})
    return ref


# -- DeepSeek-V2/V3 (deepseek2) and GLM-4.5 (glm4moe) ---------------------------------------------------------
MLA_TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=32,
                qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=3,
                first_k_dense_replace=1, n_shared_experts=2, routed_scaling_factor=2.5, max_position_embeddings=2560,
                tie_word_embeddings=False)  # every linear's input a multiple of 32 (Q8_0's block)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 64}
FAMILY_MODELS = {
    # sigmoid + correction bias, 4 groups of 2 (top 2), YaRN with mscale (Kimi K2 is the same architecture)
    "deepseek_v3": ("DeepseekV3", dict(MLA_TINY, n_group=4, topk_group=2, norm_topk_prob=True, rope_parameters=YARN)),
    # V2-Lite: plain q_proj, softmax greedy top-k, default rope
    "deepseek_v2": ("DeepseekV2", dict(MLA_TINY, q_lora_rank=None, topk_method="greedy", n_shared_experts=1,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # partial rotary, attention bias, qk norm, sigmoid + bias with 4 groups of 2
    "glm4_moe": ("Glm4Moe", dict(GLM4_MOE_TINY, num_hidden_layers=3)),
}


def make_family_model(family: str, seed: int = 0, **overrides):
    """A random float32 transformers DeepseekV3/DeepseekV2/Glm4Moe ForCausalLM of :data:`FAMILY_MODELS`; norms,
    routers, biases and the correction bias randomized (init leaves them 1 or 0, which would hide their misuse)."""
    return random_family_model(FAMILY_MODELS, family, seed, **overrides)


def _write_family_metadata(w: gguf.GGUFWriter, cfg, mtp_layers: int, gating: bool) -> None:
    """What convert_hf_to_gguf.py's TextModel and DeepseekV2Model / Glm4MoeModel ``set_gguf_parameters`` write."""
    mla = cfg.model_type.startswith("deepseek")
    rope = dict(cfg.rope_parameters)
    w.add_block_count(cfg.num_hidden_layers + mtp_layers)  # GLM's MTP layers follow the decoder layers
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1 if mla else cfg.num_key_value_heads)  # DeepseekV2Model: MLA as MQA
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "n_group", None) is not None:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    if gating:  # scoring_func in config.json (DeepSeek-V3's, V2's); Glm4MoeModel writes sigmoid always
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if cfg.model_type != "deepseek_v2"
                                 else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:  # DeepseekV2Model writes it only when true
        w.add_expert_weights_norm(True)
    if mla:
        if cfg.q_lora_rank is not None:
            w.add_q_lora_rank(cfg.q_lora_rank)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
        w.add_rope_dimension_count(cfg.qk_rope_head_dim)
        if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim"):
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    else:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.5)))
        w.add_nextn_predict_layers(mtp_layers)


def write_gguf_family(model, path: Path, qtype: str = "F32", *, types: dict | None = None, seed: int = 0,
                      split_kv_b: bool = True, mtp_layers: int = 0, gating: bool = True,
                      drop: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Write a transformers DeepSeek-V2/V3 (``deepseek2``) or GLM-4.5 (``glm4moe``) model as convert_hf_to_gguf.py
    does; return Hugging Face name -> float32 weight as the file holds it (transformers' own names).

    Names from gguf's tensor-name map; ``e_score_correction_bias`` renamed ``e_score_correction.bias`` first
    (``blk.N.exp_probs_b.bias``); experts stacked; for MLA, ``kv_b_proj`` [H * (nope + v), rank] split per head
    into ``attn_k_b`` (the key rows, transposed: [H, rank, nope]) and ``attn_v_b`` [H, v, rank] (``split_kv_b``
    false: one ``attn_kv_b``, as llama.cpp wrote before its absorbed MLA). 2-D and 3-D weights stored as
    ``qtype`` (``types``: kind -> type), norms and routers F32. ``mtp_layers``: GLM multi-token-prediction layers
    of random weights after the decoder layers (a MoE layer plus ``nextn.*``), which moestream must leave unused.
    ``gating``: write ``expert_gating_func``. ``drop``: metadata keys to leave out.
    """
    cfg = model.config
    mla = cfg.model_type.startswith("deepseek")
    arch = gguf.MODEL_ARCH.DEEPSEEK2 if mla else gguf.MODEL_ARCH.GLM4_MOE
    n_blocks = cfg.num_hidden_layers + mtp_layers
    names = gguf.get_tensor_name_map(arch, n_blocks)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    _write_family_metadata(w, cfg, mtp_layers, gating)
    for key in drop:
        del w.kv_data[0][key]

    def put(g: str, v: torch.Tensor) -> torch.Tensor:
        kind = g.split(".")[-2]
        want = "F32" if v.dim() == 1 or kind == "ffn_gate_inp" else (types or {}).get(kind, qtype)
        data, qt = encode(v.float().numpy(), want, rng)
        w.add_tensor(g, data, raw_dtype=qt)
        return decode(data, qt).reshape(v.shape)

    held: dict[str, torch.Tensor] = {}
    state = dict(model.state_dict())
    heads, nope, v_dim = cfg.num_attention_heads, getattr(cfg, "qk_nope_head_dim", 0), getattr(cfg, "v_head_dim", 0)
    for i in range(cfg.num_hidden_layers, n_blocks):  # MTP layers: the last layer's tensors, redrawn, plus nextn.*
        last = f"model.layers.{cfg.num_hidden_layers - 1}."
        for n, t in list(state.items()):
            if n.startswith(last):
                state[f"model.layers.{i}." + n[len(last):]] = torch.randn(t.shape) * 0.1 + (1.0 if "norm" in n else 0)
        h = cfg.hidden_size
        for n, shape in (("eh_proj.weight", (h, 2 * h)), ("enorm.weight", (h,)), ("hnorm.weight", (h,)),
                         ("shared_head.norm.weight", (h,))):
            state[f"model.layers.{i}.{n}"] = torch.randn(shape) * 0.1
    for hf, t in state.items():
        mtp = (m := re.match(r"model\.layers\.(\d+)\.", hf)) is not None and int(m[1]) >= cfg.num_hidden_layers
        if hf.endswith("mlp.experts.gate_up_proj"):  # stacked gate and up [E, I, H]
            stem, half = hf[: -len("gate_up_proj")], t.shape[1] // 2
            got = [put(names.get_name(stem + r, (".weight",)) + ".weight", x)
                   for r, x in (("gate_proj", t[:, :half]), ("up_proj", t[:, half:]))]
            got = torch.cat(got, dim=1)
        elif hf.endswith("mlp.experts.down_proj"):
            got = put(names.get_name(hf) + ".weight", t)
        elif hf.endswith("e_score_correction_bias"):
            got = put(names.get_name(hf.replace("e_score_correction_bias", "e_score_correction")) + ".bias", t)
        elif hf.endswith("kv_b_proj.weight") and split_kv_b:  # DeepseekV2Model's split for the absorbed MLA
            kv_b = t.view(heads, nope + v_dim, t.shape[-1])
            k_b, v_b = kv_b[:, :nope].transpose(1, 2).contiguous(), kv_b[:, nope:].contiguous()
            k_got = put(names.get_name(hf.replace("kv_b_proj", "k_b_proj"), (".weight",)), k_b)
            v_got = put(names.get_name(hf.replace("kv_b_proj", "v_b_proj"), (".weight",)), v_b)
            got = torch.cat([k_got.transpose(1, 2), v_got], dim=1).reshape(t.shape)
        else:
            g = names.get_name(hf, (".weight", ".bias"))
            assert g is not None, hf
            got = put(g, t)
        if not mtp:
            held[hf] = got
    _finish(w)
    return held


# -- qwen3next, qwen35moe and gpt-oss, written as convert_hf_to_gguf.py writes them -------------------------
# the tiny hybrid Qwen (2 key heads for 4 value heads: Qwen3.5's converter reorders the value heads only then)
# with every linear's input a multiple of Q8_0's 32
HYBRID = dict(QWEN_HYBRID_TINY, shared_expert_intermediate_size=64, linear_value_head_dim=16)
GPT_OSS = dict(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
               max_position_embeddings=512, sliding_window=5,
               rope_parameters=dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                    original_max_position_embeddings=64, rope_theta=150000.0))


def make_hybrid(family: str, seed: int = 0, **overrides):
    """A random float32 transformers Qwen3NextForCausalLM (``qwen3_next``) or Qwen3_5MoeForCausalLM
    (``qwen3_5_moe``), every layer MoE (llama.cpp's graph has no dense layer); norms, routers, gates,
    time steps and decays away from their init."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)
    args = {**HYBRID, **overrides}
    if family == "qwen3_next":
        cfg = Qwen3NextConfig(**args, norm_topk_prob=True, mlp_only_layers=[], rope_parameters=rope)
        model = Qwen3NextForCausalLM(cfg).eval()
    else:
        rope = dict(rope, mrope_section=[1, 1, 0], mrope_interleaved=True)
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**args, rope_parameters=rope)).eval()
    redraw_(model.named_parameters(),
            (ends("linear_attn.norm.weight"), 1.0, 0.2),  # the gated norm scales by weight
            (has("norm"), 0.0, 0.2),  # zero-centred norms scale by 1 + weight
            (ends("mlp.gate.weight", "shared_expert_gate.weight"), 0.0, 0.5),
            (ends("dt_bias"), 1.0, 0.3), (ends("A_log"), 0.0, 0.5))
    return model


def make_gpt_oss(seed: int = 0, **overrides):
    """A random float32 transformers GptOssForCausalLM (YaRN, sinks, biases; experts drawn wide enough that
    llama.cpp's fixed SwiGLU limit 7 binds)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**{**GPT_OSS, **overrides})).eval()
    redraw_(model.named_parameters(), NORMS, (ends("embed_tokens.weight"), 0.0, 1.0),
            (ends("gate_up_proj", "down_proj"), 0.0, 1.0), (ends("_bias", ".bias", "sinks"), 0.0, 0.3),
            (ends("router.weight"), 0.0, 0.5))
    return model


def _quantized_by_llama(gname: str, shape: tuple[int, ...]) -> bool:
    """Whether llama-quant.cpp's rules quantize tensor ``gname`` of torch ``shape`` (2-D and up as ggml counts
    them, leading 1s not counted: the [1, H] shared-expert gate stays F32; ending in ``weight``; not a norm,
    the router, or the DeltaNet conv)."""
    dims = len(shape)
    while dims > 1 and shape[len(shape) - dims] == 1:
        dims -= 1
    return (dims >= 2 and gname.endswith("weight") and "_norm.weight" not in gname
            and "ffn_gate_inp.weight" not in gname and "ssm_conv1d" not in gname)


def _reorder_v_heads(t: torch.Tensor, dim: int, k_heads: int, per: int, width: int) -> torch.Tensor:
    """``_LinearAttentionVReorderBase._reorder_v_heads`` (convert_hf_to_gguf.py): value heads grouped by key
    head -> tiled, along ``dim``."""
    shape = list(t.shape)
    dim %= len(shape)
    t = t.reshape(*shape[:dim], k_heads, per, width, *shape[dim + 1:])
    perm = list(range(t.dim()))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(shape)


def _ids_through(fn, n: int) -> torch.Tensor:
    """Where ``fn`` (rows moved along dim 0) takes each row from: ``fn(arange(n))``."""
    return fn(torch.arange(n, dtype=torch.float64)[:, None]).reshape(-1).long()


def _convert_hybrid(model, legacy: bool) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(HF name as the converter names it, tensor, source rows or None) for every tensor of ``model``, as
    Qwen3NextModel / Qwen3_5MoeTextModel.modify_tensors make them. ``source rows``: for a tensor the converter
    builds by moving rows (or columns of out_proj) of one HF tensor, which rows of it each row holds."""
    cfg = model.config
    k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, per = cfg.linear_key_head_dim, cfg.linear_value_head_dim, v_heads // k_heads
    qwen35 = cfg.model_type != "qwen3_next"
    kd = dk * k_heads
    out = []
    for name, t in model.state_dict().items():
        t = t.float()
        src = None
        if qwen35 and per > 1 and "linear_attn." in name:  # _LinearAttentionVReorderBase.modify_tensors
            if ".in_proj_qkv." in name:
                reorder = lambda x: torch.cat([x[: 2 * kd], _reorder_v_heads(x[2 * kd:], 0, k_heads, per, dv)])  # noqa: E731
            elif ".in_proj_z." in name:
                reorder = lambda x: _reorder_v_heads(x, 0, k_heads, per, dv)  # noqa: E731
            elif ".in_proj_b." in name or ".in_proj_a." in name or ".A_log" in name or ".dt_bias" in name:
                reorder = lambda x: _reorder_v_heads(x, 0, k_heads, per, 1)  # noqa: E731
            elif ".conv1d" in name:
                reorder = lambda x: torch.cat([x[: 2 * kd], _reorder_v_heads(x[2 * kd:], 0, k_heads, per, dv)])  # noqa: E731
            elif ".out_proj." in name:
                src = _ids_through(lambda x: _reorder_v_heads(x.t(), 1, k_heads, per, dv).t(), t.shape[1])
                t = _reorder_v_heads(t, 1, k_heads, per, dv)
                out.append((name, t, src))
                continue
            else:
                reorder = None
            if reorder is not None:
                src = _ids_through(reorder, t.shape[0])
                t = reorder(t.squeeze() if ".conv1d" in name else t)
        if name.endswith(".A_log"):  # Qwen3NextModel.modify_tensors
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if "in_proj_qkvz.weight" in name and not legacy:  # split into q, k, v of all heads and z
            sizes = [dk, dk, per * dv, per * dv]
            w = t.permute(1, 0).contiguous().view(-1, k_heads, sum(sizes))
            q, k, v, z = torch.split(w, sizes, dim=-1)
            flat = [p.contiguous().view(cfg.hidden_size, -1) for p in (q, k, v, z)]
            qkv = torch.cat(flat[:3], dim=-1).permute(1, 0).contiguous()
            ids = torch.arange(t.shape[0], dtype=torch.float64)[None].expand(cfg.hidden_size, -1).contiguous()
            idw = torch.split(ids.view(-1, k_heads, sum(sizes)), sizes, dim=-1)
            idf = [p.contiguous().view(cfg.hidden_size, -1)[0].long() for p in idw]
            out.append((name.replace("in_proj_qkvz", "in_proj_qkv"), qkv, torch.cat(idf[:3])))
            out.append((name.replace("in_proj_qkvz", "in_proj_z"), flat[3].permute(1, 0).contiguous(), idf[3]))
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # Qwen2MoeModel.modify_tensors: [E, 2I, H] -> gate, up
            half = t.shape[1] // 2
            stem = name[: -len("gate_up_proj")]
            out += [(stem + "gate_proj.weight", t[:, :half], None), (stem + "up_proj.weight", t[:, half:], None)]
            continue
        if name.endswith("mlp.experts.down_proj"):
            name += ".weight"
        out.append((name, t, src))
    return out


def write_hybrid_gguf(model, path: Path, qtype: str = "F32", *, legacy: bool = False, seed: int = 0,
                      recurrent_layers: bool = True, interval: int = 4, mtp: bool = False,
                      types: dict | None = None) -> dict[str, torch.Tensor]:
    """Write a transformers Qwen3-Next or Qwen3.5 MoE model as ``qwen3next`` / ``qwen35moe`` GGUF, as
    convert_hf_to_gguf.py does (its renames and transformations, gguf's tensor-name map, metadata keys);
    ``legacy``: Qwen3-Next's in_proj_qkvz as one ``ssm_in`` (conversions before attn_qkv + attn_gate).
    2-D and 3-D weights llama-quant.cpp would quantize are ``qtype`` (``types``: kind -> another type), the
    rest F32.
    ``recurrent_layers``: write ``attention.recurrent_layers`` (else ``full_attention_interval`` only);
    ``interval``: the ``full_attention_interval`` written (the config's, 4 when it has none: transformers 5
    keeps only ``layer_types``). ``mtp``: a multi-token-prediction block after the decoder's, as _QwenMtpMixin
    writes it (``block_count`` one more, ``nextn_predict_layers`` 1; a few random tensors).
    Returns transformers' name -> float32 weight as the file holds it, in transformers' form (transformations
    undone in float64 by this helper, independently of moestream).
    """
    cfg = model.config
    qwen35 = cfg.model_type != "qwen3_next"
    arch = gguf.MODEL_ARCH.QWEN35MOE if qwen35 else gguf.MODEL_ARCH.QWEN3NEXT
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(cfg.num_hidden_layers + mtp)
    if mtp:
        w.add_nextn_predict_layers(1)
        h, n = cfg.hidden_size, cfg.num_hidden_layers
        for g, shape in ((f"blk.{n}.nextn.eh_proj.weight", (h, 2 * h)), (f"blk.{n}.nextn.enorm.weight", (h,)),
                         (f"blk.{n}.attn_norm.weight", (h,)), (f"blk.{n}.ffn_gate_inp.weight", (8, h))):
            w.add_tensor(g, rng.normal(0, 0.1, shape).astype(np.float32))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if getattr(cfg, "intermediate_size", None):
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if qwen35:  # TextModel pads mrope_section to 4
        w.add_rope_dimension_sections([*rope["mrope_section"], 0, 0, 0, 0][:4])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    if recurrent_layers:  # add_recurrent_layers in newer gguf-py
        w.add_array(f"{gguf.MODEL_ARCH_NAMES[arch]}.attention.recurrent_layers",
                    [t == "linear_attention" for t in cfg.layer_types] + [False] * mtp)
    w.add_full_attention_interval(interval)
    w.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25)))
    got: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for name, t, src in _convert_hybrid(model, legacy):
        g = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert g is not None, name
        want = (types or {}).get(g.split(".")[-2], qtype) if _quantized_by_llama(g, tuple(t.shape)) else "F32"
        data, qt = encode(t.numpy(), want, rng)
        w.add_tensor(g, data, raw_dtype=qt)
        got[name] = (decode(data, qt).reshape(t.shape).double(), src)
    _finish(w)
    # back in transformers' form, from the values the file holds
    held: dict[str, torch.Tensor] = {}
    for hf, ref in model.state_dict().items():
        if hf.endswith("mlp.experts.gate_up_proj"):
            stem = hf[: -len("gate_up_proj")]
            held[hf] = torch.cat([got[stem + "gate_proj.weight"][0], got[stem + "up_proj.weight"][0]], dim=1)
            continue
        if hf.endswith("mlp.experts.down_proj"):
            held[hf] = got[hf + ".weight"][0]
            continue
        if hf.endswith("in_proj_qkvz.weight") and not legacy:
            (qkv, a), (z, b) = got[hf.replace("qkvz", "qkv")], got[hf.replace("qkvz", "z")]
            out = torch.empty(ref.shape, dtype=torch.float64)
            out[a], out[b] = qkv, z
            held[hf] = out
            continue
        key = hf.rpartition(".dt_bias")[0] + ".dt_proj.bias" if hf.endswith(".dt_bias") else hf
        v, src = got[key]
        if src is not None:  # rows (out_proj: columns) moved: back to where they came from
            back = torch.empty_like(v)
            if hf.endswith("out_proj.weight"):
                back[:, src] = v
            else:
                back[src] = v
            v = back
        if hf.endswith(".A_log"):
            v = torch.log(-v)
        elif "conv1d" in hf:
            v = v.reshape(ref.shape)
        elif hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
            v = v - 1
        held[hf] = v.reshape(ref.shape)
    return {k: v.float() if not k.endswith(".A_log") else v for k, v in held.items()}


def write_gpt_oss_gguf(model, path: Path, qtype: str = "F32", *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a transformers GptOssForCausalLM as ``gpt-oss`` GGUF, as GptOssModel in convert_hf_to_gguf.py
    does for float experts: ``sinks`` -> ``attn_sinks.weight``; ``gate_up_proj`` [E, H, 2I] transposed and
    de-interleaved (even columns gate, odd up) into ``ffn_gate_exps``/``ffn_up_exps`` with their biases;
    ``down_proj`` transposed. YaRN and the sliding window as TextModel/GptOssModel write them.
    Returns transformers' name -> float32 weight as the file holds it, in transformers' form."""
    cfg = model.config
    arch = gguf.MODEL_ARCH.GPT_OSS
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    _add_shape(w, cfg)
    rope = cfg.rope_parameters
    assert rope["rope_type"] == "yarn"
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    got: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.float()
        parts = [(name, t)]
        if name.endswith("sinks"):
            parts = [(name + ".weight", t)]
        elif name.endswith("down_proj_bias"):
            parts = [(name.replace("down_proj_bias", "down_proj.bias"), t)]
        elif name.endswith("down_proj"):
            parts = [(name.replace("down_proj", "down_proj.weight"), t.transpose(-1, -2))]
        elif name.endswith("gate_up_proj_bias"):
            parts = [(name.replace("gate_up_proj_bias", "gate_proj.bias"), t[..., ::2]),
                     (name.replace("gate_up_proj_bias", "up_proj.bias"), t[..., 1::2])]
        elif name.endswith("gate_up_proj"):
            tt = t.transpose(-1, -2)
            parts = [(name.replace("gate_up_proj", "gate_proj.weight"), tt[:, ::2, :]),
                     (name.replace("gate_up_proj", "up_proj.weight"), tt[:, 1::2, :])]
        for n, v in parts:
            g = names.get_name(n, try_suffixes=(".weight", ".bias"))
            assert g is not None, n
            v = v.contiguous()
            want = qtype if _quantized_by_llama(g, tuple(v.shape)) else "F32"
            data, qt = encode(v.numpy(), want, rng)
            w.add_tensor(g, data, raw_dtype=qt)
            got[n] = decode(data, qt).reshape(v.shape)
    _finish(w)
    held: dict[str, torch.Tensor] = {}
    for hf, ref in model.state_dict().items():
        if hf.endswith("sinks"):
            held[hf] = got[hf + ".weight"]
        elif hf.endswith("down_proj_bias"):
            held[hf] = got[hf.replace("down_proj_bias", "down_proj.bias")]
        elif hf.endswith("down_proj"):
            held[hf] = got[hf.replace("down_proj", "down_proj.weight")].transpose(-1, -2).contiguous()
        elif hf.endswith(("gate_up_proj_bias", "gate_up_proj")):
            bias = hf.endswith("_bias")
            gate = got[hf.replace("gate_up_proj_bias", "gate_proj.bias") if bias else
                       hf.replace("gate_up_proj", "gate_proj.weight")]
            up = got[hf.replace("gate_up_proj_bias", "up_proj.bias") if bias else
                     hf.replace("gate_up_proj", "up_proj.weight")]
            if not bias:
                gate, up = gate.transpose(-1, -2), up.transpose(-1, -2)  # [E, H, I]
            out = torch.empty(ref.shape)
            out[..., ::2], out[..., 1::2] = gate, up
            held[hf] = out
        else:
            held[hf] = got[hf]
    return held
