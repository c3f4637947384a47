"""Rotary embedding variants beyond the default: YaRN scaling, partial rotary, the
interleaved (DeepSeek) pair layout, and the softmax-scale correction YaRN implies for MLA.

Reference: transformers ``modeling_rope_utils._compute_yarn_parameters`` and
``models/deepseek_v3/modeling_deepseek_v3.py`` (``yarn_get_mscale``,
``yarn_apply_mscale``, ``apply_rotary_pos_emb_interleave``); YaRN is Peng et al. 2023
(arXiv 2309.00071).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ConfigError


def rope_parameters(cfg: dict) -> dict:
    """One dict of a config's RoPE settings, whichever form the config uses.

    Real checkpoints write ``rope_theta`` at the top level and a ``rope_scaling`` dict
    whose variant is ``type``; transformers 5 writes ``rope_parameters`` with
    ``rope_type`` and ``rope_theta`` inside. Returns a dict with at least ``rope_type``
    (``"default"`` when none is named) and ``rope_theta`` (float).

    Raises:
        ConfigError: no ``rope_theta`` anywhere, or a ``rope_scaling`` that is not a dict.
    """
    out = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"field {key!r} = {value!r} is not an object")
        out.update(value)
    out["rope_type"] = out.get("rope_type", out.get("type", "default")) or "default"
    theta = out.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ConfigError("no rope_theta (top level or in rope_parameters)")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
        raise ConfigError(f"field 'rope_theta' = {theta!r} is not a number above 0")
    out["rope_theta"] = float(theta)
    if "partial_rotary_factor" not in out and cfg.get("partial_rotary_factor") is not None:
        out["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    return out


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(params: dict, dim: int, max_position_embeddings: int | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (float32, CPU) and the cos/sin scale (``attention_factor``).

    ``params`` comes from :func:`rope_parameters`; ``dim`` is the number of rotated
    dimensions per head. ``default``: ``theta^(-2i/dim)``, factor 1. ``yarn``: the
    frequencies blended between interpolation (divided by ``factor``) and extrapolation
    over the dimensions between the ``beta_fast`` and ``beta_slow`` corrections, and the
    factor ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` (or
    ``attention_factor`` if given), as transformers' ``_compute_yarn_parameters``.

    Raises:
        ConfigError: another rope type, or yarn without ``original_max_position_embeddings``
            and ``max_position_embeddings``.
    """
    base, kind = params["rope_theta"], params["rope_type"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind != "yarn":
        raise ConfigError(f"rope type {kind!r} is not supported here (default or yarn)")
    original = params.get("original_max_position_embeddings", max_position_embeddings)
    if original is None:
        raise ConfigError("yarn rope needs original_max_position_embeddings (or max_position_embeddings)")
    factor = params.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ConfigError("yarn rope without a factor needs max_position_embeddings")
        factor = max_position_embeddings / original
    factor = float(factor)
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def mla_softmax_scale(qk_head_dim: int, params: dict) -> float:
    """Softmax scale of DeepSeek's MLA: ``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)^2``
    when the rope is scaled and ``mscale_all_dim`` is set (transformers' ``yarn_apply_mscale``)."""
    scale = qk_head_dim**-0.5
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_get_mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * m * m
    return scale


class ScaledRotaryEmbedding(nn.Module):
    """cos and sin for the given inverse frequencies, scaled by ``attention_factor``.

    The drop-in for :class:`~moestream.models.layers.RotaryEmbedding` when the rope is
    scaled (YaRN) or partial; same call: ``(positions [T] int64, dtype) -> (cos, sin)``,
    each [T, dim] in ``dtype``, ``cat(freqs, freqs)`` layout.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = attention_factor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., T, dim] whose rotary dims are interleaved pairs ``(x0, x1), (x2, x3), ...``.

    ``cos``/``sin`` [T, dim] in the ``cat(freqs, freqs)`` layout. The output holds the
    rotated even dims then the rotated odd dims (transformers'
    ``apply_rotary_pos_emb_interleave``); queries and keys get the same permutation, so
    their dot products are those of the interleaved layout.
    """
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
