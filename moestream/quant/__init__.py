"""Quantized experts and resident weights: published formats read as they are, kernels.

Formats (:mod:`.formats`): MLX affine (:mod:`.affine`, 2-8 bits), FP8 e4m3 with block
scales (:mod:`.fp8`), MXFP4 (:mod:`.mxfp4`), compressed-tensors (:mod:`.compressed`) and
turboquant codebooks (:mod:`.turboquant`). Expert pieces stay packed on disk and in the
cache; :mod:`.kernels` multiplies on them; :mod:`.expert` picks the expert function by
the pieces' format; :mod:`.resident` keeps quantized attention, routers and embeddings
quantized; :mod:`.model` adapts a family's model to them (the engine's way in). ``moestream convert``, which
writes moestream's own quantized checkpoints, is :mod:`moestream.convert`, a level up (it opens any checkpoint).
"""

from . import compressed, turboquant  # noqa: F401,I001  (after formats: they register their config parsers there)
from .formats import ExpertFormat, LinearFormat, QuantConfig, QuantError, Scheme, expert_format

__all__ = ["ExpertFormat", "LinearFormat", "QuantConfig", "QuantError", "Scheme", "expert_format"]
