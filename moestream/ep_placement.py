"""Expert parallelism's placement: which rank owns each expert (:func:`placement`: ``contiguous`` blocks, or
``balanced`` from the learned usage profile, :mod:`moestream.usage`: greedy longest-processing-time, at most
``ceil(E / W)`` experts per rank). Rank 0 computes it and broadcasts it (profiles can differ between machines):
:meth:`Placement.place`. A part of :class:`moestream.parallel.ExpertParallel`.
"""

from __future__ import annotations

import math

import torch

from .errors import MoestreamError
from .models.moe import StreamedMoE
from .options import EP_PLACEMENTS as PLACEMENTS
from .usage import default_profile_path, model_identity, read_profile


class Placement:
    """The owner maps of :class:`~moestream.parallel.ExpertParallel`: :meth:`place`, :meth:`owns`,
    :meth:`owned_ids` (the experts the pipeline computes here)."""

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
