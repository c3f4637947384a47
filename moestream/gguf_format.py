"""GGUF checkpoints (llama.cpp's files): a ``.gguf`` file, or a split set, read as a checkpoint whose
tensors carry the Hugging Face names moestream's families use.

A GGUF file (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) holds a header
(magic, version, tensor and key-value counts), typed metadata (``general.architecture``,
``<arch>.block_count``, ...), a tensor-info table (name, dimensions ``ne`` fastest first,
ggml type, offset into the data section) and the data section, which starts at the next
multiple of ``general.alignment`` (default 32) after the table; every tensor's offset is a
multiple of the alignment. A model split by ``llama-gguf-split`` is several such files,
``<name>-00001-of-0000N.gguf`` ..., the first holding the metadata (``split.count``).

:func:`open_gguf` parses the header, metadata and tensor infos with the ``gguf`` package's
own reader (``gguf.GGUFReader``; no tensor data is read) and validates every tensor against
its file before anything else happens: a known ggml type that moestream computes on
(:mod:`moestream.quant.ggml`: F32, F16, BF16, Q4_0-Q8_0, Q2_K-Q6_K, IQ4_NL, IQ4_XS),
whole blocks per row, an aligned offset, a byte range inside the file and overlapping no
other. A tensor of another type is refused naming the tensor and its type.

Tensors are indexed as :class:`~moestream.checkpoint.TensorInfo` byte ranges: a float
tensor as its dtype and torch shape (``ne`` reversed); a block-quantized one as its raw
bytes, dtype ``GGML_<type>``, shape ``[..., rows, row bytes]``. llama.cpp's names are
mapped onto Hugging Face names (:data:`NAMES`); the stacked experts ``blk.N.ffn_{gate,up,
down}_exps.weight`` (``ne`` = [in, out, E]: torch [E, out, in]) become
``model.layers.N.mlp.switch_mlp.{gate,up,down}_proj.weight``, the stacked layout of
:mod:`moestream.layout`, so each expert is one contiguous byte range read through the same
store, cache and O_DIRECT path as any checkpoint. The Hugging Face config is built from the
metadata (:func:`hf_config`).

Architectures (``general.architecture``): ``qwen3moe`` (family ``qwen3_moe``), ``olmoe`` (family
``olmoe``) and ``llama`` with experts (Mixtral; family ``mixtral``). llama.cpp's
``convert_hf_to_gguf.py`` permutes the q and k rows of its ``llama``-derived models
(``LlamaModel.permute``, for its interleaved rotary embedding): for ``llama`` they are read back
into Hugging Face order (derived tensors, whole rows moved: any type). ``Qwen3MoeModel`` and
``OlmoeModel`` derive from ``TextModel`` and store q and k as Hugging Face has them, so nothing is
undone there. llama.cpp's qwen3moe graph always renormalizes the top-k
router weights (``norm_topk_prob``), which the metadata does not say.

``qwen3next`` (Qwen3-Next; family ``qwen3_next``) and ``qwen35moe`` (Qwen3.5/3.6 MoE; family
``qwen3_5_moe``, as the text model ``qwen3_5_moe_text``): ``Qwen3NextModel.modify_tensors`` stores the
zero-centred norms as ``1 + w`` (every ``*norm.weight`` but the DeltaNet's gated ``linear_attn.norm``),
``A_log`` as ``blk.N.ssm_a = -exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, the conv squeezed to [C, K],
and splits Qwen3-Next's ``in_proj_qkvz`` (grouped per key head) into ``attn_qkv`` (q, k, v of all
heads) and ``attn_gate`` (z; older conversions kept it whole as ``ssm_in``);
``_LinearAttentionVReorderBase`` (Qwen3.5) reorders the value heads from grouped by key head to tiled
when there are fewer key than value heads. Each is undone at read (:func:`_adapt_hybrid`, derived
tensors): ``w = stored - 1`` in float32 (exact while ``1 + w >= 0.5``), ``A_log = log(-ssm_a)`` in
float64 rounded to float32, rows moved as stored (any type), ``out_proj``'s columns moved as whole
blocks when a value head is whole blocks, else kept as stored with the family feeding it its input in
the stored order (``GGUFFormat.input_orders``). The config comes from the ``ssm.*``
keys, ``attention.recurrent_layers`` or ``full_attention_interval`` and ``rope.dimension_count``
(partial rotary); llama.cpp's graphs always renormalize the top-k weights. ``gpt-oss`` (family
``gpt_oss``): ``GptOssModel`` de-interleaves ``gate_up`` into ``ffn_gate_exps``/``ffn_up_exps`` with
their biases and transposes ``down`` into nn.Linear orientation, which the family reads as it reads an
mlx-lm build (separate gate and up experts); ``attn_sinks.weight`` is ``self_attn.sinks``; the
sliding window and YaRN come from the metadata (:func:`_gpt_oss_config`). Fused gate/up experts
(``ffn_gate_up_exps``, a converter option) are refused by name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from .checkpoint import Checkpoint, FileHandles, TensorInfo, file_identity
from .errors import CheckpointError
from .quant import ggml

SUFFIX = ".gguf"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# general.architecture -> (Hugging Face model_type, architectures)
ARCHITECTURES = {"qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"), "llama": ("mixtral", "MixtralForCausalLM"),
                 "olmoe": ("olmoe", "OlmoeForCausalLM")}
ARCHITECTURES["qwen3next"] = ("qwen3_next", "Qwen3NextForCausalLM")
ARCHITECTURES["qwen35moe"] = ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")  # the text model at model.layers
ARCHITECTURES["gpt-oss"] = ("gpt_oss", "GptOssForCausalLM")

# llama.cpp tensor name (without the .weight / .bias suffix) -> Hugging Face module path; {i} the layer, {e} an expert
_SHARED = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
}
NAMES = {
    "qwen3moe": {
        **_SHARED,
        "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
        "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
        "blk.{i}.ffn_gate_inp": "model.layers.{i}.mlp.gate",
        "blk.{i}.ffn_gate_exps": "model.layers.{i}.mlp.switch_mlp.gate_proj",
        "blk.{i}.ffn_up_exps": "model.layers.{i}.mlp.switch_mlp.up_proj",
        "blk.{i}.ffn_down_exps": "model.layers.{i}.mlp.switch_mlp.down_proj",
        "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
        "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
        "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
    },
    "olmoe": {  # q_norm and k_norm over the whole projection (model.layers.N.self_attn.{q,k}_norm), as HF
        **_SHARED,
        "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
        "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
        "blk.{i}.ffn_gate_inp": "model.layers.{i}.mlp.gate",
        "blk.{i}.ffn_gate_exps": "model.layers.{i}.mlp.switch_mlp.gate_proj",
        "blk.{i}.ffn_up_exps": "model.layers.{i}.mlp.switch_mlp.up_proj",
        "blk.{i}.ffn_down_exps": "model.layers.{i}.mlp.switch_mlp.down_proj",
    },
    "llama": {  # Mixtral: llama with experts
        **_SHARED,
        "blk.{i}.ffn_gate_inp": "model.layers.{i}.block_sparse_moe.gate",
        "blk.{i}.ffn_gate_exps": "model.layers.{i}.block_sparse_moe.switch_mlp.gate_proj",
        "blk.{i}.ffn_up_exps": "model.layers.{i}.block_sparse_moe.switch_mlp.up_proj",
        "blk.{i}.ffn_down_exps": "model.layers.{i}.block_sparse_moe.switch_mlp.down_proj",
        # conversions from before llama.cpp stacked the experts (early 2024): one tensor per expert
        "blk.{i}.ffn_gate.{e}": "model.layers.{i}.block_sparse_moe.experts.{e}.w1",
        "blk.{i}.ffn_up.{e}": "model.layers.{i}.block_sparse_moe.experts.{e}.w3",
        "blk.{i}.ffn_down.{e}": "model.layers.{i}.block_sparse_moe.experts.{e}.w2",
    },
}
# the hybrid Qwen architectures (Qwen3NextModel and Qwen3_5MoeTextModel in convert_hf_to_gguf.py): names as the
# converter writes them, before the transformations _adapt_hybrid undoes (dt_bias -> dt_proj.bias, A_log -> the
# bare blk.N.ssm_a, in_proj_qkvz -> attn_qkv + attn_gate)
_HYBRID = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
    "blk.{i}.attn_qkv": "model.layers.{i}.linear_attn.in_proj_qkv",
    "blk.{i}.attn_gate": "model.layers.{i}.linear_attn.in_proj_z",
    "blk.{i}.ssm_conv1d": "model.layers.{i}.linear_attn.conv1d",
    "blk.{i}.ssm_dt": "model.layers.{i}.linear_attn.dt_proj",
    "blk.{i}.ssm_norm": "model.layers.{i}.linear_attn.norm",
    "blk.{i}.ssm_out": "model.layers.{i}.linear_attn.out_proj",
    "blk.{i}.ffn_gate_inp": "model.layers.{i}.mlp.gate",
    "blk.{i}.ffn_gate_exps": "model.layers.{i}.mlp.switch_mlp.gate_proj",
    "blk.{i}.ffn_up_exps": "model.layers.{i}.mlp.switch_mlp.up_proj",
    "blk.{i}.ffn_down_exps": "model.layers.{i}.mlp.switch_mlp.down_proj",
    "blk.{i}.ffn_gate_shexp": "model.layers.{i}.mlp.shared_expert.gate_proj",
    "blk.{i}.ffn_up_shexp": "model.layers.{i}.mlp.shared_expert.up_proj",
    "blk.{i}.ffn_down_shexp": "model.layers.{i}.mlp.shared_expert.down_proj",
    "blk.{i}.ffn_gate_inp_shexp": "model.layers.{i}.mlp.shared_expert_gate",
}
NAMES["qwen3next"] = {
    **_HYBRID,
    "blk.{i}.ssm_in": "model.layers.{i}.linear_attn.in_proj_qkvz",  # conversions before attn_qkv + attn_gate
    "blk.{i}.ssm_ba": "model.layers.{i}.linear_attn.in_proj_ba",
}
NAMES["qwen35moe"] = {
    **_HYBRID,
    "blk.{i}.ssm_beta": "model.layers.{i}.linear_attn.in_proj_b",
    "blk.{i}.ssm_alpha": "model.layers.{i}.linear_attn.in_proj_a",
}
NAMES["gpt-oss"] = {  # GptOssModel: experts de-interleaved into gate and up, each with its bias
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.attn_sinks": "model.layers.{i}.self_attn.sinks",  # the converter adds .weight; _adapt_gpt_oss drops it
    "blk.{i}.ffn_gate_inp": "model.layers.{i}.mlp.router",
    "blk.{i}.ffn_gate_exps": "model.layers.{i}.mlp.switch_mlp.gate_proj",
    "blk.{i}.ffn_up_exps": "model.layers.{i}.mlp.switch_mlp.up_proj",
    "blk.{i}.ffn_down_exps": "model.layers.{i}.mlp.switch_mlp.down_proj",
}
# architectures whose q and k rows convert_hf_to_gguf.py permutes (LlamaModel.permute), undone at read
_PERMUTED_QK = ("llama",)


def _pattern(key: str) -> re.Pattern:
    pat = re.escape(key).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile("^" + pat + r"\.(?P<param>weight|bias)$")


_NAME_RE = {arch: [(_pattern(k), v) for k, v in names.items()] for arch, names in NAMES.items()}
_FLOAT = {"F32": "F32", "F16": "F16", "BF16": "BF16"}  # ggml float type -> tensor-index dtype
# metadata arrays longer than this are kept as their length only (the tokenizer's vocabulary and merges)
_MAX_ARRAY = 1024


UNSUPPORTED = f"a ggml type moestream does not compute on yet; it reads {', '.join([*_FLOAT, *ggml.TYPES])}"


def is_gguf(path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix, not a folder; the header is checked when opened)."""
    return str(path).endswith(SUFFIX) and not Path(path).is_dir()


def split_files(path: Path) -> list[Path]:
    """The files of the GGUF model ``path`` names: itself, or every file of its split set.

    Raises:
        CheckpointError: a split file other than the first, or a missing file of the set.
    """
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    if int(m["no"]) != 1:
        first = path.with_name(f"{m['stem']}-{1:05d}-of-{count:05d}.gguf")
        raise CheckpointError(f"{path}: part {int(m['no'])} of a split GGUF; give the first part ({first.name})")
    files = [path.with_name(f"{m['stem']}-{n:05d}-of-{count:05d}.gguf") for n in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: split GGUF of {count} files, but {', '.join(missing[:3])} "
                              f"{'is' if len(missing) == 1 else 'are'} missing from {path.parent}")
    return files


@dataclass
class GGUFFormat:
    """What :func:`open_gguf` found (``Checkpoint.source_format`` of a GGUF checkpoint).

    ``architecture``: ``general.architecture``; ``version``: the GGUF version; ``files``: the
    file names; ``alignment``: the data alignment; ``types``: tensor kind (llama.cpp's name
    without ``blk.N.``) -> sorted ggml types; ``metadata``: every key-value (long arrays as
    their length); ``tied``: the file has no ``output`` tensor, so the head reads the embedding;
    ``input_orders``: linear (Hugging Face module path) -> the order of its input features its stored
    weight expects, a permutation of Hugging Face's that the family applies to the input (a qwen35moe
    ``out_proj`` whose blocks straddle value heads; see :func:`_adapt_tiled`).
    """

    architecture: str
    version: int
    files: list[str]
    alignment: int
    types: dict[str, list[str]] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    tied: bool = False
    unsupported: list = field(default_factory=list)
    input_orders: dict[str, list[int]] = field(default_factory=dict)

    name = "gguf"  # what a family's ``adapt_to_source`` is told
    compute_dtype = torch.float32  # llama.cpp computes activations in float32

    def describe(self, config: dict) -> str:
        """One line: ``GGUF v3, qwen3moe (llama.cpp names mapped), 1 file; Q4_K, Q6_K, F32``."""
        types = sorted({t for ts in self.types.values() for t in ts})
        files = f"{len(self.files)} file" + ("s" if len(self.files) > 1 else "")
        text = f"GGUF v{self.version}, {self.architecture} (llama.cpp names mapped), {files}; {', '.join(types)}"
        return text + ("; head tied to the embedding" if self.tied else "")


class _Reader(GGUFReader):
    """The ``gguf`` package's reader, stopped before it maps tensor data: header, metadata, tensor infos
    (``infos``: name, ``ne``, raw type, offset) and the data offset and alignment."""

    def _build_tensors(self, start_offs, fields):  # GGUFReader would view (and shape-check) each tensor's data
        self.infos = []
        for f in fields:
            _, name, _, dims, raw_type, offset = f.parts
            self.infos.append((bytes(name).decode("utf-8"), int(raw_type[0]), [int(d) for d in dims], int(offset[0])))


def _field_value(f):
    """A metadata field's value (arrays over ``_MAX_ARRAY`` items as ``{"array_of": n}``)."""
    if f.types and f.types[0] == GGUFValueType.ARRAY and len(f.data) > _MAX_ARRAY:
        return {"array_of": len(f.data)}
    return f.contents()


def _read_file(path: Path) -> tuple[dict, list, int, int, int]:
    """(metadata, tensor infos, data offset, alignment, version) of one GGUF file.

    Raises:
        CheckpointError: not a GGUF file, an unreadable or truncated header, big-endian data.
    """
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    if size < 24:
        raise CheckpointError(f"{path}: file of {size} bytes is too short to be GGUF")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        r = _Reader(path)
        meta = {k: _field_value(f) for k, f in r.fields.items() if not k.startswith("GGUF.")}
        version = int(r.fields["GGUF.version"].parts[0][0])
        infos, data_offset, alignment, order = r.infos, int(r.data_offset), int(r.alignment), r.byte_order
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError) as e:
        # the reader runs off the end of a truncated header, or meets a value type or alignment it refuses
        raise CheckpointError(f"{path}: not a readable GGUF header ({e}); the file is truncated or corrupt") from None
    finally:
        r = None  # unmap the file
    if order != "I":
        raise CheckpointError(f"{path}: a big-endian GGUF file; moestream reads little-endian files")
    if data_offset > size:
        raise CheckpointError(f"{path}: the data section starts at byte {data_offset}, past the end of the file "
                              f"({size} bytes); the file is truncated")
    return meta, infos, data_offset, alignment, version


def _index(path: Path, infos: list, data_offset: int, alignment: int, unsupported: list | None = None
           ) -> dict[str, TensorInfo]:
    """llama.cpp name -> TensorInfo of one file's tensors, each checked against the file (see module doc).

    ``unsupported``: when given, a tensor of a type moestream does not compute on is indexed (as its
    bytes) and its name and type appended here instead of refused (``moestream inspect``).
    """
    size = path.stat().st_size
    out: dict[str, TensorInfo] = {}
    for name, raw, ne, rel in infos:
        where = f"{path}: tensor {name!r}"
        if name in out:
            raise CheckpointError(f"{where} is given twice")
        try:
            qtype = GGMLQuantizationType(raw)
        except ValueError:
            raise CheckpointError(f"{where} has ggml type {raw}, which is not a ggml type (a corrupt file, or a "
                                  "type newer than this gguf package)") from None
        tname = qtype.name
        if tname not in _FLOAT and tname not in ggml.TYPES:
            if unsupported is None:
                raise CheckpointError(f"{where} is {tname}, {UNSUPPORTED}")
            unsupported.append((name, tname))
        if not ne or any(d < 0 for d in ne):
            raise CheckpointError(f"{where} has dimensions {ne}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if ne[0] % block:
            raise CheckpointError(f"{where} ({tname}) has rows of {ne[0]} values, not whole blocks of {block}")
        rows = list(reversed(ne[1:]))
        if tname in _FLOAT:
            dtype, shape = _FLOAT[tname], (*rows, ne[0])
        else:
            dtype, shape = ggml.dtype_name(tname), (*rows, ne[0] // block * type_size)
        nbytes = math.prod(ne) // block * type_size
        if rel % alignment:
            raise CheckpointError(f"{where} starts at data offset {rel}, not a multiple of the file's alignment "
                                  f"{alignment}; the file is corrupt")
        start = data_offset + rel
        if start + nbytes > size:
            raise CheckpointError(f"{where} ({tname} {ne}) takes bytes {start}-{start + nbytes} but the file holds "
                                  f"{size}; the file is truncated")
        out[name] = TensorInfo(name, path, start, nbytes, dtype, tuple(shape))
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in out.values() if t.nbytes)
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors {n0!r} and {n1!r} overlap")
    return out


def hf_name(name: str, arch: str = "qwen3moe") -> str | None:
    """The Hugging Face name of architecture ``arch``'s llama.cpp tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None when :data:`NAMES` has no rule for it."""
    for pat, repl in _NAME_RE.get(arch, ()):
        m = pat.match(name)
        if m:
            return repl.format(**{k: v for k, v in m.groupdict().items() if k != "param"}) + "." + m["param"]
    return None


def _unpermute(info: TensorInfo, heads: int, ckpt) -> torch.Tensor:
    """q or k rows [heads * D, ...] back in Hugging Face order from llama.cpp's (``LlamaModel.permute``
    stores row ``(h, i, j)`` of each head's pairs for Hugging Face row ``(h, j, i)``; j in 0..1, i < D/2).
    Whole rows move, so it holds for block-quantized rows too."""
    t = ckpt.read_info(info)
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


def _meta(meta: dict, key: str, where, kind=int, default=None, required: bool = True):
    v = meta.get(key)
    if v is None:
        if required and default is None:
            raise CheckpointError(f"{where}: metadata {key!r} is missing")
        return default
    ok = isinstance(v, kind) and not isinstance(v, bool) if kind is not bool else isinstance(v, bool)
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v, ok = float(v), True
    if not ok:
        raise CheckpointError(f"{where}: metadata {key!r} = {str(v)[:60]!r} is not {kind.__name__}")
    return v


def hf_config(meta: dict, tensors: dict[str, TensorInfo], where) -> dict:
    """The Hugging Face config (a dict) of a GGUF model's metadata and tensors.

    Raises:
        CheckpointError: an architecture moestream does not map, a required key missing or of
            the wrong type, or a setting its family does not compute (naming the key).
    """
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{where}: GGUF architecture {arch!r} is not supported; moestream reads "
                              f"{', '.join(ARCHITECTURES)}")
    if arch in _CONFIGS:  # an architecture with its own builder (below)
        return _CONFIGS[arch](meta, tensors, where)
    model_type, cls = ARCHITECTURES[arch]
    p = arch + "."
    heads = _meta(meta, p + "attention.head_count", where)
    hidden = _meta(meta, p + "embedding_length", where)
    kv = _meta(meta, p + "attention.head_count_kv", where, default=heads)
    head_dim = _meta(meta, p + "attention.key_length", where, default=hidden // heads)
    vdim = _meta(meta, p + "attention.value_length", where, default=head_dim)
    if vdim != head_dim:
        raise CheckpointError(f"{where}: attention.key_length {head_dim} and value_length {vdim} differ; "
                              f"{model_type} has one head_dim")
    rot = _meta(meta, p + "rope.dimension_count", where, required=False)
    if rot is not None and rot != head_dim:
        raise CheckpointError(f"{where}: metadata {p}rope.dimension_count {rot} is not the head dim {head_dim}: "
                              "partial rotary embeddings are not supported")
    gating = _meta(meta, p + "expert_gating_func", where, required=False)
    if gating not in (None, 1):  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise CheckpointError(f"{where}: metadata {p}expert_gating_func {gating}: {model_type} routes by softmax (1)")
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise CheckpointError(f"{where}: no token_embd.weight tensor")
    experts = _meta(meta, p + "expert_count", where, default=0, required=False)
    if not experts:
        raise CheckpointError(f"{where}: a {arch} model without experts ({p}expert_count is {experts}): a dense "
                              "model has nothing to stream")
    cfg = {
        "model_type": model_type, "architectures": [cls],
        "vocab_size": embed.shape[0],
        "hidden_size": hidden,
        "num_hidden_layers": _meta(meta, p + "block_count", where),
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "num_experts_per_tok": _meta(meta, p + "expert_used_count", where),
        "rms_norm_eps": _meta(meta, p + "attention.layer_norm_rms_epsilon", where, float),
        "rope_theta": _meta(meta, p + "rope.freq_base", where, float, default=10000.0),
        "max_position_embeddings": _meta(meta, p + "context_length", where),
        "tie_word_embeddings": False,  # a file without `output` gets the embedding's bytes as lm_head
        "torch_dtype": "float32",
    }
    if arch == "qwen3moe":
        cfg["num_experts"] = experts
        cfg["moe_intermediate_size"] = _meta(meta, p + "expert_feed_forward_length", where)
        cfg["norm_topk_prob"] = _meta(meta, p + "expert_weights_norm", where, bool, default=True)
        # feed_forward_length is the dense MLP's width (unused while every layer is MoE)
        cfg["intermediate_size"] = _meta(meta, p + "feed_forward_length", where, default=cfg["moe_intermediate_size"])
    elif arch == "olmoe":  # OlmoeModel writes the experts' width as feed_forward_length; llama.cpp's graph
        cfg["num_experts"] = experts  # renormalizes the top-k weights only when told (norm_w false)
        cfg["norm_topk_prob"] = _meta(meta, p + "expert_weights_norm", where, bool, default=False)
        ff = _meta(meta, p + "feed_forward_length", where, required=False)
        cfg["intermediate_size"] = _meta(meta, p + "expert_feed_forward_length", where, default=ff)
    else:  # Mixtral: convert_hf_to_gguf.py writes the experts' width as feed_forward_length
        cfg["num_local_experts"] = experts
        ff = _meta(meta, p + "feed_forward_length", where, required=False)
        cfg["intermediate_size"] = _meta(meta, p + "expert_feed_forward_length", where, default=ff)
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": meta.get(p + "rope.scaling.factor"),
                               "original_max_position_embeddings": meta.get(p + "rope.scaling.original_context_length")}
    for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if isinstance(meta.get(key), int):
            cfg[hf] = meta[key]
    return cfg


class GGUFCheckpoint(Checkpoint):
    """A GGUF model opened as a :class:`~moestream.checkpoint.Checkpoint`: ``path`` is its (first) file,
    ``shards`` its files, ``tensors`` the byte ranges under Hugging Face names, ``config`` built from the
    metadata, ``source_format`` a :class:`GGUFFormat`. Build it with :func:`open_gguf`."""

    def __init__(self, path: Path, config: dict, tensors: dict[str, TensorInfo], files: list[Path],
                 identities: dict, fmt: GGUFFormat):
        self.path = path
        self.config = config
        self.shards = files
        self.tensors = tensors
        self.metadata = {f.name: {} for f in files}
        self.derived = {}
        self.identities = identities
        self._weight_map = None
        self._files = FileHandles()
        self.source_format = fmt


def open_gguf(path, inspect_only: bool = False) -> GGUFCheckpoint:
    """Open the GGUF model ``path`` (a ``.gguf`` file or the first of a split set); nothing but headers is read.

    ``inspect_only``: index tensors of types moestream does not compute on instead of refusing them
    (listed in ``source_format.unsupported``; such a checkpoint is for ``moestream inspect`` only).

    Raises:
        CheckpointError: naming the file, and the tensor or metadata key, of anything that is not
            a GGUF model moestream reads (see the module doc).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    files = split_files(path)
    identities = {f: file_identity(f) for f in files}  # before the headers: a later change shows
    raw: dict[str, TensorInfo] = {}
    meta, version, alignment = {}, 0, 0
    unsupported: list | None = [] if inspect_only else None
    for n, f in enumerate(files):
        m, infos, data_offset, align, ver = _read_file(f)
        if n == 0:
            meta, version, alignment = m, ver, align
        elif len(files) > 1 and m.get("split.no") not in (None, n):
            raise CheckpointError(f"{f}: metadata split.no is {m.get('split.no')}, expected {n}")
        for name, info in _index(f, infos, data_offset, align, unsupported).items():
            if name in raw:
                raise CheckpointError(f"{f}: tensor {name!r} is also in {raw[name].file.name}")
            raw[name] = info
    if len(files) > 1:
        count, total = meta.get("split.count"), meta.get("split.tensors.count")
        if count is not None and count != len(files):
            raise CheckpointError(f"{path}: metadata split.count is {count}, but the set has {len(files)} files")
        if total is not None and total != len(raw):
            raise CheckpointError(f"{path}: metadata split.tensors.count is {total}, but the files hold {len(raw)}")
    fmt = GGUFFormat(str(meta.get("general.architecture")), version, [f.name for f in files], alignment,
                     metadata=meta, unsupported=unsupported or [])
    tensors: dict[str, TensorInfo] = {}
    types: dict[str, set] = {}
    arch = str(meta.get("general.architecture"))
    for name, info in raw.items():
        hf = hf_name(name, arch) or name  # a tensor without a rule keeps its name (reported unused)
        tensors[hf] = info
        kind = re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight")
        types.setdefault(kind, set()).add(ggml.block_type(info.dtype) or info.dtype)
    fmt.types = {k: sorted(v) for k, v in sorted(types.items())}
    cfg = hf_config(meta, tensors, path)
    derived = {}
    if arch in _ADAPT:  # the converter's renames and transformations of this architecture, undone
        _ADAPT[arch](tensors, derived, cfg, path, fmt)
    if arch in _PERMUTED_QK:
        for hf, info in tensors.items():
            m = re.match(r"^model\.layers\.\d+\.self_attn\.([qk])_proj\.(weight|bias)$", hf)
            if m:
                heads = cfg["num_attention_heads"] if m[1] == "q" else cfg["num_key_value_heads"]
                derived[hf] = partial(_unpermute, info, heads)
    if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        # llama.cpp ties the head to the embedding when the file has no `output` tensor: the same bytes
        emb = tensors["model.embed_tokens.weight"]
        tensors["lm_head.weight"] = emb
        fmt.tied = True
    ckpt = GGUFCheckpoint(path, cfg, tensors, files, identities, fmt)
    ckpt.derived = derived
    return ckpt


# -- qwen3next, qwen35moe (the hybrid Qwen families) and gpt-oss ---------------------------------------
def _bools(meta: dict, key: str, where, n: int) -> list[bool] | None:
    """A metadata array of at least ``n`` bools (its first ``n``), or None when the file lacks ``key``."""
    v = meta.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) < n or not all(isinstance(b, bool) for b in v):
        raise CheckpointError(f"{where}: metadata {key!r} = {str(v)[:60]!r} is not an array of {n} bools")
    return v[:n]


def _moe_checks(meta: dict, p: str, where, family: str) -> int:
    """The expert count, checked to be > 0; refuses an expert weight scale other than 1 (llama.cpp scales the
    routing weights by it; the family does not). ``expert_gating_func`` is not read: llama.cpp's graphs of
    these architectures fix their gating function (softmax; gpt-oss: softmax over the top-k), as the families."""
    experts = _meta(meta, p + "expert_count", where, default=0, required=False)
    if not experts:
        raise CheckpointError(f"{where}: a model without experts ({p}expert_count is {experts}): a dense model "
                              "has nothing to stream")
    scale = _meta(meta, p + "expert_weights_scale", where, float, required=False)
    if scale not in (None, 0.0, 1.0):  # llama.cpp reads 0 as no scaling
        raise CheckpointError(f"{where}: metadata {p}expert_weights_scale {scale}: {family} does not scale the "
                              "routing weights")
    return experts


def _base_config(meta: dict, tensors: dict, where, arch: str) -> dict:
    """The fields every architecture below shares: vocabulary, widths, heads, norms, rope base, token ids."""
    model_type, cls = ARCHITECTURES[arch]
    p = arch + "."
    heads = _meta(meta, p + "attention.head_count", where)
    hidden = _meta(meta, p + "embedding_length", where)
    head_dim = _meta(meta, p + "attention.key_length", where, default=hidden // heads)
    vdim = _meta(meta, p + "attention.value_length", where, default=head_dim)
    if vdim != head_dim:
        raise CheckpointError(f"{where}: attention.key_length {head_dim} and value_length {vdim} differ; "
                              f"{model_type} has one head_dim")
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise CheckpointError(f"{where}: no token_embd.weight tensor")
    cfg = {
        "model_type": model_type, "architectures": [cls],
        "vocab_size": embed.shape[0], "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": _meta(meta, p + "attention.head_count_kv", where, default=heads),
        "head_dim": head_dim,
        "num_experts_per_tok": _meta(meta, p + "expert_used_count", where),
        "rms_norm_eps": _meta(meta, p + "attention.layer_norm_rms_epsilon", where, float),
        "rope_theta": _meta(meta, p + "rope.freq_base", where, float, default=10000.0),
        "max_position_embeddings": _meta(meta, p + "context_length", where),
        "tie_word_embeddings": False,  # a file without `output` gets the embedding's bytes as lm_head
        "torch_dtype": "float32",
    }
    for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if isinstance(meta.get(key), int):
            cfg[hf] = meta[key]
    return cfg


def _hybrid_config(meta: dict, tensors: dict, where, arch: str) -> dict:
    """Qwen3-Next (``qwen3next``) or Qwen3.5/3.6 MoE (``qwen35moe``, the text model ``qwen3_5_moe_text``).

    The DeltaNet shapes come from the ``ssm.*`` keys as Qwen3NextModel.set_gguf_parameters writes them:
    ``conv_kernel`` (linear_conv_kernel_dim), ``state_size`` (linear_key_head_dim), ``group_count``
    (linear_num_key_heads), ``time_step_rank`` (linear_num_value_heads), ``inner_size`` (value head dim x
    value heads). The layer kinds come from ``attention.recurrent_layers`` (true: DeltaNet), else
    ``full_attention_interval`` (default 4, as llama.cpp). ``rope.dimension_count`` gives the partial
    rotary factor. Blocks past ``block_count - nextn_predict_layers`` are the multi-token-prediction
    layer. llama.cpp's graph renormalizes the top-k weights and runs every layer as MoE.
    """
    p = arch + "."
    cfg = _base_config(meta, tensors, where, arch)
    family = cfg["model_type"]
    blocks = _meta(meta, p + "block_count", where)
    mtp = _meta(meta, p + "nextn_predict_layers", where, default=0, required=False)
    layers = blocks - mtp
    if layers < 1:
        raise CheckpointError(f"{where}: metadata {p}block_count {blocks} leaves no layer beside "
                              f"{p}nextn_predict_layers {mtp}")
    experts = _moe_checks(meta, p, where, family)
    head_dim = cfg["head_dim"]
    rot = _meta(meta, p + "rope.dimension_count", where, default=head_dim)
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(f"{where}: metadata {p}rope.scaling.type {scaling!r}: {family} computes the "
                              "default rotary embedding only")
    rope = {"rope_type": "default", "rope_theta": cfg["rope_theta"], "partial_rotary_factor": rot / head_dim}
    if arch == "qwen35moe":  # interleaved M-RoPE: for text every section sees the same position
        sections = meta.get(p + "rope.dimension_sections")
        if isinstance(sections, list) and all(isinstance(x, int) for x in sections):
            rope.update(mrope_section=sections[:3], mrope_interleaved=True)
    value_heads = _meta(meta, p + "ssm.time_step_rank", where)
    inner = _meta(meta, p + "ssm.inner_size", where)
    if value_heads < 1 or inner % value_heads:
        raise CheckpointError(f"{where}: metadata {p}ssm.inner_size {inner} is not a multiple of "
                              f"{p}ssm.time_step_rank {value_heads} (the value heads)")
    recurrent = _bools(meta, p + "attention.recurrent_layers", where, layers)
    if recurrent is None:
        interval = _meta(meta, p + "full_attention_interval", where, default=4, required=False)
        if interval < 1:
            raise CheckpointError(f"{where}: metadata {p}full_attention_interval {interval} must be at least 1")
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    moe = _meta(meta, p + "expert_feed_forward_length", where)
    ff = _meta(meta, p + "feed_forward_length", where, required=False)
    cfg.update({
        "num_hidden_layers": layers,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
        "rope_parameters": rope, "partial_rotary_factor": rot / head_dim,
        "num_experts": experts,
        "moe_intermediate_size": moe,
        # llama.cpp's default when the key is missing: the dense width
        "shared_expert_intermediate_size": _meta(meta, p + "expert_shared_feed_forward_length", where, default=ff),
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "linear_conv_kernel_dim": _meta(meta, p + "ssm.conv_kernel", where),
        "linear_key_head_dim": _meta(meta, p + "ssm.state_size", where),
        "linear_num_key_heads": _meta(meta, p + "ssm.group_count", where),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
    })
    if ff is not None:
        cfg["intermediate_size"] = ff
    if mtp:
        cfg["mtp_num_hidden_layers"] = mtp
    return cfg


def _gpt_oss_config(meta: dict, tensors: dict, where) -> dict:
    """gpt-oss (``gpt-oss``): GptOssModel.set_gguf_parameters' keys. The sliding layers follow
    ``attention.sliding_window_pattern`` (bools, or a period n: layer i slides when ``i % n < n - 1``),
    default 2, as llama.cpp (sliding, full, ...). The YaRN parameters come from ``rope.scaling.*``;
    ``truncate`` is false, as the published configs and OpenAI's reference (ggml's YaRN rounds the
    correction range, a difference from llama.cpp). The clamped SwiGLU's alpha 1.702 and limit 7.0 are
    fixed in llama.cpp's graph, so the config holds those.
    """
    p = "gpt-oss."
    cfg = _base_config(meta, tensors, where, "gpt-oss")
    layers = _meta(meta, p + "block_count", where)
    experts = _moe_checks(meta, p, where, "gpt_oss")
    rot = _meta(meta, p + "rope.dimension_count", where, required=False)
    if rot is not None and rot != cfg["head_dim"]:
        raise CheckpointError(f"{where}: metadata {p}rope.dimension_count {rot} is not the head dim "
                              f"{cfg['head_dim']}: partial rotary embeddings are not supported for gpt_oss")
    pattern = meta.get(p + "attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = _bools(meta, p + "attention.sliding_window_pattern", where, layers)
    else:
        n = _meta(meta, p + "attention.sliding_window_pattern", where, default=2, required=False)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    scaling = meta.get(p + "rope.scaling.type")
    theta = cfg["rope_theta"]
    if scaling in (None, "none"):
        rope = {"rope_type": "default", "rope_theta": theta}
    elif scaling == "yarn":
        for key in ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor"):
            if meta.get(p + key) is not None:
                raise CheckpointError(f"{where}: metadata {p}{key} is set; gpt_oss computes YaRN's default "
                                      "extrapolation and attention factors only")
        rope = {"rope_type": "yarn", "rope_theta": theta,
                "factor": _meta(meta, p + "rope.scaling.factor", where, float),
                "original_max_position_embeddings": _meta(meta, p + "rope.scaling.original_context_length", where),
                "beta_fast": _meta(meta, p + "rope.scaling.yarn_beta_fast", where, float, default=32.0),
                "beta_slow": _meta(meta, p + "rope.scaling.yarn_beta_slow", where, float, default=1.0),
                "truncate": False}
    else:
        raise CheckpointError(f"{where}: metadata {p}rope.scaling.type {scaling!r}: gpt_oss computes YaRN or "
                              "the default rotary embedding")
    cfg.update({
        "num_hidden_layers": layers,
        "intermediate_size": _meta(meta, p + "expert_feed_forward_length", where),
        "num_local_experts": experts,
        "sliding_window": _meta(meta, p + "attention.sliding_window", where),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": rope,
        "swiglu_limit": 7.0, "attention_bias": True,
    })
    return cfg


_CONFIGS = {"qwen3next": partial(_hybrid_config, arch="qwen3next"),
            "qwen35moe": partial(_hybrid_config, arch="qwen35moe"), "gpt-oss": _gpt_oss_config}

_FLOAT_SIZE = {"F32": 4, "F16": 2, "BF16": 2}


def _as_float32(info: TensorInfo, name: str, shape: tuple[int, ...]) -> TensorInfo:
    """``info``'s place, described as the float32 tensor ``shape`` a derived function returns."""
    return TensorInfo(name, info.file, info.offset, math.prod(shape) * 4, "F32", tuple(shape))


def _float(info: TensorInfo, ckpt) -> torch.Tensor:
    """The float32 values of a stored tensor (block-quantized rows dequantized by :mod:`moestream.quant.ggml`)."""
    t = ckpt.read_info(info)
    qtype = ggml.block_type(info.dtype)
    if qtype is None:
        return t.float()
    return ggml.dequantize(t, qtype, ggml.in_features(qtype, info.shape[-1]))


def _values(info: TensorInfo) -> int:
    """Values per row of ``info`` (its last dimension, or the row of blocks' weights)."""
    qtype = ggml.block_type(info.dtype)
    return info.shape[-1] if qtype is None else ggml.in_features(qtype, info.shape[-1])


def _v_heads(k_heads: int, per: int, width: int) -> torch.Tensor:
    """Index ``perm`` with ``hf = file[perm]`` for value heads stored tiled (``_LinearAttentionVReorderBase``:
    file position ``(j, g, d)`` holds Hugging Face's ``(g, j, d)``, g the key head, j < per its value heads)."""
    return torch.arange(k_heads * per * width).reshape(per, k_heads, width).permute(1, 0, 2).reshape(-1)


def _take_rows(info: TensorInfo, perm: torch.Tensor, ckpt) -> torch.Tensor:
    """Rows of ``info`` reordered (``out = stored[perm]``); whole rows move, so any type."""
    return ckpt.read_info(info)[perm].contiguous()


def _take_columns(info: TensorInfo, perm: torch.Tensor, block: int, ckpt) -> torch.Tensor:
    """Columns of ``info`` reordered (``out[:, c] = stored[:, perm[c]]``): block-quantized rows move whole
    blocks (``block`` values; ``perm`` moves runs of whole blocks), float rows move values."""
    t = ckpt.read_info(info)
    if block == 1:
        return t[:, perm].contiguous()
    size = t.shape[-1] // (perm.numel() // block)
    blocks = perm.reshape(-1, block)[:, 0] // block
    return t.reshape(t.shape[0], -1, size)[:, blocks].reshape(t.shape).contiguous()


def _unshift(info: TensorInfo, ckpt) -> torch.Tensor:
    """A norm weight stored as ``1 + w`` (Qwen3NextModel adds 1): ``w`` in float32 (``1 + w`` gives back the
    stored value exactly while it is >= 0.5, by Sterbenz's lemma)."""
    return _float(info, ckpt) - 1.0


def _a_log(info: TensorInfo, perm: torch.Tensor | None, ckpt) -> torch.Tensor:
    """``A_log`` [V] from llama.cpp's ``ssm_a = -exp(A_log)``: ``log(-ssm_a)`` in float64, rounded to float32.

    Raises:
        CheckpointError: a value >= 0 (no A_log gives one).
    """
    a = _float(info, ckpt).double()
    if perm is not None:
        a = a[perm]
    if not bool((a < 0).all()):
        raise CheckpointError(f"{info.file}: tensor {info.name!r} holds a value >= 0; llama.cpp stores "
                              "ssm_a = -exp(A_log), which is negative")
    return torch.log(-a).float()


def _conv(info: TensorInfo, perm: torch.Tensor | None, ckpt) -> torch.Tensor:
    """``conv1d.weight`` [C, 1, K] from the squeezed ``ssm_conv1d`` [C, K] (channels reordered by ``perm``)."""
    w = _float(info, ckpt)
    if perm is not None:
        w = w[perm]
    return w.reshape(w.shape[0], 1, -1).contiguous()


def _cat_rows(first: TensorInfo, second: TensorInfo, perm: torch.Tensor, same: bool, ckpt) -> torch.Tensor:
    """Rows of ``first`` then ``second``, reordered (``out = cat[perm]``): as stored when both are stored
    alike (``same``), else as float32."""
    read = ckpt.read_info if same else partial(_float, ckpt=ckpt)
    return torch.cat([read(first), read(second)])[perm].contiguous()


def _qkvz_rows(k_heads: int, dk: int, vdim: int) -> torch.Tensor:
    """Index into ``cat(attn_qkv, attn_gate)`` rows giving Hugging Face's ``in_proj_qkvz`` rows: per key
    head g its q, k, v (``vdim`` = its value heads x value dim) and z rows (Qwen3NextModel's split, undone)."""
    kd = k_heads * dk
    conv = 2 * kd + k_heads * vdim
    out = []
    for g in range(k_heads):
        out += [torch.arange(g * dk, (g + 1) * dk), torch.arange(kd + g * dk, kd + (g + 1) * dk),
                torch.arange(2 * kd + g * vdim, 2 * kd + (g + 1) * vdim),
                torch.arange(conv + g * vdim, conv + (g + 1) * vdim)]
    return torch.cat(out)


def _derive(tensors: dict, derived: dict, name: str, info: TensorInfo, make) -> None:
    tensors[name] = info
    derived[name] = make


def _adapt_hybrid(tensors: dict[str, TensorInfo], derived: dict, cfg: dict, where, fmt: GGUFFormat) -> None:
    """Undo Qwen3NextModel's (and Qwen3_5MoeTextModel's) transformations, so the family reads the Hugging
    Face tensors (see the module doc): zero-centred norms stored ``+ 1``; ``A_log`` as ``ssm_a = -exp(A_log)``;
    ``dt_bias`` as ``ssm_dt.bias``; ``conv1d`` squeezed to [C, K]; Qwen3-Next's ``in_proj_qkvz`` split into
    ``attn_qkv`` (q, k, v of all heads) and ``attn_gate`` (z); for Qwen3.5 with fewer key than value heads,
    the value heads reordered from grouped to tiled (``_LinearAttentionVReorderBase``) in ``in_proj_qkv``'s v
    rows, ``in_proj_z``, ``in_proj_b``/``in_proj_a``, ``A_log``, ``dt_bias``, the conv's v channels and
    ``out_proj``'s columns. Blocks past the decoder (``nextn_predict_layers``) go under ``mtp.``.

    Raises:
        CheckpointError: a tensor a DeltaNet layer needs missing, fused gate/up experts or a fused
            q/k/v attention (converter options moestream does not read), shapes the config does not give.
    """
    layers = cfg["num_hidden_layers"]
    k_heads, v_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if v_heads % k_heads:
        raise CheckpointError(f"{where}: ssm.time_step_rank {v_heads} (value heads) is not a multiple of "
                              f"ssm.group_count {k_heads} (key heads)")
    per = v_heads // k_heads
    qwen35 = cfg["model_type"] == "qwen3_5_moe_text"
    tiled = qwen35 and per > 1  # _LinearAttentionVReorderBase reorders only when the head counts differ
    for name in list(tensors):  # the multi-token-prediction blocks (under their llama.cpp names)
        m = re.match(r"^(?:model\.layers|blk)\.(\d+)\.", name)
        if m and int(m[1]) >= layers:
            info = tensors.pop(name)
            tensors["mtp." + info.name] = info
        elif ".ffn_gate_up_exps." in name:
            raise CheckpointError(f"{where}: tensor {name!r}: gate and up experts fused into one tensor "
                                  "(convert_hf_to_gguf.py's fuse option) are not read yet")

    def need(name: str) -> TensorInfo:
        if name not in tensors:
            raise CheckpointError(f"{where}: no tensor {name!r} (a Hugging Face name) in a linear-attention layer")
        return tensors[name]

    def unshift(name: str) -> None:
        if name in tensors:
            info = tensors[name]
            _derive(tensors, derived, name, _as_float32(info, name, info.shape), partial(_unshift, info))

    unshift("model.norm.weight")
    for i in range(layers):
        pre, gguf = f"model.layers.{i}.", f"blk.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            unshift(pre + n + ".weight")
        gate = tensors.get(pre + "mlp.shared_expert_gate.weight")
        if gate is not None and len(gate.shape) == 1:  # [H] -> the [1, H] linear Hugging Face has
            tensors[pre + "mlp.shared_expert_gate.weight"] = TensorInfo(
                gate.name, gate.file, gate.offset, gate.nbytes, gate.dtype, (1, *gate.shape))
        la = pre + "linear_attn."
        if cfg["layer_types"][i] != "linear_attention":
            if la + "in_proj_qkv.weight" in tensors:
                raise CheckpointError(f"{where}: tensor {gguf}attn_qkv.weight in full-attention layer {i}: fused "
                                      "q/k/v attention (convert_hf_to_gguf.py's fuse option) is not read yet")
            continue
        vperm = _v_heads(k_heads, per, 1) if tiled else None
        a = tensors.pop(gguf + "ssm_a", None)
        if a is None:
            raise CheckpointError(f"{where}: no tensor '{gguf}ssm_a' (-exp(A_log)) in linear-attention layer {i}")
        _derive(tensors, derived, la + "A_log", _as_float32(a, la + "A_log", a.shape), partial(_a_log, a, vperm))
        dt = tensors.pop(la + "dt_proj.bias", None)  # convert_hf_to_gguf renames dt_bias to dt_proj.bias
        if dt is None:
            raise CheckpointError(f"{where}: no tensor '{gguf}ssm_dt.bias' (dt_bias) in linear-attention layer {i}")
        if vperm is None:
            tensors[la + "dt_bias"] = dt
        else:
            _derive(tensors, derived, la + "dt_bias", dt, partial(_take_rows, dt, vperm))
        conv = need(la + "conv1d.weight")
        cperm = None
        if tiled:
            qk = 2 * k_heads * dk
            cperm = torch.cat([torch.arange(qk), qk + _v_heads(k_heads, per, dv)])
        _derive(tensors, derived, la + "conv1d.weight",  # stored squeezed [C, K] (or already [C, 1, K])
                _as_float32(conv, la + "conv1d.weight", (conv.shape[0], 1, _values(conv))),
                partial(_conv, conv, cperm))
        if qwen35:
            if tiled:
                _adapt_tiled(tensors, derived, la, k_heads, per, dk, dv, where, fmt)
        elif la + "in_proj_qkvz.weight" not in tensors:  # attn_qkv + attn_gate: back into one tensor
            qkv, z = need(la + "in_proj_qkv.weight"), need(la + "in_proj_z.weight")
            del tensors[la + "in_proj_qkv.weight"], tensors[la + "in_proj_z.weight"]
            perm = _qkvz_rows(k_heads, dk, per * dv)
            rows = qkv.shape[0] + z.shape[0]
            if perm.numel() != rows:
                raise CheckpointError(f"{where}: {gguf}attn_qkv and attn_gate hold {rows} rows; the ssm.* metadata "
                                      f"gives {perm.numel()}")
            same = qkv.dtype == z.dtype and qkv.shape[1:] == z.shape[1:]
            name = la + "in_proj_qkvz.weight"
            info = (TensorInfo(name, qkv.file, qkv.offset, qkv.nbytes + z.nbytes, qkv.dtype, (rows, *qkv.shape[1:]))
                    if same else _as_float32(qkv, name, (rows, _values(qkv))))
            _derive(tensors, derived, name, info, partial(_cat_rows, qkv, z, perm, same))


def _adapt_tiled(tensors: dict, derived: dict, la: str, k_heads: int, per: int, dk: int, dv: int, where,
                 fmt: GGUFFormat) -> None:
    """Qwen3.5's value heads back from tiled to grouped order in one DeltaNet layer's projections: rows as
    stored; ``out_proj``'s columns as whole blocks when a value head is whole blocks (or float values), else
    (K-quants with head dim 128) kept as stored and the order recorded in ``fmt.input_orders``: the family
    feeds that out_proj its input in the stored order, so no weight is dequantized."""
    for proj, width, offset in (("in_proj_qkv", dv, 2 * k_heads * dk), ("in_proj_z", dv, 0),
                                ("in_proj_b", 1, 0), ("in_proj_a", 1, 0)):
        name = la + proj + ".weight"
        if name not in tensors:
            raise CheckpointError(f"{where}: no tensor {name!r}")
        info = tensors[name]
        perm = torch.cat([torch.arange(offset), offset + _v_heads(k_heads, per, width)])
        if perm.numel() != info.shape[0]:
            raise CheckpointError(f"{info.file}: tensor {info.name!r} has {info.shape[0]} rows; the ssm.* metadata "
                                  f"gives {perm.numel()}")
        _derive(tensors, derived, name, info, partial(_take_rows, info, perm))
    name = la + "out_proj.weight"
    info = tensors.get(name)
    if info is None:
        raise CheckpointError(f"{where}: no tensor {name!r}")
    perm = _v_heads(k_heads, per, dv)
    qtype = ggml.block_type(info.dtype)
    block = 1 if qtype is None else ggml.TYPES[qtype][0]
    if _values(info) != perm.numel():
        raise CheckpointError(f"{info.file}: tensor {info.name!r} has rows of {_values(info)} values; the ssm.* "
                              f"metadata gives {perm.numel()}")
    if dv % block == 0:  # whole blocks move
        _derive(tensors, derived, name, info, partial(_take_columns, info, perm, block))
    else:  # a block holds parts of two heads: the input moves instead (input[:, order] @ stored.T)
        fmt.input_orders[name.removesuffix(".weight")] = torch.argsort(perm).tolist()


def _adapt_gpt_oss(tensors: dict[str, TensorInfo], derived: dict, cfg: dict, where, fmt: GGUFFormat) -> None:
    """GptOssModel's renames undone: ``attn_sinks.weight`` is the bare ``self_attn.sinks``. Its other
    transformations (gate_up de-interleaved into ``ffn_gate_exps``/``ffn_up_exps`` with their biases, ``down``
    transposed into nn.Linear orientation) give the stacked layout the family reads through its
    ``adapt_to_source`` (separate gate and up experts), so nothing else is undone.

    Raises:
        CheckpointError: fused gate/up experts (a converter option moestream does not read).
    """
    for name in list(tensors):
        if name.endswith(".self_attn.sinks.weight"):
            tensors[name[: -len(".weight")]] = tensors.pop(name)
        elif ".ffn_gate_up_exps." in name:
            raise CheckpointError(f"{where}: tensor {name!r}: gate and up experts fused into one tensor "
                                  "(convert_hf_to_gguf.py's fuse option) are not read yet")


_ADAPT = {"qwen3next": _adapt_hybrid, "qwen35moe": _adapt_hybrid, "gpt-oss": _adapt_gpt_oss}


__all__ = ["ARCHITECTURES", "UNSUPPORTED", "GGUFCheckpoint", "GGUFFormat", "NAMES", "hf_config", "hf_name", "is_gguf",
           "open_gguf",
           "split_files"]
