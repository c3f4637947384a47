"""Host-to-device copies of experts (:class:`CopyEngine`): each expert's buffer goes over on a side
CUDA stream in one ``cudaMemcpyAsync`` from pinned memory, an event is recorded after it, and the compute
stream waits on that event, so the host thread never blocks on a copy and disk reads of later experts
overlap the copies of earlier ones. On the CPU the copies are synchronous (the tier logic runs unchanged).
Used by :class:`moestream.tiered_cache.TieredExpertCache`.
"""

from __future__ import annotations

import contextlib

import torch

from .store import ExpertWeights


class CopyEngine:
    """Host-to-device copies of experts on a side stream, with an event per copy.

    Args:
        device: the compute device. ``cpu`` makes copies synchronous host copies with no
            events (the tier logic then runs unchanged on the CPU).

    Attributes:
        h2d_bytes, copies: bytes and copies issued.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.h2d_bytes = 0
        self.copies = 0

    def to_device(self, ew: ExpertWeights):
        """Start copying expert ``ew`` (host tensors) to the device.

        Returns ``(device ExpertWeights, event)``; the event (None on the CPU) completes
        when the copy has landed. The compute stream is made to wait on it, so kernels
        queued after this call see the copied bytes; the host buffer must stay untouched
        until the event completes. When every tensor is a contiguous view of one buffer
        (the store's layout), the whole buffer goes in one copy and the device tensors are
        views at the same byte offsets.
        """
        tensors = ew.tensors
        storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
        one = len(storages) == 1 and all(t.is_contiguous() for t in tensors.values())
        event = None
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            # the destination may be memory the compute stream just freed: copy after its queued work
            self.stream.wait_stream(compute)
        if one:
            st = next(iter(tensors.values())).untyped_storage()
            # the span the tensors cover (the store lays a buffer out like the file, in whole blocks)
            lo = min(t.storage_offset() * t.element_size() for t in tensors.values())
            lo -= lo % 64  # each tensor keeps its alignment to 64 bytes (a CPU kernel's bits may depend on it)
            hi = max((t.storage_offset() + t.numel()) * t.element_size() for t in tensors.values())
            src = torch.empty(0, dtype=torch.uint8).set_(st)[lo:hi]
            dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
            out = {}
            for role, t in tensors.items():
                off = t.storage_offset() * t.element_size() - lo
                n = t.numel() * t.element_size()
                out[role] = dst[off : off + n].view(t.dtype).view(t.shape)
            nbytes = src.numel()
        else:
            out, nbytes = {}, 0
            for role, t in tensors.items():
                d = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        d.copy_(t, non_blocking=True)
                else:
                    d.copy_(t)
                out[role] = d
                nbytes += t.numel() * t.element_size()
        if self.cuda:
            for d in out.values():  # written on the copy stream: not reused before the copy is done
                d.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
            compute.wait_event(event)
        self.h2d_bytes += nbytes
        self.copies += 1
        return ExpertWeights(ew.key, out, nbytes, None), event

    def copy_into(self, ew: ExpertWeights, row: torch.Tensor, views: dict[str, torch.Tensor], after=None,
                  wait: bool = True):
        """Start copying expert ``ew`` (host tensors) into a device slot.

        Args:
            ew: the host expert (the store's buffer, or separate tensors).
            row: uint8 [slot_bytes], the slot's bytes; views: role -> the slot's typed view of it.
            after: an event the copy must wait for (the slot's last use by compute), or None.
            wait: make the compute stream wait for the copy now (a fetch that computes next);
                False leaves that to the caller, who waits on the returned event before the
                kernel that reads the slot (a copy ahead of its layer, beside compute).

        Returns:
            the copy's event (None on the CPU). One copy of the whole buffer when its pieces
            sit at the slot's offsets (the store's layout), else one per piece.

        Raises:
            ValueError: when ``ew``'s pieces are not the slot's.
        """
        tensors = ew.tensors
        if set(tensors) != set(views):
            raise ValueError(f"expert {ew.key} holds {sorted(tensors)}; its slot holds {sorted(views)}")
        base = row.data_ptr()
        storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
        # one copy when the pieces sit in one buffer at the slot's offsets plus one shift (the
        # store's buffers hold each expert at its file offset modulo 4 KiB)
        shifts = {t.storage_offset() * t.element_size() - (views[r].data_ptr() - base) for r, t in tensors.items()}
        span = max(views[r].data_ptr() - base + t.numel() * t.element_size() for r, t in tensors.items())
        single = len(storages) == 1 and len(shifts) == 1 and min(shifts) >= 0 and all(
            t.is_contiguous() and t.dtype == views[r].dtype and t.shape == views[r].shape
            for r, t in tensors.items()
        ) and span <= row.numel() and min(shifts) + span <= next(iter(tensors.values())).untyped_storage().nbytes()
        if self.cuda:
            if after is not None:
                self.stream.wait_event(after)
            ctx = torch.cuda.stream(self.stream)
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            if single:
                src = torch.empty(0, dtype=torch.uint8).set_(next(iter(tensors.values())).untyped_storage())
                nbytes, shift = span, min(shifts)
                row[:nbytes].copy_(src[shift : shift + nbytes], non_blocking=self.cuda)
            else:
                nbytes = 0
                for role, t in tensors.items():
                    views[role].copy_(t, non_blocking=self.cuda)
                    nbytes += t.numel() * t.element_size()
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self.stream)
            if wait:
                torch.cuda.current_stream(self.device).wait_event(event)
        self.h2d_bytes += nbytes
        self.copies += 1
        return event

    @staticmethod
    def done(event) -> bool:
        return event is None or event.query()

    @staticmethod
    def wait(event) -> None:
        """Block the host until ``event`` completes."""
        if event is not None:
            event.synchronize()
