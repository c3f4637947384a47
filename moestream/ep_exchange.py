"""Expert parallelism's combine: every rank's routing slots exchanged as raw bytes (``all_gather_single`` into a
padded buffer, or ``all_to_all_single`` with exact split sizes), each rank's part behind a 32-byte header (layer,
slots, routing fingerprint, its slot count) that the others check against their own routing, so ranks that
diverge fail naming the rank and layer. The pipeline calls :meth:`SlotExchange.gather_slots`. A part of
:class:`moestream.parallel.ExpertParallel`.
"""

from __future__ import annotations

import time

import torch

from .ep_group import ParallelError, all_gather_single

HEADER = 32  # bytes: int64 layer, slots (T*K), routing fingerprint, this rank's slot count


SMALL_EXCHANGE = 256 * 1024  # bytes gathered at most in one step (decode); larger ones send headers first


class SlotExchange:
    """The slot exchange of :class:`~moestream.parallel.ExpertParallel` (the pipeline's ``exchange``)."""

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
                self._collective(lambda: all_gather_single(recv, send), f"layer {layer}'s combine")
                self._account(full, [full] * w)
                parts = [recv[r * full : (r + 1) * full] for r in range(w)]
                heads = torch.stack([p[:HEADER] for p in parts]).view(torch.int64).tolist()  # syncs on a GPU
                self._check(heads, header, counts, layer)
                return [p[HEADER : HEADER + counts[r] * row_bytes] for r, p in enumerate(parts)]
            hsend = header.view(torch.uint8).to(dev)
            hrecv = torch.empty(w * HEADER, dtype=torch.uint8, device=dev)
            self._collective(lambda: all_gather_single(hrecv, hsend), f"layer {layer}'s combine (headers)")
            self._account(HEADER, [HEADER] * w)
            self._check(hrecv.view(torch.int64).view(w, 4).tolist(), header, counts, layer)
            size = [_round8(c * row_bytes) for c in counts]  # the same on every rank now
            raw = rows.contiguous().view(torch.uint8).reshape(-1)
            if self.combine == "allgather":
                pad = max(size)
                send = torch.zeros(pad, dtype=torch.uint8, device=dev)
                send[: raw.numel()].copy_(raw)
                recv = torch.empty(w * pad, dtype=torch.uint8, device=dev)
                self._collective(lambda: all_gather_single(recv, send), f"layer {layer}'s combine")
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


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def _fill(buf: torch.Tensor, header: torch.Tensor, rows: torch.Tensor) -> None:
    """``buf`` (uint8) <- the 32-byte header, then ``rows``' bytes."""
    buf[:HEADER].copy_(header.view(torch.uint8))
    if rows.numel():
        raw = rows.contiguous().view(torch.uint8).reshape(-1)
        buf[HEADER : HEADER + raw.numel()].copy_(raw)
