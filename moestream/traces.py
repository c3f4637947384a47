"""Routing traces in the formats ``moestream cache-sim`` replays: which experts each token used at each MoE layer.

* **moestream** (``--trace FILE``, :class:`moestream.usage.TraceWriter`): JSON lines, a header
  ``{"format": "moestream-trace", ...}`` (experts per layer, bytes per expert, top-k), then one
  record per MoE layer per forward pass ``{"token": t0, "layer": l, "experts": [[e, ...], ...],
  "ahead": [[l2, [e, ...]], ...], "chunk": [[l + 1, [e, ...]]]}``: one row of expert ids per token
  (tokens t0, t0+1, ...) and, in traces written since prefetch could be simulated, the experts the
  following layers' routers predict from this layer's input (``ahead``: what ``--prefetch-ahead``
  reads in a one-token step). In traces written since prefill reads ahead, a record of several
  tokens also has ``chunk``: the experts the next MoE layer's router sends the chunk's token slots
  to, most slots first (:func:`moestream.prefetch.predict_chunk`; ``[]`` at the last MoE layer),
  from which the engine read the first ``chunk_window`` (the header's) not already held; such a
  step reads nothing else ahead. A trace without ``chunk`` replays its chunks from ``ahead``.
* **JSON lines** as public routing logs write them: one object per line with ``layer``, an
  optional ``token`` (or ``token_idx``; else the records of a layer are its tokens in order),
  and the expert ids in ``experts``, ``selected_ids`` or ``topk_ids``: a list of ids (one token)
  or a list of lists (consecutive tokens from ``token``). Other fields are ignored.
* **FLAME-MoE** routing traces (Kang et al. 2025, the CMU-FLAME/FLAME-MoE-Traces data set):
  parquet files, one per MoE layer (``layer_NN.parquet``, the layer from the name), one row per
  token with the top-k expert ids in the column ``indices`` (router scores in ``scores``, not
  used). A folder of such files is one trace. Needs ``pyarrow`` (``pip install pyarrow``).

Experts per layer are the header's (moestream) or one more than the largest id seen; bytes per
expert are known only for moestream traces (budgets of other traces are given as residencies).
A malformed line or row is refused with a :class:`~moestream.errors.MoestreamError` naming the
file and the line (or row).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import MoestreamError

TRACE_FORMAT = "moestream-trace"
EXPERT_FIELDS = ("experts", "selected_ids", "topk_ids")
TOKEN_FIELDS = ("token", "token_idx")

Record = tuple[int, int, list[list[int]]]  # (first token, layer, experts [T][K])
Ahead = list[tuple[int, list[int]]]  # (following layer, predicted experts)


@dataclass
class Trace:
    """A routing trace: records in execution order (token-major, then layer), and per record the
    following layers' predicted experts (``ahead``, empty where the trace has none) and, for a record
    of several tokens, the next layer's experts in chunk read-ahead order (``chunk``: None where not
    recorded: one-token records, and every record of older traces; an empty list means none)."""

    path: Path
    format: str
    header: dict
    records: list[Record]
    ahead: list[Ahead] = field(default_factory=list)
    chunk: list[Ahead | None] = field(default_factory=list)

    @property
    def num_experts(self) -> dict[int, int]:
        """Layer -> experts in that layer: the header's, else one more than the largest id routed to."""
        known = {int(k): int(v) for k, v in self.header.get("num_experts", {}).items()}
        if known:
            return known
        seen: dict[int, int] = {}
        for _t, layer, rows in self.records:
            seen[layer] = max(seen.get(layer, 0), max((e for row in rows for e in row), default=-1) + 1)
        return dict(sorted(seen.items()))

    @property
    def expert_bytes(self) -> dict[int, int]:
        """Layer -> bytes of one expert (moestream traces only; empty otherwise)."""
        return {int(k): int(v) for k, v in self.header.get("expert_bytes", {}).items()}

    @property
    def has_ahead(self) -> bool:
        return any(self.ahead)

    @property
    def has_chunk(self) -> bool:
        """Whether the trace recorded what prefill chunks read ahead (moestream traces since that was added)."""
        return any(c is not None for c in self.chunk)

    @property
    def chunk_window(self) -> int:
        """Experts of the next layer the engine read ahead per chunk (the header's ``chunk_window``; 0: none)."""
        return int(self.header.get("chunk_window", 0) or 0)

    @property
    def tokens(self) -> int:
        return max((t + len(rows) for t, _l, rows in self.records), default=0)


def _ids(value, where: str) -> list[list[int]]:
    """Expert ids as rows [T][K] from a list of ids or a list of lists; raises ValueError."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} is not a non-empty list of expert ids")
    rows = value if isinstance(value[0], list) else [value]
    out = []
    for row in rows:
        if not isinstance(row, list) or not row or not all(
            isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in row
        ):
            raise ValueError(f"{where} holds {row!r:.60}, not a list of expert ids >= 0")
        out.append(row)
    return out


def load_trace(path: str | Path, max_tokens: int | None = None) -> Trace:
    """Read a routing trace in any of the module's formats (by content: parquet by name or folder).

    ``max_tokens`` keeps the first tokens only (FLAME-MoE captures hold 52 million).

    Raises:
        MoestreamError: the file cannot be read or a line (row) is malformed, naming file and line.
    """
    path = Path(path)
    if path.is_dir() or path.suffix == ".parquet":
        return _read_flame(path, max_tokens)
    try:
        with open(path) as f:
            first = f.readline()
    except (OSError, UnicodeDecodeError) as e:
        raise MoestreamError(f"trace {path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    try:
        head = json.loads(first) if first.strip() else None
    except json.JSONDecodeError as e:
        raise MoestreamError(f"trace {path}: line 1 is not JSON ({e})") from None
    if head is None:
        raise MoestreamError(f"trace {path}: empty")
    if isinstance(head, dict) and head.get("format") == TRACE_FORMAT:
        return _cut(_read_moestream(path), max_tokens)
    if isinstance(head, dict) and "layer" in head:
        return _cut(_read_jsonl(path), max_tokens)
    raise MoestreamError(f"trace {path}: line 1 is neither a moestream trace header nor a routing record "
                         f"(an object with 'layer' and one of {', '.join(EXPERT_FIELDS)})")


def _cut(trace: Trace, max_tokens: int | None) -> Trace:
    if max_tokens is None:
        return trace
    keep = [i for i, (t, _l, _r) in enumerate(trace.records) if t < max_tokens]
    recs = [(t, layer, rows[: max_tokens - t]) for t, layer, rows in (trace.records[i] for i in keep)]
    ahead = [trace.ahead[i] for i in keep] if trace.ahead else []
    chunk = [trace.chunk[i] for i in keep] if trace.chunk else []
    return Trace(trace.path, trace.format, trace.header, recs, ahead, chunk)


def _lines(path: Path):
    try:
        with open(path) as f:
            yield from enumerate(f, 1)
    except (OSError, UnicodeDecodeError) as e:
        raise MoestreamError(f"trace {path}: cannot read: {getattr(e, 'strerror', None) or e}") from None


def _pairs(value) -> Ahead:
    """``[[layer, [expert, ...]], ...]`` as ``[(layer, [expert, ...]), ...]``; raises TypeError/ValueError."""
    return [(int(layer), [int(e) for e in es]) for layer, es in value]


def _read_moestream(path: Path) -> Trace:
    header, records, ahead, chunk = {}, [], [], []
    for n, line in _lines(path):
        if n == 1:
            header = json.loads(line)
            continue
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            rec = (int(r["token"]), int(r["layer"]), _ids(r["experts"], "experts"))
            pred = _pairs(r.get("ahead", []))
            plan = None if r.get("chunk") is None else _pairs(r["chunk"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise MoestreamError(f"trace {path}: line {n} is not a routing record ({e})") from None
        records.append(rec)
        ahead.append(pred)
        chunk.append(plan)
    return Trace(path, "moestream", header, records, ahead, chunk)


def _read_jsonl(path: Path) -> Trace:
    raw, counters = [], {}
    for n, line in _lines(path):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            if not isinstance(r, dict):
                raise ValueError("not a JSON object")
            key = next((k for k in EXPERT_FIELDS if k in r), None)
            if key is None:
                raise ValueError(f"no expert ids (one of {', '.join(EXPERT_FIELDS)})")
            layer = r["layer"]
            if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
                raise ValueError(f"layer {layer!r} is not an index")
            rows = _ids(r[key], key)
            tkey = next((k for k in TOKEN_FIELDS if k in r), None)
            if tkey is None:
                token = counters.get(layer, 0)
            else:
                token = r[tkey]
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    raise ValueError(f"{tkey} {token!r} is not a position")
            counters[layer] = token + len(rows)
        except (json.JSONDecodeError, KeyError, ValueError) as e:
            raise MoestreamError(f"trace {path}: line {n} is not a routing record ({e})") from None
        raw.append((token, layer, rows))
    if not raw:
        raise MoestreamError(f"trace {path}: no routing records")
    raw.sort(key=lambda r: (r[0], r[1]))  # the order a forward pass visits them
    return Trace(path, "jsonl", {}, raw, [[] for _ in raw], [None for _ in raw])


def _read_flame(path: Path, max_tokens: int | None) -> Trace:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MoestreamError(f"trace {path}: reading parquet (FLAME-MoE) traces needs pyarrow; "
                             "install it with: pip install pyarrow") from None
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise MoestreamError(f"trace {path}: no .parquet files in the folder")
    per_layer: dict[int, list[list[int]]] = {}
    for i, f in enumerate(files):
        m = re.search(r"layer_?(\d+)", f.stem)
        layer = int(m.group(1)) if m else i
        if layer in per_layer:
            raise MoestreamError(f"trace {f}: layer {layer} appears twice in {path}")
        try:
            pf = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises its own error types for a corrupt file
            raise MoestreamError(f"trace {f}: not a parquet file ({e})") from None
        names = pf.schema_arrow.names
        if "indices" not in names:
            raise MoestreamError(f"trace {f}: no 'indices' column (FLAME-MoE's expert ids); columns: {names}")
        rows: list[list[int]] = []
        for batch in pf.iter_batches(columns=["indices"], batch_size=65536):
            for r in batch.column(0).to_pylist():
                if max_tokens is not None and len(rows) >= max_tokens:
                    break
                try:
                    rows.append(_ids(r, "indices")[0] if r and not isinstance(r[0], list) else _bad(r))
                except ValueError as e:
                    raise MoestreamError(f"trace {f}: row {len(rows)} is not a routing record ({e})") from None
            if max_tokens is not None and len(rows) >= max_tokens:
                break
        per_layer[layer] = rows
    n = min(len(r) for r in per_layer.values())
    records = [(t, layer, [per_layer[layer][t]]) for t in range(n) for layer in sorted(per_layer)]
    return Trace(path, "flame-moe", {}, records, [[] for _ in records], [None for _ in records])


def _bad(r):
    raise ValueError(f"indices holds {r!r:.60}, not a list of expert ids")
