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
(:mod:`moestream.quant.ggml`: F32, F16, BF16, Q4_0-Q8_0, Q2_K-Q6_K, IQ4_NL, IQ4_XS, MXFP4, IQ2_XXS,
IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0),
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
    their length); ``tied``: the file has no ``output`` tensor, so the head reads the embedding.
    """

    architecture: str
    version: int
    files: list[str]
    alignment: int
    types: dict[str, list[str]] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    tied: bool = False
    unsupported: list = field(default_factory=list)

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


__all__ = ["ARCHITECTURES", "UNSUPPORTED", "GGUFCheckpoint", "GGUFFormat", "NAMES", "hf_config", "hf_name", "is_gguf",
           "open_gguf",
           "split_files"]
