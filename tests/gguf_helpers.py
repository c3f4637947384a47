"""Tiny GGUF files for the tests, written by the ``gguf`` package (llama.cpp's own Python writer) from a
transformers Qwen3-MoE model, independently of moestream: names from ``gguf``'s tensor-name map,
weights quantized by ``gguf.quants.quantize`` where it has a quantizer (random blocks of the type where it
has none: the K-quants) and read back by ``gguf.quants.dequantize`` for the reference."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize, quantize

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
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
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
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
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
