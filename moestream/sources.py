"""A checkpoint of any source, opened: a Hugging Face folder, an mlx-lm build (its names and layouts mapped by
:mod:`moestream.mlx_format`) or a llama.cpp GGUF file (:mod:`moestream.gguf_format`).

Every command that reads a checkpoint (the engine, ``inspect``, ``convert``) opens it here, so none of the
formats imports another to find out what it was given.
"""

from __future__ import annotations

from .checkpoint import Checkpoint
from .gguf_format import is_gguf, open_gguf
from .mlx_format import adapt


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


__all__ = ["open_checkpoint"]
