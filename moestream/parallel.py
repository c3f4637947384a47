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
import math
import os
import time
from dataclasses import asdict, dataclass

import torch

from .errors import MoestreamError
from .generation import generate
from .models.moe import StreamedMoE
from .options import EP_COMBINES as COMBINES
from .options import EP_PLACEMENTS as PLACEMENTS
from .sampling import SamplingParams
from .tiered_cache import resolve_device
from .usage import default_profile_path, model_identity, read_profile

HEADER = 32  # bytes: int64 layer, slots (T*K), routing fingerprint, this rank's slot count
SMALL_EXCHANGE = 256 * 1024  # bytes gathered at most in one step (decode); larger ones send headers first


class ParallelError(MoestreamError):
    """A collective failed: a rank died, stopped answering, or the ranks diverged."""


class _Shutdown(Exception):
    """Rank 0 ended ``serve``: a follower leaves :meth:`ExpertParallel.follow`."""


def world_size_from_env() -> int:
    """``WORLD_SIZE`` as torchrun sets it (1 when not launched by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise MoestreamError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


# -- placement ---------------------------------------------------------------------------------
def contiguous_owners(num_experts: int, world: int) -> list[int]:
    """Owner rank of each of ``num_experts`` experts: expert e -> rank ``e * world // num_experts``
    (contiguous blocks whose sizes differ by at most one)."""
    return [e * world // num_experts for e in range(num_experts)]


def balanced_owners(load: list[float], world: int) -> list[int]:
    """Owner rank of each expert so that per-rank load is balanced (greedy longest processing time).

    Experts are taken heaviest first (ties: lower id first) and given to the least-loaded
    rank (ties: the lower rank) that holds fewer than ``ceil(E / world)`` experts, so every
    rank holds about as many experts (memory stays even). ``load[e]`` is expert e's share
    of the traffic (any non-negative unit, e.g. the usage profile's decayed routing counts).
    """
    n = len(load)
    cap = math.ceil(n / world)
    owners = [0] * n
    rank_load = [0.0] * world
    held = [0] * world
    for e in sorted(range(n), key=lambda i: (-load[i], i)):
        r = min((r for r in range(world) if held[r] < cap), key=lambda r: (rank_load[r], r))
        owners[e] = r
        rank_load[r] += load[e]
        held[r] += 1
    return owners


def placement(num_experts: dict[int, int], world: int, profile: dict[int, list[float]] | None = None,
              mode: str = "auto") -> tuple[dict[int, list[int]], str]:
    """Per MoE layer, the owner rank of each expert.

    Args:
        num_experts: layer -> experts in that layer.
        world: number of ranks.
        profile: layer -> per-expert load (:func:`moestream.usage.read_profile`), or None.
        mode: ``balanced`` (from ``profile``; contiguous where it has no traffic for a
            layer), ``contiguous``, or ``auto`` (balanced when a profile exists).

    Returns:
        ``(layer -> owners [E] list of ranks, a note saying what was used)``.

    Raises:
        MoestreamError: an unknown mode, or ``world`` < 1.
    """
    if mode not in PLACEMENTS:
        raise MoestreamError(f"--ep-placement {mode!r}: expected one of {', '.join(PLACEMENTS)}")
    if world < 1:
        raise MoestreamError(f"world size must be at least 1, got {world}")
    use = mode == "balanced" or (mode == "auto" and profile is not None)
    if use and profile is None:
        note = "placement: contiguous (balanced asked, but there is no usage profile yet)"
        use = False
    else:
        note = "placement: balanced from the usage profile" if use else "placement: contiguous"
    owners = {}
    for layer, n in sorted(num_experts.items()):
        load = profile.get(layer) if use and profile else None
        if load is not None and len(load) == n and sum(load) > 0:
            owners[layer] = balanced_owners([float(v) for v in load], world)
        else:
            owners[layer] = contiguous_owners(n, world)
    return owners, note


def rank_loads(owners: list[int], load: list[float], world: int) -> list[float]:
    """Sum of ``load`` per rank under ``owners``."""
    out = [0.0] * world
    for e, r in enumerate(owners):
        out[r] += load[e]
    return out


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
class ExpertParallel:
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

    # -- ownership ---------------------------------------------------------------------------
    def owns(self, key: tuple[int, int]) -> bool:
        """Whether this rank owns expert ``key`` = (layer, expert)."""
        return key in self._owned

    def place(self, checkpoint, model, num_experts: dict[int, int], usage_file=None,
              learn_experts: bool = True) -> None:
        """Compute the owner maps on rank 0 (from its usage profile, :func:`placement`) and
        broadcast them, so every rank uses rank 0's. Called by ``engine.load`` before any
        expert is read."""
        layers = sorted(num_experts)
        flat = torch.zeros(sum(num_experts.values()), dtype=torch.int64)
        mode = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            profile = None
            if learn_experts and self.placement_mode != "contiguous":
                profile = _read_profile(checkpoint, model, num_experts, usage_file)
            owners, note = placement(num_experts, self.world, profile, self.placement_mode)
            flat = torch.tensor([r for layer in layers for r in owners[layer]], dtype=torch.int64)
            mode[0] = 1 if note.startswith("placement: balanced") else 0
            self.placement_note = note
        flat, mode = flat.to(self.device), mode.to(self.device)
        self._collective(lambda: (self._dist().broadcast(flat, 0), self._dist().broadcast(mode, 0)), "placement")
        if self.rank != 0:
            self.placement_note = "placement: balanced from rank 0's usage profile" if int(mode) else \
                "placement: contiguous"
        at = 0
        for layer in layers:
            n = num_experts[layer]
            self.owners[layer] = flat[at : at + n].clone()
            at += n
        self._owned = {(layer, e) for layer in layers for e, r in enumerate(self.owners[layer].tolist())
                       if r == self.rank}
        self._owned_ids = {}
        if not self._owned:
            import sys

            print(f"note: rank {self.rank} owns no experts ({self.world} ranks for "
                  f"{min(num_experts[layer] for layer in layers)} experts per layer); it still runs the dense part",
                  file=sys.stderr)

    def owned_ids(self, layer: int) -> set[int]:
        """The expert ids of ``layer`` this rank computes (the pipeline fetches only these)."""
        owned = self._owned_ids.get(layer)
        if owned is None:
            owned = self._owned_ids[layer] = set(torch.nonzero(self.owners[layer] == self.rank).view(-1).tolist())
        return owned

    # -- the combine ---------------------------------------------------------------------------
    def gather_slots(self, slots: torch.Tensor, idx: torch.Tensor, layer: int) -> torch.Tensor:
        """Every rank's slots in one [T*K, H] buffer: this rank's own slots from ``slots``, the
        others' from their ranks, as raw bytes (no arithmetic touches a value).

        Args:
            slots: [T*K, H]: the weighted outputs of this rank's experts' slots (the others' are
                ignored), as :meth:`moestream.pipeline.ExpertPipeline.compute_slots` made them.
            idx: [T, K] int64 expert ids (the same on every rank); layer: the MoE layer.

        Returns:
            [T*K, H] in slots' dtype, every slot filled, for the routing-order sum.

        Raises:
            ParallelError: a rank died or diverged.
        """
        t, k = idx.shape
        h = slots.shape[1]
        flat = idx.reshape(-1)
        slot_rank = self.owners[layer][flat]  # [T*K]: who computes each slot
        n_slots = t * k
        fp = ((flat + 1) * (torch.arange(n_slots, device=flat.device) * 7919 + 1)).sum()
        meta = torch.cat([torch.bincount(slot_rank, minlength=self.world), fp.view(1)]).tolist()
        counts, fingerprint = meta[: self.world], meta[self.world]
        mine = torch.nonzero(slot_rank == self.rank).squeeze(1)  # ascending slot positions owned here
        rows = slots[mine]
        self.stats.slots_computed += mine.numel()
        row_bytes = h * slots.element_size()
        header = torch.tensor([layer, n_slots, fingerprint, counts[self.rank]], dtype=torch.int64)
        gathered = self._exchange(header, rows, counts, row_bytes, layer)
        by_rank = torch.argsort(slot_rank, stable=True)  # positions grouped by rank, ascending within
        out = slots.new_empty(n_slots, h)
        out[by_rank] = torch.cat([g.view(slots.dtype).view(-1, h) for g in gathered])
        return out

    def _exchange(self, header: torch.Tensor, rows: torch.Tensor, counts: list[int], row_bytes: int,
                  layer: int) -> list[torch.Tensor]:
        """Every rank's slot rows as uint8 [counts[r] * row_bytes] tensors, rank order; headers checked.

        Every buffer size depends only on what every rank knows alike (T, K, H and headers
        already exchanged), never on this rank's own routing: a collective whose sizes differ
        between ranks aborts gloo's process (and is undefined on NCCL), so ranks that diverged
        must first agree on sizes to be told apart. Small exchanges (decode) are one
        ``all_gather_single`` padded to every slot, T x K rows; larger ones (prefill) first
        gather the 32-byte headers, check them, then the rows (padded to the largest rank's,
        or ``all_to_all_single`` with exact split sizes).
        """
        dev = rows.device
        w = self.world
        n_slots = int(header[1])
        t0 = time.perf_counter()
        try:
            full = _round8(HEADER + n_slots * row_bytes)
            if self.combine == "allgather" and w * full <= SMALL_EXCHANGE:
                send = torch.zeros(full, dtype=torch.uint8, device=dev)
                _fill(send, header, rows)
                recv = torch.empty(w * full, dtype=torch.uint8, device=dev)
                self._collective(lambda: _all_gather_single(recv, send), f"layer {layer}'s combine")
                self._account(full, [full] * w)
                parts = [recv[r * full : (r + 1) * full] for r in range(w)]
                heads = torch.stack([p[:HEADER] for p in parts]).view(torch.int64).tolist()  # syncs on a GPU
                self._check(heads, header, counts, layer)
                return [p[HEADER : HEADER + counts[r] * row_bytes] for r, p in enumerate(parts)]
            hsend = header.view(torch.uint8).to(dev)
            hrecv = torch.empty(w * HEADER, dtype=torch.uint8, device=dev)
            self._collective(lambda: _all_gather_single(hrecv, hsend), f"layer {layer}'s combine (headers)")
            self._account(HEADER, [HEADER] * w)
            self._check(hrecv.view(torch.int64).view(w, 4).tolist(), header, counts, layer)
            size = [_round8(c * row_bytes) for c in counts]  # the same on every rank now
            raw = rows.contiguous().view(torch.uint8).reshape(-1)
            if self.combine == "allgather":
                pad = max(size)
                send = torch.zeros(pad, dtype=torch.uint8, device=dev)
                send[: raw.numel()].copy_(raw)
                recv = torch.empty(w * pad, dtype=torch.uint8, device=dev)
                self._collective(lambda: _all_gather_single(recv, send), f"layer {layer}'s combine")
                self._account(pad, [pad] * w)
                return [recv[r * pad : r * pad + counts[r] * row_bytes] for r in range(w)]
            mine = size[self.rank]
            send = torch.zeros(mine, dtype=torch.uint8, device=dev)
            send[: raw.numel()].copy_(raw)
            send = send.repeat(w)
            recv = torch.empty(sum(size), dtype=torch.uint8, device=dev)
            self._collective(lambda: self._dist().all_to_all_single(recv, send, size, [mine] * w),
                             f"layer {layer}'s combine")
            self._account(mine, size)
            offs = [sum(size[:r]) for r in range(w)]
            out = [recv[offs[r] : offs[r] + counts[r] * row_bytes] for r in range(w)]
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)  # the time in collectives includes the transfer
            return out
        finally:
            self.stats.seconds += time.perf_counter() - t0
            self.stats.combines += 1

    def _account(self, sent_each: int, received: list[int]) -> None:
        """Count one exchange's bytes: ``sent_each`` to every other rank, ``received[r]`` from rank r."""
        self.stats.bytes_sent += (self.world - 1) * sent_each
        self.stats.bytes_received += sum(received) - received[self.rank]

    def _check(self, heads: list[list[int]], header: torch.Tensor, counts: list[int], layer: int) -> None:
        """Every rank's header against this rank's routing; :class:`ParallelError` on a mismatch."""
        want = header.tolist()
        for r, hd in enumerate(heads):
            if hd[:3] != want[:3] or hd[3] != counts[r]:
                self.failed = True
                raise ParallelError(
                    f"expert parallel: rank {r} diverged from rank {self.rank} at layer {layer} (its routing "
                    f"fingerprint {hd[:3]} and {hd[3]} slots, here {want[:3]} and {counts[r]}): the ranks are "
                    "not running the same tokens (another prompt, seed or option on one of them, or machines "
                    "whose arithmetic differs)"
                )

    # -- requests, flags, stats ---------------------------------------------------------------------
    def agree(self, request: dict) -> dict:
        """Rank 0's ``request`` (a JSON-able dict) on every rank, sent as UTF-8 JSON bytes in a
        uint8 tensor (never pickled). While :attr:`serving`, the other ranks first wait, as long
        as it takes, for rank 0 to post that a request is coming (on the rendezvous store), so an
        idle server never runs into the collectives' timeout."""
        seq = self._seq
        self._seq += 1
        if self.serving:
            self._ready(seq)
        data = json.dumps(request, sort_keys=True).encode() if self.rank == 0 else b""
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self._collective(lambda: self._dist().broadcast(n, 0), "the request's size")
        buf = torch.zeros(int(n), dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._collective(lambda: self._dist().broadcast(buf, 0), "the request")
        return json.loads(bytes(buf.cpu().tolist()).decode()) if self.rank != 0 else request

    def _ready(self, seq: int) -> None:
        """Rank 0 posts request ``seq`` on the store; the others wait for it without a deadline."""
        from torch.distributed import distributed_c10d as c10d

        store = c10d._get_default_store()
        key = f"moestream/request/{seq}"
        if self.rank == 0:
            store.set(key, "1")
            if seq:  # every rank has passed the previous request's broadcast by now
                try:
                    store.delete_key(f"moestream/request/{seq - 1}")
                except Exception:  # a store without delete: a few bytes stay
                    pass
            return
        while True:  # polled, not store.wait: a wait that times out logs a warning each time
            try:
                if store.check([key]):
                    return
            except Exception as e:
                self.failed = True
                raise ParallelError(f"expert parallel: rank {self.rank} lost the rendezvous store while "
                                    f"waiting for rank 0's next request: {str(e).splitlines()[0][:300]}") from None
            time.sleep(0.02)

    def follow(self, engine) -> int:
        """A follower rank of ``serve``: run each generation rank 0 starts (:func:`moestream.generation.generate`
        adopts rank 0's request), waiting as long as needed between them, until rank 0 calls
        :meth:`shutdown`. An error that rank 0 meets too (a bad request) is skipped; a failed
        collective ends the loop (:class:`ParallelError`). Returns the generations followed."""
        self.serving = True
        n = 0
        while True:
            try:
                for _ in generate(engine, [0], 1, SamplingParams()):
                    pass
                n += 1
            except _Shutdown:
                return n
            except ParallelError:
                raise
            except MoestreamError:  # the same request fails on rank 0, which answers it
                n += 1

    def shutdown(self) -> None:
        """Rank 0 of ``serve``: tell the followers (in :meth:`follow`) to stop."""
        if self.rank == 0 and not self.failed:
            try:
                self.agree({"shutdown": True})
            except ParallelError:  # the followers are gone already (an interrupt reaches every rank)
                pass

    def agree_generation(self, prompt_ids, max_tokens: int, sampling, stop, stop_at_eos: bool, multi_think: bool,
                         prefill_chunk: int) -> tuple:
        """Rank 0's generation request on every rank: ``(prompt_ids, max_tokens, sampling, stop,
        stop_at_eos, multi_think, prefill_chunk)``. With sampling on and no seed, rank 0 draws
        one, so every rank samples the same tokens."""
        from dataclasses import replace

        if self.rank == 0 and sampling.seed is None and sampling.temperature > 0:
            import secrets

            sampling = replace(sampling, seed=secrets.randbelow(2**63))
        req = self.agree({
            "shutdown": False, "prompt_ids": [int(t) for t in prompt_ids], "max_tokens": int(max_tokens),
            "sampling": asdict(sampling),
            "stop": list(stop), "stop_at_eos": bool(stop_at_eos), "multi_think": bool(multi_think),
            "prefill_chunk": int(prefill_chunk),
        })
        if req["shutdown"]:
            raise _Shutdown()
        return (req["prompt_ids"], req["max_tokens"], SamplingParams(**req["sampling"]), req["stop"],
                req["stop_at_eos"], req["multi_think"], req["prefill_chunk"])

    def flag(self, value: bool) -> bool:
        """Rank 0's ``value`` on every rank (the per-step "continue" flag of a generation)."""
        t = torch.tensor([1 if value else 0], dtype=torch.int64, device=self.device)
        self._collective(lambda: self._dist().broadcast(t, 0), "the continue flag")
        return bool(int(t))

    def gather_stats(self, local: dict) -> list[dict]:
        """Every rank's :data:`RANK_FIELDS` (floats), gathered on every rank, rank order."""
        t = torch.tensor([float(local.get(k, 0)) for k in RANK_FIELDS], dtype=torch.float64, device=self.device)
        out = torch.empty(self.world * len(RANK_FIELDS), dtype=torch.float64, device=self.device)
        self._collective(lambda: _all_gather_single(out, t), "the stats")
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

    def close(self) -> None:
        """Leave the process group (when this module started it)."""
        import torch.distributed as dist

        if getattr(self, "_owns_group", False) and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a dead peer: nothing left to tear down cleanly
                pass

    # -- failures ----------------------------------------------------------------------------
    @staticmethod
    def _dist():
        import torch.distributed as dist

        return dist

    def _collective(self, fn, what: str):
        """Run one collective; turn a dead or silent peer into a :class:`ParallelError`."""
        try:
            return fn()
        except ParallelError:
            raise
        except Exception as e:  # gloo: RuntimeError on a reset connection or at the timeout; NCCL: DistBackendError
            self.failed = True
            who = self._missing_ranks()
            name = (f"rank {', '.join(map(str, who))}" if who else
                    f"rank {1 - self.rank}" if self.world == 2 else "another rank")
            msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            raise ParallelError(
                f"expert parallel: {name} stopped answering during {what} (rank {self.rank} of {self.world} "
                f"waited at most {self.timeout_s:g} s): {msg}"
            ) from None

    def _missing_ranks(self) -> list[int]:
        """Ranks that do not check in on the rendezvous store within 2 s (best effort: [] when
        the store itself is gone)."""
        try:
            from torch.distributed import distributed_c10d as c10d

            store = c10d._get_default_store()
            store.set_timeout(datetime.timedelta(seconds=2))
            store.set(f"moestream/alive/{self.rank}", "1")
            time.sleep(1.0)
            return [r for r in range(self.world) if r != self.rank and not store.check([f"moestream/alive/{r}"])]
        except Exception:
            return []


def _all_gather_single(out: torch.Tensor, t: torch.Tensor) -> None:
    """``all_gather_single`` (torch >= 2.13), else its older name ``all_gather_into_tensor``."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t)


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def _fill(buf: torch.Tensor, header: torch.Tensor, rows: torch.Tensor) -> None:
    """``buf`` (uint8) <- the 32-byte header, then ``rows``' bytes."""
    buf[:HEADER].copy_(header.view(torch.uint8))
    if rows.numel():
        raw = rows.contiguous().view(torch.uint8).reshape(-1)
        buf[HEADER : HEADER + raw.numel()].copy_(raw)


def _read_profile(checkpoint, model, num_experts: dict[int, int], usage_file) -> dict[int, list[float]] | None:
    """This machine's usage profile for the model (:mod:`moestream.usage`), or None (none, or a bad one)."""
    from pathlib import Path

    router = next((n + ".gate.weight" for n, m in model.named_modules() if isinstance(m, StreamedMoE)), None)
    model_id = model_identity(checkpoint, router)
    path = Path(usage_file) if usage_file is not None else default_profile_path(checkpoint.path, model_id)
    if not path.exists():
        return None
    counts, _ = read_profile(path, model_id, num_experts)
    return counts


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
