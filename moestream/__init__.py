"""moestream: run Mixture-of-Experts language models bigger than memory by streaming
their routed experts from disk through a byte-budgeted cache, bit-identical to the
whole model in memory.

Layers, in the order data flows: :mod:`moestream.checkpoint` (safetensors index,
config) -> :mod:`moestream.layout` (where each expert lies) -> :mod:`moestream.store`
(reads bytes) -> :mod:`moestream.cache` (budget, LRU, stats) -> :mod:`moestream.models`
(one module per family) -> :mod:`moestream.generation` -> :mod:`moestream.cli`.

``moestream.load`` and ``moestream.Engine`` are imported on first use, so that the
command line starts without importing PyTorch until it needs it.
"""

from .errors import MoestreamError

__version__ = "0.1.0"
__all__ = ["Engine", "MoestreamError", "load", "__version__"]


def __getattr__(name: str):
    if name in ("Engine", "load"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'moestream' has no attribute {name!r}")
