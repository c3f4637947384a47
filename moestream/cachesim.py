"""Replaying routing traces through cache policies: how far is LRU from the best possible?

``moestream cache-sim --trace FILE --budgets 1,2,4`` replays traces recorded with
``--trace`` under each online policy of :mod:`moestream.policies` and under Belady's
MIN (Belady 1966, "A study of replacement algorithms for a virtual-storage computer":
evict the expert whose next use is furthest in the future), which no policy can beat.

The simulator follows :class:`moestream.cache.ExpertCache` step for step: a MoE layer's
request is the experts its tokens route to, in order of first use; the policy sees the
hits, then the misses, each in request order; misses are inserted one at a time and the
cache shrinks to its byte budget after each, evicting experts outside the request
first. With a budget of at least one request's experts the real cache evicts exactly
the same experts (a test checks the hit counts agree); with less, the real cache's
choice among the request's own experts depends on the order reads complete.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .policies import POLICIES, EvictionPolicy, Key, PriorityPolicy, make_policy
from .usage import read_trace

Request = tuple[int, list[int]]  # (layer, experts in order of first use)


def requests_of(records: list[tuple[int, int, list[list[int]]]]) -> tuple[list[Request], list[bool]]:
    """Cache requests of trace records, and whether each is a decode step (one token).

    A record's experts [T][K] become the layer's request: its distinct experts in order
    of first use, token-major then rank (as ``streamed_experts`` asks the cache).
    """
    reqs, decode = [], []
    for _token, layer, rows in records:
        reqs.append((layer, list(dict.fromkeys(e for row in rows for e in row))))
        decode.append(len(rows) == 1)
    return reqs, decode


class BeladyPolicy(PriorityPolicy):
    """Belady's MIN: evict the cached expert whose next use is furthest away (never: first).

    Offline: built from the whole request sequence. Each :meth:`record` of a key must be
    its lookup in the next request that holds it, as the simulator does.
    """

    name = "belady"

    def __init__(self, requests: list[Request]):
        super().__init__()
        self._uses: dict[Key, list[int]] = {}
        for i, (layer, experts) in enumerate(requests):
            for e in experts:
                self._uses.setdefault((layer, e), []).append(i)
        self._seen: dict[Key, int] = {}

    def _bump(self, key: Key, stamp: int) -> tuple:
        n = self._seen.get(key, 0) + 1  # lookups of key so far, this one included
        self._seen[key] = n
        uses = self._uses.get(key, [])
        nxt = uses[n] if n < len(uses) else math.inf
        return (-nxt, key)

    def _initial(self, key: Key, stamp: int) -> tuple:
        uses = self._uses.get(key, [])
        n = self._seen.get(key, 0)
        return (-(uses[n] if n < len(uses) else math.inf), key)


@dataclass
class SimResult:
    """Lookups and hits of one replay, overall and in decode steps."""

    lookups: int = 0
    hits: int = 0
    decode_lookups: int = 0
    decode_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def decode_hit_rate(self) -> float:
        return self.decode_hits / self.decode_lookups if self.decode_lookups else 0.0


def simulate(
    requests: list[Request],
    expert_bytes: Callable[[Key], int],
    budget_bytes: int,
    policy: EvictionPolicy,
    decode: list[bool] | None = None,
) -> SimResult:
    """Replay ``requests`` through a cache of ``budget_bytes`` driven by ``policy``, from empty.

    ``expert_bytes(key)`` is what an expert costs the budget. Returns the counts.
    """
    present: dict[Key, int] = {}
    used = 0
    res = SimResult()

    def shrink(busy: set[Key], protect: set[Key]) -> None:
        nonlocal used
        while used > budget_bytes:
            key = policy.victim(lambda k: k in busy or k in protect)
            if key is None:
                key = policy.victim(busy.__contains__)
            if key is None:
                return
            policy.remove(key)
            used -= present.pop(key)

    for i, (layer, experts) in enumerate(requests):
        keys = [(layer, e) for e in experts]
        hits = [k for k in keys if k in present]
        misses = [k for k in keys if k not in present]
        res.lookups += len(keys)
        res.hits += len(hits)
        if decode is not None and decode[i]:
            res.decode_lookups += len(keys)
            res.decode_hits += len(hits)
        for k in hits + misses:
            policy.record(k)
        protect = set(keys)
        for k in misses:
            present[k] = expert_bytes(k)
            used += present[k]
            policy.admit(k)
            shrink({k}, protect)
            shrink(set(), protect)
    return res


def simulate_policy(name: str, requests: list[Request], expert_bytes, budget_bytes: int, decode=None,
                    half_life: float = 1024.0) -> SimResult:
    """:func:`simulate` under the policy ``name`` (``lru``, ``lfu``, ``layer`` or ``belady``)."""
    policy = BeladyPolicy(requests) if name == "belady" else make_policy(name, half_life)
    return simulate(requests, expert_bytes, budget_bytes, policy, decode)


def distinct_per_layer(records) -> dict[int, int]:
    """Layer -> distinct experts the trace's tokens routed to."""
    seen: dict[int, set[int]] = {}
    for _t, layer, rows in records:
        seen.setdefault(layer, set()).update(e for row in rows for e in row)
    return {layer: len(s) for layer, s in sorted(seen.items())}


def run_cache_sim(traces: list[Path], budgets_gb: list[float], policies: list[str] | None = None,
                  half_life: float | None = None) -> str:
    """Replay ``traces`` (each from an empty cache) at each budget (GB) under each policy; a markdown table.

    Hit rates are summed over the traces. ``half_life`` (lookups) of the LFU-based policies
    defaults to the number of routed experts in the model, as in the engine.

    Raises:
        MoestreamError: a trace cannot be read (naming it).
    """
    policies = policies or [*POLICIES, "belady"]
    loaded = []
    for path in traces:
        header, records = read_trace(path)
        sizes = {int(k): int(v) for k, v in header.get("expert_bytes", {}).items()}
        reqs, decode = requests_of(records)
        loaded.append((path, header, records, sizes, reqs, decode))
    lines = []
    for path, header, records, *_ in loaded:
        d = distinct_per_layer(records)
        n = header.get("num_experts", {})
        per = max((int(v) for v in n.values()), default=0)
        tokens = max((t + len(rows) for t, _l, rows in records), default=0)
        vals = list(d.values()) or [0]
        lines.append(
            f"- {Path(path).name}: {tokens} tokens, {len(records)} layer requests; distinct experts per MoE layer "
            f"{sum(vals) / len(vals):.1f} of {per} (min {min(vals)}, max {max(vals)})"
        )
    total = sum(sum(s.get(int(k), 0) * int(v) for k, v in h.get("num_experts", {}).items())
                for _p, h, _r, s, _q, _d in loaded[:1])
    head = "| budget GB | experts held | " + " | ".join(f"{p} (decode)" for p in policies) + " |"
    lines += ["", head, "|" + " --- |" * (2 + len(policies))]
    for gb in budgets_gb:
        budget = int(gb * 1e9)
        row, held = [], None
        for p in policies:
            agg = SimResult()
            for _path, header, _records, sizes, reqs, decode in loaded:
                hl = half_life or sum(int(v) for v in header.get("num_experts", {}).values()) or 1024
                one = max(sizes.values()) if sizes else 1
                held = min(budget // one, sum(int(v) for v in header.get("num_experts", {}).values()))
                r = simulate_policy(p, reqs, lambda k, s=sizes, o=one: s.get(k[0], o), budget, decode, hl)
                agg.lookups += r.lookups
                agg.hits += r.hits
                agg.decode_lookups += r.decode_lookups
                agg.decode_hits += r.decode_hits
            row.append(f"{agg.hit_rate:.1%} ({agg.decode_hit_rate:.1%})")
        share = "" if not total else " (all)" if budget >= total else f" ({budget / total:.0%} of experts)"
        lines.append(f"| {gb:g} | {held}{share} | " + " | ".join(row) + " |")
    return "\n".join(lines)
