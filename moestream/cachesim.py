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
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .budget import GB, gb_text
from .cache import HitCounts
from .errors import MoestreamError
from .policies import POLICIES, EvictionPolicy, Key, PriorityPolicy, make_policy
from .traces import Trace, load_trace
from .usage import HOT_SHARE

Request = tuple[int, list[int]]  # (layer, experts in order of first use)


def requests_of(records: list[tuple[int, int, list[list[int]]]]) -> tuple[list[Request], list[bool]]:
    """Cache requests of trace records, and whether each is a decode step (one token).

    A record's experts [T][K] become the layer's request: its distinct experts in order
    of first use, token-major then rank (as the expert pipeline asks the cache).
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
class SimResult(HitCounts):
    """Lookups and hits of one replay, overall and in decode steps.

    ``prefetch_hits`` (a subset of ``hits``, as the engine counts them) are lookups served by a
    read ahead; ``reads`` counts experts read (misses and reads ahead), ``wasted`` the reads
    ahead no layer used; ``pinned_hits`` (a subset of ``hits``) the hits on hot-list pins.
    ``chunk_issued``, ``chunk_hits``, ``chunk_wasted``: the part of the reads ahead, prefetch hits
    and wasted reads that multi-token chunks read ahead (as :class:`moestream.prefetch.PrefetchStats`).
    """

    decode_lookups: int = 0
    decode_hits: int = 0
    decode_prefetch_hits: int = 0
    reads: int = 0
    decode_reads: int = 0
    wasted: int = 0
    chunk_issued: int = 0
    chunk_hits: int = 0
    chunk_wasted: int = 0

    @property
    def decode_hit_rate(self) -> float:
        return self.decode_hits / self.decode_lookups if self.decode_lookups else 0.0

    def add(self, other: "SimResult") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


def simulate(
    requests: list[Request],
    expert_bytes: Callable[[Key], int],
    budget_bytes: int,
    policy: EvictionPolicy,
    decode: list[bool] | None = None,
    pinned: list[Key] | None = None,
    ahead: list[list[tuple[int, list[int]]]] | None = None,
    depth: int = 0,
    min_decided: int = 32,
    chunk: list[list[tuple[int, list[int]]] | None] | None = None,
    window: int = 0,
) -> SimResult:
    """Replay ``requests`` through a cache of ``budget_bytes`` driven by ``policy``, from empty.

    ``expert_bytes(key)`` is what an expert costs the budget. ``pinned``: experts pinned
    first (hottest first, up to the budget), as :meth:`moestream.cache.ExpertCache.pin`:
    never evicted, counted in the budget, unseen by the policy. ``ahead[i]``, with
    ``depth`` >= 1: the experts the following layers' routers predicted at request ``i``;
    the first ``depth`` of them are read ahead as :class:`moestream.prefetch.Prefetcher`
    does (planned before the request's lookups unless cached or already read ahead,
    claimed by the layer they were read for or wasted when it passes, switched off once
    ``min_decided`` reads ahead are decided and the wasted bytes exceed the saved ones).
    ``chunk[i]`` (not None: request ``i`` is a multi-token chunk, as traces since prefill reads
    ahead record it): the next layer's experts in the prefetcher's chunk order; up to ``window``
    of them not cached, read ahead or planned are read ahead instead of any ``ahead[i]``, whatever
    ``depth`` (the engine reads chunks ahead even without ``--prefetch-ahead``), claimed and wasted
    as above but outside the switch-off's counts. Requests whose ``chunk`` is None (all of them in
    older traces) replay ``ahead`` as before. Reads ahead wait outside the budget and enter the
    cache when claimed, as misses do.
    Returns the counts.
    """
    present: dict[Key, int] = {}
    used = 0
    res = SimResult()
    pins: set[Key] = set()
    for key in dict.fromkeys(pinned or []):
        n = expert_bytes(key)
        if used + n > budget_bytes:
            break
        pins.add(key)
        present[key] = n
        used += n
    staged: list[Key] = []  # read ahead, in issue order
    staged_set: set[Key] = set()
    chunk_staged: set[Key] = set()  # the part of staged read ahead for chunks (the prefetcher's _chunk)
    # decode read-ahead only (chunks aside, as Prefetcher._judge): bytes saved and lost, reads decided
    enabled, saved, wasted_bytes, decided = depth > 0 and ahead is not None, 0, 0, 0

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
        is_decode = decode is not None and decode[i]
        plan_chunk = chunk[i] if chunk is not None and i < len(chunk) else None
        predicted = ahead[i][:depth] if enabled and plan_chunk is None else []
        planned, chunk_planned = _plan_ahead(plan_chunk, predicted, window, chunk_staged, staged_set, present)
        keys = [(layer, e) for e in experts]
        hits = [k for k in keys if k in present]
        claimed = [k for k in keys if k not in present and k in staged_set]
        misses = [k for k in keys if k not in present and k not in staged_set]
        res.lookups += len(keys)
        res.hits += len(hits) + len(claimed)
        res.prefetch_hits += len(claimed)
        res.pinned_hits += sum(k in pins for k in hits)
        res.reads += len(misses)
        if is_decode:
            res.decode_lookups += len(keys)
            res.decode_hits += len(hits) + len(claimed)
            res.decode_prefetch_hits += len(claimed)
            res.decode_reads += len(misses)
        for k in hits + claimed + misses:
            if k not in pins:
                policy.record(k)
        # the prefetcher's retire: claimed reads are hits, the rest read for this layer are wasted
        waste = [k for k in staged if k[0] == layer and k not in claimed]
        decode_claimed = [k for k in claimed if k not in chunk_staged]  # chunks' reads ahead are counted apart
        decode_waste = [k for k in waste if k not in chunk_staged]
        res.chunk_hits += len(claimed) - len(decode_claimed)
        res.chunk_wasted += len(waste) - len(decode_waste)
        saved += sum(map(expert_bytes, decode_claimed))
        wasted_bytes += sum(map(expert_bytes, decode_waste))
        decided += len(decode_claimed) + len(decode_waste)
        res.wasted += len(waste)
        gone = set(claimed) | set(waste)
        staged = [k for k in staged if k not in gone]
        staged_set -= gone
        chunk_staged -= gone
        if enabled and decided >= min_decided and wasted_bytes > saved:
            enabled = False
            planned = [k for k in planned if k in chunk_planned]  # a chunk's reads ahead go on
        for k in planned:  # issue
            staged.append(k)
            staged_set.add(k)
        chunk_staged |= chunk_planned
        res.chunk_issued += len(chunk_planned)
        res.reads += len(planned)
        if is_decode:
            res.decode_reads += len(planned)
        protect = set(keys)
        for k in claimed + misses:
            present[k] = expert_bytes(k)
            used += present[k]
            policy.admit(k)
            shrink({k}, protect)
            shrink(set(), protect)
    return res


def _plan_ahead(plan_chunk, predicted, window: int, chunk_staged: set, staged: set, present: dict
                ) -> tuple[list[Key], set[Key]]:
    """One request's reads ahead, as :class:`moestream.prefetch.Prefetcher` plans them: ``(planned, the part
    for a chunk)``. A chunk (``plan_chunk`` not None, ``Prefetcher._plan_chunk``) reads only the next layer's most
    used experts ahead, up to ``window`` of that layer's; otherwise the ``predicted`` layers' experts. Neither
    plans what is cached, read ahead already or planned."""
    planned: list[Key] = []
    chunk_planned: set[Key] = set()
    if plan_chunk is not None:
        for nxt, es in plan_chunk[:1]:
            room = window - sum(1 for k in chunk_staged if k[0] == nxt)
            for e in es:
                if room <= 0:
                    break
                k = (nxt, e)
                if k not in staged and k not in present and k not in planned:
                    planned.append(k)
                    chunk_planned.add(k)
                    room -= 1
        return planned, chunk_planned
    for nxt, es in predicted:
        for e in es:
            k = (nxt, e)
            if k not in staged and k not in present and k not in planned:
                planned.append(k)
    return planned, chunk_planned


def simulate_policy(name: str, requests: list[Request], expert_bytes, budget_bytes: int, decode=None,
                    half_life: float = 1024.0, pinned=None, ahead=None, depth: int = 0, chunk=None,
                    window: int = 0) -> SimResult:
    """:func:`simulate` under the policy ``name`` (``lru``, ``lfu``, ``layer`` or ``belady``)."""
    policy = BeladyPolicy(requests) if name == "belady" else make_policy(name, half_life)
    return simulate(requests, expert_bytes, budget_bytes, policy, decode, pinned, ahead, depth, chunk=chunk,
                    window=window)


def distinct_per_layer(records) -> dict[int, int]:
    """Layer -> distinct experts the trace's tokens routed to."""
    seen: dict[int, set[int]] = {}
    for _t, layer, rows in records:
        seen.setdefault(layer, set()).update(e for row in rows for e in row)
    return {layer: len(s) for layer, s in sorted(seen.items())}


# -- locality statistics ----------------------------------------------------------------------------

def routes_by_layer(records) -> dict[int, list[list[int]]]:
    """Layer -> each token's experts, in token order (a record of T tokens gives T rows)."""
    out: dict[int, dict[int, list[int]]] = {}
    for t0, layer, rows in records:
        tokens = out.setdefault(layer, {})
        for j, row in enumerate(rows):
            tokens[t0 + j] = list(row)
    return {layer: [tok[t] for t in sorted(tok)] for layer, tok in sorted(out.items())}


def gini(counts: list[float]) -> float:
    """Gini coefficient of ``counts`` (0: all equal; (n-1)/n: all on one): sum_i (2i - n - 1) x_(i) / (n sum x),
    over the counts sorted ascending, i = 1..n (0 for all zeros)."""
    x = sorted(counts)
    n, total = len(x), sum(x)
    if not n or not total:
        return 0.0
    return sum((2 * i - n - 1) * v for i, v in enumerate(x, 1)) / (n * total)


def lru_hits(routes: list[list[int]], capacity: int, warmup: int = 0) -> tuple[int, int]:
    """(hits, lookups) of one layer's own LRU of ``capacity`` experts over its tokens' routes:
    a token's experts are looked up, then all become the most recent (misses inserted), and the
    least recent beyond ``capacity`` are evicted. The first ``warmup`` tokens fill the cache
    uncounted (steady state)."""
    lru: OrderedDict[int, None] = OrderedDict()
    hits = lookups = 0
    for t, row in enumerate(routes):
        if t >= warmup:
            lookups += len(row)
            hits += sum(e in lru for e in row)
        for e in row:
            lru[e] = None
            lru.move_to_end(e)
        while len(lru) > capacity:
            lru.popitem(last=False)
    return hits, lookups


@dataclass
class Locality:
    """How a trace reuses experts over time (per-layer figures pooled over layers).

    ``next_token_reuse``: the share of a token's expert selections that its layer also
    selected at the previous token; ``reuse_within``: within the ``window`` previous tokens
    (both over tokens after the first). ``reuse_distance``: percentile -> tokens since the
    layer last selected the expert (``inf``: never before). ``lru``: residency (share of the
    layer's experts) -> hit rate of a per-layer LRU of that many experts after the first
    ``warmup`` tokens (the steady state, as kekzl/imp#1359 measured it).
    """

    tokens: int
    window: int
    warmup: int
    next_token_reuse: float
    reuse_within: float
    reuse_distance: dict[int, float]
    distinct: dict[int, int]
    num_experts: dict[int, int]
    gini: dict[int, float]
    lru: dict[float, float]

    def summary(self) -> list[str]:
        d = list(self.distinct.values()) or [0]
        g = list(self.gini.values()) or [0.0]
        n = list(self.num_experts.values()) or [0]
        full = sum(self.distinct.get(k, 0) >= v for k, v in self.num_experts.items())
        pct = ", ".join(f"p{p} {'never' if math.isinf(v) else f'{v:g}'}" for p, v in self.reuse_distance.items())
        return [
            f"next-token reuse {self.next_token_reuse:.1%}, reuse within {self.window} tokens {self.reuse_within:.1%}; "
            f"reuse distance (tokens) {pct}",
            f"distinct experts per layer {sum(d) / len(d):.1f} of {max(n)} (min {min(d)}, max {max(d)}; "
            f"all used in {full} of {len(self.num_experts)} layers); usage Gini {sum(g) / len(g):.3f} "
            f"(min {min(g):.3f}, max {max(g):.3f})",
            f"per-layer LRU hit rate after the first {self.warmup} tokens: "
            + ", ".join(f"{r:.1%} of experts {h:.1%}" for r, h in self.lru.items()),
        ]


def locality(records, num_experts: dict[int, int] | None = None, residencies=(0.125, 0.25, 0.4), window: int = 8,
             percentiles=(50, 90, 99), warmup: int = 64) -> Locality:
    """The :class:`Locality` of trace ``records`` [(token, layer, experts [T][K])].

    ``num_experts`` (layer -> experts) sizes the Gini and the per-layer LRUs (at least one
    expert); default: one more than the largest id routed to in the layer. ``warmup``: tokens
    the per-layer LRUs fill before their hits count (at most half the trace's tokens).
    """
    routes = routes_by_layer(records)
    num = dict(num_experts or {})
    for layer, rows in routes.items():
        num.setdefault(layer, max((e for r in rows for e in r), default=-1) + 1)
    nxt = within = total = 0
    dists: list[float] = []
    distinct, ginis = {}, {}
    for layer, rows in routes.items():
        last: dict[int, int] = {}
        counts = [0] * num[layer]
        for t, row in enumerate(rows):
            for e in row:
                if e < len(counts):
                    counts[e] += 1
                if t > 0:
                    d = t - last[e] if e in last else math.inf
                    total += 1
                    nxt += d == 1
                    within += d <= window
                    dists.append(d)
            for e in row:
                last[e] = t
        distinct[layer] = len(last)
        ginis[layer] = gini(counts)
    dists.sort()
    pct = {p: (dists[max(0, math.ceil(p / 100 * len(dists)) - 1)] if dists else math.inf) for p in percentiles}
    tokens = max((len(r) for r in routes.values()), default=0)
    warmup = min(warmup, tokens // 2)
    lru = {}
    for r in residencies:
        h = n = 0
        for layer, rows in routes.items():
            a, b = lru_hits(rows, max(1, int(r * num[layer])), warmup)
            h, n = h + a, n + b
        lru[r] = h / n if n else 0.0
    return Locality(
        tokens=tokens, window=window, warmup=warmup,
        next_token_reuse=nxt / total if total else 0.0, reuse_within=within / total if total else 0.0,
        reuse_distance=pct, distinct=distinct, num_experts={k: num[k] for k in routes}, gini=ginis, lru=lru,
    )


def hot_keys(traces: list[Trace]) -> list[Key]:
    """A hot list from traces: (layer, expert) by how many token routings chose it, hottest first
    (as ``moestream hotlist`` ranks a usage profile)."""
    counts: dict[int, dict[int, float]] = {}
    for tr in traces:
        for _t, layer, rows in tr.records:
            c = counts.setdefault(layer, {})
            for row in rows:
                for e in row:
                    c[e] = c.get(e, 0) + 1
    return sorted(((layer, e) for layer, c in counts.items() for e in c), key=lambda k: (-counts[k[0]][k[1]], k))


def run_cache_sim(traces: list[Path], budgets_gb: list[float] | None = None, policies: list[str] | None = None,
                  half_life: float | None = None, residencies: list[float] | None = None,
                  prefetch: list[int] | None = None, hot_from: list[Path] | None = None,
                  max_tokens: int | None = None, hot_fraction: float = HOT_SHARE) -> str:
    """Replay ``traces`` (each from an empty cache) at each budget under each policy; markdown.

    Budgets are GB (``budgets_gb``; moestream traces, which record bytes per expert) or
    residencies (``residencies``: shares of all the model's experts; for traces without sizes
    every expert counts one). Hit rates are summed over the traces. ``half_life`` (lookups) of
    the LFU-based policies defaults (when None) to the number of routed experts in the model, as in
    the engine; a value not above 0 raises ValueError. ``prefetch``: read-ahead depths to replay
    (1 and 2 need traces that recorded predictions); prefill chunks are read ahead as the engine
    read them wherever the trace recorded that (its ``chunk_window``), at every depth; ``hot_from``: traces whose usage
    makes a hot list, pinned up to ``hot_fraction`` of the budget as the engine pins one
    (tables with and without it).
    Each trace's locality statistics come first.

    Raises:
        MoestreamError: a trace cannot be read (naming it), or budgets in GB for a trace
            without expert sizes, or a prefetch depth the trace has no predictions for.
    """
    policies = policies or [*POLICIES, "belady"]
    depths = prefetch or [0]
    loaded = [load_trace(p, max_tokens) for p in traces]
    for tr in loaded:
        if budgets_gb and not tr.expert_bytes:
            raise MoestreamError(f"trace {tr.path}: records no expert sizes ({tr.format} format); "
                                 "give budgets as --residency shares instead of GB")
        if max(depths) > 0 and not tr.has_ahead:
            raise MoestreamError(f"trace {tr.path}: records no predictions of the following layers' experts, "
                                 "so prefetch cannot be replayed (record it again with --trace)")
        if max(depths) > int(tr.header.get("ahead", 0) or 0) and tr.format == "moestream":
            raise MoestreamError(f"trace {tr.path}: records predictions {tr.header.get('ahead')} layers ahead; "
                                 f"--prefetch {max(depths)} needs more")
    hot = hot_keys([load_trace(p, max_tokens) for p in hot_from]) if hot_from else None
    lines = []
    for tr in loaded:
        d = distinct_per_layer(tr.records)
        per = max(tr.num_experts.values(), default=0)
        vals = list(d.values()) or [0]
        lines.append(
            f"- {Path(tr.path).name}: {tr.tokens} tokens, {len(tr.records)} layer requests; distinct experts per MoE "
            f"layer {sum(vals) / len(vals):.1f} of {per} (min {min(vals)}, max {max(vals)})"
        )
        lines += ["  - " + x for x in locality(tr.records, tr.num_experts).summary()]
        if tr.has_chunk:
            lines.append(f"  - prefill chunks replayed reading up to {tr.chunk_window} experts of the next layer "
                         "ahead, as recorded")
    first = loaded[0]
    sizes0 = first.expert_bytes
    total = sum(sizes0.get(k, 1) * v for k, v in first.num_experts.items())
    n_experts = sum(first.num_experts.values())
    unit = " GB" if residencies else ""
    rows_spec = ([(f"{gb_text(gb * GB, 6)}{unit}", int(gb * GB), True) for gb in budgets_gb or []]
                 + [(f"{r:.1%}", r, False) for r in residencies or []])
    for depth in depths:
        for pins in ([None, hot] if hot is not None else [None]):
            if len(depths) > 1 or hot is not None:
                what = "off" if pins is None else f"on ({', '.join(Path(p).name for p in hot_from)})"
                lines += ["", f"Prefetch depth {depth}, hot list {what}:"]
            cols = [p for p in policies if not (p == "belady" and depth > 0)]
            head = ("| budget GB | experts held | " if budgets_gb and not residencies else "| budget | experts held | ")
            head += " | ".join(f"{p} (decode)" for p in cols) + " |"
            lines += ["", head, "|" + " --- |" * (2 + len(cols))]
            for label, amount, in_bytes in rows_spec:
                row, held = [], None
                for p in cols:
                    agg = SimResult()
                    for tr in loaded:
                        sizes = tr.expert_bytes
                        one = max(sizes.values()) if sizes else 1
                        n_all = sum(tr.num_experts.values())
                        tr_total = sum(sizes.get(k, one) * v for k, v in tr.num_experts.items())
                        budget = amount if in_bytes else int(amount * tr_total)
                        hl = half_life if half_life is not None else (n_all or 1024)
                        held = min(budget // one, n_all)
                        reqs, decode = requests_of(tr.records)
                        pinned = [k for k in pins if k[0] in tr.num_experts] if pins else None
                        r = simulate_policy(
                            p, reqs, lambda k, s=sizes, o=one: s.get(k[0], o),
                            budget if pins is None else budget, decode, hl,
                            pinned=_hot_share(pinned, sizes, one, budget, hot_fraction), ahead=tr.ahead,
                            depth=depth, chunk=tr.chunk, window=tr.chunk_window)
                        agg.add(r)
                    cell = f"{agg.hit_rate:.1%} ({agg.decode_hit_rate:.1%})"
                    if depth:
                        dl = agg.decode_lookups or 1
                        cell += f" [{agg.decode_prefetch_hits / dl:.0%} ahead, {agg.decode_reads / dl:.2f} reads]"
                    row.append(cell)
                budget0 = amount if in_bytes else int(amount * total)
                share = "" if not total else " (all)" if budget0 >= total else f" ({budget0 / total:.0%} of experts)"
                if not in_bytes:
                    share = "" if held < n_experts else " (all)"
                lines.append(f"| {label} | {held}{share} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _hot_share(keys: list[Key] | None, sizes: dict[int, int], one: int, budget: int,
               fraction: float) -> list[Key] | None:
    """The hottest ``keys`` that fit in ``fraction`` of ``budget`` (as ``setup_cache_policy`` pins a hot list)."""
    if not keys:
        return None
    out, used = [], 0
    for k in keys:
        n = sizes.get(k[0], one)
        if used + n > fraction * budget:
            break
        out.append(k)
        used += n
    return out
