"""GGUF checkpoints (llama.cpp's files): a ``.gguf`` file, or a split set, read as a checkpoint whose
tensors carry the Hugging Face names moestream's families use.

A GGUF file (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) holds a header
(magic, version, tensor and key-value counts), typed metadata (``general.architecture``,
``<arch>.block_count``, ...), a tensor-info table (name, dimensions ``ne`` fastest first,
ggml type, offset into the data section) and the data section, which starts at the next
multiple of ``general.alignment`` (default 32) after the table; every tensor's offset is a
multiple of the alignment. A model split by ``llama-gguf-split`` is several such files,
``<name>-00001-of-0000N.gguf`` ..., the first holding the metadata (``split.count``).

:func:`open_gguf` reads the header, metadata and tensor infos with its own bounded walk (:class:`_Header`;
no tensor data is read): a header comes from whoever made the file, so every count in it is checked against
the bytes left in the file before anything is allocated or iterated, and the keys, tensors, string lengths,
array items and nesting depth are bounded (``MAX_KEYS`` ... ``MAX_DEPTH``, each named in the error that
enforces it). The ``gguf`` package (its tensor-name map and ggml type tables) is imported only when a GGUF
file is opened. Every tensor is validated against its file before anything else happens: a known ggml
type that moestream computes on (:mod:`moestream.quant.ggml`: F32, F16, BF16, Q4_0-Q8_0, Q2_K-Q6_K,
IQ4_NL, IQ4_XS, MXFP4, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0),
whole blocks per row, an aligned offset, a byte range inside the file and overlapping no
other. A tensor of another type is refused naming the tensor and its type.

Tensors are indexed as :class:`~moestream.checkpoint.TensorInfo` byte ranges: a float
tensor as its dtype and torch shape (``ne`` reversed); a block-quantized one as its raw
bytes, dtype ``GGML_<type>``, shape ``[..., rows, row bytes]``. llama.cpp's names are
mapped onto Hugging Face names (:func:`derive_names`) by the mapping the ``gguf`` package itself
defines, the one ``convert_hf_to_gguf.py`` writes by (``gguf.TensorNameMap`` of the
architecture, :func:`derive_names`): of the Hugging Face names it lists for each llama.cpp
tensor, the one moestream's family uses (``GGUFArchitecture.modules``). Overrides where moestream's
names differ: the stacked experts ``blk.N.ffn_{gate,up,down}_exps.weight`` (``ne`` = [in,
out, E]: torch [E, out, in]) become ``model.layers.N.mlp.switch_mlp.{gate,up,down}_proj.weight``,
the stacked layout of :mod:`moestream.layout`, so each expert is one contiguous byte range
read through the same store, cache and O_DIRECT path as any checkpoint; ``exp_probs_b.bias``
is ``mlp.gate.e_score_correction_bias`` (the converter renames it so the map finds it); the
DeltaNet's bare ``blk.N.ssm_a`` (``A_log``, no ``.weight``) has no name rule and is read by name
(:func:`moestream.models.qwen3_next.gguf_tensors`). The Hugging Face config is built from the metadata
(:func:`hf_config`); a key moestream needs
and the file lacks is refused naming the file and key, and so is a count or size under 1, a head count
that is not a multiple of the key/value heads, or a ``block_count`` above the blocks the file's tensors hold
(checked before anything is built per layer). A metadata array of more than
``_MAX_ARRAY`` items (the tokenizer's vocabulary, token types and merges) is stepped over by
:class:`_Header`, not parsed, and kept as its length; the tokenizer reads the lists itself
(:func:`moestream.tokenizer.load_gguf_tokenizer`). The compute dtype by default (``--dtype
auto``) is bf16, float32 for a file of F32 tensors only (:func:`compute_dtype`,
``GGUFFormat.compute_dtype``); block-quantized tensors stay as their bytes in either.

Architectures (``general.architecture``): each is declared by its family, beside the family's model
(``GGUF``, a :class:`GGUFArchitecture` in ``moestream/models/<family>.py``: its Hugging Face module names, its
config builder and, where the converter did more than rename tensors, its tensor rewrites: derived tensors,
computed from the stored ones when the resident weights load). This module holds the reader, the
name mapping and the helpers the builders share (:func:`base_config`, :func:`meta_value`, ...), and takes the
families' table as an argument (:func:`open_gguf`; :mod:`moestream.sources` passes
:func:`moestream.models.gguf_architectures`), so it imports nothing above the formats. What each does:

* ``qwen3moe`` (family ``qwen3_moe``), ``olmoe`` (``olmoe``): q and k stored as Hugging Face has
  them, nothing undone. llama.cpp's qwen3moe graph always renormalizes the top-k router weights
  (``norm_topk_prob``), which the metadata does not say.
* ``llama`` with experts (Mixtral; ``mixtral``): ``convert_hf_to_gguf.py`` permutes the q and k rows
  (``LlamaModel.permute``, for its interleaved rotary embedding); they are read back into Hugging
  Face order (``models/mixtral.py``; whole rows move: any type).
* ``deepseek2`` (DeepSeek-V2/V2.5/V3/R1, Kimi K2; ``deepseek_v3`` when ``expert_gating_func`` is
  sigmoid, else ``deepseek_v2``): ``DeepseekV2Model`` splits each layer's ``kv_b_proj`` into
  ``attn_k_b`` (the key rows, transposed) and ``attn_v_b``; they are joined back into ``kv_b_proj``
  (``models/deepseek.py``; a derived float32 tensor, dequantized from any type).
* ``glm4moe`` (GLM-4.5/4.6; ``glm4_moe``): partial rotary, biases and qk norm read off the
  tensors; the multi-token-prediction layers (``nextn_predict_layers``) follow the decoder layers in
  ``block_count`` and are left unused, as for Hugging Face checkpoints.
* ``qwen3next`` (Qwen3-Next; ``qwen3_next``) and ``qwen35moe`` (Qwen3.5/3.6 MoE; ``qwen3_5_moe``, as
  the text model ``qwen3_5_moe_text``): ``Qwen3NextModel.modify_tensors`` stores the zero-centred
  norms as ``1 + w`` (every ``*norm.weight`` but the DeltaNet's gated ``linear_attn.norm``), ``A_log``
  as ``blk.N.ssm_a = -exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, the conv squeezed to [C, K], and
  splits Qwen3-Next's ``in_proj_qkvz`` (grouped per key head) into ``attn_qkv`` (q, k, v of all
  heads) and ``attn_gate`` (z; older conversions kept it whole as ``ssm_in``);
  ``_LinearAttentionVReorderBase`` (Qwen3.5) reorders the value heads from grouped by key head to
  tiled when there are fewer key than value heads. Each is undone (``models/qwen3_next.py``): ``w =
  stored - 1`` in float32 (exact while ``1 + w >= 0.5``), ``A_log = log(-ssm_a)`` in float64 rounded
  to float32, rows moved as stored (any type), ``out_proj``'s columns moved as whole blocks when a
  value head is whole blocks, else kept as stored with the family feeding it its input in the stored
  order (``GGUFFormat.input_orders``). The config comes from the ``ssm.*`` keys,
  ``attention.recurrent_layers`` or ``full_attention_interval`` and ``rope.dimension_count`` (partial
  rotary); llama.cpp's graphs always renormalize the top-k weights.
* ``gpt-oss`` (``gpt_oss``): ``GptOssModel`` de-interleaves ``gate_up`` into ``ffn_gate_exps`` /
  ``ffn_up_exps`` with their biases and transposes ``down`` into nn.Linear orientation, which the
  family reads as it reads an mlx-lm build (separate gate and up experts); ``attn_sinks.weight`` is
  ``self_attn.sinks``; the sliding window and YaRN come from the metadata (``models/gpt_oss.py``).

Fused gate/up experts (``ffn_gate_up_exps``, a converter option) are refused by name.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch

from .checkpoint import Checkpoint, FileHandles, TensorInfo, file_identity
from .errors import CheckpointError
from .quant import ggml

SUFFIX = ".gguf"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class GGUFArchitecture:
    """What a family declares (its module's ``GGUF``) to read llama.cpp's files of one ``general.architecture``.

    ``name``: the architecture (``qwen3moe``); ``model_type``, ``hf_class``: the Hugging Face config's
    ``model_type`` and ``architectures`` entry the builder starts from; ``modules``: the Hugging Face module names
    under ``model.layers.{bid}.`` the family uses (:func:`derive_names` picks them from gguf's map; the
    building blocks :data:`ATTN`, :data:`ROUTED`, ... are here); ``config(meta, tensors, where, spec)``: the
    Hugging Face config from the metadata (the helpers :func:`base_config`, :func:`meta_value`, ...);
    ``tensors(tensors, cfg, derived, where, fmt)``: the converter's tensor transformations undone, or None when it
    only renamed; ``extra_names``: llama.cpp names gguf's map no longer lists, ``(llama.cpp, Hugging Face)``;
    ``own_head_dims``: the head dims come from the architecture's own keys (MLA), not width over heads;
    ``added``: the order architectures were added in, which messages list them by.
    """

    name: str
    model_type: str
    hf_class: str
    modules: tuple[str, ...]
    config: Callable[..., dict]
    tensors: Callable[..., None] | None = None
    extra_names: tuple[tuple[str, str], ...] = ()
    own_head_dims: bool = False
    added: int = 0


# -- tensor names ---------------------------------------------------------------------------------------
# llama.cpp's names are read back through the mapping the ``gguf`` package defines (gguf.TensorNameMap, the one
# convert_hf_to_gguf.py writes by): for each tensor of an architecture (gguf.MODEL_TENSORS) it lists the Hugging
# Face names of every model it converts (ffn_gate_inp is block_sparse_moe.gate for Mixtral, mlp.gate for
# Qwen3-MoE, mlp.router for others). The one moestream's family for that architecture uses is picked from these
# module names ({bid} the layer); a name gguf's map does not list for the architecture is never used.
ATTN = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "post_attention_layernorm")
QK_NORM = ("self_attn.q_norm", "self_attn.k_norm")
ROUTED = ("mlp.gate", "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
DENSE = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# shared experts and the sigmoid routers' correction bias (DeepSeek-V3, GLM-4.5)
SHARED_EXPERTS = ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj",
                   "mlp.gate.e_score_correction")
# Multi-head Latent Attention; k_b_proj / v_b_proj are llama.cpp's split of kv_b_proj, joined at open
MLA = ("self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
        "self_attn.kv_a_layernorm", "self_attn.kv_b_proj", "self_attn.k_b_proj", "self_attn.v_b_proj")
# Gated DeltaNet (Qwen3-Next, Qwen3.5). A_log is llama.cpp's bare blk.N.ssm_a (no .weight / .bias suffix, so no
# name rule matches it): the Qwen3-Next family's gguf_tensors reads it by that name
DELTANET = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.conv1d", "linear_attn.dt_proj",
             "linear_attn.norm", "linear_attn.out_proj")
# Qwen's one shared expert and its sigmoid gate
SHARED_EXPERT = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
                  "mlp.shared_expert_gate")
_TOP_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
# Overrides where moestream's names differ from the Hugging Face names in gguf's map. The stacked experts: the
# map names them as convert_hf_to_gguf.py stacks them (mlp.experts.gate_proj, Mixtral's experts.w1 ...);
# moestream's stacked layout (moestream.layout, mlx-lm's) calls them switch_mlp.{gate,up,down}_proj.
_STACKED = ((".experts.gate_proj", ".switch_mlp.gate_proj"), (".experts.up_proj", ".switch_mlp.up_proj"),
            (".experts.down_proj", ".switch_mlp.down_proj"), (".experts.w1", ".switch_mlp.gate_proj"),
            (".experts.w3", ".switch_mlp.up_proj"), (".experts.w2", ".switch_mlp.down_proj"))
# Tensors the converter renamed so the map finds them (DeepseekV2Model, Glm4MoeModel: e_score_correction_bias ->
# e_score_correction.bias, i.e. blk.N.exp_probs_b.bias): their Hugging Face name back
_SUFFIX_FIXES = ((".e_score_correction.bias", ".e_score_correction_bias"),)


def _model_arch(arch: str):
    import gguf  # the gguf package is needed for GGUF files only: imported when one is opened

    return next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)


@cache
def derive_names(spec: GGUFArchitecture) -> dict[str, str]:
    """llama.cpp tensor name (without ``.weight`` / ``.bias``) -> Hugging Face module path of ``spec``'s
    architecture, ``{i}`` the layer and ``{e}`` an expert: gguf's map restricted to ``spec.modules``, with the
    overrides above.

    Raises:
        ValueError: two of the architecture's module names map to one llama.cpp tensor (a vocabulary error).
    """
    import gguf

    arch = spec.name
    names = (*_TOP_MODULES, *("model.layers.{bid}." + m for m in spec.modules))
    want = {name.format(bid=0): name for name in names}
    out: dict[str, str] = {}
    for hf, (_, g) in gguf.get_tensor_name_map(_model_arch(arch), 1).mapping.items():
        template = want.get(hf)
        if template is None:
            continue
        key = re.sub(r"^blk\.0\.", "blk.{i}.", g)
        value = template.replace("{bid}", "{i}")
        for a, b in _STACKED:
            value = value.replace(a, b) if value.endswith(a) else value
        if out.get(key, value) != value:
            raise ValueError(f"{arch}: {out[key]} and {value} both map to llama.cpp's {key}")
        out[key] = value
    return {**out, **dict(spec.extra_names)}


def _pattern(key: str) -> re.Pattern:
    pat = re.escape(key).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile("^" + pat + r"\.(?P<param>weight|bias)$")


@cache
def _compiled_names(spec: GGUFArchitecture) -> list[tuple[re.Pattern, str]]:
    return [(_pattern(k), v) for k, v in derive_names(spec).items()]


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
    ``out_proj`` whose blocks straddle value heads; see :func:`moestream.models.qwen3_next._adapt_tiled`);
    ``compute_dtype``: the compute dtype of ``--dtype auto`` (:func:`compute_dtype`).
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

    compute_dtype: torch.dtype = torch.bfloat16  # the compute dtype by default (--dtype auto): compute_dtype()

    name = "gguf"  # what a family's ``adapt_to_source`` is told

    def describe(self, config: dict) -> str:
        """One line: ``GGUF v3, qwen3moe (llama.cpp names mapped), 1 file; Q4_K, Q6_K, F32``."""
        types = sorted({t for ts in self.types.values() for t in ts})
        files = f"{len(self.files)} file" + ("s" if len(self.files) > 1 else "")
        text = f"GGUF v{self.version}, {self.architecture} (llama.cpp names mapped), {files}; {', '.join(types)}"
        return text + ("; head tied to the embedding" if self.tied else "")


# -- the header, read with bounds -----------------------------------------------------------------------------
# A GGUF header is written by whoever made the file. Every count in it is checked against the bytes left in the
# file before anything is allocated or iterated, and these bound what a header may ask of the reader, each named
# in the error that enforces it. llama.cpp's files hold about 50 keys, some hundreds of tensors, no array of
# arrays, and arrays of about 500,000 items in all (a tokenizer's vocabulary, token types and merges).
MAX_KEYS = 65_536  # metadata keys
MAX_TENSORS = 262_144  # tensor infos
MAX_KEY_BYTES = 65_535  # a metadata key (the GGUF spec's limit)
MAX_TENSOR_NAME_BYTES = 256  # a tensor name (llama.cpp's GGML_MAX_NAME is 64)
MAX_STRING_BYTES = 16 << 20  # one string value (a chat template is tens of KB)
MAX_ITEMS = 1 << 23  # items of all the metadata's arrays together (8,388,608)
MAX_DEPTH = 8  # arrays inside arrays
MAX_NESTED_ITEMS = _MAX_ARRAY  # items under one key that holds arrays of arrays
MAX_KEPT_BYTES = 32 << 20  # keys and values held in memory (long arrays are stepped over, not held)
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_VERSIONS = (2, 3)  # version 1 had 32-bit counts; the gguf package reads 2 and 3

_STRING, _ARRAY = 8, 9  # GGUFValueType
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_VALUE_TYPES = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32", "BOOL", "STRING", "ARRAY",
                "UINT64", "INT64", "FLOAT64")
_ALIGNMENT_KEY, _UINT32 = "general.alignment", 4


class _Header:
    """One GGUF file's header read from its mapped bytes, within the bounds above: metadata (arrays of more
    than ``_MAX_ARRAY`` items, the tokenizer's lists, stepped over and kept as ``{"array_of": n}``; the tokenizer
    reads them itself, :func:`moestream.tokenizer.load_gguf_tokenizer`), tensor infos (name, raw type, ``ne``,
    offset), data offset, alignment and version. No tensor data is read.

    Raises:
        CheckpointError: naming the file, and the key or tensor, of a header that runs past the end of the
            file, holds a value or type GGUF does not define, or asks more than a bound (naming the bound).
    """

    def __init__(self, path: Path, buf):
        self.path, self.buf, self.size, self.pos = path, buf, len(buf), 0
        self.key: str | None = None  # the key being read, named in errors
        self.items = 0  # array items walked, every key together
        self.nested = 0  # items under this key in arrays of arrays
        self.kept = 0  # bytes of the keys and values held

    def fail(self, what: str) -> CheckpointError:
        where = "" if self.key is None else f"metadata {self.key!r}: "
        return CheckpointError(f"{self.path}: {where}{what}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"{what} at byte {self.pos} needs {n} bytes, but the file has {self.size - self.pos} "
                            "left; the file is truncated or corrupt")

    def unpack(self, fmt: str, what: str) -> tuple:
        s = struct.Struct("<" + fmt)
        self.need(s.size, what)
        out = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return out

    def keep(self, n: int) -> None:
        self.kept += n
        if self.kept > MAX_KEPT_BYTES:
            raise self.fail(f"the metadata's keys and values (its arrays of up to {_MAX_ARRAY} items, strings) come "
                            f"to more than {MAX_KEPT_BYTES:,} bytes, moestream's limit")

    def text(self, what: str, limit: int, held: bool = True) -> str:
        """A string of at most ``limit`` bytes; ``held``: it counts towards ``MAX_KEPT_BYTES`` (tensor names,
        at most ``MAX_TENSORS`` x ``MAX_TENSOR_NAME_BYTES``, do not)."""
        (n,) = self.unpack("Q", f"the length of {what}")
        if n > limit:
            raise self.fail(f"{what} of {n:,} bytes, over moestream's limit of {limit:,}")
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        if held:
            self.keep(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, vtype: int, depth: int = 0):
        if vtype in _SCALARS:
            self.keep(8)
            return self.unpack(_SCALARS[vtype], f"a {_VALUE_TYPES[vtype]} value")[0]
        if vtype == _STRING:
            return self.text("a string", MAX_STRING_BYTES)
        if vtype == _ARRAY:
            return self.array(depth)
        raise self.fail(f"value type {vtype}, which is not a GGUF value type (0 to 12)")

    def array(self, depth: int):
        if depth >= MAX_DEPTH:
            raise self.fail(f"arrays nested more than {MAX_DEPTH} deep, moestream's limit (llama.cpp writes no "
                            "array of arrays)")
        itype, count = self.unpack("IQ", "an array's item type and length")
        if itype not in _SCALARS and itype not in (_STRING, _ARRAY):
            raise self.fail(f"an array of value type {itype}, which is not a GGUF value type (0 to 12)")
        least = struct.calcsize("<" + _SCALARS[itype]) if itype in _SCALARS else 8 if itype == _STRING else 12
        self.need(count * least, f"an array of {count:,} {_VALUE_TYPES[itype]} items")  # before iterating any
        self.items += count
        if self.items > MAX_ITEMS:
            raise self.fail(f"the metadata's arrays hold more than {MAX_ITEMS:,} items in all, moestream's limit "
                            "(a tokenizer's lists hold about 500,000)")
        if depth or itype == _ARRAY:
            self.nested += count
            if self.nested > MAX_NESTED_ITEMS:
                raise self.fail(f"arrays of arrays holding more than {MAX_NESTED_ITEMS:,} items, moestream's limit "
                                "(llama.cpp writes no array of arrays)")
        held = count <= _MAX_ARRAY
        if itype in _SCALARS:
            if not held:  # stepped over: one length, no item read
                self.pos += count * least
                return {"array_of": count}
            self.keep(8 * count)
            out = list(struct.unpack_from(f"<{count}{_SCALARS[itype]}", self.buf, self.pos))
            self.pos += count * least
            return out
        if itype == _STRING:
            if held:
                return [self.text("a string", MAX_STRING_BYTES) for _ in range(count)]
            self.skip_strings(count)
            return {"array_of": count}
        out = [self.array(depth + 1) for _ in range(count)]  # count <= MAX_NESTED_ITEMS
        return out if held else {"array_of": count}

    def skip_strings(self, count: int) -> None:
        """Step over ``count`` strings (uint64 length, then the bytes): 0.1 s for Qwen3's 303,323."""
        pos, size, buf, unpack = self.pos, self.size, self.buf, struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                break
            pos += 8 + unpack(buf, pos)[0]
        else:
            if pos <= size:
                self.pos = pos
                return
        raise self.fail(f"an array of {count:,} strings runs past the end of the file; the file is truncated or "
                        "corrupt")

    def read(self) -> tuple[dict, list, int, int, int]:
        """(metadata, tensor infos, data offset, alignment, version)."""
        self.pos = 4  # the magic, checked by the caller
        (version,) = self.unpack("I", "the version")
        if version & 0xFFFF == 0:  # the gguf package's test: a version written in the other byte order
            raise self.fail("a big-endian GGUF file; moestream reads little-endian files")
        if version not in _VERSIONS:
            raise self.fail(f"GGUF version {version}; moestream reads versions {' and '.join(map(str, _VERSIONS))}")
        n_tensors, n_keys = self.unpack("QQ", "the tensor and key counts")
        if n_keys > MAX_KEYS:
            raise self.fail(f"the header declares {n_keys:,} metadata keys; moestream reads at most {MAX_KEYS:,} "
                            "(llama.cpp writes about 50)")
        if n_tensors > MAX_TENSORS:
            raise self.fail(f"the header declares {n_tensors:,} tensors; moestream reads at most {MAX_TENSORS:,}")
        # a key is at least 13 bytes (length, type, a one-byte value), a tensor info 24: checked before either loop
        self.need(13 * n_keys + 24 * n_tensors, f"the {n_keys:,} metadata keys and {n_tensors:,} tensor infos declared")
        meta: dict = {}
        alignment = 32  # GGUF's default
        for i in range(n_keys):
            self.key = None
            key = self.text(f"metadata key {i}", MAX_KEY_BYTES)
            if key in meta:
                raise self.fail(f"metadata key {key!r} is given twice")
            self.key, self.nested = key, 0
            (vtype,) = self.unpack("I", "its value type")
            meta[key] = self.value(vtype)
            if key == _ALIGNMENT_KEY:
                alignment = meta[key]
                if vtype != _UINT32 or alignment == 0 or alignment & (alignment - 1):
                    raise self.fail(f"{str(alignment)[:40]} ({_VALUE_TYPES[vtype]}): the data alignment must be a "
                                    "power of two, as a UINT32")
        self.key = None
        infos = []
        for i in range(n_tensors):
            name = self.text(f"the name of tensor {i}", MAX_TENSOR_NAME_BYTES, held=False)
            (n_dims,) = self.unpack("I", f"tensor {name!r}'s dimension count")
            if n_dims > _MAX_DIMS:
                raise self.fail(f"tensor {name!r} has {n_dims:,} dimensions; a GGUF tensor has at most {_MAX_DIMS}")
            dims = list(self.unpack(f"{n_dims}Q", f"tensor {name!r}'s dimensions"))
            raw_type, offset = self.unpack("IQ", f"tensor {name!r}'s type and offset")
            infos.append((name, raw_type, dims, offset))
        data_offset = -(-self.pos // alignment) * alignment
        return meta, infos, data_offset, alignment, version


def _read_file(path: Path) -> tuple[dict, list, int, int, int]:
    """(metadata, tensor infos, data offset, alignment, version) of one GGUF file (:class:`_Header`).

    Raises:
        CheckpointError: not a GGUF file, an unreadable, truncated or hostile header, big-endian data.
    """
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    if size < 24:
        raise CheckpointError(f"{path}: file of {size} bytes is too short to be GGUF")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic != b"GGUF":
                raise CheckpointError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                meta, infos, data_offset, alignment, version = _Header(path, buf).read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
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
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # the gguf package, needed for GGUF files only

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


def compute_dtype(tensors: dict[str, TensorInfo]) -> torch.dtype:
    """The compute dtype of a GGUF model by default (``--dtype auto``): float32 when every tensor is stored
    F32 (a float32 conversion, computed as stored, as a float32 safetensors checkpoint is), else bfloat16.

    Block-quantized tensors (experts, attention, embedding, LM head) stay as their bytes whatever the
    dtype: the kernels dequantize them in float32 registers, accumulate in float32 and round each output
    to the compute dtype once (an embedding row is dequantized in float32, then cast). Float tensors
    (F32 norms and routers, the weights of an F16 / BF16 file) are cast to the compute dtype at load. So
    bf16 changes the activations between operations and the KV cache, which takes half float32's bytes
    (the same context in less memory). llama.cpp keeps F16 / F32 weights as stored and computes its
    activations in float32 (an F16 KV cache); bf16 keeps float32's exponent range, where F16 activations
    can overflow, at 8 bits of precision; ``--dtype float32`` computes as llama.cpp does.
    """
    if tensors and all(t.dtype == "F32" for t in tensors.values()):
        return torch.float32
    return torch.bfloat16


def hf_name(name: str, spec: GGUFArchitecture | None) -> str | None:
    """The Hugging Face name of architecture ``spec``'s llama.cpp tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``, ``blk.3.exp_probs_b.bias`` ->
    ``model.layers.3.mlp.gate.e_score_correction_bias``), or None when :func:`derive_names` has no rule for it
    (or ``spec`` is None: an architecture no family declares)."""
    for pat, repl in _compiled_names(spec) if spec is not None else ():
        m = pat.match(name)
        if m:
            out = repl.format(**{k: v for k, v in m.groupdict().items() if k != "param"}) + "." + m["param"]
            for a, b in _SUFFIX_FIXES:
                out = out[: -len(a)] + b if out.endswith(a) else out
            return out
    return None


def meta_value(meta: dict, key: str, where, kind=int, default=None, required: bool = True, minimum: int | None = None):
    """Metadata ``key`` of type ``kind`` (an int passes as a float); ``default`` when absent (required if
    ``required`` and no default). ``minimum``: the smallest integer allowed (a count or a size: at least 1).

    Raises:
        CheckpointError: naming the file and key, when missing, of another type, or under ``minimum``.
    """
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
    if minimum is not None and v < minimum:
        raise CheckpointError(f"{where}: metadata {key!r} = {v} must be at least {minimum}")
    return v


_BLOCK = re.compile(r"^(?:model\.layers|blk)\.(\d+)\.")


def blocks_held(tensors: dict[str, TensorInfo]) -> int:
    """How many blocks (layers) the file's tensors hold: the highest ``blk.N`` (``model.layers.N``) plus one."""
    return max((int(m[1]) + 1 for name in tensors if (m := _BLOCK.match(name))), default=0)


def hf_config(meta: dict, tensors: dict[str, TensorInfo], where,
              architectures: Mapping[str, GGUFArchitecture]) -> dict:
    """The Hugging Face config (a dict) of a GGUF model's metadata and tensors, built by its architecture's
    builder (``config`` of its :class:`GGUFArchitecture` in ``architectures``, which the families declare:
    :func:`moestream.models.gguf_architectures`).

    Raises:
        CheckpointError: an architecture moestream does not map, a required key missing or of
            the wrong type, or a setting its family does not compute (naming the key).
    """
    arch = meta.get("general.architecture")
    spec = architectures.get(arch) if isinstance(arch, str) else None
    if spec is None:
        known = sorted(architectures.values(), key=lambda a: a.added)
        raise CheckpointError(f"{where}: GGUF architecture {arch!r} is not supported; moestream reads "
                              f"{', '.join(a.name for a in known)}")
    return spec.config(meta, tensors, where, spec)


# -- for the families' config builders (each family's GGUFArchitecture.config) ----------------------------------
def base_config(meta: dict, tensors: dict[str, TensorInfo], where, spec: GGUFArchitecture) -> dict:
    """The config fields every architecture reads the same way: model type, vocabulary (the embedding's rows),
    width, layers (``block_count``), heads, key/value heads, head dim (``attention.key_length``), experts per
    token, norm eps, rope base, context and the bos / eos token ids.

    Raises:
        CheckpointError: a required key missing or of the wrong type, or no ``token_embd.weight``.
    """
    model_type, cls = spec.model_type, spec.hf_class
    p = spec.name + "."
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise CheckpointError(f"{where}: no token_embd.weight tensor")
    blocks = meta_value(meta, p + "block_count", where, minimum=1)
    held = blocks_held(tensors)
    if blocks > held:  # before anything is built per layer (a block_count of 2^32 - 1 took minutes)
        raise CheckpointError(f"{where}: metadata '{p}block_count' = {blocks}, but the file's tensors hold "
                              + (f"{held} blocks (blk.0 to blk.{held - 1})" if held else "no blocks (blk.N)"))
    heads = meta_value(meta, p + "attention.head_count", where, minimum=1)
    hidden = meta_value(meta, p + "embedding_length", where, minimum=1)
    kv_heads = meta_value(meta, p + "attention.head_count_kv", where, default=heads, minimum=1)
    if heads % kv_heads:
        raise CheckpointError(f"{where}: metadata '{p}attention.head_count' = {heads} is not a multiple of "
                              f"'{p}attention.head_count_kv' = {kv_heads}")
    head_dim = meta_value(meta, p + "attention.key_length", where, required=False, minimum=1)
    if head_dim is None:  # the head dim by default: the width over the heads, as llama.cpp's n_embd_head_k
        if hidden % heads and not spec.own_head_dims:  # deepseek2's head dims are MLA's (its own keys)
            raise CheckpointError(f"{where}: metadata '{p}embedding_length' = {hidden} is not a multiple of "
                                  f"'{p}attention.head_count' = {heads}, and no '{p}attention.key_length' gives "
                                  "the head dim")
        head_dim = hidden // heads
    cfg = {
        "model_type": model_type, "architectures": [cls],
        "vocab_size": embed.shape[0],
        "hidden_size": hidden,
        "num_hidden_layers": blocks,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_experts_per_tok": meta_value(meta, p + "expert_used_count", where, minimum=1),
        "rms_norm_eps": meta_value(meta, p + "attention.layer_norm_rms_epsilon", where, float),
        "rope_theta": meta_value(meta, p + "rope.freq_base", where, float, default=10000.0),
        "max_position_embeddings": meta_value(meta, p + "context_length", where, minimum=1),
        "tie_word_embeddings": False,  # a file without `output` gets the embedding's bytes as lm_head
        "torch_dtype": "float32",
    }
    for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if isinstance(meta.get(key), int):
            cfg[hf] = meta[key]
    return cfg


def expert_count(meta: dict, p: str, where) -> int:
    """``expert_count``, refused when missing or 0 (a dense model has nothing to stream)."""
    experts = meta_value(meta, p + "expert_count", where, default=0, required=False)
    if not experts:
        raise CheckpointError(f"{where}: a {p[:-1]} model without experts ({p}expert_count is {experts}): a dense "
                              "model has nothing to stream")
    return experts


def one_head_dim(meta: dict, p: str, where, cfg: dict) -> None:
    """Refuse an ``attention.value_length`` other than the head dim (the family has one ``head_dim``)."""
    vdim = meta_value(meta, p + "attention.value_length", where, default=cfg["head_dim"], minimum=1)
    if vdim != cfg["head_dim"]:
        raise CheckpointError(f"{where}: attention.key_length {cfg['head_dim']} and value_length {vdim} differ; "
                              f"{cfg['model_type']} has one head_dim")


def softmax_moe_config(meta: dict, tensors: dict[str, TensorInfo], where, spec: GGUFArchitecture) -> tuple[dict, int]:
    """``(config, expert count)`` of an architecture with softmax routing, full rotary and every layer MoE
    (Qwen3-MoE, OLMoE, Mixtral): :func:`base_config`, one head dim, rope scaling; the family adds its expert
    fields (their names and widths differ).

    Raises:
        CheckpointError: a required key missing or of the wrong type, partial rotary, sigmoid gating,
            no experts, or key and value widths that differ.
    """
    p = spec.name + "."
    cfg = base_config(meta, tensors, where, spec)
    one_head_dim(meta, p, where, cfg)
    head_dim = cfg["head_dim"]
    rot = meta_value(meta, p + "rope.dimension_count", where, required=False, minimum=1)
    if rot is not None and rot != head_dim:
        raise CheckpointError(f"{where}: metadata {p}rope.dimension_count {rot} is not the head dim {head_dim}: "
                              "partial rotary embeddings are not supported")
    gating = meta_value(meta, p + "expert_gating_func", where, required=False)
    if gating not in (None, 1):  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise CheckpointError(f"{where}: metadata {p}expert_gating_func {gating}: {cfg['model_type']} routes by "
                              "softmax (1)")
    experts = expert_count(meta, p, where)
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": meta.get(p + "rope.scaling.factor"),
                               "original_max_position_embeddings": meta.get(p + "rope.scaling.original_context_length")}
    return cfg, experts












def bools(meta: dict, key: str, where, n: int) -> list[bool] | None:
    """A metadata array of at least ``n`` bools (its first ``n``), or None when the file lacks ``key``."""
    v = meta.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) < n or not all(isinstance(b, bool) for b in v):
        raise CheckpointError(f"{where}: metadata {key!r} = {str(v)[:60]!r} is not an array of {n} bools")
    return v[:n]


def moe_checks(meta: dict, p: str, where, family: str) -> int:
    """The expert count (:func:`expert_count`); refuses an expert weight scale other than 1 (llama.cpp scales the
    routing weights by it; the family does not). ``expert_gating_func`` is not read: llama.cpp's graphs of
    these architectures fix their gating function (softmax; gpt-oss: softmax over the top-k), as the families."""
    experts = expert_count(meta, p, where)
    scale = meta_value(meta, p + "expert_weights_scale", where, float, required=False)
    if scale not in (None, 0.0, 1.0):  # llama.cpp reads 0 as no scaling
        raise CheckpointError(f"{where}: metadata {p}expert_weights_scale {scale}: {family} does not scale the "
                              "routing weights")
    return experts








# -- for the families' tensor rewrites (each family's GGUFArchitecture.tensors) -----------------------------------
# Each rewrite takes (tensors under their mapped names, the config, derived, the file, the GGUFFormat) and undoes
# what convert_hf_to_gguf.py did to the tensors beyond renaming them: a derived tensor is indexed as what it
# returns (a float32 TensorInfo unless it keeps the stored bytes) and computed from the stored ones when the
# resident weights load.
def float_weight(info: TensorInfo, ckpt) -> torch.Tensor:
    """A stored weight as float32 of its logical shape (block-quantized rows dequantized, as llama.cpp reads them)."""
    t = ckpt.read_info(info)
    qtype = ggml.block_type(info.dtype)
    if qtype is None:
        return t.float()
    return ggml.dequantize(t, qtype, ggml.in_features(qtype, info.shape[-1]))


def logical_shape(info: TensorInfo) -> tuple[int, ...]:
    qtype = ggml.block_type(info.dtype)
    if qtype is None:
        return tuple(info.shape)
    return (*info.shape[:-1], ggml.in_features(qtype, info.shape[-1]))


def as_float32(info: TensorInfo, name: str, shape: tuple[int, ...]) -> TensorInfo:
    """``info``'s place, described as the float32 tensor ``shape`` a derived function returns."""
    return TensorInfo(name, info.file, info.offset, math.prod(shape) * 4, "F32", tuple(shape))


def derive(tensors: dict, derived: dict, name: str, info: TensorInfo, make) -> None:
    """Index ``name`` as ``info`` (the float32 or stored tensor ``make(ckpt)`` returns), read through ``make``."""
    tensors[name] = info
    derived[name] = make












def take_rows(info: TensorInfo, perm: torch.Tensor, ckpt) -> torch.Tensor:
    """Rows of ``info`` reordered (``out = stored[perm]``); whole rows move, so any type."""
    return ckpt.read_info(info)[perm].contiguous()






















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


def open_gguf(path, architectures: Mapping[str, GGUFArchitecture], inspect_only: bool = False) -> GGUFCheckpoint:
    """Open the GGUF model ``path`` (a ``.gguf`` file or the first of a split set); nothing but headers is read.

    ``architectures``: ``general.architecture`` -> :class:`GGUFArchitecture`, the families' declarations
    (:func:`moestream.models.gguf_architectures`; :func:`moestream.sources.open_gguf` passes them).

    ``inspect_only``: index tensors of types moestream does not compute on instead of refusing them
    (listed in ``source_format.unsupported``; such a checkpoint is for ``moestream inspect`` only).

    Raises:
        CheckpointError: naming the file, and the tensor or metadata key, of anything that is not
            a GGUF model moestream reads (see the module doc).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    try:  # the gguf package (its tensor-name map and ggml type tables) is needed for GGUF files only
        import gguf  # noqa: F401
    except ImportError:
        raise CheckpointError(f"{path}: reading a GGUF file needs the gguf package (pip install 'gguf>=0.17')"
                              ) from None
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
    spec = architectures.get(arch)
    for name, info in raw.items():
        hf = hf_name(name, spec) or name  # a tensor without a rule keeps its name (reported unused)
        tensors[hf] = info
        kind = re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight")
        types.setdefault(kind, set()).add(ggml.block_type(info.dtype) or info.dtype)
    fmt.types = {k: sorted(v) for k, v in sorted(types.items())}
    fmt.compute_dtype = compute_dtype(raw)
    cfg = hf_config(meta, tensors, path, architectures)
    derived = {}
    if spec.tensors is not None:  # the converter's transformations of this architecture, undone
        spec.tensors(tensors, cfg, derived, path, fmt)
    if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        # llama.cpp ties the head to the embedding when the file has no `output` tensor: the same bytes
        emb = tensors["model.embed_tokens.weight"]
        tensors["lm_head.weight"] = emb
        fmt.tied = True
    ckpt = GGUFCheckpoint(path, cfg, tensors, files, identities, fmt)
    ckpt.derived = derived
    return ckpt


__all__ = ["ATTN", "DELTANET", "DENSE", "MLA", "QK_NORM", "ROUTED", "SHARED_EXPERT", "SHARED_EXPERTS", "UNSUPPORTED",
           "GGUFArchitecture", "GGUFCheckpoint", "GGUFFormat", "as_float32", "base_config", "bools", "compute_dtype",
           "derive", "derive_names", "expert_count", "float_weight", "hf_config", "hf_name", "is_gguf", "logical_shape",
           "meta_value", "moe_checks", "one_head_dim", "open_gguf", "softmax_moe_config", "split_files", "take_rows"]
