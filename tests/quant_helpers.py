"""Independent writers of published quantized formats for the tests.

Each follows the format's public definition with its own code (numpy bit streams, not
moestream.quant), so a packing or layout bug in moestream cannot hide behind a shared helper:

* MLX affine: per group of ``group_size`` inputs, ``scale = (max - min) / (2^bits - 1)``,
  ``bias = min``, codes ``round((w - bias) / scale)``, packed LSB-first as one bit stream per
  row into uint32 words; config ``quantization: {group_size, bits}``.
* FP8 e4m3 with 128x128 block scales (DeepSeek-V3): ``scale_inv = amax(block) / 448``,
  ``weight = fp8(w / scale_inv)``; config ``quantization_config: {quant_method: fp8, ...}``.
* MXFP4 (gpt-oss, transformers ``integrations/mxfp4.py``): 32-value blocks, e8m0 scale
  ``2^(floor(log2(amax)) - 2)``, e2m1 codes by nearest value, low nibble = even position;
  gate and up rows interleaved in ``gate_up_proj``.

Each returns the dequantized float tensors too, to build the float reference model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moestream.engine import load
from moestream.errors import MoestreamError

from .helpers import read_all, split_experts, write_checkpoint


def assert_refused(path, *words):
    """Loading ``path`` raises a MoestreamError whose message holds every one of ``words``."""
    with pytest.raises(MoestreamError) as e:
        load(path, cache_budget_gb="0", tokenizer=False)
    for w in words:
        assert w in str(e.value), str(e.value)


def mlx_quantize(w: torch.Tensor, bits: int, group: int):
    """(packed uint32, scales, biases, dequantized float32) of ``w`` [..., in]."""
    a = w.detach().double().numpy()
    g = a.reshape(*a.shape[:-1], -1, group)
    lo, hi = g.min(-1), g.max(-1)
    scales = ((hi - lo) / (2**bits - 1)).astype(np.float32)
    biases = lo.astype(np.float32)
    s = np.where(scales == 0, 1, scales)[..., None].astype(np.float64)
    q = np.clip(np.rint((g - biases[..., None]) / s), 0, 2**bits - 1).astype(np.uint8)
    deq = (q * scales[..., None].astype(np.float64) + biases[..., None]).reshape(a.shape)
    q = q.reshape(a.shape)
    # bit stream: each code's `bits` low bits, least significant first, codes in order
    stream = np.unpackbits(q[..., None], axis=-1, bitorder="little")[..., :bits]
    stream = stream.reshape(*a.shape[:-1], -1)
    packed = np.packbits(stream, axis=-1, bitorder="little").view("<u4")
    return (torch.from_numpy(packed.copy()).view(torch.uint32), torch.from_numpy(scales),
            torch.from_numpy(biases), torch.from_numpy(deq.astype(np.float32)))


def write_mlx(src: Path, dst: Path, bits: int, group: int, num_experts: int, overrides: dict | None = None,
              quantize_attention: bool = True, down_bits: int | None = None):
    """The float checkpoint ``src`` as mlx-lm writes a quantized one: stacked ``switch_mlp`` experts,
    quantized experts, attention, router, embedding and LM head. Returns the dequantized float tensors."""
    groups, tensors = split_experts(read_all(src))
    out, ref = {}, {}
    cfg_q = {"group_size": group, "bits": bits}
    for k, v in tensors.items():
        mod = k[: -len(".weight")]
        quant = k.endswith(".weight") and v.dim() == 2 and v.shape[-1] % group == 0 and "norm" not in k
        if quant and not quantize_attention and "self_attn" in k:
            cfg_q[mod] = False
            quant = False
        if quant:
            b = bits
            if mod.endswith("mlp.gate"):
                b = 8  # mlx-lm keeps routers at 8 bits: a per-module override
                cfg_q[mod] = {"group_size": group, "bits": 8}
            packed, s, bi, deq = mlx_quantize(v, b, group)
            out[k], out[mod + ".scales"], out[mod + ".biases"] = packed, s, bi
            ref[k] = deq
        else:
            out[k] = ref[k] = v
    for block, projs in groups.items():
        for p in ("gate", "up", "down"):
            b = down_bits if (p == "down" and down_bits) else bits
            stack = torch.stack([projs[p][e] for e in range(num_experts)])
            packed, s, bi, deq = mlx_quantize(stack, b, group)
            name = f"{block}.switch_mlp.{p}_proj"
            out[name + ".weight"], out[name + ".scales"], out[name + ".biases"] = packed, s, bi
            if b != bits:
                cfg_q[name] = {"group_size": group, "bits": b}
            for e in range(num_experts):
                ref[f"{block}.experts.{e}.{p}_proj.weight"] = deq[e]
    cfg_q.update(overrides or {})
    write_checkpoint(src, dst, out)
    _edit_config(dst, quantization=cfg_q, quantization_config=cfg_q)
    return ref


E4M3_MAX = 448.0


def fp8_quantize(w: torch.Tensor, block: int = 128):
    """(fp8 weight, float32 scale_inv [ceil(out/b), ceil(in/b)], dequantized float32) of ``w`` [out, in]."""
    out_f, in_f = w.shape
    rb, cb = -(-out_f // block), -(-in_f // block)
    pad = torch.zeros(rb * block, cb * block)
    pad[:out_f, :in_f] = w.float()
    blocks = pad.view(rb, block, cb, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = (amax / E4M3_MAX).float()
    q = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn)
    deq = (q.float() * scale_inv[:, None, :, None]).view(rb * block, cb * block)[:out_f, :in_f]
    return q.view(rb * block, cb * block)[:out_f, :in_f].contiguous(), scale_inv, deq.contiguous()


def write_fp8(src: Path, dst: Path, block: int = 128):
    """The float checkpoint as a DeepSeek-V3-style FP8 release: every linear weight of the decoder
    layers (experts, attention) in e4m3 with block scales; embeddings, norms, routers and LM head float."""
    tensors = read_all(src)
    out, ref = {}, {}
    for k, v in tensors.items():
        if k.endswith("_proj.weight") and v.dim() == 2:
            q, s, deq = fp8_quantize(v, block)
            out[k], out[k + "_scale_inv"], ref[k] = q, s, deq
        else:
            out[k] = ref[k] = v
    write_checkpoint(src, dst, out)
    _edit_config(dst, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [block, block]})
    return ref


FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_quantize(w: torch.Tensor):
    """(blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32], dequantized float32) of ``w``."""
    a = w.detach().double().numpy()
    g = a.reshape(*a.shape[:-1], -1, 32)
    amax = np.abs(g).max(-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127).clip(-127, 127)
    scaled = g / np.exp2(exp)[..., None]
    codes = np.abs(scaled[..., None] - FP4[:8]).argmin(-1) + 8 * (np.signbit(scaled) & (scaled != 0))
    deq = FP4[codes] * np.exp2(exp)[..., None]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return (torch.from_numpy(blocks), torch.from_numpy((exp + 127).astype(np.uint8)),
            torch.from_numpy(deq.reshape(a.shape).astype(np.float32)))


def write_mxfp4(src: Path, dst: Path, num_experts: int):
    """The float checkpoint with its experts as gpt-oss ships them: ``experts.gate_up_proj_blocks``
    [E, 2I, H/32, 16] (gate and up rows interleaved), ``..._scales``, ``experts.down_proj_blocks``."""
    groups, tensors = split_experts(read_all(src))
    out, ref = dict(tensors), dict(tensors)
    for block, projs in groups.items():
        gate = torch.stack([projs["gate"][e] for e in range(num_experts)])
        up = torch.stack([projs["up"][e] for e in range(num_experts)])
        gate_up = torch.stack((gate, up), dim=2).flatten(1, 2)  # rows g0, u0, g1, u1, ...
        down = torch.stack([projs["down"][e] for e in range(num_experts)])
        for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
            b, s, deq = mxfp4_quantize(w)
            out[f"{block}.experts.{name}_blocks"], out[f"{block}.experts.{name}_scales"] = b, s
            if name == "down_proj":
                for e in range(num_experts):
                    ref[f"{block}.experts.{e}.down_proj.weight"] = deq[e]
            else:
                for e in range(num_experts):
                    ref[f"{block}.experts.{e}.gate_proj.weight"] = deq[e, 0::2]
                    ref[f"{block}.experts.{e}.up_proj.weight"] = deq[e, 1::2]
    write_checkpoint(src, dst, out)
    _edit_config(dst, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "gate",
                                                                                             "embed_tokens",
                                                                                             "lm_head"]})
    return ref


def _edit_config(path: Path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))


def reference_model(src: Path, ref_tensors: dict[str, torch.Tensor]):
    """transformers' Qwen3MoeForCausalLM of ``src``'s config with the dequantized weights ``ref_tensors``."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(src, torch_dtype=torch.float32).eval()
    sd = model.state_dict()
    fused, rest = split_experts(ref_tensors)
    for k, v in rest.items():
        if k in sd:
            sd[k] = v.float()
    for block, projs in fused.items():
        n = len(projs["gate"])
        gu = torch.cat([torch.stack([projs["gate"][e] for e in range(n)]),
                        torch.stack([projs["up"][e] for e in range(n)])], dim=1)
        sd[f"{block}.experts.gate_up_proj"] = gu
        sd[f"{block}.experts.down_proj"] = torch.stack([projs["down"][e] for e in range(n)])
    model.load_state_dict(sd)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


def mlx_dequantize(packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int) -> torch.Tensor:
    """Float32 weight of mlx affine tensors, unpacking the bit stream with numpy (independent of moestream)."""
    raw = packed.contiguous().view(torch.uint8).numpy()
    stream = np.unpackbits(raw, axis=-1, bitorder="little")
    n = stream.shape[-1] // bits
    codes = np.packbits(stream.reshape(*raw.shape[:-1], n, bits), axis=-1, bitorder="little")[..., 0]
    group = n // scales.shape[-1]
    g = codes.reshape(*raw.shape[:-1], -1, group).astype(np.float64)
    w = g * scales.double().numpy()[..., None] + biases.double().numpy()[..., None]
    return torch.from_numpy(w.reshape(*raw.shape[:-1], n).astype(np.float32))
