"""The VRAM tier as preallocated slots (the fused MoE kernel's cache, :mod:`moestream.fused_moe`): every
expert of the model has one byte layout (:class:`SlotLayout`, :func:`expert_slot_layout`), so the tier is
one ``[capacity, slot_bytes]`` device buffer (:class:`SlotPool`) and a device-side table gives each layer's
expert -> slot (-1: not resident), which the kernel reads. A slot is refilled only after the event of its
last use and its new contents are read only after the event of their copy. Filled by
:class:`moestream.tiered_cache.TieredExpertCache`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .checkpoint import torch_dtype
from .store import PIECE_ALIGN, ExpertStore, Key

SLOT_ALIGN = 256  # bytes: a slot's start, so every piece keeps the alignment it has in a read buffer


@dataclass(frozen=True)
class SlotLayout:
    """Where an expert's pieces sit in a VRAM slot.

    Attributes:
        roles: ``(role, dtype, shape, byte offset)`` per piece, in the store's piece order, at
            offsets rounded up to :data:`~moestream.store.PIECE_ALIGN` as the store lays out a
            read buffer (so a buffer goes over in one copy).
        slot_bytes: bytes per slot (a multiple of :data:`SLOT_ALIGN`).
    """

    roles: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]
    slot_bytes: int

    @classmethod
    def of(cls, pieces: list[tuple[str, torch.dtype, tuple[int, ...]]],
           frame: tuple[int, ...] | None = None) -> "SlotLayout":
        """The layout of pieces ``(role, dtype, shape)``, in order: packed at
        :data:`~moestream.store.PIECE_ALIGN` offsets, or at a store frame's piece offsets ``at``
        less the first (as the pieces lie in the store's buffers: one copy moves an expert)."""
        roles, at = [], 0
        first = min(frame) if frame else 0
        for i, (role, dtype, shape) in enumerate(pieces):
            nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
            roles.append((role, dtype, tuple(shape), frame[i] - first if frame else at))
            at = max(at, frame[i] - first + nbytes) if frame else at + -(-nbytes // PIECE_ALIGN) * PIECE_ALIGN
        return cls(tuple(roles), max(SLOT_ALIGN, -(-at // SLOT_ALIGN) * SLOT_ALIGN))

    def views(self, storage: torch.Tensor) -> dict[str, torch.Tensor]:
        """role -> a view [S, *shape] of ``storage`` (uint8 [S, slot_bytes]): slot ``s``'s piece is ``view[s]``."""
        out = {}
        for role, dtype, shape, off in self.roles:
            nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
            out[role] = storage[:, off : off + nbytes].view(dtype).view(storage.shape[0], *shape)
        return out


def expert_slot_layout(store: ExpertStore, keys: list[Key]) -> SlotLayout | None:
    """The one slot layout of experts ``keys`` as the store hands them out (after its cast to the compute
    dtype), or None when they differ (or the store transforms experts: then no slot pool)."""
    if getattr(store, "prepare", None) is not None or not keys:
        return None
    layout, frames = None, set()
    for key in keys:
        pieces, cast = [], False
        for p in store.layout.pieces(*key):
            converts = store._converts(p.dtype, p.role)
            cast |= converts
            pieces.append((p.role, store.dtype if converts else torch_dtype(p.dtype), tuple(p.shape)))
        this = SlotLayout.of(pieces)
        if layout is None:
            layout = this
        elif this != layout:
            return None
        at = store.frame(key).at
        frames.add(None if cast else tuple(a - min(at) for a in at))
    # the store lays buffers out like the file, each expert at its file offset modulo 4 KiB: when
    # the pieces lie alike relative to the first in every expert, a slot takes that layout and one
    # copy of the buffer's span moves an expert
    if len(frames) == 1 and None not in frames:
        return SlotLayout.of(pieces, next(iter(frames)))
    return layout


class SlotPool:
    """The VRAM expert tier as preallocated slots of one :class:`SlotLayout`.

    Args:
        layout: the slot layout; capacity: slots; num_experts: layer -> experts (sizes the table);
        device: where the slots and the table live.

    Attributes:
        storage: uint8 [capacity, slot_bytes] on ``device``; views: role -> [capacity, *shape]
            (what the fused kernel reads: ``gate``/``up`` [S, I, H], ``down`` [S, H, I]).
        table: int32 [max layer + 1, max experts] on ``device``: ``table[layer, e]`` is expert
            ``e``'s slot, -1 when not resident; written from :attr:`host_table` by :meth:`flush`.
        slot_of: (layer, expert) -> slot, on the host.
        last_use: per slot, the event after the last compute that read it (None: nothing pending);
        ready: per slot, the event of a copy nothing has waited for yet.
    """

    def __init__(self, layout: SlotLayout, capacity: int, num_experts: dict[int, int],
                 device: torch.device | str):
        if capacity < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {capacity}")
        self.layout, self.capacity, self.device = layout, capacity, torch.device(device)
        self.storage = torch.empty(capacity, layout.slot_bytes, dtype=torch.uint8, device=self.device)
        self.views = layout.views(self.storage)
        rows, cols = max(num_experts, default=0) + 1, max(num_experts.values(), default=1)
        self.host_table = torch.full((rows, cols), -1, dtype=torch.int32)
        self.table = torch.full((rows, cols), -1, dtype=torch.int32, device=self.device)
        self.slot_of: dict[Key, int] = {}
        self.key_of: list[Key | None] = [None] * capacity
        self.last_use: list[object] = [None] * capacity
        self.ready: list[object] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        self.dirty = False

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self, key: Key) -> int:
        """A free slot for ``key`` (which must not hold one); recorded in the host table."""
        if key in self.slot_of:
            raise ValueError(f"expert {key} already holds slot {self.slot_of[key]}")
        if not self._free:
            raise RuntimeError("no free VRAM slot (the cache evicts before it takes one)")
        slot = self._free.pop()
        self.slot_of[key], self.key_of[slot] = slot, key
        self.host_table[key] = slot
        self.dirty = True
        return slot

    def give(self, key: Key) -> int:
        """Free ``key``'s slot (its table entry becomes -1); returns the slot."""
        slot = self.slot_of.pop(key)
        self.key_of[slot] = None
        self.ready[slot] = None
        self.host_table[key] = -1
        self.dirty = True
        self._free.append(slot)
        return slot

    def row(self, slot: int) -> torch.Tensor:
        """uint8 [slot_bytes]: slot ``slot``'s bytes."""
        return self.storage[slot]

    def tensors(self, slot: int) -> dict[str, torch.Tensor]:
        """role -> slot ``slot``'s piece (a view)."""
        return {role: v[slot] for role, v in self.views.items()}

    def flush(self) -> None:
        """Write the host table to the device table (queued on the compute stream, before the kernels
        launched after this), when it changed."""
        if self.dirty:
            # pageable source: the copy is staged before this returns, so the host table may change after
            self.table.copy_(self.host_table, non_blocking=True)
            self.dirty = False

    def mark_used(self, keys, event) -> None:
        """Compute that reads ``keys``' slots was queued before ``event``: refill them only after it."""
        for key in keys:
            slot = self.slot_of.get(key)
            if slot is not None:
                self.last_use[slot] = event
