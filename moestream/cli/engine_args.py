"""The engine flags every command that loads a model shares (generate, serve, hotlist): the model, the
cache and I/O, the expert usage and cache policy, and expert parallelism; parsed once into an
:class:`~moestream.options.EngineOptions`. ``inspect`` takes those that change the load plan
(:func:`add_plan_args`), so that it prints the plan ``generate`` with the same flags loads by."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..options import ACTIVATIONS, DEFAULT_DIST_TIMEOUT_S, DTYPES, EP_COMBINES, EP_PLACEMENTS
from ..policies import POLICIES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model, cache and I/O options, shared by every command that loads a model (generate, serve)."""
    p.add_argument("--model", required=True,
                   help="checkpoint folder, Hugging Face Hub id, or GGUF file (the first file of a split set)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder to use instead of the model's own (a GGUF file's default: the tokenizer "
                   "transformers builds from its metadata, else the tokenizer files beside it)")
    add_plan_args(p)
    p.add_argument("--fast", action="store_true",
                   help="turboquant builds: skip the QJL residual correction (faster; changes the output)")
    add_cache_policy_args(p)
    add_parallel_args(p)  # --dist-timeout, --ep-placement, --ep-combine (under torchrun)


def add_plan_args(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    """The engine flags that change the load plan (:func:`moestream.load_plan.plan_load`): the budget, the reads,
    the device and its tiers, the dtype (``dtype``: this ``--dtype``; ``inspect`` has its own) and the activations."""
    p.add_argument(
        "--cache-budget-gb", default="3",
        help="expert cache budget in GB (10^9 bytes), or 'all' to keep every expert resident, or 'auto' to size it "
        "from the memory available (cgroup limits included) less resident weights, KV cache and a reserve (default 3); "
        "under torchrun, per rank (auto: this rank's share)",
    )
    p.add_argument("--prefetch-workers", type=int, default=8, help="parallel expert reads (default 8)")
    p.add_argument("--prefix-cache-gb", type=float, default=0.0,
                   help="keep the KV blocks of computed prompts (LRU, in GB) and reuse a request's longest cached "
                   "prefix instead of prefilling it again (same bits; CPU, attention-only families; default 0: off)")
    # -- I/O (the "Cache and I/O" issue's read half) --
    pc = p.add_mutually_exclusive_group()
    pc.add_argument(
        "--use-page-cache", dest="use_page_cache", action="store_const", const=True, default=None,
        help="read experts through the OS page cache (default: only when the checkpoint is under 0.6 of the "
        "memory available)",
    )
    pc.add_argument(
        "--no-page-cache", dest="use_page_cache", action="store_const", const=False,
        help="bypass the page cache: O_DIRECT reads into huge-page buffers (posix_fadvise DONTNEED where refused)",
    )
    p.add_argument(
        "--prefetch-ahead", type=int, default=0,
        help="while layer L computes, read the experts layers L+1..L+N will likely need (default 0: off)",
    )
    # -- the GPU tier (moestream/tiered_cache.py) --
    p.add_argument("--device", default="auto",
                   help="compute device: auto (default: cuda when available, else cpu), cpu, cuda or cuda:N; on cuda "
                   "--cache-budget-gb is the VRAM expert cache")
    p.add_argument("--host-cache-gb", default=None,
                   help="with --device cuda: a second LRU tier of experts in pinned host RAM, in GB or 'auto' "
                   "(0.8 of the memory available less a reserve; default: none)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="with --device cuda: run decode steps eagerly instead of replaying them as CUDA graphs "
                   "(the same kernels and bits; slower)")
    p.add_argument("--wire-memory", action="store_true",
                   help="lock the resident weights and the expert cache in RAM (mlock; needs RLIMIT_MEMLOCK)")
    if dtype:
        p.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="compute dtype: auto (default: the checkpoint's embedding dtype; bf16 for a GGUF file "
                       "unless every tensor is F32), bf16, fp16 or fp32 (float32, llama.cpp's activations: more memory "
                       "for the KV cache); another dtype than auto's changes the output")
    p.add_argument("--activations", default="float", choices=ACTIVATIONS,
                   help="quantized linears' inputs: float (default: float32) or q8 (inputs rounded to 8 bits per "
                   "block, integer dot products, CPU only: for GGUF files llama.cpp's numerics on Q4_K, Q5_K, Q6_K, "
                   "Q8_0, Q4_0, Q5_0, IQ4_NL weights; for MLX affine 4- and 8-bit weights blocks of 32; other "
                   "types stay float); q8 changes the output (GGUF: towards llama.cpp's)")


def add_cache_policy_args(p: argparse.ArgumentParser) -> None:
    """The expert-usage and cache-policy options of ``engine.load``."""
    p.add_argument("--max-active-experts", type=int, default=0, metavar="K",
                   help="keep each token's K highest-weight routed experts, renormalized as the model does "
                        "(0 = the model's own routing, default). Changes the output.")
    p.add_argument("--no-hotlist", action="store_true", help="ignore hot_experts.json in the model folder")
    p.add_argument("--hot-fraction", type=float, default=None, metavar="F",
                   help="share of the budget the hot list and the usage profile may pin (default 0: off; recency "
                        "beats pinning by frequency on trained models' routing)")
    p.add_argument("--pin-file", type=Path, default=None,
                   help='preload and pin the experts of this {"pin": [[layer, expert], ...]} file')
    p.add_argument("--usage-file", type=Path, default=None,
                   help="usage profile to read and update (default: one per model in ~/.cache/moestream/usage)")
    p.add_argument("--no-learn-experts", action="store_true",
                   help="neither count expert usage into a profile nor pin hot experts from it")
    p.add_argument("--trace", type=Path, default=None, help="write the routing trace (JSON lines) to this file")
    p.add_argument("--cache-policy", default="lru", choices=POLICIES, help="eviction policy (default lru)")


def add_parallel_args(p) -> None:
    """The expert-parallel options (used only under torchrun, WORLD_SIZE > 1)."""
    p.add_argument("--dist-timeout", type=float, default=DEFAULT_DIST_TIMEOUT_S,
                   help="under torchrun: seconds a rank waits for the others before failing (default 60)")
    p.add_argument("--ep-placement", default="auto", choices=EP_PLACEMENTS,
                   help="under torchrun: which rank owns which expert: balanced (from the usage profile), contiguous, "
                   "or auto (balanced when a profile exists; default)")
    p.add_argument("--ep-combine", default="allgather", choices=EP_COMBINES,
                   help="under torchrun: the collective that gathers expert outputs (default allgather)")



def engine_options(args: argparse.Namespace, context: int | None = None, context_flag: str = "--max-context"):
    """The :class:`~moestream.options.EngineOptions` of the flags of :func:`add_engine_args`, checked
    before any loading; ``context``: tokens of context to leave room for (KV cache) when sizing
    ``--cache-budget-gb auto``, given by ``context_flag`` (messages name it). ``--host-cache-gb`` needs
    ``--device cuda`` here (the Python API runs the tier logic on the CPU too, for tests). Raises MoestreamError
    naming the flag."""
    from ..errors import ConfigError
    from ..options import EngineOptions
    from ..tiered_cache import resolve_device

    options = EngineOptions.from_args(args, context_tokens=context,  # the values first: "-1" is wrong anywhere
                                      context_flag=context_flag)
    if options.host_cache is not None and resolve_device(options.device).type != "cuda":
        raise ConfigError("--host-cache-gb needs --device cuda (on the CPU the expert cache is in host RAM already)")
    return options


def load_engine(args: argparse.Namespace, options, tokenizer: bool = True):
    """``engine.load`` of ``args.model`` with ``options`` (:func:`engine_options`), under torchrun with
    this rank's :class:`~moestream.parallel.ExpertParallel` (``args._parallel``)."""
    from ..engine import load

    if tokenizer and getattr(args, "tokenizer", None):
        tokenizer = args.tokenizer
    return load(args.model, options=options, tokenizer=tokenizer, parallel=getattr(args, "_parallel", None))
