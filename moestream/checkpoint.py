"""Checkpoint layer: a Hugging Face model folder, its config and its safetensors shards.

A checkpoint is a folder holding ``config.json``, the weights as ``model.safetensors``
or as shards listed by ``model.safetensors.index.json``, and tokenizer files. This
module parses every shard's safetensors header (validating it against the file
before any read), maps every tensor to ``(shard, byte offset, byte length, dtype,
shape)`` and reads tensors by positional reads. It never unpickles anything.

The safetensors format: an 8-byte little-endian header length N, N bytes of JSON
mapping each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the data section that starts at 8 + N), then the data.
Specification: https://github.com/huggingface/safetensors#format
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError, ConfigError, ReadError

# safetensors dtype name -> (torch dtype or None where this torch lacks it, bytes per element)
_DTYPES: dict[str, tuple[torch.dtype | None, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "U16": (getattr(torch, "uint16", None), 2),
    "U32": (getattr(torch, "uint32", None), 4),
    "U64": (getattr(torch, "uint64", None), 8),
    "F8_E4M3": (getattr(torch, "float8_e4m3fn", None), 1),
    "F8_E5M2": (getattr(torch, "float8_e5m2", None), 1),
    "F8_E8M0": (getattr(torch, "float8_e8m0fnu", None), 1),
}
_TORCH_TO_ST = {v[0]: k for k, v in _DTYPES.items() if v[0] is not None}

# A header larger than this is refused rather than parsed (real ones are well under 10 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_SHARD_GB = 1e6  # a million GB: past any disk, and int(gb * 1e9) stays exact


def shard_bytes(shard_gb: float) -> int:
    """Bytes per shard for a ``--shard-gb`` size in GB (10^9 bytes): the one check ``synth`` and
    ``convert`` share.

    Raises:
        ConfigError: ``shard_gb`` is not above 0 and below :data:`MAX_SHARD_GB` (nan and inf included).
    """
    if not 0 < shard_gb < MAX_SHARD_GB:
        raise ConfigError(f"--shard-gb {shard_gb}: expected a size in GB above 0 and below {MAX_SHARD_GB:.0f}")
    return int(shard_gb * 1e9)


# A block-quantized GGUF tensor (moestream.quant.ggml) is indexed as its raw bytes under the dtype name
# ``GGML_<type>`` ("GGML_Q4_K"), shape [..., row bytes]: one byte per element for every layer above.
BLOCK_DTYPE_PREFIX = "GGML_"


def dtype_size(st_dtype: str) -> int:
    """Bytes per element of a safetensors dtype name such as ``"BF16"`` (1 for a ``GGML_*`` block type)."""
    if st_dtype.startswith(BLOCK_DTYPE_PREFIX):
        return 1
    return _DTYPES[st_dtype][1]


def torch_dtype(st_dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (uint8 for a ``GGML_*`` block type's bytes); raises
    CheckpointError if this torch lacks it."""
    if st_dtype.startswith(BLOCK_DTYPE_PREFIX):
        return torch.uint8
    dt = _DTYPES.get(st_dtype, (None, 0))[0]
    if dt is None:
        raise CheckpointError(f"dtype {st_dtype} is not supported by this PyTorch build")
    return dt


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return _TORCH_TO_ST[dtype]
    except KeyError:
        raise CheckpointError(f"torch dtype {dtype} has no safetensors name") from None


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie: ``nbytes`` bytes at absolute byte ``offset`` of ``file``.

    ``dtype`` is the safetensors dtype name (``"BF16"``), ``shape`` the tensor shape.
    """

    name: str
    file: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# -- header validation helpers (the reliability issue) ----------------------------------
def _json_no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook`` for :func:`json.loads` that refuses a key given twice (the
    plain parser silently keeps the last one, so two readers could disagree on a tensor)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


class _DuplicateKey(ValueError):
    pass


def _short(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: a hostile header's values stay out of messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse_header_json(path: Path, raw: bytes) -> dict:
    """The header's JSON object; CheckpointError naming ``path`` when it is not one."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_json_no_duplicates)
    except _DuplicateKey as e:
        raise CheckpointError(f"{path}: header gives the key {e.args[0]!r} twice") from None
    except ValueError as e:  # bad UTF-8, bad JSON, an integer of more than 4300 digits
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    except RecursionError:  # hostile nesting: the C parser stops at Python's recursion limit
        raise CheckpointError(f"{path}: header is not a safetensors header (JSON nested too deep)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    return header


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors file's header against the file's size.

    Returns ``(tensors, metadata)``. Checks, before any tensor byte is read: the header
    length lies inside the file, the JSON is a well-formed object (no key given twice,
    no hostile nesting), every dtype is known,
    every shape is a list of non-negative integers, every byte range equals dtype size
    times element count, lies inside the data section and overlaps no other.

    Raises:
        CheckpointError: naming the file and, where one is at fault, the tensor.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: file of {size} bytes is too short to be safetensors")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: header length {n} runs past the end of the file ({size} bytes); "
                    "the file is truncated or not safetensors"
                )
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header of {n} bytes is larger than {MAX_HEADER_BYTES}")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    header = _parse_header_json(path, raw)
    data_start = 8 + n
    data_size = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: __metadata__ is not a JSON object")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: entry is not a JSON object")
        dt = entry.get("dtype")
        if not isinstance(dt, str) or dt not in _DTYPES:  # a list or object is unhashable: not a dtype
            raise CheckpointError(f"{where}: unknown dtype {_short(dt)}")
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise CheckpointError(f"{where}: shape {_short(shape)} is not a list of non-negative integers")
        offs = entry.get("data_offsets")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        ):
            raise CheckpointError(f"{where}: data_offsets {_short(offs)} is not a pair of integers")
        begin, end = offs
        if begin < 0 or end < begin:
            raise CheckpointError(f"{where}: data_offsets {offs} are not ordered")
        if end > data_size:
            raise CheckpointError(
                f"{where}: data_offsets end at {end} but the data section holds {data_size} bytes; "
                "the file is truncated or the header is corrupt"
            )
        expect = math.prod(shape) * _DTYPES[dt][1]
        if end - begin != expect:
            raise CheckpointError(
                f"{where}: holds {end - begin} bytes but dtype {dt} x shape {shape} needs {expect}"
            )
        tensors[name] = TensorInfo(name, path, data_start + begin, end - begin, dt, tuple(shape))
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors {n0!r} and {n1!r} overlap")
    return tensors, metadata


def pread_full(fd: int, offset: int, buffers: list[memoryview], path: Path | str, what: str) -> int:
    """Fill ``buffers`` (writable byte views, in file order) from ``offset`` of ``fd``.

    Uses ``os.preadv``, which releases the GIL, and retries after partial reads.
    Returns the bytes read (the buffers' total length).

    Raises:
        ReadError: on an OS error or end of file before the buffers are full,
            naming ``what`` (a tensor or expert) and ``path``.
    """
    pending = [b for b in buffers if len(b)]
    total = sum(len(b) for b in pending)
    pos = offset
    iov_max = 1024
    while pending:
        try:
            n = os.preadv(fd, pending[:iov_max], pos)
        except OSError as e:
            raise ReadError(f"reading {what} from {path} at byte {pos}: {e.strerror or e}") from None
        if n <= 0:
            try:
                size = f"the file now holds {os.fstat(fd).st_size} bytes"
            except OSError:
                size = "the file size is unknown"
            raise ReadError(
                f"reading {what} from {path}: short read, nothing at byte {pos} ({size}; "
                f"{sum(len(b) for b in pending)} bytes still expected): truncated or replaced?"
            )
        pos += n
        while n and pending:
            if n >= len(pending[0]):
                n -= len(pending[0])
                pending.pop(0)
            else:
                pending[0] = pending[0][n:]
                n = 0
    return total


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte memoryview over a contiguous CPU tensor's storage."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def empty_for(info: TensorInfo) -> tuple[torch.Tensor, memoryview]:
    """An uninitialised CPU tensor of ``info``'s dtype and shape, and a byte view to read into."""
    raw = torch.empty(info.nbytes, dtype=torch.uint8)
    return raw.view(torch_dtype(info.dtype)).view(info.shape), memoryview(raw.numpy())


class FileHandles:
    """Read-only descriptors of shard files, each opened once and shared by reader threads.

    ``advice``, when given, is a ``posix_fadvise`` advice applied to each file on open
    (expert reads use ``POSIX_FADV_RANDOM``: no readahead past what is asked for).

    Raises (from :meth:`get`):
        ReadError: naming the file when it cannot be opened.
    """

    def __init__(self, advice: int | None = None):
        self.advice = advice
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def get(self, file: Path) -> int:
        fd = self._fds.get(file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file)
                if fd is None:
                    try:
                        fd = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    except OSError as e:
                        raise ReadError(f"{file}: cannot open: {e.strerror or e}") from None
                    if self.advice is not None and hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, self.advice)
                    self._fds[file] = fd
        return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def file_identity(path: Path) -> tuple[int, int, int, int]:
    """``(device, inode, size, mtime_ns)`` of ``path``: what changes when a file is replaced,
    truncated, grown or written. Raises CheckpointError when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot stat: {e.strerror or e}") from None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _identity_change(before: tuple[int, ...], now: tuple[int, ...]) -> str:
    if before[:2] != now[:2]:
        return "replaced by another file"
    if before[2] != now[2]:
        return f"its size went from {before[2]} to {now[2]} bytes"
    return "it was written to"


def _refuse_pickle_shard(index: Path, shard: str) -> None:
    """An index naming a pickle file as a shard is refused by name, before anything opens it."""
    if shard.endswith(_PICKLE_SUFFIXES):
        raise CheckpointError(
            f"{index}: shard {shard} is a pickle file; moestream never unpickles weights. Convert the "
            "checkpoint to safetensors (for example with transformers' save_pretrained(..., "
            "safe_serialization=True)) and point --model at that."
        )


def resolve_model(model: str | os.PathLike) -> Path:
    """A local checkpoint for ``model``: a folder path, a GGUF file (``*.gguf``), or a Hugging Face Hub id.

    A Hub id (``org/name``) is resolved with ``huggingface_hub.snapshot_download``,
    fetching only config, safetensors, index and tokenizer files (or the local Hub
    cache when offline).

    Raises:
        CheckpointError: when ``model`` is neither an existing folder, a GGUF file nor a Hub id that
            can be fetched ("no such file" for a missing ``*.gguf``).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() and path.suffix == ".gguf":  # moestream.gguf_format reads it
        return path
    if path.exists():
        raise CheckpointError(f"{path}: --model must be a checkpoint folder or a .gguf file, not another file")
    text = str(model)
    if text.endswith(".gguf"):  # a file's path, even when shaped as a Hub id (dir/x.gguf)
        raise CheckpointError(f"{text}: no such file")
    if not re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", text):
        if re.fullmatch(r"\.[A-Za-z][A-Za-z0-9]{0,15}", path.suffix):  # a file's suffix, not a version's dot (.5-7B)
            raise CheckpointError(f"{text}: no such file or folder")
        raise CheckpointError(f"{text}: no such folder, and not a Hugging Face Hub id (org/name)")
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            repo_id=text,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"],
        )
    except Exception as e:  # huggingface_hub raises many kinds; all mean "cannot fetch"
        reason = " ".join(str(e).split())  # Hub messages span several lines
        raise CheckpointError(f"{text}: not a local folder, and fetching it from the Hub failed: {reason}") from None
    return Path(local)


class Checkpoint:
    """An opened checkpoint folder: its config and an index of every tensor.

    Attributes:
        path: the folder.
        config: the parsed ``config.json`` (a dict, fields as Hugging Face names them).
        tensors: tensor name -> :class:`TensorInfo`, across all shards.
        shards: the shard files, in index order.
        metadata: shard file name -> its safetensors ``__metadata__``.
        source_format: a :class:`moestream.mlx_format.MLXFormat` once
            :func:`moestream.sources.open_checkpoint` (or ``moestream.mlx_format.adapt``) found an mlx-lm build and
            mapped its names onto Hugging Face names, else None.
        derived: tensor name -> function of the checkpoint computing it (an MLX build's
            tensors whose values differ from the Hugging Face ones); read by :meth:`read_tensor`.

    Raises (from the constructor):
        CheckpointError: missing folder, config, shard or tensor; corrupt header or index;
            pickle-only weights (never loaded).
        ConfigError: config.json is not valid JSON.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: checkpoint folder does not exist")
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{self.path}: no config.json in the checkpoint folder")
        try:
            self.config = json.loads(cfg_path.read_text())
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep
            raise ConfigError(f"{cfg_path}: not valid JSON ({e})") from None
        if not isinstance(self.config, dict):
            raise ConfigError(f"{cfg_path}: not a JSON object")
        self.shards = self._find_shards()
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, dict] = {}  # shard file name -> its safetensors __metadata__
        self.derived: dict = {}  # tensor name -> fn(checkpoint) computing it (moestream.mlx_format)
        self._index_tensors()
        self._files = FileHandles()
        self.source_format = None  # set by moestream.mlx_format.adapt for an mlx-lm build

    # -- discovery ---------------------------------------------------------------------
    def _find_shards(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                data = json.loads(index.read_text())
                weight_map = data["weight_map"]
                assert isinstance(weight_map, dict)
            except (ValueError, RecursionError, KeyError, TypeError, AssertionError):
                raise CheckpointError(f"{index}: not a valid index (needs a 'weight_map' object)") from None
            self._weight_map = weight_map
            names = []
            for tensor, shard in weight_map.items():
                if not isinstance(shard, str) or Path(shard).name != shard:
                    raise CheckpointError(
                        f"{index}: tensor {_short(tensor)} maps to {_short(shard)}, not a file in the folder"
                    )
                _refuse_pickle_shard(index, shard)
                if shard not in names:
                    names.append(shard)
            shards = [self.path / s for s in names]
            for s in shards:
                if not s.is_file():
                    raise CheckpointError(f"{index}: shard {s.name} is listed but missing from {self.path}")
            return shards
        self._weight_map = None
        shards = sorted(self.path.glob("*.safetensors"))
        if shards:
            return shards
        pickles = sorted(p.name for p in self.path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{self.path}: weights are only in pickle files ({', '.join(pickles)}); moestream never "
                "unpickles weights. Convert the checkpoint to safetensors (for example with "
                "transformers' save_pretrained(..., safe_serialization=True)) and point --model at that."
            )
        raise CheckpointError(f"{self.path}: no *.safetensors weight files")

    def _index_tensors(self) -> None:
        self.identities: dict[Path, tuple[int, ...]] = {}
        for shard in self.shards:
            self.identities[shard] = file_identity(shard)  # before the header: a later change shows
            tensors, self.metadata[shard.name] = read_safetensors_header(shard)
            for name, info in tensors.items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"{shard}: tensor {name!r} is also in {self.tensors[name].file.name}"
                    )
                self.tensors[name] = info
        if self._weight_map is not None:
            for name, shard in self._weight_map.items():
                info = self.tensors.get(name)
                if info is None or info.file.name != shard:
                    raise CheckpointError(
                        f"{self.path / INDEX_FILE}: tensor {name!r} is listed in {shard} but that shard "
                        "does not hold it"
                    )

    # -- reading -----------------------------------------------------------------------
    def fd(self, file: Path) -> int:
        """A read-only file descriptor of a shard, opened once (for resident weights)."""
        return self._files.get(file)

    def info(self, name: str) -> TensorInfo:
        """The :class:`TensorInfo` of ``name``; raises CheckpointError naming it if absent."""
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint") from None

    def read_tensor(self, name: str) -> torch.Tensor:
        """Read one whole tensor into a new CPU tensor of its stored dtype and shape.

        A derived tensor (``self.derived``: an MLX checkpoint's shifted norm, merged or
        dequantized weight) is computed from the stored ones it comes from.
        """
        make = self.derived.get(name)
        if make is not None:
            return make(self)
        return self.read_info(self.info(name))

    def read_info(self, info: TensorInfo) -> torch.Tensor:
        """Read the bytes ``info`` describes into a new CPU tensor of its dtype and shape."""
        out, view = empty_for(info)
        pread_full(self.fd(info.file), info.offset, [view], info.file, f"tensor {info.name!r}")
        self.check_unchanged(info.file, f"tensor {info.name!r}")
        return out

    def check_unchanged(self, file: Path, what: str) -> None:
        """Raise ReadError (naming ``what`` and ``file``) if the shard is no longer the file whose
        header was validated: replaced (another inode), truncated or grown, or written since.

        Called after each read: bytes read from a changed file may be another tensor's, and
        must not reach the model.
        """
        before = self.identities.get(file)
        if before is None:
            return
        try:
            now = file_identity(file)
        except CheckpointError:
            now = None
        if now != before:
            why = "it is gone" if now is None else _identity_change(before, now)
            raise ReadError(
                f"reading {what} from {file}: the shard changed on disk after the checkpoint was opened ({why}); "
                "the bytes read cannot be trusted. Restart moestream to load the checkpoint as it is now."
            )

    def close(self) -> None:
        """Close every shard file descriptor."""
        self._files.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data over all shards."""
        return sum(t.nbytes for t in self.tensors.values())
