"""moestream: run Mixture-of-Experts language models bigger than memory by streaming
their routed experts from disk through a byte-budgeted cache, bit-identical to the
whole model in memory.

Layers, in the order data flows: :mod:`moestream.checkpoint` (safetensors index,
config) -> :mod:`moestream.layout` (where each expert lies) -> :mod:`moestream.store`
(reads bytes) -> :mod:`moestream.cache` (budget, LRU, stats) -> :mod:`moestream.models`
(one module per family) -> :mod:`moestream.generation` -> :mod:`moestream.cli`.
"""

__version__ = "0.1.0"

from .engine import Engine, load  # noqa: E402
from .errors import MoestreamError  # noqa: E402

__all__ = ["Engine", "MoestreamError", "load", "__version__"]
