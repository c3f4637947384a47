"""The prefix cache: KV blocks of prompts already computed, kept under a byte budget and reused.

As vLLM's automatic prefix caching: a sequence's tokens are cut into blocks of :attr:`PrefixCache.block`
tokens; block ``i`` is keyed by a chained hash, SHA-256 over block ``i - 1``'s key and block ``i``'s token
ids, so a key names the whole prefix up to the block's end. A request looks its prompt's blocks up in
order and reuses the keys and values of the longest run found (:meth:`PrefixCache.lookup`); after its
prefill (and at its end) its full blocks are stored (:meth:`PrefixCache.store`). Blocks are evicted least
recently used first, the deepest block of a prefix before its parents (a hit touches a chain from its
last block to its first).

Exactness: on the CPU every op of the token path gives a row bits that depend only on its own inputs
(:mod:`moestream.models.ops`; ``docs/reliability.md``, "Invariance"): a position's keys and values are
the same bits whichever request computed them, in whatever chunk, so logits after a reused prefix are
``torch.equal`` to a fresh prefill. The cache therefore serves only models whose state is a plain
:class:`~moestream.models.layers.KVCache` of attention layers (:attr:`CausalLM.batchable`) on the CPU:
a hybrid or linear-attention family's recurrent state cannot be sliced at a block end; on CUDA (whose kernels
are row-invariant too: ``docs/reliability.md``, "Invariance on the GPU") it is off until a GPU test holds it,
and the KV storage there is the decode graphs' kept pool (:func:`prefix_cache_for`).
Each stored block's token ids are kept and compared on a hit, so a hash collision can never hand out
another prefix's keys.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .models.layers import KVCache

DEFAULT_BLOCK_TOKENS = 16


@dataclass
class _Block:
    tokens: tuple[int, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys [kv_heads, B, d], values [kv_heads, B, dv])
    nbytes: int


@dataclass
class PrefixStats:
    """Counters since start: tokens looked up and found, blocks stored and evicted, bytes held."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0


def block_keys(ids: list[int], block: int) -> list[bytes]:
    """The chained keys of ``ids``' full blocks of ``block`` tokens: key i = SHA-256(key i-1, block i's ids)."""
    keys, parent = [], b""
    for i in range(len(ids) // block):
        h = hashlib.sha256(parent)
        h.update(torch.tensor(ids[i * block : (i + 1) * block], dtype=torch.int64).numpy().tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """KV blocks of computed prefixes under ``budget_bytes`` (LRU), shared by every request of an engine.

    Args:
        num_layers: the model's decoder layers (each an attention layer holding keys and values).
        budget_bytes: bytes of keys and values kept at most (> 0).
        block: tokens per block.

    Thread-safe: the server's scheduler and the Python API may use it from different threads.
    """

    def __init__(self, num_layers: int, budget_bytes: int, block: int = DEFAULT_BLOCK_TOKENS):
        if budget_bytes <= 0 or block < 1:
            raise ValueError(f"a prefix cache needs a budget > 0 and blocks of >= 1 token, got {budget_bytes}, {block}")
        self.num_layers, self.budget_bytes, self.block = num_layers, budget_bytes, block
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self.used_bytes = 0
        self.stats = PrefixStats()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, ids: list[int], limit: int) -> tuple[int, list[_Block]]:
        """The longest run of cached blocks that starts ``ids``: ``(tokens it covers, the blocks)``, at most
        ``limit`` tokens (a request must still prefill its last prompt token to get logits; the last block may
        then be used in part). The blocks found are touched (most recently used)."""
        keys = block_keys(ids, self.block)
        found: list[tuple[bytes, _Block]] = []
        with self._lock:
            for i, key in enumerate(keys):
                b = self._blocks.get(key)
                if b is None or b.tokens != tuple(ids[i * self.block : (i + 1) * self.block]):
                    break
                found.append((key, b))
            for key, _ in reversed(found):  # the first block most recent: children go before their parents
                self._blocks.move_to_end(key)
            n = min(len(found) * self.block, max(0, limit))
            self.stats.lookups += 1
            self.stats.lookup_tokens += len(ids)
            self.stats.hit_tokens += n
        return n, [b for _, b in found][: (n + self.block - 1) // self.block]

    def fill(self, kv: KVCache, n: int, blocks: list[_Block]) -> None:
        """Write the first ``n`` tokens of ``blocks`` (from :meth:`lookup`) into the empty cache ``kv`` at
        positions ``0..n`` (``kv.length`` becomes ``n``)."""
        if n == 0:
            return
        for layer in range(self.num_layers):
            keys = torch.cat([b.kv[layer][0] for b in blocks], dim=1)[:, :n]
            values = torch.cat([b.kv[layer][1] for b in blocks], dim=1)[:, :n]
            kv.update(layer, 0, keys, values)
        kv.length = n

    def store(self, ids: list[int], kv: KVCache) -> int:
        """Keep the full blocks of ``ids`` (the tokens whose keys and values ``kv`` holds at positions
        ``0..len(ids)``) that are not cached yet, evicting least recently used blocks beyond the budget.
        Returns the blocks added. A block larger than the whole budget is not kept."""
        n = min(len(ids), kv.length)
        keys = block_keys(ids[:n], self.block)
        if any(kv.layers[i] is None for i in range(self.num_layers)) or not keys:
            return 0
        added = 0
        for i, key in enumerate(keys):
            with self._lock:
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    continue
            a, b = i * self.block, (i + 1) * self.block
            per = [(k[:, a:b].clone(), v[:, a:b].clone()) for k, v in kv.layers[: self.num_layers]]
            size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in per)
            if size > self.budget_bytes:
                return added
            with self._lock:
                if key in self._blocks:
                    continue
                while self._blocks and self.used_bytes + size > self.budget_bytes:
                    _, old = self._blocks.popitem(last=False)
                    self.used_bytes -= old.nbytes
                    self.stats.evicted_blocks += 1
                self._blocks[key] = _Block(tuple(ids[a:b]), per, size)
                self.used_bytes += size
                self.stats.stored_blocks += 1
                added += 1
        return added

    def clear(self) -> None:
        """Drop every block."""
        with self._lock:
            self._blocks.clear()
            self.used_bytes = 0


def prefix_cache_supported(model, device: torch.device) -> str | None:
    """None when the prefix cache can serve ``model`` on ``device``, else why not (a sentence)."""
    if device.type != "cpu":
        return ("the prefix cache runs on the CPU only for now: on CUDA no test yet holds a reused prefix to the "
                "bits of a fresh prefill")
    if not getattr(model, "batchable", False):
        return ("this model's decode state is not a plain KV cache of attention layers (linear attention, MLA): "
                "its state cannot be sliced at block ends, so it has no prefix cache")
    return None


def prefix_cache_for(model, device: torch.device, budget_bytes: int) -> PrefixCache | None:
    """A :class:`PrefixCache` of ``budget_bytes`` for ``model`` on ``device``, or None (budget 0, or a model
    or device it cannot serve: :func:`prefix_cache_supported`)."""
    if budget_bytes <= 0 or prefix_cache_supported(model, device) is not None:
        return None
    return PrefixCache(len(model.decoder.layers), budget_bytes)
