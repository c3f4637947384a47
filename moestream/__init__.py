"""moestream: run Mixture-of-Experts language models bigger than memory by streaming
their routed experts from disk through a byte-budgeted cache, bit-identical to the
whole model in memory.

Layers, in the order data flows: :mod:`moestream.checkpoint` (safetensors index,
config) -> :mod:`moestream.layout` (where each expert lies) -> :mod:`moestream.store`
(reads bytes) -> :mod:`moestream.cache` (budget, LRU, stats) -> :mod:`moestream.models`
(one module per family) -> :mod:`moestream.generation` -> :mod:`moestream.cli`.

The Python API mirrors the CLI (see :mod:`moestream.api`)::

    engine = moestream.load("Qwen/Qwen3-30B-A3B", cache_budget_gb=3)
    text = moestream.generate(engine, "Why is the sky blue?", max_tokens=200)
    for r in moestream.stream_generate(engine, "Why is the sky blue?"):
        print(r.text, end="")

``moestream.load``, ``moestream.generate``, ``moestream.stream_generate``, ``moestream.batch_generate`` and the other
names in ``__all__`` are imported on first use, so that the command line starts without
importing PyTorch until it needs it. (``python -m moestream.stream_generate`` is the CLI
under its reference-system name; the attribute ``moestream.stream_generate`` is the function.)
"""

import os as _os

# How OpenMP workers wait between the compiled kernels' parallel regions (a token runs ~70 of them). Sleeping at
# once (PASSIVE) pays a futex wake-up per region: a 12-layer 4-bit step took 69 ms on 2 idle cores against 50.5 ms
# with a short spin, at no more CPU time; spinning without end (libgomp's default, 300,000 spins) held the core
# a busy machine's other jobs needed (a decode step 1.35 s against 0.31 s with PASSIVE at load 6-7). So a short
# spin, then sleep (docs/benchmarks.md, "OpenMP wait policy"); OMP_WAIT_POLICY=PASSIVE suits a machine shared
# with other busy jobs (the test suite sets it). Takes effect when moestream is imported before torch (the CLI,
# the server, the benchmark workers); a value the user set is kept.
SPIN_COUNT = "10000"
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)

from .errors import MoestreamError  # noqa: E402

__version__ = "0.1.0"
__all__ = ["BatchStep", "Engine", "GenerationResponse", "GenerationStats", "MoestreamError", "SamplingParams",
           "batch_generate", "generate", "load", "stream_generate", "__version__"]

_LAZY = {"Engine": "engine", "load": "engine", "generate": "api", "stream_generate": "api",
         "GenerationResponse": "api", "GenerationStats": "generation", "SamplingParams": "generation",
         "batch_generate": "api", "BatchStep": "api"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'moestream' has no attribute {name!r}")
