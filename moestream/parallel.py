"""Expert parallelism over ``torch.distributed``: each process owns a share of every MoE layer's experts.

Launched with ``torchrun`` (one process per GPU, or several CPU processes on one or more
machines). Every rank loads the resident weights and runs the dense part (embeddings,
attention, norms, shared experts, LM head) itself on the same tokens, so every rank
routes for itself and the layer input is already on every expert owner. A MoE layer then
costs one collective, the *combine*:

1. each rank's :class:`~moestream.pipeline.ExpertPipeline` computes, exactly as one process
   does (the same token subsets through the same kernel, so the same bits), the weighted
   outputs of the routing slots ``(t, k)`` whose expert it owns (:meth:`ExpertParallel.owned_ids`),
   reading only its own experts through its own cache (on a GPU the batched kernel runs at
   the whole layer's shapes, zero weights in the rows of others' experts);
2. the ranks exchange those slots (``all_gather_single`` into a padded buffer, or
   ``all_to_all_single`` with exact split sizes: :data:`COMBINES`), so every rank holds
   all ``T x K`` slots;
3. every rank's pipeline sums the slots over ``k = 0..K-1`` in routing order.

So with the same routing the logits are ``torch.equal`` to the single-process run on the
same device type, dtype and thread count (tested on the CPU; measured on 2 H200s).
Every rank knows from its routing how many slots each
rank owns; each rank's part of the exchange starts with a 32-byte header (layer, slots,
routing fingerprint, its slot count) that the others check against their own routing: ranks
that diverge (another prompt, another seed) fail with an error naming the rank and layer
instead of mixing numbers. The exchange is done on the raw bytes (``uint8``), so no
reduction ever touches the values.

Placement (:func:`placement`): ``contiguous`` blocks, or ``balanced`` from the learned usage
profile (:mod:`moestream.usage`): greedy longest-processing-time, at most ``ceil(E / W)``
experts per rank. Rank 0 computes it and broadcasts it (profiles can differ between machines).

A rank that dies makes the others fail within ``--dist-timeout`` seconds with a
:class:`~moestream.errors.MoestreamError` naming the rank when it can be found, never a hang.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import asdict, dataclass

import torch

from .ep_exchange import SlotExchange
from .ep_group import CollectiveGroup, ParallelError, all_gather_single  # noqa: F401  (ParallelError: the error callers catch)
from .ep_placement import Placement
from .ep_requests import Requests
from .errors import MoestreamError
from .options import EP_COMBINES as COMBINES
from .options import EP_PLACEMENTS as PLACEMENTS
from .tiered_cache import resolve_device


def world_size_from_env() -> int:
    """``WORLD_SIZE`` as torchrun sets it (1 when not launched by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise MoestreamError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


# -- stats -------------------------------------------------------------------------------------
@dataclass
class CollectiveStats:
    """This rank's collective counters. Bytes are payload bytes of the exchange (headers and
    padding included) that left this rank for others / came in from others."""

    combines: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0  # wall time in collectives (waiting for the slowest rank included)
    slots_computed: int = 0  # routing slots whose expert this rank owns, computed here


RANK_FIELDS = ("cache_lookups", "cache_hits", "experts_read", "gb_read", "combines", "bytes_sent",
               "bytes_received", "collective_seconds", "slots_computed", "tokens", "decode_tok_s",
               "distinct_experts")


def rank_summary(per_rank: list[dict]) -> dict:
    """Per-rank stats (dicts of :data:`RANK_FIELDS`) summed, with the derived rates:
    ``cache_hit_rate``, ``mb_read_per_token`` and ``kb_exchanged_per_token`` (received bytes,
    summed over ranks, per token forwarded)."""
    total = {k: sum(r.get(k, 0) for r in per_rank) for k in RANK_FIELDS}
    tokens = per_rank[0]["tokens"] if per_rank else 0
    total["tokens"] = tokens
    total["decode_tok_s"] = per_rank[0]["decode_tok_s"] if per_rank else 0.0
    total["cache_hit_rate"] = total["cache_hits"] / total["cache_lookups"] if total["cache_lookups"] else 0.0
    total["mb_read_per_token"] = total["gb_read"] * 1e3 / tokens if tokens else 0.0
    total["kb_exchanged_per_token"] = total["bytes_received"] / 1e3 / tokens if tokens else 0.0
    total["collective_seconds_max"] = max((r["collective_seconds"] for r in per_rank), default=0.0)
    return total


def format_rank_stats(per_rank: list[dict]) -> str:
    """The per-rank table and the summed line printed by ``generate`` under torchrun."""
    lines = ["rank  hit rate  experts read  GB read  KB exchanged/token  s in collectives  "
             "distinct experts, all layers"]
    rows = per_rank + [rank_summary(per_rank)]
    for i, r in enumerate(rows):
        name = str(i) if i < len(per_rank) else "sum"
        hit = r["cache_hits"] / r["cache_lookups"] if r["cache_lookups"] else 0.0
        kb = r["bytes_received"] / 1e3 / r["tokens"] if r["tokens"] else 0.0
        lines.append(f"{name:<5} {hit:8.1%}  {int(r['experts_read']):12d}  {r['gb_read']:7.3f}  {kb:18.1f}  "
                     f"{r['collective_seconds']:16.2f}  {int(r['distinct_experts']):28d}")
    return "\n".join(lines)


# -- the process group --------------------------------------------------------------------------
class ExpertParallel(Placement, SlotExchange, Requests, CollectiveGroup):
    """This process's part in expert parallelism: its rank, the owner maps, the combine.

    Made by :func:`init_from_env` (torchrun's environment) and passed to
    :func:`moestream.engine.load` (``parallel=``), which calls :meth:`place` and hands it to the
    expert pipeline as its exchange: the pipeline computes the slots of :meth:`owned_ids` and
    calls :meth:`gather_slots`.

    Attributes:
        rank, world: this rank and the number of ranks; local_world: ranks on this machine
            (the ``auto`` cache budget divides this machine's memory by it).
        device: this rank's compute device (``cuda:LOCAL_RANK`` with NCCL, else the CPU).
        timeout_s: seconds a collective may wait for the other ranks.
        combine: ``allgather`` (padded buffer, one ``all_gather_single``) or ``alltoall``
            (``all_to_all_single`` with exact split sizes).
        owners: layer -> int64 [E] owner ranks (on ``device``), after :meth:`place`.
        stats: :class:`CollectiveStats`.
    """

    def __init__(self, rank: int, world: int, local_world: int, device: torch.device, timeout_s: float,
                 combine: str = "allgather", placement_mode: str = "auto"):
        if combine not in COMBINES:
            raise MoestreamError(f"--ep-combine {combine!r}: expected one of {', '.join(COMBINES)}")
        if placement_mode not in PLACEMENTS:
            raise MoestreamError(f"--ep-placement {placement_mode!r}: expected one of {', '.join(PLACEMENTS)}")
        self.rank, self.world, self.local_world = rank, world, max(1, local_world)
        self.device, self.timeout_s = device, timeout_s
        self.combine, self.placement_mode = combine, placement_mode
        self.owners: dict[int, torch.Tensor] = {}
        self._owned: set[tuple[int, int]] = set()
        self._owned_ids: dict[int, set[int]] = {}  # layer -> owned expert ids (the batched path)
        self.placement_note = ""
        self.stats = CollectiveStats()
        self.failed = False
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.serving = False  # serve: followers wait for requests without a deadline (:meth:`follow`)
        self._seq = 0  # requests agreed so far

    # -- stats (the rest is in its parts: Placement, SlotExchange, Requests, CollectiveGroup) -------------
    def gather_stats(self, local: dict) -> list[dict]:
        """Every rank's :data:`RANK_FIELDS` (floats), gathered on every rank, rank order."""
        t = torch.tensor([float(local.get(k, 0)) for k in RANK_FIELDS], dtype=torch.float64, device=self.device)
        out = torch.empty(self.world * len(RANK_FIELDS), dtype=torch.float64, device=self.device)
        self._collective(lambda: all_gather_single(out, t), "the stats")
        rows = out.view(self.world, -1).cpu().tolist()
        return [dict(zip(RANK_FIELDS, r)) for r in rows]

    def merge_usage(self, usage: dict[int, torch.Tensor]) -> None:
        """Sum the per-rank routing counts (each rank counts only its own experts) in place,
        so rank 0 saves the whole model's usage profile."""
        for layer in sorted(usage):
            t = usage[layer].to(self.device)
            self._collective(lambda t=t: self._dist().all_reduce(t), "the usage counts")
            usage[layer].copy_(t.cpu())

    def local_stats(self, stats, cache) -> dict:
        """This rank's :data:`RANK_FIELDS` from a finished ``GenerationStats`` and the cache."""
        d = asdict(self.stats)
        return {
            "cache_lookups": stats.cache_lookups, "cache_hits": stats.cache_hits, "experts_read": stats.experts_read,
            "gb_read": stats.gb_read, "combines": d["combines"], "bytes_sent": d["bytes_sent"],
            "bytes_received": d["bytes_received"], "collective_seconds": d["seconds"],
            "slots_computed": d["slots_computed"], "tokens": stats.prompt_tokens + stats.generated_tokens,
            "decode_tok_s": stats.decode_tok_s, "distinct_experts": sum(stats.distinct_experts_per_layer.values()),
        }

    def report(self, stats, engine, err, quiet: bool = False) -> str:
        """Gather every rank's counters for the generation just done (every rank must call this);
        rank 0 prints the per-rank table and the sum to ``err`` (unless ``quiet``). Returns the
        stats JSON with an ``expert_parallel`` object (world, placement, per rank, sum)."""
        per_rank = self.gather_stats(self.local_stats(stats, engine.cache))
        if self.rank == 0 and not quiet:
            print(f"expert parallel: {self.world} ranks ({self.backend}), {self.placement_note}, "
                  f"combine {self.combine}; the figures above are rank 0's own, every rank's and their sum:",
                  file=err)
            print(format_rank_stats(per_rank), file=err)
        d = json.loads(stats.to_json())
        d["expert_parallel"] = {"world": self.world, "backend": self.backend,
                                "placement": self.placement_note.removeprefix("placement: "),
                                "combine": self.combine, "per_rank": per_rank, "sum": rank_summary(per_rank)}
        return json.dumps(d, indent=2)


def init_from_env(options) -> ExpertParallel | None:
    """Join the process group torchrun described (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``); None when ``WORLD_SIZE`` <= 1.

    ``options``: the :class:`~moestream.options.EngineOptions` (``device``, ``dist_timeout``, which
    bounds every collective, ``ep_combine``, ``ep_placement``). Backend gloo on the CPU, NCCL on
    CUDA (device ``cuda:LOCAL_RANK``; NVLink multicast off, ``NCCL_NVLS_ENABLE=0``).

    Raises:
        MoestreamError: a bad environment or device, or the group cannot be formed.
    """
    world = world_size_from_env()
    if world <= 1:
        return None
    device, timeout_s = options.device, options.dist_timeout
    combine, placement_mode = options.ep_combine, options.ep_placement
    try:
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except (KeyError, ValueError) as e:
        raise MoestreamError(
            f"WORLD_SIZE={world} but RANK/LOCAL_RANK are missing or bad ({e}); launch with torchrun"
        ) from None
    dev = resolve_device(device)
    if dev.type == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (the device notes)
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    elif dev.type == "cpu":
        backend = "gloo"
    else:
        raise MoestreamError(f"expert parallelism runs on cpu (gloo) or cuda (nccl), not {dev}")
    ep = ExpertParallel(rank, world, local_world, dev, timeout_s, combine, placement_mode)
    import torch.distributed as dist

    if not dist.is_initialized():
        try:
            dist.init_process_group(backend, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            raise MoestreamError(f"expert parallel: rank {rank} could not join the {backend} process group of "
                                 f"{world} within {timeout_s:g} s: {str(e).splitlines()[0][:300]}") from None
        ep._owns_group = True
    return ep
