"""Engine options: every option of a loaded model, parsed and validated once, then only read.

The CLI (``EngineOptions.from_args``), the Python API (``moestream.load(model, **keywords)``,
``EngineOptions.make``) and the server build one frozen :class:`EngineOptions`; the engine,
the budget, the I/O set-up, the expert pipeline and the usage module read it. A bad value is a
:class:`~moestream.errors.ConfigError` (or ``BudgetError``) naming the option, raised before
anything is loaded. Messages name an option as its builder does (:meth:`EngineOptions.name`): the CLI's
flag (``--max-context``) for options the CLI built, ``moestream.load``'s keyword (``context_tokens=``) else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from .budget import AUTO, GB, gb_text, parse_budget, parse_host_budget
from .errors import ConfigError, flag, given, keyword
from .policies import POLICIES

DEFAULT_BUDGET_GB = 3
DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32")
EP_COMBINES = ("allgather", "alltoall")
# --activations: float32 inputs (moestream's own numerics) or 8-bit activation blocks (GGUF: llama.cpp's; MLX affine)
ACTIVATIONS = ("float", "q8")
EP_PLACEMENTS = ("auto", "balanced", "contiguous")
DEFAULT_DIST_TIMEOUT_S = 60.0
# Share of the budget hot lists and usage profiles may pin (--hot-fraction). 0, off, by default: on routing that
# reuses experts as trained models do, pinning by frequency loses to LRU's recency at every budget, by up to 45
# points at 10% residency (docs/benchmarks.md, "Routing like trained models"; kekzl/imp#2061 measured the same on a
# trained model).
HOT_FRACTION = 0.0


def _name(flags: dict[str, str] | None, option: str) -> str:
    """How messages name ``option`` for options built with ``flags`` (:meth:`EngineOptions.name`)."""
    return keyword(option) if flags is None else flags.get(option) or flag(option)


def _path(value, name: str) -> Path | None:
    if value is None:
        return None
    p = Path(value)
    if p.is_dir() or not p.parent.is_dir():
        raise ConfigError(f"{given(name, p)}: not a file in an existing folder")
    return p


@dataclass(frozen=True)
class EngineOptions:
    """The options of a loaded model (the CLI's engine flags; ``moestream.load``'s keywords).

    Attributes:
        cache_budget: expert cache budget in bytes, None for ``all`` (every expert resident,
            preloaded), or ``"auto"`` (sized from the memory available; :mod:`moestream.budget`).
            On CUDA it is the VRAM expert cache.
        workers: reader threads for expert reads (``--prefetch-workers``).
        device: ``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: compute dtype: ``auto`` (the checkpoint's embedding dtype; a GGUF file's own,
            :attr:`moestream.gguf_format.GGUFFormat.compute_dtype`: bf16 unless every tensor is
            F32), bf16, fp16 or fp32 (``--dtype``); another dtype than auto's changes the output.
        use_page_cache: read experts through the OS page cache (True), bypass it with
            ``O_DIRECT`` (False), or None: only when the checkpoint is under 0.6 of the memory
            available.
        prefetch_ahead: layers read ahead while a layer computes (0: off; :mod:`moestream.prefetch`).
        wire_memory: lock the resident weights and cached experts in RAM (mlock).
        context_tokens: tokens of context the KV cache must hold, for the ``auto`` budget
            (None: 4096, or the model's context if smaller).
        max_active_experts: keep at most this many routed experts per token, the highest
            weighted, renormalized as the family does (0: the model's own routing). Below the
            model's top-k this changes the output.
        hotlist: preload and pin the experts of ``hot_experts.json`` in the model folder.
        pin_file: a ``{"pin": [[layer, expert], ...]}`` file of experts to preload and pin.
        usage_file: the usage profile to read and update (None: one per model in the user
            cache folder).
        learn_experts: count expert usage into the profile and (with ``hot_fraction``) pin the
            hottest from it.
        hot_fraction: share of the budget, 0 to 1, the hot list and the usage profile may pin
            (``HOT_FRACTION``, 0: off, as measured on routing like trained models').
        trace: write the routing trace (JSON lines) to this file.
        cache_policy: eviction policy, ``lru``, ``lfu`` or ``layer``.
        fast: skip the QJL residual of turboquant linears (changes the output).
        activations: how the input of a quantized linear is multiplied: ``float`` (float32, the default) or
            ``q8``: rounded to 8 bits per block and multiplied by integer dot products, for GGUF files as
            llama.cpp's CPU backend does (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0, IQ4_NL weights), for MLX affine
            4- and 8-bit weights in blocks of 32 (other types keep float activations, named once at load).
            Changes the output (GGUF: towards llama.cpp's); streaming stays bit-identical to budget ``all``
            within either mode. GGUF and MLX affine checkpoints on the CPU only.
        host_cache: the pinned host-RAM tier behind a VRAM cache in bytes, ``"auto"``, or None
            (none); on the CPU the same tier logic runs with a CPU "device" tier (for tests).
        batched_experts: compute each layer's SwiGLU experts as one batched matmul chain
            (None: on CUDA only); its bits differ from the per-expert chain's, the same for
            every budget either way.
        fused_experts: compute each layer's SwiGLU experts with the fused Triton kernel in place
            from VRAM slots (:mod:`moestream.fused_moe`; None: on CUDA when Triton is present and
            there is no expert parallelism; on the CPU only under ``TRITON_INTERPRET=1``, for tests).
            Its bits differ from the other kernels', the same for every budget.
        cuda_graphs: replay decode steps as CUDA graphs where the model allows
            (:mod:`moestream.decode_graph`); False runs the same static steps eagerly (same bits).
        dist_timeout, ep_combine, ep_placement: expert parallelism under torchrun
            (:mod:`moestream.parallel`).
        max_batch: sequences that run at once in the scheduler (``--max-batch``,
            :mod:`moestream.scheduler`); the budget plan keeps a KV cache of the context for each.
        prefix_cache: bytes of KV blocks the prefix cache keeps (``--prefix-cache-gb``; 0: off;
            :mod:`moestream.prefix_cache`); counted in the budget plan.
        flags: who built the options, for how messages name them (:meth:`name`): None, the Python API
            (``moestream.load``'s keywords); a dict, the CLI (its flags, :func:`~moestream.errors.flag`, and the
            dict's own flag for an option a command sets from another: ``generate`` sizes the context from
            ``--max-tokens``). Not compared.

    None of these but ``max_active_experts``, ``fast``, ``dtype`` and ``activations`` changes the output.
    """

    cache_budget: int | None | str = int(DEFAULT_BUDGET_GB * GB)
    workers: int = 8
    device: str = "auto"
    dtype: str = "auto"
    use_page_cache: bool | None = None
    prefetch_ahead: int = 0
    wire_memory: bool = False
    context_tokens: int | None = None
    max_active_experts: int = 0
    hotlist: bool = True
    pin_file: Path | None = None
    usage_file: Path | None = None
    learn_experts: bool = True
    hot_fraction: float = HOT_FRACTION
    trace: Path | None = None
    cache_policy: str = "lru"
    fast: bool = False
    activations: str = "float"
    host_cache: int | None | str = None
    batched_experts: bool | None = None
    fused_experts: bool | None = None
    cuda_graphs: bool = True
    dist_timeout: float = DEFAULT_DIST_TIMEOUT_S
    ep_combine: str = "allgather"
    ep_placement: str = "auto"
    max_batch: int = 1
    prefix_cache: int = 0
    flags: dict[str, str] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        def whole(option, low):
            v = getattr(self, option)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{self.name(option)} must be an integer, got {v!r}")
            if v < low:
                raise ConfigError(f"{self.name(option)} must be at least {low}, got {v}")

        whole("workers", 1)
        whole("prefetch_ahead", 0)
        whole("max_active_experts", 0)
        whole("max_batch", 1)
        whole("prefix_cache", 0)
        if self.context_tokens is not None:
            whole("context_tokens", 1)
        for option, allowed in (("dtype", DTYPES), ("activations", ACTIVATIONS), ("cache_policy", POLICIES),
                                ("ep_combine", EP_COMBINES),
                                ("ep_placement", EP_PLACEMENTS)):
            if getattr(self, option) not in allowed:
                raise ConfigError(f"{given(self.name(option), repr(getattr(self, option)))}: expected one of "
                                  f"{', '.join(allowed)}")
        for option in ("cache_budget", "host_cache"):
            v = getattr(self, option)
            if not (v is None or v == AUTO or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)):
                raise ConfigError(f"{option}: {v!r} must be bytes >= 0, None or 'auto' (see EngineOptions.make)")
        hf = self.hot_fraction
        if isinstance(hf, bool) or not isinstance(hf, (int, float)) or not 0 <= hf <= 1:
            raise ConfigError(f"{given(self.name('hot_fraction'), repr(hf))}: give a share of the budget between 0 "
                              "and 1")
        if not (isinstance(self.dist_timeout, (int, float)) and 0 < self.dist_timeout < math.inf):
            raise ConfigError(f"{self.name('dist_timeout')} must be a positive number of seconds, got "
                              f"{self.dist_timeout}")
        object.__setattr__(self, "trace", _path(self.trace, self.name("trace")))
        object.__setattr__(self, "usage_file", _path(self.usage_file, self.name("usage_file")))
        if self.pin_file is not None:  # read at load, after the resident weights: a missing one is said now
            p = Path(self.pin_file)
            if not p.is_file():
                raise ConfigError(f"{given(self.name('pin_file'), p)}: " + ("not a file" if p.exists() else
                                                                            "no such file"))
            object.__setattr__(self, "pin_file", p)

    def name(self, option: str) -> str:
        """How messages name ``option`` (a field): its CLI flag (``--max-context``) when the CLI built these
        options, else the keyword of ``moestream.load`` (``context_tokens=``)."""
        return _name(self.flags, option)

    @classmethod
    def make(cls, cache_budget_gb: str | float | None = DEFAULT_BUDGET_GB, host_cache_gb: str | float | None = None,
             prefix_cache_gb: float = 0, **options) -> "EngineOptions":
        """Options from ``moestream.load``'s keywords: budgets in GB (10^9 bytes) or ``all`` / ``auto``
        (``prefix_cache_gb``: a number of GB, 0 off), the other fields by name (``flags``: the CLI's, see
        :meth:`from_args`).

        Raises:
            TypeError: for a keyword that is no option. ConfigError, BudgetError: for a bad value.
        """
        names = {f.name for f in fields(cls)} - {"cache_budget", "host_cache", "prefix_cache"}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; known: cache_budget_gb, "
                            f"host_cache_gb, prefix_cache_gb, {', '.join(sorted(names - {'flags'}))}")
        flags = options.get("flags")
        pc = prefix_cache_gb
        if isinstance(pc, bool) or not isinstance(pc, (int, float)) or not 0 <= pc < math.inf:
            raise ConfigError(f"{given(_name(flags, 'prefix_cache'), repr(pc))}: give a number of GB >= 0 (0: off)")
        return cls(cache_budget=parse_budget(cache_budget_gb, _name(flags, "cache_budget")),
                   host_cache=parse_host_budget(host_cache_gb, _name(flags, "host_cache")), prefix_cache=int(pc * GB),
                   **options)

    @classmethod
    def from_args(cls, args, context_tokens: int | None = None,
                  context_flag: str = "--max-context") -> "EngineOptions":
        """Options from the CLI's parsed engine flags (``moestream.cli.engine_args``); ``context_flag``: the flag
        that gave ``context_tokens`` (messages name it: ``generate`` sizes the context from ``--max-tokens``).

        Raises:
            ConfigError, BudgetError: naming the flag.
        """
        def get(name, default):
            return getattr(args, name, default)

        return cls.make(
            get("cache_budget_gb", DEFAULT_BUDGET_GB), get("host_cache_gb", None), get("prefix_cache_gb", 0),
            max_batch=get("max_batch", 1), workers=get("prefetch_workers", 8),
            device=get("device", "auto"),
            use_page_cache=get("use_page_cache", None), prefetch_ahead=get("prefetch_ahead", 0),
            wire_memory=get("wire_memory", False), context_tokens=context_tokens, fast=get("fast", False),
            max_active_experts=get("max_active_experts", 0), hotlist=not get("no_hotlist", False),
            pin_file=get("pin_file", None), usage_file=get("usage_file", None),
            learn_experts=not get("no_learn_experts", False), trace=get("trace", None),
            hot_fraction=HOT_FRACTION if get("hot_fraction", None) is None else get("hot_fraction", None),
            cache_policy=get("cache_policy", "lru"), dist_timeout=get("dist_timeout", DEFAULT_DIST_TIMEOUT_S),
            ep_combine=get("ep_combine", "allgather"), ep_placement=get("ep_placement", "auto"),
            cuda_graphs=not get("no_cuda_graphs", False), dtype=get("dtype", "auto"),
            activations=get("activations", "float"), flags={"context_tokens": context_flag},
        )

    def replace(self, **changes) -> "EngineOptions":
        """A copy with ``changes`` (validated again)."""
        from dataclasses import replace

        return replace(self, **changes)

    def describe_budget(self) -> str:
        """The budget as the user gave it: ``all``, ``auto`` or ``N GB`` (a plain number: ``100000 GB``)."""
        b = self.cache_budget
        return "all" if b is None else AUTO if b == AUTO else f"{gb_text(b)} GB"
