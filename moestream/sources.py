"""A checkpoint of any source, opened: a Hugging Face folder, an mlx-lm build (its names and layouts mapped by
:mod:`moestream.mlx_format`) or a llama.cpp GGUF file (:mod:`moestream.gguf_format`).

Every command that reads a checkpoint (the engine, ``inspect``, ``convert``) opens it here, so none of the
formats imports another to find out what it was given. A GGUF file is read by the architectures the families
declare (each family module's ``GGUF``, :func:`moestream.models.gguf_architectures`): this module sits above the
models and hands them to :mod:`moestream.gguf_format`, which holds the reader and asks nothing of the layers
above it. :func:`open_gguf`, :func:`hf_config`, :func:`hf_name`, :data:`NAMES` and :data:`HF_MODULES` are
``gguf_format``'s, over those architectures.
"""

from __future__ import annotations

from collections.abc import Mapping

from . import gguf_format
from .checkpoint import Checkpoint, TensorInfo
from .gguf_format import GGUFCheckpoint, is_gguf
from .mlx_format import adapt
from .models import gguf_architectures


def open_checkpoint(path) -> Checkpoint:
    """A :class:`~moestream.checkpoint.Checkpoint` of folder ``path``, an mlx-lm build's names and layouts
    mapped onto Hugging Face ones (:func:`moestream.mlx_format.adapt`); of a GGUF file, llama.cpp's names mapped
    (:func:`moestream.gguf_format.open_gguf`). Raises what those raise."""
    if is_gguf(path):
        return open_gguf(path)
    ckpt = Checkpoint(path)
    try:
        adapt(ckpt)
    except BaseException:
        ckpt.close()
        raise
    return ckpt


def open_gguf(path, inspect_only: bool = False) -> GGUFCheckpoint:
    """:func:`moestream.gguf_format.open_gguf` over the families' architectures; raises what it raises."""
    return gguf_format.open_gguf(path, gguf_architectures(), inspect_only)


def hf_config(meta: dict, tensors: dict[str, TensorInfo], where) -> dict:
    """:func:`moestream.gguf_format.hf_config` over the families' architectures."""
    return gguf_format.hf_config(meta, tensors, where, gguf_architectures())


def hf_name(name: str, arch: str = "qwen3moe") -> str | None:
    """:func:`moestream.gguf_format.hf_name` of architecture ``arch`` (None for one no family declares)."""
    return gguf_format.hf_name(name, gguf_architectures().get(arch))


class _ByArchitecture(Mapping):
    """architecture -> ``of(spec)`` over the families' GGUF architectures, computed when read (so that importing
    this module imports neither the families' modules nor the gguf package)."""

    def __init__(self, of):
        self._of = of

    def __getitem__(self, arch: str):
        return self._of(gguf_architectures()[arch])

    def __iter__(self):
        return iter(gguf_architectures())

    def __len__(self) -> int:
        return len(gguf_architectures())


# architecture -> {llama.cpp name: Hugging Face name}, derived from the gguf package's map (gguf_format.derive_names)
NAMES: Mapping[str, dict[str, str]] = _ByArchitecture(gguf_format.derive_names)
# architecture -> the Hugging Face module names its family uses (GGUFArchitecture.modules)
HF_MODULES: Mapping[str, tuple[str, ...]] = _ByArchitecture(lambda spec: spec.modules)

__all__ = ["HF_MODULES", "NAMES", "hf_config", "hf_name", "open_checkpoint", "open_gguf"]
