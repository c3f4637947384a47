"""Expert layout discovery: find every MoE layer's routed experts from tensor names.

Checkpoints store routed experts in one of three layouts, found by rule rather than
by a per-model table of names:

* per-expert tensors, what Hugging Face checkpoints hold on disk:
  ``<layers>.N.<block>.experts.E.{gate_proj,up_proj,down_proj}.weight``
  (Mixtral's ``w1``/``w3``/``w2`` mean gate/up/down);
* fused 3-D tensors, what transformers 5 holds in memory:
  ``<layers>.N.<block>.experts.gate_up_proj`` [E, 2I, H] (gate rows first) and
  ``<layers>.N.<block>.experts.down_proj`` [E, H, I];
* stacked 3-D tensors, what mlx-lm writes:
  ``<layers>.N.<block>.switch_mlp.{gate,up,down}_proj.weight`` [E, out, in].
* fused 3-D tensors stored for ``x @ W``, what gpt-oss holds (transformers writes it so):
  ``...experts.gate_up_proj`` [E, H, 2I] (gate and up columns interleaved) and
  ``...experts.down_proj`` [E, I, H], with ``...experts.gate_up_proj_bias`` [E, 2I] and
  ``...experts.down_proj_bias`` [E, H]; told from the nn.Linear orientation by the two
  shapes. Such an expert becomes the pieces ``gate_up`` [H, 2I], ``down`` [I, H],
  ``down.bias`` [H] and ``gate_up.bias`` [2I]: interleaved columns cannot be cut into two
  byte ranges, so the family's expert function splits them.

``<layers>`` is ``model.layers``, ``model.language_model.layers`` or
``language_model.model.layers``. Whatever the layout, each expert becomes the same
three byte ranges (pieces) ``gate`` [I, H], ``up`` [I, H] and ``down`` [H, I], so the
compute and the cache see one form and every layout gives bit-identical results.
Shared experts (``shared_expert``, ``shared_experts``) are not routed: they stay with
the resident weights.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import BLOCK_DTYPE_PREFIX, TensorInfo, dtype_size
from .errors import LayoutError
from .quant import registry

LAYER_PREFIXES = ("model.layers", "model.language_model.layers", "language_model.model.layers")
_PRE = "(?P<prefix>" + "|".join(re.escape(p) for p in LAYER_PREFIXES) + r")\.(?P<layer>\d+)\.(?P<block>[\w.]+?)"
_PER_EXPERT = re.compile(_PRE + r"\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<param>\w+)$")
_FUSED = re.compile(_PRE + r"\.experts\.(?P<proj>gate_up_proj|down_proj)(?:\.weight)?$")
_STACKED = re.compile(_PRE + r"\.switch_mlp\.(?P<proj>\w+)\.(?P<param>\w+)$")
# biases of fused experts, as gpt-oss stores them: gate_up_proj_bias [E, 2I], down_proj_bias [E, H]
_FUSED_BIAS = re.compile(_PRE + r"\.experts\.(?P<proj>gate_up_proj|down_proj)_bias$")
# resident tensors that live under an experts module: Laguna's router correction bias
_RESIDENT_UNDER_EXPERTS = re.compile(r"\.experts\.e_score_correction_bias$|\.switch_mlp\.\w+\.(codebook|signs)$")
# per-projection tensors of stacked experts shared by every expert (turboquant): resident, not pieces
SHARED_PARAMS = ("codebook", "signs")
# MXFP4 experts as gpt-oss ships them: ...experts.{gate_up,down}_proj_{blocks,scales,bias} (see moestream.quant)
_MXFP4 = re.compile(_PRE + r"\.experts\.(?P<proj>gate_up_proj|down_proj)_(?P<param>blocks|scales|bias)$")
# any name that looks like it holds routed experts; used to report layouts we do not know
_EXPERTISH = re.compile(r"\.(experts|switch_mlp)\.")
ROLE_OF_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
ROLES = ("gate", "up", "down")
# the roles of a fused expert stored for x @ W (gpt-oss): interleaved gate/up columns, then down
FUSED_IO_ROLES = ("gate_up", "down")
# piece dtypes and parameter names that mark quantized experts (moestream.quant checks them against the config)
QUANT_DTYPES = ("U32", "F8_E4M3")
QUANT_PARAMS = registry.quant_params()  # the roles the stored formats declare (moestream.quant.registry)
# a weight stored under another parameter name: compressed-tensors' packed 4-bit ``weight_packed``
WEIGHT_PARAMS = ("weight", "weight_packed")


@dataclass(frozen=True)
class Piece:
    """One tensor of one expert: ``nbytes`` bytes at absolute ``offset`` of ``file``.

    ``role`` is ``"gate"``, ``"up"`` or ``"down"`` (``"<role>.<param>"`` for a tensor other
    than the weight, such as a bias); ``dtype`` the safetensors dtype name; ``shape`` the
    expert's own 2-D shape ([out, in], as ``nn.Linear`` stores it); ``source`` the
    checkpoint tensor it lies in, for error messages.
    """

    role: str
    file: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    source: str


@dataclass
class MoELayerLayout:
    """The routed experts of one MoE layer.

    ``block`` is the module path of the MoE block (``model.layers.3.mlp``), ``kind``
    the layout (``"per-expert"``, ``"fused"`` or ``"stacked"``), ``experts[e]`` the
    pieces of expert ``e`` in role order.
    """

    layer: int
    block: str
    kind: str
    experts: list[tuple[Piece, ...]]

    @property
    def num_experts(self) -> int:
        return len(self.experts)


class ExpertLayout:
    """Every MoE layer's experts, as byte ranges of the checkpoint's shards.

    Attributes:
        layers: layer index -> :class:`MoELayerLayout`.
        expert_tensors: names of the checkpoint tensors that hold routed experts (the
            rest are resident weights or unused).
    """

    def __init__(self, layers: dict[int, MoELayerLayout], expert_tensors: set[str]):
        self.layers = layers
        self.expert_tensors = expert_tensors

    def pieces(self, layer: int, expert: int) -> tuple[Piece, ...]:
        """The pieces of one expert, in role order."""
        return self.layers[layer].experts[expert]

    def expert_nbytes(self, layer: int, expert: int) -> int:
        """Bytes one expert occupies on disk."""
        return sum(p.nbytes for p in self.pieces(layer, expert))

    @property
    def total_bytes(self) -> int:
        """Bytes of every routed expert of every layer."""
        return sum(p.nbytes for lay in self.layers.values() for ex in lay.experts for p in ex)

    @property
    def num_experts(self) -> int:
        """Total routed experts over all layers."""
        return sum(lay.num_experts for lay in self.layers.values())


def _piece(role: str, info: TensorInfo, index: int, rows: slice | None = None) -> Piece:
    """The piece ``info[index]`` of a 3-D expert tensor (optionally only ``rows`` of it)."""
    inner = info.shape[1:]
    per = dtype_size(info.dtype) * math.prod(inner)
    offset, nbytes, shape = info.offset + index * per, per, inner
    if rows is not None:
        row_bytes = per // inner[0] if inner[0] else 0
        offset += rows.start * row_bytes
        nbytes = (rows.stop - rows.start) * row_bytes
        shape = (rows.stop - rows.start, *inner[1:])
    return Piece(role, info.file, offset, nbytes, info.dtype, shape, info.name)


def discover_experts(tensors: dict[str, TensorInfo]) -> ExpertLayout:
    """Find the routed experts of every MoE layer in a checkpoint's tensor index.

    Args:
        tensors: tensor name -> :class:`TensorInfo` (``Checkpoint.tensors``).

    Returns:
        An :class:`ExpertLayout`; empty when the checkpoint has no routed experts.

    Raises:
        LayoutError: tensors that look like experts in no known layout, a layer mixing
            layouts, an expert missing gate, up or down, or experts of one layer whose
            shapes disagree; the message names what was found.
    """
    found: dict[tuple[str, int, str], dict] = {}
    expert_tensors: set[str] = set()
    unknown: list[str] = []
    for name, info in tensors.items():
        if any(read(found, name, info, tensors) for read in _READERS):
            expert_tensors.add(name)
        elif (
            _EXPERTISH.search(name)
            and not _RESIDENT_UNDER_EXPERTS.search(name)
            and any(name.startswith(p + ".") for p in LAYER_PREFIXES)
        ):
            unknown.append(name)
    if unknown:
        raise LayoutError(
            f"unknown expert layout: found {len(unknown)} tensors such as {sorted(unknown)[:3]}; moestream "
            "reads per-expert '...experts.E.{gate,up,down}_proj.weight', fused '...experts.gate_up_proj' "
            "[E, 2I, H] with '...experts.down_proj' [E, H, I] (or gpt-oss's [E, H, 2I] and [E, I, H], with "
            "optional '_bias' tensors), and stacked "
            "'...switch_mlp.{gate,up,down}_proj.weight' [E, out, in]"
        )
    layers: dict[int, MoELayerLayout] = {}
    for (prefix, layer, block), slot in sorted(found.items(), key=lambda kv: kv[0][1]):
        path = f"{prefix}.{layer}.{block}"
        if layer in layers:
            raise LayoutError(f"layer {layer} holds experts under both {layers[layer].block} and {path}")
        experts = _experts(path, slot)
        _check_alike(path, experts)
        _check_shapes(path, experts[0])
        layers[layer] = MoELayerLayout(layer, path, slot["kind"], experts)
    return ExpertLayout(layers, expert_tensors)


# Each reader takes one tensor of one expert layout into ``found`` (block -> its experts' pieces by role) and
# says whether it did; discover_experts tries them in this order, the first that takes a tensor wins.

def _read_per_expert(found: dict, name: str, info: TensorInfo, tensors: dict) -> bool:
    """``...experts.E.{gate,up,down}_proj.<param>`` (Mixtral's w1/w3/w2): one piece as stored."""
    if not ((m := _PER_EXPERT.match(name)) and m["proj"] in ROLE_OF_PROJ):
        return False
    parts, role = _slot(found, m, "per-expert", name), _role(m)
    if m["param"] in WEIGHT_PARAMS:
        _check_rank(info, 2, name)
    parts[int(m["expert"])][role] = Piece(role, info.file, info.offset, info.nbytes, info.dtype, info.shape, name)
    return True


def _read_stacked(found: dict, name: str, info: TensorInfo, tensors: dict) -> bool:
    """mlx-lm's ``...switch_mlp.{gate,up,down}_proj.<param>`` [E, ...]: one piece per expert row."""
    if not ((m := _STACKED.match(name)) and m["proj"] in ROLE_OF_PROJ and m["param"] not in SHARED_PARAMS):
        return False
    parts, role = _slot(found, m, "stacked", name), _role(m)
    if m["param"] == "weight":
        _check_rank(info, 3, name)
    for e in range(info.shape[0]):
        parts[e][role] = _piece(role, info, e)
    return True


def _read_mxfp4(found: dict, name: str, info: TensorInfo, tensors: dict) -> bool:
    """gpt-oss's MXFP4 ``...experts.{gate_up,down}_proj_{blocks,scales,bias}`` (a bias only beside blocks)."""
    if not ((m := _MXFP4.match(name)) and (m["param"] != "bias" or name[: -len("bias")] + "blocks" in tensors)):
        return False
    parts = _slot(found, m, "mxfp4", name)
    role = "gate_up" if m["proj"] == "gate_up_proj" else "down"
    role += "" if m["param"] == "blocks" else "." + m["param"]
    for e in range(info.shape[0]):
        parts[e][role] = _piece(role, info, e)
    return True


def _read_fused_in_out(found: dict, name: str, info: TensorInfo, tensors: dict) -> bool:
    """gpt-oss orientation, x @ W: gate_up_proj [E, H, 2I] with gate and up columns interleaved (one piece,
    split by the expert function), down_proj [E, I, H]."""
    if not ((m := _FUSED.match(name)) and _fused_in_out(name, tensors)):
        return False
    parts = _slot(found, m, "fused", name)
    _check_rank(info, 3, name)
    role = "gate_up" if m["proj"] == "gate_up_proj" else "down"
    for e in range(info.shape[0]):
        parts[e][role] = _piece(role, info, e)
    return True


def _read_fused_bias(found: dict, name: str, info: TensorInfo, tensors: dict) -> bool:
    """``...experts.{gate_up,down}_proj_bias`` [E, n]: whole per expert, or split into gate and up halves when
    the fused weights are in nn.Linear orientation."""
    if not (m := _FUSED_BIAS.match(name)):
        return False
    parts = _slot(found, m, "fused", name)
    _check_rank(info, 2, name)
    split = m["proj"] == "gate_up_proj" and not _fused_in_out(name[: -len("_bias")], tensors)
    half = info.shape[1] // 2
    for e in range(info.shape[0]):
        if not split:
            role = ("gate_up" if m["proj"] == "gate_up_proj" else "down") + ".bias"
            parts[e][role] = _piece(role, info, e)
            continue
        for role, cols in (("gate.bias", slice(0, half)), ("up.bias", slice(half, 2 * half))):
            parts[e][role] = _piece1d(role, info, e, cols)
    return True


def _read_fused(found: dict, name: str, info: TensorInfo, tensors: dict) -> bool:
    """transformers 5's fused experts in nn.Linear orientation: gate_up_proj [E, 2I, H] (gate rows first, cut
    into two pieces), down_proj [E, H, I]."""
    if not (m := _FUSED.match(name)):
        return False
    parts = _slot(found, m, "fused", name)
    _check_rank(info, 3, name)
    two_i = info.shape[1]
    if m["proj"] == "gate_up_proj" and two_i % 2:
        raise LayoutError(f"{name}: gate_up_proj has an odd row count {two_i}; expected [E, 2I, H]")
    for e in range(info.shape[0]):
        if m["proj"] == "down_proj":
            parts[e]["down"] = _piece("down", info, e)
            continue
        for role, rows in (("gate", slice(0, two_i // 2)), ("up", slice(two_i // 2, two_i))):
            parts[e][role] = _piece(role, info, e, rows)
    return True


_READERS = (_read_per_expert, _read_stacked, _read_mxfp4, _read_fused_in_out, _read_fused_bias, _read_fused)


def _experts(path: str, slot: dict) -> list[tuple[Piece, ...]]:
    """Every expert of the block at ``path`` as its pieces, required roles first, the rest sorted.

    Raises:
        LayoutError: an expert number missing, or an expert lacking a required role.
    """
    parts = slot["parts"]
    count = max(parts) + 1
    missing = [e for e in range(count) if e not in parts]
    if missing:
        raise LayoutError(f"{path}: experts {missing[:5]} are missing (found {len(parts)} of {count})")
    experts = []
    for e in range(count):
        roles = parts[e]
        required = FUSED_IO_ROLES if "gate_up" in roles else ROLES
        lacking = [r for r in required if r not in roles]
        if lacking:
            where = next(iter(roles.values())).file
            who = "every expert (stacked)" if slot["kind"] == "stacked" else f"expert {e}"
            raise LayoutError(f"{where}: {path}: {who} lacks {', '.join(lacking)} "
                              f"(found {', '.join(sorted(roles))})")
        order = list(required) + sorted(r for r in roles if r not in required)
        experts.append(tuple(roles[r] for r in order))
    return experts


def _check_alike(path: str, experts: list[tuple[Piece, ...]]) -> None:
    """Every expert of a layer has expert 0's roles, shapes and dtypes. Raises LayoutError naming the tensor."""
    ref = [(p.role, p.shape, p.dtype) for p in experts[0]]
    for e, pieces in enumerate(experts):
        extra = sorted({r for r, _, _ in ref} - {p.role for p in pieces})
        if extra:  # e.g. a quantized expert missing its scales
            own = {p.role: p.source for p in pieces}.get(extra[0].split(".")[0], f"expert {e}")
            raise LayoutError(f"{path}: tensor {own!r} has no {extra[0].split('.', 1)[-1]} piece, which "
                              f"expert 0 has ({next(p.source for p in experts[0] if p.role == extra[0])})")
        for p, (role, shape, dt) in zip(pieces, ref):
            if (p.role, p.shape, p.dtype) != (role, shape, dt):
                raise LayoutError(
                    f"{path}: expert {e} {p.role} is {p.dtype} {list(p.shape)} but expert 0's is "
                    f"{dt} {list(shape)} ({p.source})"
                )


def _check_shapes(path: str, pieces: tuple[Piece, ...]) -> None:
    """An unquantized expert's pieces form a SwiGLU expert (gate and up [I, H], down [H, I]) or a fused one
    (gate_up [H, 2I], down [I, H]); packed shapes are checked against the config by
    ``moestream.quant.formats.expert_format``. Raises LayoutError naming the shapes."""
    if _quantized(pieces):
        return
    if pieces[0].role == "gate_up":
        gate_up, down = pieces[:2]
        if len(down.shape) != 2 or gate_up.shape != (down.shape[1], 2 * down.shape[0]):
            raise LayoutError(
                f"{path}: expert shapes gate_up {gate_up.shape}, down {down.shape} do not form a fused "
                "expert (gate_up [H, 2I], down [I, H])"
            )
        return
    gate, up, down = pieces[:3]
    if gate.shape != up.shape or down.shape[::-1] != gate.shape:
        raise LayoutError(
            f"{path}: expert shapes gate {gate.shape}, up {up.shape}, down {down.shape} do not form a "
            "SwiGLU expert (gate and up [I, H], down [H, I])"
        )


def _slot(found: dict, m: re.Match, kind: str, name: str) -> dict:
    """The per-expert parts dict of the MoE block ``m`` names, checking it uses one layout."""
    key = (m["prefix"], int(m["layer"]), m["block"])
    slot = found.setdefault(key, {"kind": kind, "parts": defaultdict(dict)})
    if slot["kind"] != kind:
        raise LayoutError(f"{key[0]}.{key[1]}.{key[2]}: mixes {slot['kind']} and {kind} expert tensors ({name})")
    return slot["parts"]


def _role(m: re.Match) -> str:
    """``gate``/``up``/``down`` for a weight, ``<role>.<param>`` for another tensor (a bias)."""
    return ROLE_OF_PROJ[m["proj"]] + ("" if m["param"] in WEIGHT_PARAMS else "." + m["param"])


def _fused_in_out(name: str, tensors: dict[str, TensorInfo]) -> bool:
    """Whether the fused pair holding ``name`` is stored for ``x @ W`` (gpt-oss) rather than as nn.Linear.

    Decided by the two shapes: gate_up_proj [E, A, B] and down_proj [E, C, D] are
    [E, 2I, H] and [E, H, I] (nn.Linear orientation) when B == C and A == 2D, and
    [E, H, 2I] and [E, I, H] (x @ W) when A == D and B == 2C; both at once only when I = 0.

    Raises:
        LayoutError: shapes that fit neither orientation.
    """
    stem = name.rsplit(".experts.", 1)[0] + ".experts."
    gate_up, down = tensors.get(stem + "gate_up_proj"), tensors.get(stem + "down_proj")
    if gate_up is None or down is None or len(gate_up.shape) != 3 or len(down.shape) != 3:
        return False  # reported as a missing role or a wrong rank elsewhere
    (_, a, b), (_, c, d) = gate_up.shape, down.shape
    if b == c and a == 2 * d:
        return False
    if a == d and b == 2 * c:
        return True
    raise LayoutError(
        f"{stem}gate_up_proj {list(gate_up.shape)} and {stem}down_proj {list(down.shape)} fit neither "
        "[E, 2I, H] with [E, H, I] nor [E, H, 2I] with [E, I, H]"
    )


def _piece1d(role: str, info: TensorInfo, index: int, cols: slice) -> Piece:
    """Elements ``cols`` of row ``index`` of a 2-D per-expert tensor (half of a fused bias)."""
    size = dtype_size(info.dtype)
    offset = info.offset + (index * info.shape[1] + cols.start) * size
    n = cols.stop - cols.start
    return Piece(role, info.file, offset, n * size, info.dtype, (n,), info.name)


def _quantized(pieces: tuple[Piece, ...]) -> bool:
    """Whether an expert's pieces are quantized (packed or fp8 weights, scales, mxfp4 or ggml blocks)."""
    return any(p.dtype in QUANT_DTYPES or p.dtype.startswith(BLOCK_DTYPE_PREFIX)
               or p.role.partition(".")[2] in QUANT_PARAMS for p in pieces)


def _check_rank(info: TensorInfo, rank: int, name: str) -> None:
    if len(info.shape) != rank:
        raise LayoutError(f"{name}: expected a {rank}-D tensor, found shape {list(info.shape)}")
