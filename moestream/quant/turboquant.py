"""turboquant-mlx (``tq*``) checkpoints: codebook-quantized linears behind a blockwise Hadamard rotation.

Specification: ``notes/turboquant-format.md`` (gathered from the public ``turboquant_mlx``
package and MLX's Hadamard transform). config.json carries ``quantization: {mode:
"turboquant", bits, group_size, ...}``. Each quantized linear ``<path>`` stores

* ``weight`` uint32 [out, ceil(in / epw)] (experts: [E, out, ...]): codes along the row,
  LSB-first, ``epw`` = 32 / 16 / 10 / 8 codes of 1 / 2 / 3 / 4 bits per word; ternary
  layers hold 20 base-3 digits per word (``word = sum t_i 3^i``). Words do not align with groups.
* ``scales`` float16 [out, in / g]: one per group of ``g`` consecutive inputs.
* ``codebook`` float16 [2^bits] or [3] (ternary): the code values; ``signs`` float16 +-1 [in].
* optional ``bias`` [out]; on dense linears optional QJL residual ``qjl_packed`` uint32
  [out, ceil(in / 32)], ``qjl_norms`` [out], ``qjl_signs`` [in].

Stacked experts (``...switch_mlp.{gate,up,down}_proj``) hold ``weight`` and ``scales`` per
expert (streamed, one expert's slices per read) and one ``codebook`` and ``signs`` per
projection, shared by every expert and kept resident. Other leftovers may be MLX affine
("affine extras": ``weight``, ``scales``, ``biases``, no codebook; :mod:`.affine`).

As the reference loader does, nothing is re-derived: bits come from the codebook's length,
the group size from ``in / scales.shape[-1]``, rotation is on unless the config says
``rotation: none`` and every stored sign is +1, QJL is on where ``qjl_packed`` exists.

Forward (``y = W x``; weights are stored rotated on the input dim, ``W_rot[o] = H(signs * W[o])``):

1. ``x_r = H_B(signs * x)`` in float32, ``H_B`` the orthonormal Hadamard transform applied to
   each contiguous block of ``B`` inputs, ``B`` the largest ``m * 2^k`` (m in 1, 12, 20, 28)
   dividing ``in`` (:func:`blockwise_hadamard`, MLX's ``hadamard_transform`` order).
2. ``y[o] = sum_j codebook[idx[o, j]] * scales[o, j // g] * x_r[j]`` in float32.
3. QJL (unless ``--fast``): ``y += fp16(sqrt(pi/2)/sqrt(in)) * qjl_norms * (fp16(H_B(qjl_signs
   * x_r)) @ (2 bit - 1)^T)`` in float16; then ``y += bias``.

The result is returned in the input's dtype (MLX keeps float32 activations for bf16 models;
moestream keeps its compute dtype between layers). fp16 inputs are computed in float32 too,
not with the Metal kernel's half-precision roundings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import torch_dtype
from ..nnutil import set_submodule
from . import native, registry
from .formats import ExpertFormat, LinearFormat, QuantConfig, QuantError, Scheme, _affine_scheme
from .hadamard import block_size, blockwise_hadamard, sloane_matrix  # noqa: F401  (turboquant's rotation)
from .registry import CpuKernel, StoredFormat

# codebook length -> bits per code (3: ternary, one base-3 digit)
LEVEL_BITS = {2: 1, 4: 2, 8: 3, 16: 4}
TRIT = 3
TRIT_PER_WORD = 20
ROTATIONS = ("hadamard", "blockwise_hadamard", "none")
GROUP_SIZES = (16, 32, 64, 128)
# float32 elements dequantized per chunk (1 MiB): no dequantized layer is ever held whole
CHUNK_ELEMS = 256 * 1024

def codes_per_word(levels: int) -> int:
    """Codes one uint32 word holds for a codebook of ``levels`` entries (20 for ternary)."""
    return TRIT_PER_WORD if levels == TRIT else 32 // LEVEL_BITS[levels]


def _words(packed: torch.Tensor) -> torch.Tensor:
    """uint32 (or int32) words as non-negative int64."""
    return packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def unpack_codes(packed: torch.Tensor, levels: int, n: int) -> torch.Tensor:
    """Codes [..., n] (int64, 0 .. levels-1) from words [..., ceil(n / epw)].

    Bit-packed: code j in word j // epw at bit (j % epw) * bits, LSB-first. Ternary: digit
    ``t_i = (word // 3^i) % 3``.
    """
    w = _words(packed)
    if levels == TRIT:
        pow3 = torch.tensor([3**i for i in range(TRIT_PER_WORD)], dtype=torch.int64, device=w.device)
        c = (w.unsqueeze(-1) // pow3) % 3
    else:
        bits = LEVEL_BITS[levels]
        shifts = torch.arange(0, 32 // bits * bits, bits, dtype=torch.int64, device=w.device)
        c = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*w.shape[:-1], -1)[..., :n]


def pack_codes(codes: torch.Tensor, levels: int) -> torch.Tensor:
    """Pack codes [..., n] into uint32 words [..., ceil(n / epw)] (tail padded with code 0); inverse of
    :func:`unpack_codes`."""
    epw = codes_per_word(levels)
    n = codes.shape[-1]
    c = F.pad(codes.to(torch.int64), (0, -n % epw)).reshape(*codes.shape[:-1], -1, epw)
    if levels == TRIT:
        mult = torch.tensor([3**i for i in range(TRIT_PER_WORD)], dtype=torch.int64)
    else:
        mult = torch.tensor([1 << (i * LEVEL_BITS[levels]) for i in range(epw)], dtype=torch.int64)
    words = (c * mult).sum(-1)  # disjoint digits: the sum is exact
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(torch.uint32)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """QJL sign bits [..., ceil(n / 32)] -> float32 [..., n] of +-1 (bit 1 is +1, LSB-first)."""
    bits = unpack_codes(packed, 2, n)
    return bits.to(torch.float32) * 2 - 1


@dataclass(frozen=True)
class TQScheme(Scheme):
    """One turboquant linear: ``levels`` codebook entries (3: ternary), group ``group_size``.

    ``bits`` is the code width (ternary: 0); ``rotation`` the config's rotation field;
    ``qjl``/``bias``: whether the checkpoint stores a QJL residual / a bias.
    """

    levels: int = 0
    rotation: str = "hadamard"
    qjl: bool = False
    bias: bool = False

    @property
    def label(self) -> str:
        return "ternary" if self.levels == TRIT else f"{self.bits}-bit"

    @property
    def tag(self) -> str:
        return f"turboquant {self.label}, group {self.group_size}"


class TurboQuantConfig(QuantConfig):
    """config.json ``quantization`` with ``mode: "turboquant"`` (spec section 2).

    ``default`` (what :meth:`QuantConfig.scheme` returns) is the affine-extras scheme, or
    None; ``levels`` the codebook lengths the config allows; ``group_sizes`` its group sizes.
    """

    def __init__(self, q: dict, where: str):
        def bits_field(name, default=None, allowed=(1, 2, 3, 4)):
            v = q.get(name, default)
            if v is not None and (v not in allowed or isinstance(v, bool)):
                raise QuantError(f"{where}: quantization.{name} {v!r} must be one of {allowed}")
            return v

        bits = bits_field("bits", ..., (2, 3, 4))
        if bits is ...:
            raise QuantError(f"{where}: quantization.bits is missing (mode turboquant)")
        gs = q.get("group_size")
        if gs not in GROUP_SIZES or isinstance(gs, bool):
            raise QuantError(f"{where}: quantization.group_size {gs!r} must be one of {GROUP_SIZES}")
        mgs = q.get("mlp_group_size")
        if mgs is not None and (mgs not in GROUP_SIZES or isinstance(mgs, bool)):
            raise QuantError(f"{where}: quantization.mlp_group_size {mgs!r} must be one of {GROUP_SIZES}")
        rotation = q.get("rotation", "hadamard")
        if rotation not in ROTATIONS:
            raise QuantError(f"{where}: quantization.rotation {rotation!r} must be one of {ROTATIONS}")
        declared = {bits}
        for name in ("attn_bits", "mlp_bits", "expert_down_bits", "protect_bits"):
            v = bits_field(name)
            if v is not None:
                declared.add(v)
        ternary = bool(q.get("ternary_experts", False))
        tiers = q.get("expert_layer_tiers") or {}
        if not isinstance(tiers, dict):
            raise QuantError(f"{where}: quantization.expert_layer_tiers is not an object")
        for layer, tier in tiers.items():
            if tier == "ternary":
                ternary = True
            elif str(tier) in ("1", "2", "3", "4"):
                declared.add(int(tier))
            else:
                raise QuantError(f"{where}: quantization.expert_layer_tiers[{layer!r}] {tier!r} must be "
                                 "'ternary', '2', '3' or '4'")
        extras = q.get("affine_extras")
        extra = None
        if extras is not None:
            if not isinstance(extras, dict):
                raise QuantError(f"{where}: quantization.affine_extras is not an object")
            extra = _affine_scheme({k: v for k, v in extras.items() if k in ("bits", "group_size")},
                                   f"{where}: quantization.affine_extras")
        super().__init__("turboquant", extra, {})
        self.bits, self.group_size, self.mlp_group_size, self.rotation = bits, gs, mgs, rotation
        self.levels = {1 << b for b in declared} | ({TRIT} if ternary else set())
        self.group_sizes = {gs} | ({mgs} if mgs else set())
        self.where = where

    def check(self, name: str, levels: int, group: int) -> None:
        """Refuse a linear whose codebook length or group size the config does not declare."""
        if levels not in self.levels:
            what = "ternary" if levels == TRIT else f"{LEVEL_BITS.get(levels, '?')}-bit"
            allowed = sorted("ternary" if v == TRIT else f"{LEVEL_BITS[v]}-bit" for v in self.levels)
            raise QuantError(f"{self.where}: tensor {name + '.codebook'!r} has {levels} entries ({what}), but "
                             f"config.json quantization declares only {', '.join(allowed)}")
        if group not in self.group_sizes:
            raise QuantError(f"{self.where}: tensor {name + '.scales'!r} makes groups of {group} inputs; "
                             f"config.json quantization declares group_size {self.group_size}"
                             + (f" and mlp_group_size {self.mlp_group_size}" if self.mlp_group_size else ""))


def linear_scheme(path: str, tensors: dict, cfg: TurboQuantConfig, out_in: tuple[int, int] | None,
                  stacked: bool = False) -> tuple[TQScheme, int, int]:
    """Check the turboquant tensors of module ``path`` (a checkpoint index) and return (scheme, out, in).

    ``out_in``: the shape the model config implies (checked when given). ``stacked``: an
    expert projection (``weight`` and ``scales`` carry a leading expert dim; no QJL).

    Raises:
        QuantError: naming the tensor whose shape, dtype or codebook disagrees with the spec or the config.
    """
    where = cfg.where
    w, sc = tensors.get(path + ".weight"), tensors.get(path + ".scales")
    cb, sg = tensors.get(path + ".codebook"), tensors.get(path + ".signs")
    for suffix, info in (("weight", w), ("scales", sc), ("codebook", cb), ("signs", sg)):
        if info is None:
            raise QuantError(f"{where}: turboquant module {path!r} has a codebook but tensor "
                             f"{path + '.' + suffix!r} is missing")
    if w.dtype != "U32":
        raise QuantError(f"{where}: tensor {path + '.weight'!r} is {w.dtype}; turboquant codes are uint32")
    if len(cb.shape) != 1 or cb.shape[0] not in (TRIT, *LEVEL_BITS):
        raise QuantError(f"{where}: tensor {path + '.codebook'!r} has shape {list(cb.shape)}; expected 2, 3, 4, 8 "
                         "or 16 entries")
    if len(sg.shape) != 1:
        raise QuantError(f"{where}: tensor {path + '.signs'!r} has shape {list(sg.shape)}; expected [in]")
    levels, inn = cb.shape[0], sg.shape[0]
    lead = 1 if stacked else 0
    if len(w.shape) != 2 + lead or len(sc.shape) != 2 + lead or w.shape[:-1] != sc.shape[:-1]:
        raise QuantError(f"{where}: tensors {path + '.weight'!r} {list(w.shape)} and {path + '.scales'!r} "
                         f"{list(sc.shape)} are not [{'E, ' if stacked else ''}out, words] and "
                         f"[{'E, ' if stacked else ''}out, groups]")
    out = w.shape[-2]
    epw = codes_per_word(levels)
    if w.shape[-1] != -(-inn // epw):
        legacy = levels == TRIT and w.shape[-1] == -(-inn // 16)
        raise QuantError(
            f"{where}: tensor {path + '.weight'!r} has {w.shape[-1]} words per row; {inn} inputs "
            f"({path + '.signs'!r}) at {epw} codes per word need {-(-inn // epw)}"
            + (" (a pre-0.12 ternary layout in the 2-bit slot, not supported)" if legacy else "")
        )
    groups = sc.shape[-1]
    if groups < 1 or inn % groups:
        raise QuantError(f"{where}: tensor {path + '.scales'!r} has {groups} groups per row, which do not divide "
                         f"{inn} inputs")
    cfg.check(path, levels, inn // groups)
    if out_in is not None and (out, inn) != tuple(out_in):
        raise QuantError(f"{where}: turboquant module {path!r} is [{out}, {inn}] (weight rows, signs); the model "
                         f"config implies {list(out_in)}")
    qjl = path + ".qjl_packed" in tensors
    if stacked and any(path + s in tensors for s in (".qjl_packed", ".qjl_norms", ".qjl_signs")):
        raise QuantError(f"{where}: tensor {path + '.qjl_packed'!r}: turboquant has no QJL on experts")
    if qjl:
        want = {"qjl_packed": (out, -(-inn // 32)), "qjl_norms": (out,), "qjl_signs": (inn,)}
        for suffix, shape in want.items():
            got = tensors.get(f"{path}.{suffix}")
            if got is None or tuple(got.shape) != shape:
                raise QuantError(f"{where}: tensor {path + '.' + suffix!r} is "
                                 f"{'missing' if got is None else list(got.shape)}; QJL needs {list(shape)}")
    elif any(f"{path}.{s}" in tensors for s in ("qjl_norms", "qjl_signs")):
        raise QuantError(f"{where}: tensor {path + '.qjl_packed'!r} is missing but QJL norms/signs are present")
    bias = tensors.get(path + ".bias")
    if bias is not None and tuple(bias.shape) != (*w.shape[:lead], out):
        raise QuantError(f"{where}: tensor {path + '.bias'!r} has shape {list(bias.shape)}; expected "
                         f"{[*w.shape[:lead], out]}")
    scheme = TQScheme("turboquant", LEVEL_BITS.get(levels, 0), inn // groups, levels=levels, rotation=cfg.rotation,
                      qjl=qjl, bias=bias is not None)
    return scheme, out, inn


def _rotated(signs: torch.Tensor, rotation: str) -> bool:
    """Rotation is on unless the config says ``none`` and every stored sign is +1 (spec section 2)."""
    return not (rotation == "none" and bool((signs == 1).all()))


def rotate(x: torch.Tensor, signs: torch.Tensor, rotated: bool) -> torch.Tensor:
    """``H_B(signs * x)`` (or ``x``, when not rotated) for ``x`` [n, in], in float32."""
    xf = x.float()
    return blockwise_hadamard(xf * signs.float()) if rotated else xf


def _rows(inn: int) -> int:
    return max(1, CHUNK_ELEMS // inn)


# codes decoded per table lookup: a word splits into keys of this many codes (2^15 .. 2^16 keys)
_LUT_CODES = {2: 16, 4: 8, 8: 5, 16: 4, TRIT: 10}


def code_table(codebook: torch.Tensor) -> torch.Tensor:
    """Float32 [keys, k]: the codebook values of every run of k codes one key of a word holds.

    Bit-packed: key = k codes of ``bits`` bits (LSB-first); ternary: key = 10 base-3 digits.
    Decoding a word is then a few row lookups instead of one per code.
    """
    levels = codebook.shape[0]
    k = _LUT_CODES[levels]
    keys = torch.arange(levels**k, dtype=torch.int64)
    if levels == TRIT:
        digits = torch.stack([(keys // 3**j) % 3 for j in range(k)], -1)
    else:
        bits = LEVEL_BITS[levels]
        digits = torch.stack([(keys >> (j * bits)) & (levels - 1) for j in range(k)], -1)
    return codebook.float()[digits].contiguous()


_TABLES: dict[bytes, torch.Tensor] = {}


def shared_table(codebook: torch.Tensor) -> torch.Tensor:
    """:func:`code_table` of ``codebook``, built once per distinct codebook (builds share a few codebooks)."""
    key = codebook.detach().cpu().float().numpy().tobytes()
    t = _TABLES.get(key)
    if t is None:
        t = _TABLES[key] = code_table(codebook.detach().cpu())
    return t.to(codebook.device)


def dequantize_rows(packed: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor, inn: int,
                    table: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 rotated-domain weight rows ``codebook[idx] * scale`` [r, in].

    ``packed``: words [r, words]; ``scales``: [r, groups]; ``codebook``: [levels];
    ``table``: :func:`code_table` of the codebook (built here when not given).
    """
    levels = codebook.shape[0]
    if table is None:
        table = shared_table(codebook)
    k = table.shape[1]
    if levels == TRIT:
        w = _words(packed)
        keys = torch.stack((w % 3**k, w // 3**k), -1)
    else:  # int32 words: every key is masked after the shift, so the sign bit never leaks into one
        w = packed.contiguous().view(torch.int32)
        kb = k * LEVEL_BITS[levels]
        keys = torch.stack([(w >> (j * kb)) & ((1 << kb) - 1) for j in range(codes_per_word(levels) // k)], -1)
    # index_select: plain advanced indexing measured far slower on this CPU build (PyTorch 2.13)
    vals = table.index_select(0, keys.reshape(-1)).view(*w.shape[:-1], -1)[..., :inn]
    g = inn // scales.shape[-1]
    return (vals.reshape(*vals.shape[:-1], -1, g) * scales.float().unsqueeze(-1)).reshape(vals.shape)


def rotated_matmul(xr: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor,
                   table: torch.Tensor | None = None) -> torch.Tensor:
    """``xr`` [n, in] (float32, rotated) times the dequantized rotated weight, transposed: [n, out] float32.

    Dequantized a few rows at a time (``CHUNK_ELEMS``), so no whole weight is held.
    """
    inn, out = xr.shape[-1], packed.shape[0]
    if table is None:
        table = shared_table(codebook)
    y = xr.new_empty(xr.shape[0], out)
    step = _rows(inn)
    for r0 in range(0, out, step):
        r1 = min(r0 + step, out)
        y[:, r0:r1] = xr @ dequantize_rows(packed[r0:r1], scales[r0:r1], codebook, inn, table).t()
    return y


# QJL sign bits as a 1-bit codebook: bit 0 is -1, bit 1 is +1 (spec section 5.4)
_QJL_CODEBOOK = torch.tensor([-1.0, 1.0], dtype=torch.float16)


def qjl_correction(xr: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, qsigns: torch.Tensor
                   ) -> torch.Tensor:
    """The QJL residual term [n, out] in float16 (spec section 5.4) for rotated input ``xr`` [n, in] float32."""
    inn = xr.shape[-1]
    sx = blockwise_hadamard(xr * qsigns.float()).half().float()
    scale = torch.tensor(math.sqrt(math.pi / 2) / math.sqrt(inn), dtype=torch.float16)
    t = xr.new_empty(xr.shape[0], packed.shape[0])
    step = _rows(inn)
    for r0 in range(0, packed.shape[0], step):
        r1 = min(r0 + step, packed.shape[0])
        t[:, r0:r1] = sx @ unpack_signs(packed[r0:r1], inn).t()
    return (scale * norms.half()) * t.half()


class TQLinear(nn.Module):
    """A resident turboquant linear: ``x`` [..., in] -> [..., out] in x.dtype (float32 inside).

    Parameters carry the checkpoint's names and stored dtypes (``weight``, ``scales``,
    ``codebook``, ``signs``, optional ``bias`` and ``qjl_packed``/``qjl_norms``/``qjl_signs``).
    ``use_qjl`` (True unless ``--fast``) applies the stored QJL residual.
    """

    def __init__(self, scheme: TQScheme, out_features: int, in_features: int, shapes: dict):
        super().__init__()
        self.fmt = LinearFormat("weight", scheme, out_features, in_features)
        for name, (shape, dt) in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=torch_dtype(dt)), requires_grad=False))
        if not scheme.bias:
            self.bias = None
        self.use_qjl = True
        self._rot: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._rot is None:
            self._rot = _rotated(self.signs, self.fmt.scheme.rotation)
        x2 = x.reshape(-1, x.shape[-1])
        y = self._native(x2)
        if y is not None:
            return y.to(x.dtype).view(*x.shape[:-1], -1)
        xr = rotate(x2, self.signs, self._rot)
        y = rotated_matmul(xr, self.weight, self.scales, self.codebook)
        if self.fmt.scheme.qjl and self.use_qjl:
            y = y + qjl_correction(xr, self.qjl_packed, self.qjl_norms, self.qjl_signs)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], -1)

    def _native(self, x2: torch.Tensor) -> torch.Tensor | None:
        """The forward on moestream's CPU kernels (float32 [n, out]), or None on the PyTorch path."""
        if native._ready(x2) is None:
            return None
        inn = self.fmt.in_features
        signs = self.signs if self._rot else None
        if not (self.fmt.scheme.qjl and self.use_qjl):
            spec = native.codebook_spec(self.weight, self.scales, self.codebook, inn, signs, self.bias)
            return native.codebook_linear(x2, spec, torch.float32)
        # QJL: y = W xr + fp16(c) * norms * fp16(fp16(H(qjl_signs * xr)) @ (2 bit - 1)^T), then the bias
        xr = native.rotate(x2, self.signs) if self._rot else x2.float()
        y = native.codebook_linear(xr, native.codebook_spec(self.weight, self.scales, self.codebook, inn),
                                   torch.float32)
        ones = native._cached(self.qjl_norms, native.ones_column)
        sign_spec = native.codebook_spec(self.qjl_packed, ones, _QJL_CODEBOOK, inn, self.qjl_signs, rot_half=True)
        t = native.codebook_linear(xr, sign_spec, torch.float32)
        if y is None or t is None:
            return None
        scale = torch.tensor(math.sqrt(math.pi / 2) / math.sqrt(inn), dtype=torch.float16)
        y = y + (scale * self.qjl_norms.half()) * t.half()
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] in the input domain, ``W_rot H_B diag(signs)`` (for references)."""
        w = dequantize_rows(self.weight, self.scales, self.codebook, self.fmt.in_features)
        if _rotated(self.signs, self.fmt.scheme.rotation):
            w = blockwise_hadamard(w, transpose=True) * self.signs.float()
        return w


@dataclass(frozen=True)
class TQExpertFormat(ExpertFormat):
    """An MoE layer of turboquant experts: ``shared[role]`` is the checkpoint module path of the
    projection whose ``codebook`` and ``signs`` all experts share (resident)."""

    shared: dict = field(default_factory=dict)
    turboquant: bool = True


_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def expert_format(lay, tensors: dict, cfg: TurboQuantConfig, shape: tuple[int, int], where) -> TQExpertFormat:
    """The :class:`TQExpertFormat` of one MoE layer's stacked experts (pieces ``<role>``, ``<role>.scales``).

    Raises:
        QuantError: experts that are not turboquant-stacked, or tensors that disagree with the config.
    """
    pieces = {p.role: p for p in lay.experts[0]}
    inter, hidden = shape
    logical = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    if lay.kind != "stacked" or set(pieces) - {f"{r}{s}" for r in _PROJ for s in ("", ".scales", ".bias")}:
        raise QuantError(f"{where}: {lay.block}: turboquant experts must be stacked "
                         "'...switch_mlp.{gate,up,down}_proj.{weight,scales}' (found "
                         f"{lay.kind} experts with {', '.join(sorted(pieces))})")
    linears, shared = {}, {}
    for role in ("gate", "up", "down"):
        module = pieces[role].source.rsplit(".", 1)[0]
        if module + ".codebook" not in tensors:
            raise QuantError(f"{where}: tensor {pieces[role].source!r} is quantized under a turboquant config but "
                             f"{module + '.codebook'!r} is missing (turboquant experts are never affine)")
        scheme, out, inn = linear_scheme(module, tensors, cfg, logical[role], stacked=True)
        linears[role] = LinearFormat(role, scheme, out, inn)
        shared[role] = module
    return TQExpertFormat(linears, False, shared)


class TQExperts:
    """The expert function of a turboquant layer: SwiGLU ``down(silu(gate x) * up x)`` on streamed
    codes and scales, each projection rotating its own input with its shared signs; float32
    inside, float32 out (the expert pipeline weighs and casts). A family whose expert is not
    ``swiglu_expert`` gets its float function on the un-rotated dequantized weights instead.
    """

    def __init__(self, fmt: TQExpertFormat, holders: dict[str, nn.Module], float_fn=None):
        self.fmt, self.holders, self.float_fn = fmt, holders, float_fn
        self._rot: dict[str, bool] = {}

    def _is_rotated(self, role: str) -> bool:
        if role not in self._rot:
            self._rot[role] = _rotated(self.holders[role].signs, self.fmt.linears[role].scheme.rotation)
        return self._rot[role]

    def _linear(self, x: torch.Tensor, w: dict, role: str) -> torch.Tensor:
        h = self.holders[role]
        y = rotated_matmul(rotate(x, h.signs, self._is_rotated(role)), w[role], w[role + ".scales"], h.codebook)
        bias = w.get(role + ".bias")
        return y if bias is None else y + bias

    def weight(self, w: dict, role: str) -> torch.Tensor:
        """The float32 input-domain weight [out, in] of one expert's projection ``role``."""
        h, lf = self.holders[role], self.fmt.linears[role]
        deq = dequantize_rows(w[role], w[role + ".scales"], h.codebook, lf.in_features)
        if self._is_rotated(role):
            deq = blockwise_hadamard(deq, transpose=True) * h.signs.float()
        return deq

    def _native(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The SwiGLU expert in one call of moestream's CPU kernels (float32), or None on the PyTorch path."""
        if native._ready(x) is None:
            return None
        specs = []
        for role in ("gate", "up", "down"):
            h, lf = self.holders[role], self.fmt.linears[role]
            signs = h.signs if self._is_rotated(role) else None
            specs.append(native.codebook_spec(w[role], w[role + ".scales"], h.codebook, lf.in_features, signs,
                                              w.get(role + ".bias")))
        return native.codebook_expert(x, tuple(specs), torch.float32)

    def __call__(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.float_fn is None:
            y = self._native(x, w)
            if y is not None:
                return y
        if self.float_fn is not None:
            dense = {r: t for r, t in w.items() if r.split(".")[0] not in self.fmt.linears}
            for role in self.fmt.linears:
                dense[role] = self.weight(w, role).to(x.dtype)
            return self.float_fn(x, dense)
        h = F.silu(self._linear(x, w, "gate")) * self._linear(x, w, "up")
        return self._linear(h, w, "down")


def _holder(shapes: dict) -> nn.Module:
    m = nn.Module()
    for name, (shape, dt) in shapes.items():
        setattr(m, name, nn.Parameter(torch.empty(shape, dtype=torch_dtype(dt)), requires_grad=False))
    return m


# tensors kept in their stored dtype (float16) rather than cast to the compute dtype
_STORED = ("codebook", "signs", "bias", "qjl_norms", "qjl_signs")


def quantize_resident(model: nn.Module, tensors: dict, cfg: TurboQuantConfig, where) -> list[str]:
    """Swap each ``nn.Linear`` the checkpoint stores turboquant-quantized for a :class:`TQLinear`, and give
    each MoE block its experts' shared ``codebook`` and ``signs`` as parameters (checkpoint names).

    Run on the meta-device model before loading. Sets ``model.stored_dtype_parameters`` (names
    ``load_resident`` keeps at their stored dtype). Returns the module paths swapped.

    Raises:
        QuantError: a codebook on a module that is not a linear, tensors that disagree with the
            spec or the config (naming the tensor), or uint32 weights without a codebook when the
            config declares no ``affine_extras``.
    """
    keep = set(getattr(model, "stored_dtype_parameters", ()))
    swapped = []
    modules = dict(model.named_modules())
    moe = set(model.moe_blocks())
    blocks = {name: m for name, m in modules.items() if m in moe}
    for path in sorted(n[: -len(".codebook")] for n in tensors if n.endswith(".codebook")):
        mod = modules.get(path)
        if isinstance(mod, nn.Linear):
            scheme, out, inn = linear_scheme(path, tensors, cfg, (mod.out_features, mod.in_features))
            names = ["weight", "scales", "codebook", "signs"] + (["bias"] if scheme.bias else [])
            if scheme.qjl:
                names += ["qjl_packed", "qjl_norms", "qjl_signs"]
            shapes = {n: (tensors[f"{path}.{n}"].shape, tensors[f"{path}.{n}"].dtype) for n in names}
            if mod.bias is not None and not scheme.bias:
                raise QuantError(f"{where}: tensor {path + '.bias'!r} is missing (the model config has a bias there)")
            model.set_submodule(path, TQLinear(scheme, out, inn, shapes))
            keep.update(f"{path}.{n}" for n in _STORED if n in shapes)
            swapped.append(path)
            continue
        block = next((b for b in blocks if path.startswith(b + ".")), None)
        if block is None:
            raise QuantError(f"{where}: tensor {path + '.codebook'!r} belongs to no linear or MoE block of this "
                             "model (an embedding or router cannot be turboquant-quantized)")
        shapes = {n: (tensors[f"{path}.{n}"].shape, tensors[f"{path}.{n}"].dtype)
                  for n in ("codebook", "signs") if f"{path}.{n}" in tensors}
        set_submodule(blocks[block], path[len(block) + 1:], _holder(shapes))
        keep.update(f"{path}.{n}" for n in shapes)
    for path, mod in modules.items():
        w = tensors.get(path + ".weight")
        if isinstance(mod, (nn.Linear, nn.Embedding)) and w is not None and w.dtype == "U32" \
                and path + ".codebook" not in tensors and cfg.default is None:
            raise QuantError(f"{where}: tensor {path + '.weight'!r} is uint32 without a codebook (an MLX affine "
                             "extra) but config.json quantization declares no affine_extras")
    model.stored_dtype_parameters = keep
    return swapped


def set_fast(model: nn.Module, fast: bool) -> int:
    """Turn the QJL residual of every :class:`TQLinear` off (``fast``) or on; returns how many have one."""
    n = 0
    for m in model.modules():
        if isinstance(m, TQLinear) and m.fmt.scheme.qjl:
            m.use_qjl = not fast
            n += 1
    return n


def _kind(path: str) -> str:
    parts = path.split(".")
    if "switch_mlp" in parts or "experts" in parts:
        return "expert down" if parts[-1] == "down_proj" else "experts"
    if any(p.startswith(("shared_expert", "routed_expert_")) for p in parts):
        return "shared experts"
    if any(p in ("self_attn", "attention", "linear_attn") for p in parts):
        return "attention"
    if any(p in ("mlp", "feed_forward") for p in parts):
        return "dense mlp"
    if parts[-1] == "lm_head":
        return "lm_head"
    return "other"


def describe(tensors: dict, cfg: TurboQuantConfig) -> str:
    """One line for ``moestream inspect``: bits and group size per layer kind, rotation, QJL, extras.

    Reads shapes only (codebook length -> bits, ``in / scales`` -> group).
    """
    kinds: dict[str, set] = {}
    qjl = 0
    for name in tensors:
        if not name.endswith(".codebook"):
            continue
        path = name[: -len(".codebook")]
        levels = tensors[name].shape[0]
        inn, groups = tensors[path + ".signs"].shape[0], tensors[path + ".scales"].shape[-1]
        label = "ternary" if levels == TRIT else f"{LEVEL_BITS.get(levels, '?')}-bit"
        kinds.setdefault(_kind(path), set()).add(f"{label} g{inn // groups}")
        qjl += path + ".qjl_packed" in tensors
    order = ("attention", "experts", "expert down", "shared experts", "dense mlp", "lm_head", "other")
    parts = [f"{k} {', '.join(sorted(kinds[k]))}" for k in order if k in kinds]
    rot = "off" if cfg.rotation == "none" else "blockwise Hadamard"
    text = f"turboquant: {'; '.join(parts)}; rotation {rot}"
    if qjl:
        text += f"; QJL on {qjl} linear{'s' if qjl > 1 else ''}"
    if cfg.default is not None:
        extras = sorted(n[: -len(".biases")] for n in tensors if n.endswith(".biases"))
        if extras:
            text += f"; affine extras {cfg.default.bits}-bit g{cfg.default.group_size} ({', '.join(extras)})"
    return text


def _dequantize(t: dict, lf: LinearFormat, r0: int, r1: int) -> torch.Tensor:
    """Rows r0:r1 of a turboquant linear's rotated-domain weight from its pieces ``<role>``, ``<role>.scales``
    and its module's shared ``<role>.codebook`` (the input's rotation H_B(signs * x) is not in it)."""
    role = lf.role
    return dequantize_rows(t[role][r0:r1], t[role + ".scales"][r0:r1], t[role + ".codebook"], lf.in_features)


registry.register(StoredFormat(
    name="turboquant", method="turboquant",
    summary="turboquant-mlx tq* builds: codebook codes (1-4 bits, ternary) per group scale, Hadamard-rotated input",
    selected_by="config.json quantization.mode turboquant; tensors <module>.{weight,scales,codebook,signs}",
    weight=("U32",), params=(("scales", ("F16", "BF16", "F32")),), scale="scales", parse=TurboQuantConfig,
    check=linear_scheme, dequantize=_dequantize, tag=TQScheme.tag.fget, cpu=CpuKernel("codebook"),
    no_gpu="codebook lookups and the input's Hadamard rotation have no fused GPU kernel", mode="turboquant"))
