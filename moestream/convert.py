"""``moestream convert``: write a quantized checkpoint that moestream streams with one read per expert.

Input: a bf16, fp16 or fp32 checkpoint, or an FP8 one with block scales (DeepSeek-V3,
Kimi K2, Qwen3 FP8), in any expert layout moestream reads. Output: MLX affine
quantization (:mod:`moestream.quant.affine`), config.json ``quantization`` as mlx-lm
writes it (default ``{group_size, bits}`` plus per-module overrides), with separate bit
widths for experts (and their down projections), attention and the other linears; norms
stay float and routers take 8 bits (as mlx-lm keeps them; a router with an
``e_score_correction_bias`` stays float, as mlx-lm keeps it; so does MLA's ``kv_b_proj``,
which moestream's MLA uses as a matrix). Bits 16 keeps a part float;
with every part at 16 (``--bits 16``) the output is the float checkpoint, routers included,
in the streaming layout below, and config.json declares no quantization.

On-disk layout: experts are per-expert tensors ``<block>.experts.E.{gate,up,down}_proj.
{weight,scales,biases}`` (and a linear's own ``bias``, kept float, after its weight: gpt-oss), the
tensors of one expert adjacent in that order and the run starting at a 4 KiB-aligned file offset
(the header is padded with spaces, gaps with ``moestream.pad.N`` tensors, so the files stay valid
safetensors): the store reads an expert
in one ``preadv`` of one contiguous range. Shards hold about ``shard_gb`` GB and never
split an expert. The writer holds one tensor (or one expert) at a time, and the same
input gives the same bytes (fixed order, no timestamps). Experts stored for ``x @ W`` with gate
and up in interleaved columns (gpt-oss's ``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H])
are written de-interleaved and transposed into nn.Linear orientation, as mlx-lm and llama.cpp
write them (:func:`_expert_shapes`); the family reads them so by their layout.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import (
    INDEX_FILE,
    Checkpoint,
    dtype_size,
    pread_full,
    resolve_model,
    safetensors_dtype,
    shard_bytes,
    torch_dtype,
)
from .errors import ConfigError, MoestreamError
from .layout import discover_experts
from .quant import affine, fp8
from .quant.formats import QuantConfig, QuantError
from .sources import open_checkpoint

ALIGN = 4096
PAD_PREFIX = "moestream.pad."
ROUTER_BITS = 8
FLOAT_BITS = 16
_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass(frozen=True)
class ConvertSpec:
    """Bit widths per part (16 = keep float) and the group size.

    ``expert_bits``/``expert_down_bits``: routed experts (gate and up / down);
    ``attn_bits``: attention projections; ``other_bits``: every other linear and the
    embedding (dense MLPs, shared experts, LM head). Routers take ``ROUTER_BITS``.
    """

    group_size: int = 64
    expert_bits: int = 4
    expert_down_bits: int = 4
    attn_bits: int = 4
    other_bits: int = 4

    def check(self) -> None:
        """Raises ConfigError naming the bad option."""
        for name in ("expert_bits", "expert_down_bits", "attn_bits", "other_bits"):
            b = getattr(self, name)
            if b not in (*affine.BITS, FLOAT_BITS):
                raise ConfigError(f"--{name.replace('_', '-')} {b}: expected one of {affine.BITS} or 16 (float)")
        if self.group_size not in (32, 64, 128):
            raise ConfigError(f"--group-size {self.group_size}: expected 32, 64 or 128")

    def folder_name(self, model: str) -> str:
        """``<model>-e<expert bits>g<group>``, then ``d<down>``, ``a<attn>``, ``o<other>`` bits where they differ."""
        name = f"{model}-e{self.expert_bits}g{self.group_size}"
        if self.expert_down_bits != self.expert_bits:
            name += f"d{self.expert_down_bits}"
        if self.attn_bits != self.expert_bits:
            name += f"a{self.attn_bits}"
        if self.other_bits != self.expert_bits:
            name += f"o{self.other_bits}"
        return name


@dataclass
class _Out:
    """One output tensor: name, shape, safetensors dtype, and ``make()`` giving its data."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    make: Callable[[], torch.Tensor] | None = None
    nbytes_in: int = 0  # input bytes it consumes (progress)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


@dataclass
class _Item:
    """A run of output tensors written together; ``align``: its start is 4 KiB-aligned (one expert)."""

    tensors: list[_Out]
    align: bool = False
    make: Callable[[], dict[str, torch.Tensor]] | None = None
    nbytes_in: int = 0
    offsets: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _qshapes(name: str, out_f: int, in_f: int, bits: int, group: int, st_dtype: str) -> list[_Out]:
    mod = name[: -len(".weight")]
    if bits == FLOAT_BITS:
        return [_Out(name, (out_f, in_f), st_dtype)]
    return [_Out(name, (out_f, in_f * bits // 32), "U32"), _Out(mod + ".scales", (out_f, in_f // group), st_dtype),
            _Out(mod + ".biases", (out_f, in_f // group), st_dtype)]


def _quantize(w: torch.Tensor, name: str, bits: int, group: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if bits == FLOAT_BITS:
        return {name: w.to(dtype)}
    q, s, b = affine.quantize(w, bits, group, dtype)
    mod = name[: -len(".weight")]
    return {name: q, mod + ".scales": s, mod + ".biases": b}


class _Reader:
    """Reads input tensors, dequantizing FP8 block-scaled weights to float32."""

    def __init__(self, ckpt: Checkpoint, qcfg: QuantConfig | None):
        self.ckpt, self.qcfg = ckpt, qcfg

    def piece(self, p) -> torch.Tensor:
        raw = torch.empty(p.nbytes, dtype=torch.uint8)
        pread_full(self.ckpt.fd(p.file), p.offset, [memoryview(raw.numpy())], p.file, p.source)
        return raw.view(torch_dtype(p.dtype)).view(p.shape)

    def fp8(self, w: torch.Tensor, scale_inv: torch.Tensor, name: str) -> torch.Tensor:
        if self.qcfg is None or self.qcfg.method != "fp8":
            raise QuantError(f"{self.ckpt.path}: tensor {name!r} is fp8 but config.json declares no fp8 "
                             "quantization_config")
        return fp8.dequantize(w, scale_inv, self.qcfg.default.block, torch.float32)

    def tensor(self, name: str) -> torch.Tensor:
        t = self.ckpt.read_tensor(name)
        if t.dtype == getattr(torch, "float8_e4m3fn", None):
            si = name + "_scale_inv"
            if si not in self.ckpt.tensors:
                raise QuantError(f"{self.ckpt.path}: tensor {name!r} is fp8 but {si} is missing")
            t = self.fp8(t, self.ckpt.read_tensor(si), name)
        return t


def _category(name: str) -> str:
    if ".self_attn." in name or ".attn." in name or ".attention." in name:
        return "attn"
    # Qwen/DeepSeek ``mlp.gate``, Mixtral ``block_sparse_moe.gate``, gpt-oss ``mlp.router``, HunYuan ``mlp.gate.wg``
    if name.endswith((".gate.weight", ".router.weight", ".gate.wg.weight")):
        return "router"
    return "other"


def plan(ckpt: Checkpoint, spec: ConvertSpec, dtype: torch.dtype) -> tuple[list[_Item], dict | None]:
    """Output items in file order, and config.json's ``quantization`` dict (None when every part is float)."""
    spec.check()
    where = ckpt.path
    qcfg = QuantConfig.from_config(ckpt.config, str(where / "config.json"))
    layout = discover_experts(ckpt.tensors)
    reader = _Reader(ckpt, qcfg)
    st_dtype = safetensors_dtype(dtype)
    g = spec.group_size
    widths = [b for b in (spec.expert_bits, spec.expert_down_bits, spec.attn_bits, spec.other_bits) if b != FLOAT_BITS]
    # the default width mlx-lm's config names: the experts', else the first part quantized; None: all float
    default = widths[0] if widths else None
    router_bits = ROUTER_BITS if widths else FLOAT_BITS  # every part float (--bits 16): the routers too
    qdict: dict | None = {"group_size": g, "bits": default} if widths else None
    tied = bool(ckpt.config.get("tie_word_embeddings", False))
    items: list[_Item] = []
    for name, info in ckpt.tensors.items():
        if name in layout.expert_tensors or name.endswith("_scale_inv"):
            continue
        if info.dtype in ("U32", "U8") and name.endswith(("_blocks", ".weight")):
            raise QuantError(f"{where}: tensor {name!r} is {info.dtype}: convert reads float or fp8 checkpoints")
        bits = FLOAT_BITS
        linear = name.endswith(".weight") and len(info.shape) == 2 and "norm" not in name
        if linear:
            cat = _category(name)
            bits = {"attn": spec.attn_bits, "router": router_bits, "other": spec.other_bits}[cat]
            if name.endswith(".kv_b_proj.weight"):
                # MLA absorbs kv_b_proj into the query and the output as a matrix (models/mla.py): kept float
                bits = FLOAT_BITS
            if name[: -len("weight")] + "e_score_correction_bias" in ckpt.tensors:
                # a biased sigmoid router (DeepSeek-V3, GLM-4.5, Kimi) routes in float32, and mlx-lm keeps
                # it float (its MoEGate is not a Linear): quantizing it would change which experts are chosen
                bits = FLOAT_BITS
            if "embed_tokens" in name and tied:
                bits = FLOAT_BITS
            if info.shape[1] % g:
                bits = FLOAT_BITS
            mod = name[: -len(".weight")]
            if qdict is not None and bits != default:
                qdict[mod] = False if bits == FLOAT_BITS else {"group_size": g, "bits": bits}
        outs = _qshapes(name, *info.shape, bits, g, st_dtype) if linear else [_Out(name, info.shape, st_dtype)]
        if not linear and not torch_dtype(info.dtype).is_floating_point:
            outs = [_Out(name, info.shape, info.dtype)]

        def make(name=name, bits=bits, linear=linear):
            t = reader.tensor(name)
            if not t.is_floating_point():
                return {name: t}
            return _quantize(t.float(), name, bits, g, dtype) if linear else {name: t.to(dtype)}

        items.append(_Item(outs, make=make, nbytes_in=info.nbytes))
    for _, lay in sorted(layout.layers.items()):
        if lay.kind == "mxfp4":
            raise QuantError(f"{where}: {lay.block} experts are mxfp4; convert reads float or fp8 checkpoints")
        for role, bits in (("gate", spec.expert_bits), ("up", spec.expert_bits), ("down", spec.expert_down_bits)):
            if qdict is not None and bits != default:
                key = f"{lay.block}.switch_mlp.{_PROJ[role]}"  # the module path mlx-lm gives stacked experts
                qdict[key] = False if bits == FLOAT_BITS else {"group_size": g, "bits": bits}
        for e in range(lay.num_experts):
            pieces = {p.role: p for p in lay.experts[e]}
            shapes = _expert_shapes(pieces)
            outs = []
            for role in ("gate", "up", "down"):
                bits = spec.expert_down_bits if role == "down" else spec.expert_bits
                out_f, in_f = shapes[role]
                if in_f % g and bits != FLOAT_BITS:
                    source = pieces.get(role, pieces.get("gate_up")).source
                    raise ConfigError(f"{source}: {in_f} inputs are not a multiple of --group-size {g}")
                outs += _qshapes(f"{lay.block}.experts.{e}.{_PROJ[role]}.weight", out_f, in_f, bits, g, st_dtype)
                if role + ".bias" in shapes:  # a linear's own bias (gpt-oss): kept float, after its weight
                    outs.append(_Out(f"{lay.block}.experts.{e}.{_PROJ[role]}.bias", shapes[role + ".bias"], st_dtype))

            def make(lay=lay, e=e, pieces=pieces):
                out = {}
                for role, w in _expert_weights(reader, pieces, where).items():
                    name = f"{lay.block}.experts.{e}.{_PROJ[role.split('.')[0]]}."
                    if role.endswith(".bias"):
                        out[name + "bias"] = w.to(dtype)
                        continue
                    bits = spec.expert_down_bits if role == "down" else spec.expert_bits
                    out.update(_quantize(w.float(), name + "weight", bits, g, dtype))
                return out

            items.append(_Item(outs, align=True, make=make, nbytes_in=sum(p.nbytes for p in lay.experts[e])))
    return items, qdict


def _expert_shapes(pieces: dict) -> dict[str, tuple[int, ...]]:
    """The [out, in] shape of an expert's gate, up and down linears as convert writes them (and of their
    biases, ``<role>.bias``, where the expert has them): as stored, or, for experts stored for ``x @ W`` with
    gate and up in interleaved columns (gpt-oss: ``gate_up`` [H, 2I], ``down`` [I, H]), de-interleaved and
    transposed into nn.Linear orientation (gate and up [I, H], down [H, I]), as mlx-lm and llama.cpp write them."""
    if "gate_up" in pieces:
        hidden, two_i = pieces["gate_up"].shape
        out = {"gate": (two_i // 2, hidden), "up": (two_i // 2, hidden), "down": (hidden, two_i // 2)}
        if "gate_up.bias" in pieces:
            out["gate.bias"] = out["up.bias"] = (two_i // 2,)
    else:
        out = {role: tuple(pieces[role].shape) for role in ("gate", "up", "down")}
        out.update({role + ".bias": tuple(pieces[role + ".bias"].shape) for role in ("gate", "up")
                    if role + ".bias" in pieces})
    if "down.bias" in pieces:
        out["down.bias"] = tuple(pieces["down.bias"].shape)
    return dict(sorted(out.items(), key=lambda kv: ("gate", "up", "down").index(kv[0].split(".")[0])))


def _expert_weights(reader: _Reader, pieces: dict, where) -> dict[str, torch.Tensor]:
    """An expert's gate, up and down weights (fp8 dequantized) and biases, in the orientation and order of
    :func:`_expert_shapes`."""
    if "gate_up" in pieces:  # x @ W with interleaved columns: gate = gate_up[:, 0::2].T, up = gate_up[:, 1::2].T
        gate_up = reader.piece(pieces["gate_up"])
        out = {"gate": gate_up[:, 0::2].T, "up": gate_up[:, 1::2].T, "down": reader.piece(pieces["down"]).T}
        if "gate_up.bias" in pieces:
            bias = reader.piece(pieces["gate_up.bias"])
            out["gate.bias"], out["up.bias"] = bias[0::2], bias[1::2]
    else:
        out = {}
        for role in ("gate", "up", "down"):
            w = reader.piece(pieces[role])
            if w.dtype == getattr(torch, "float8_e4m3fn", None):
                si = pieces.get(role + ".weight_scale_inv")
                if si is None:
                    raise QuantError(f"{where}: tensor {pieces[role].source!r} is fp8 but its weight_scale_inv is "
                                     "missing")
                w = reader.fp8(w, reader.piece(si), pieces[role].source)
            out[role] = w
        out.update({role + ".bias": reader.piece(pieces[role + ".bias"]) for role in ("gate", "up")
                    if role + ".bias" in pieces})
    if "down.bias" in pieces:
        out["down.bias"] = reader.piece(pieces["down.bias"])
    return {role: out[role] for role in _expert_shapes(pieces)}


def _shards(items: list[_Item], shard_bytes: int) -> list[list[_Item]]:
    shards, cur, size = [], [], 0
    for it in items:
        if cur and size + it.nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += it.nbytes + (ALIGN if it.align else 0)
    if cur:
        shards.append(cur)
    return shards


def _layout_shard(items: list[_Item], pad_start: int) -> tuple[bytes, list[tuple[str, int]], int]:
    """The padded header, the padding runs ``(name, bytes)`` in order (as items), and the next pad index.

    Data offsets are assigned so that every aligned item starts at a multiple of ALIGN of
    the file: the header is padded with spaces to end on an ALIGN boundary.
    """
    header: dict = {}
    pads: list[tuple[str, int]] = []
    pos, k = 0, pad_start
    for it in items:
        gap = (-pos) % ALIGN if it.align else 0
        if gap:
            name = f"{PAD_PREFIX}{k}"
            header[name] = {"dtype": "U8", "shape": [gap], "data_offsets": [pos, pos + gap]}
            pads.append((name, gap))
            k += 1
            pos += gap
        else:
            pads.append(("", 0))
        it.offsets = []
        for t in it.tensors:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            it.offsets.append(pos)
            pos += t.nbytes
    header["__metadata__"] = {"format": "pt", "writer": "moestream convert"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    total = 8 + len(raw)
    raw += b" " * ((-total) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw, pads, k


def default_out(model: str | Path, src: Path, spec: ConvertSpec) -> Path:
    """``<model>-e<bits>g<group>...`` next to a local model folder, or in the working folder for a Hub id."""
    local = Path(model).expanduser()
    if local.is_dir():
        return local.parent / spec.folder_name(local.name)
    return Path.cwd() / spec.folder_name(str(model).rstrip("/").split("/")[-1])


@dataclass(frozen=True)
class ConvertPlan:
    """A checked convert job (nothing written yet): :func:`plan_convert` makes it, :func:`write_convert` runs it.

    Attributes:
        src: the local checkpoint (folder or GGUF file) read.
        out: the folder to create (absent, in an existing folder).
        spec: bit widths and group size.
        shard_bytes: shard size in bytes.
        nbytes: bytes of tensor data in ``src`` (what the progress counts down).
    """

    src: Path
    out: Path
    spec: ConvertSpec
    shard_bytes: int
    nbytes: int


def _check_out(out: Path) -> None:
    """Refuse an ``out`` that exists, or whose folder does not (convert makes only the last folder)."""
    if out.exists():
        raise MoestreamError(f"{out}: already exists; choose another --out or delete it")
    if not out.parent.is_dir():
        raise MoestreamError(
            f"--out {out}: {out.parent} is not an existing folder (convert makes only the last folder)")


def _dtype(ckpt: Checkpoint) -> torch.dtype:
    """The float dtype the output keeps unquantized tensors in: the config's, else bf16."""
    cfg_dtype = ckpt.config.get("torch_dtype") or ckpt.config.get("dtype") or "bfloat16"
    return {"float16": torch.float16, "float32": torch.float32}.get(cfg_dtype, torch.bfloat16)


def plan_convert(model: str | Path, out: str | Path | None = None, spec: ConvertSpec | None = None,
                 shard_gb: float = 5.0) -> ConvertPlan:
    """Check every convert argument and the input's tensors (headers only; nothing is written), so a
    refusal comes before any progress output.

    Args: as :func:`convert`.

    Raises:
        ConfigError: a bad option (spec, ``shard_gb``); QuantError: an input already quantized or fp8
        without its scales; CheckpointError: an unreadable input; MoestreamError: ``out`` exists, or
        its folder does not.
    """
    spec = spec or ConvertSpec()
    spec.check()
    nbytes_shard = shard_bytes(shard_gb)
    src = resolve_model(model)
    out = Path(out) if out is not None else default_out(model, src, spec)
    _check_out(out)
    with open_checkpoint(src) as ckpt:
        plan(ckpt, spec, _dtype(ckpt))  # refuses what convert cannot read, by tensor name
        nbytes = ckpt.total_bytes
    return ConvertPlan(src, out, spec, nbytes_shard, nbytes)


def write_convert(job: ConvertPlan, progress: Callable[[int], None] | None = None) -> Path:
    """Write the planned quantized checkpoint into ``job.out`` (as a hidden ``.partial`` folder renamed
    when complete; removed on failure). ``progress`` is called with the input bytes of each tensor or
    expert converted. Returns ``job.out``.

    Raises:
        MoestreamError: ``job.out`` was created since the plan; what :func:`plan_convert` raises.
    """
    out = job.out
    _check_out(out)
    with open_checkpoint(job.src) as ckpt:
        items, qdict = plan(ckpt, job.spec, _dtype(ckpt))
        tmp = out.parent / f".{out.name}.partial"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            _write(ckpt, items, qdict, tmp, job.shard_bytes, progress)
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def convert(model: str | Path, out: str | Path | None = None, spec: ConvertSpec | None = None,
            shard_gb: float = 5.0, progress: Callable[[int], None] | None = None) -> Path:
    """Write the quantized checkpoint of ``model`` into the new folder ``out``: :func:`plan_convert`,
    then :func:`write_convert`.

    Args:
        model: checkpoint folder or Hub id (bf16, fp16, fp32 or fp8 with block scales).
        out: the folder to create, in an existing folder (default: :func:`default_out`).
        spec: bit widths and group size (:class:`ConvertSpec`).
        shard_gb: shard size in GB (10^9 bytes), above 0.
        progress: called with the input bytes of each tensor or expert converted.

    Returns:
        The output folder.

    Raises:
        ConfigError: a bad option; QuantError: an input already quantized or fp8 without
        its scales; CheckpointError: an unreadable input; MoestreamError: ``out`` exists, or its
        folder does not.
    """
    return write_convert(plan_convert(model, out, spec, shard_gb), progress)


def _write(ckpt: Checkpoint, items: list[_Item], qdict: dict | None, folder: Path, shard_bytes: int, progress) -> None:
    shards = _shards(items, shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, pad_k, total = {}, 0, 0
    for shard, fname in zip(shards, names):
        head, pads, pad_k = _layout_shard(shard, pad_k)
        with open(folder / fname, "wb") as f:
            f.write(head)
            for it, (pad_name, gap) in zip(shard, pads):
                if gap:
                    f.write(bytes(gap))
                    weight_map[pad_name] = fname
                data = it.make()
                for t in it.tensors:
                    x = data[t.name].contiguous()
                    if tuple(x.shape) != t.shape or safetensors_dtype(x.dtype) != t.dtype:
                        raise AssertionError(f"{t.name}: planned {t.dtype}{list(t.shape)}, made {x.dtype}")
                    f.write(memoryview(x.view(torch.uint8).reshape(-1).numpy()))
                    weight_map[t.name] = fname
                    total += t.nbytes
                if progress is not None:
                    progress(it.nbytes_in)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    cfg = dict(ckpt.config)
    cfg.pop("quantization_config", None)
    cfg.pop("quantization", None)
    if qdict is not None:  # None: every part float, a plain float checkpoint in the streaming layout
        cfg["quantization"] = qdict
        cfg["quantization_config"] = qdict  # mlx-lm writes both names
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in sorted(ckpt.path.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (INDEX_FILE, "config.json"):
            if not re.search(r"\.(bin|pt|pth|ckpt|pkl)$", f.name):
                shutil.copyfile(f, folder / f.name)


def padding_tensors(tensors: dict) -> set[str]:
    """Names of the padding tensors ``convert`` writes (not weights)."""
    return {n for n in tensors if n.startswith(PAD_PREFIX)}
