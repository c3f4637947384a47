"""Rotary position embeddings, every variant the families use, behind one factory (:func:`make_rope`).

Reading a config's RoPE settings (:func:`rope_theta`, :func:`rope_scaling_type`,
:func:`rope_parameters`), the inverse frequencies of the default rope and of YaRN
(:func:`rope_inv_freq`), the module that turns positions into cos/sin
(:class:`RotaryEmbedding`, one per layer type with :class:`PerTypeRope`), and applying
them: rotate-half on all or the first dims of a head (:func:`apply_rotary`, partial
rotary), or on interleaved pairs (:func:`apply_rotary_interleaved`, DeepSeek), and the
softmax-scale correction YaRN implies for MLA (:func:`mla_softmax_scale`).

Reference: RoFormer (Su et al. 2021); transformers ``modeling_rope_utils``
(``_compute_default_rope_parameters``, ``_compute_yarn_parameters``) and
``models/deepseek_v3/modeling_deepseek_v3.py`` (``yarn_get_mscale``,
``yarn_apply_mscale``, ``apply_rotary_pos_emb_interleave``); YaRN is Peng et al. 2023
(arXiv 2309.00071).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ConfigError


def _rope_dict(cfg: dict, key: str) -> dict:
    value = cfg.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"field {key!r} = {value!r} is not an object")
    return value


def _theta(value) -> float:
    if value is None:
        raise ConfigError("no rope_theta (top level or in rope_parameters)")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"field 'rope_theta' = {value!r} is not a number above 0")
    return float(value)


def rope_theta(cfg: dict) -> float:
    """``rope_theta`` from a config, in transformers 4 (top level) or 5 (``rope_parameters``) form.

    Raises:
        ConfigError: none there, or not a number above 0.
    """
    return _theta(_rope_dict(cfg, "rope_parameters").get("rope_theta", cfg.get("rope_theta")))


def rope_scaling_type(cfg: dict) -> str:
    """The RoPE variant a config asks for (``"default"`` when it names none)."""
    params = _rope_dict(cfg, "rope_parameters") or _rope_dict(cfg, "rope_scaling")
    return params.get("rope_type", params.get("type", "default")) or "default"


def rope_parameters(cfg: dict) -> dict:
    """One dict of a config's RoPE settings, whichever form the config uses.

    Real checkpoints write ``rope_theta`` at the top level and a ``rope_scaling`` dict
    whose variant is ``type``; transformers 5 writes ``rope_parameters`` with
    ``rope_type`` and ``rope_theta`` inside. Returns a dict with at least ``rope_type``
    (``"default"`` when none is named) and ``rope_theta`` (float).

    Raises:
        ConfigError: no ``rope_theta`` anywhere, or a ``rope_scaling`` that is not a dict.
    """
    out = {**_rope_dict(cfg, "rope_scaling"), **_rope_dict(cfg, "rope_parameters")}
    out["rope_type"] = out.get("rope_type", out.get("type", "default")) or "default"
    out["rope_theta"] = _theta(out.get("rope_theta", cfg.get("rope_theta")))
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
    over the dimensions between the ``beta_fast`` and ``beta_slow`` corrections (floored
    and ceiled unless ``truncate`` is false), and the factor ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)`` (or ``attention_factor`` if given), as
    transformers' ``_compute_yarn_parameters``. Without ``max_position_embeddings`` YaRN
    needs both ``factor`` and ``original_max_position_embeddings``.

    Raises:
        ConfigError: another rope type, or yarn without ``original_max_position_embeddings``
            and ``max_position_embeddings``.
    """
    base, kind = params["rope_theta"], params["rope_type"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind != "yarn":
        raise ConfigError(f"rope type {kind!r} is not supported (default or yarn)")
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


class RotaryEmbedding(nn.Module):
    """cos and sin for the given inverse frequencies, scaled by ``attention_factor`` (YaRN's; 1 for the
    default rope), as transformers' rotary embeddings: ``(positions [T] int64, dtype) -> (cos, sin)``,
    each [T, dim] in ``dtype``, ``cat(freqs, freqs)`` layout. Build one with :func:`make_rope`.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = attention_factor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:  # times 1.0 is exact: the default rope skips it
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


ScaledRotaryEmbedding = RotaryEmbedding  # the name MLA's tests and callers know it by


class PerTypeRope(nn.Module):
    """One :class:`RotaryEmbedding` per layer type; returns ``({type: cos}, {type: sin})`` for the layers to
    pick from (Laguna's ``rope_parameters`` keyed by ``full_attention`` / ``sliding_attention``)."""

    def __init__(self, ropes: dict[str, RotaryEmbedding]):
        super().__init__()
        self.ropes = nn.ModuleDict(ropes)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[dict, dict]:
        cos, sin = {}, {}
        for kind, rope in self.ropes.items():
            cos[kind], sin[kind] = rope(positions, dtype)
        return cos, sin


def make_rope(dim: int, theta: float, params: dict | None = None,
              max_position_embeddings: int | None = None) -> RotaryEmbedding:
    """The rotary embedding of ``dim`` rotated dimensions per head (partial rotary: fewer than the head's).

    ``theta`` is the base; ``params`` the config's RoPE settings (:func:`rope_parameters`,
    or a family's own dict; ``rope_type``/``type`` ``default`` when absent, or ``yarn`` with
    its fields) and ``max_position_embeddings`` what YaRN may derive a missing factor or
    original length from (see :func:`rope_inv_freq`). The frequencies are computed on the
    CPU in float32, whatever device the model is built on.

    Raises:
        ConfigError: another rope type, or YaRN without its fields.
    """
    p = dict(params or {})
    p["rope_type"] = p.get("rope_type", p.get("type", "default")) or "default"
    p["rope_theta"] = float(theta)
    with torch.device("cpu"):
        return RotaryEmbedding(*rope_inv_freq(p, dim, max_position_embeddings))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., T, head_dim] by cos/sin [T, dim] (half-split convention, as transformers).

    With ``dim`` below ``head_dim`` (partial rotary: GLM, Laguna, MiniMax-M2, Qwen3-Next) only
    the first ``dim`` dimensions rotate; the rest pass unchanged.
    """
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat([head * cos + rotate_half(head) * sin, tail], dim=-1)


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
