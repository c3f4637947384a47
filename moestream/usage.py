"""Which experts a model uses: usage profiles, hot lists, pin files and routing traces.

- A **usage profile** (``~/.cache/moestream/usage/<model>-<id>.json``, or
  ``--usage-file``) holds, per MoE layer, a decayed count of the token routings that
  chose each expert. The engine saves it when it closes (merged with the previous
  profile: ``DECAY x previous + this run``) and preloads and pins the hottest experts
  from it at the next start.
- A **hot list** (``hot_experts.json`` in the model folder) and a **pin file**
  (``--pin-file``) are ``{"pin": [[layer, expert], ...]}``, hottest first, optionally with
  the ``model_id`` they were made for.
- A **routing trace** (``--trace FILE``) is JSON lines: a header, then one record per
  MoE layer per forward pass, ``{"token": t0, "layer": l, "experts": [[e, ...], ...],
  "ahead": [[l + 1, [e, ...]], [l + 2, [e, ...]]], "chunk": [[l + 1, [e, ...]]]}`` (one row of
  top-k expert indices per token, tokens t0, t0+1, ...; ``ahead``: the experts the next two MoE
  layers' routers predict from this layer's input, what ``--prefetch-ahead`` would read; ``chunk``,
  in records of several tokens: the next layer's experts in the order prefill reads them ahead,
  up to the header's ``chunk_window``), which ``moestream cache-sim`` replays
  (:mod:`moestream.traces` reads it and public formats).

A profile, hot list or pin file that is not valid JSON, belongs to another model, or
names layers or experts the model does not have is ignored with a warning naming the
file, and never rewritten (a pin file that does not exist is refused with the options:
:class:`~moestream.options.EngineOptions`). Profiles are written to a temporary file in the same folder
and renamed over the old one, so a crash never leaves one half-written.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch

from .errors import MoestreamError, given
from .models.moe import StreamedMoE
from .prefetch import following_blocks, predict_chunk, predict_next
from .traces import TRACE_FORMAT, load_trace

Key = tuple[int, int]
DECAY = 0.5  # weight of the previous profile when a run's counts are merged in
# options.HOT_FRACTION (--hot-fraction): the share of the budget hot lists and usage profiles may pin, 0 (off) by
# default. HOT_SHARE is the share a hot list gets when asked for without a number (cache-sim --hot-from).
HOT_SHARE = 0.5
HOT_LIST = "hot_experts.json"
PROFILE_FORMAT = "moestream-usage"
TRACE_AHEAD = 2  # following MoE layers whose predicted experts a trace records (cache-sim's prefetch depths)


def warn(msg: str) -> None:
    """Print a one-line warning to stderr."""
    print(f"moestream: warning: {msg}", file=sys.stderr, flush=True)


def note(msg: str) -> None:
    """Print a one-line note to stderr."""
    print(f"moestream: {msg}", file=sys.stderr, flush=True)


def usage_dir() -> Path:
    """The user cache folder for usage profiles (``$XDG_CACHE_HOME`` or ``~/.cache``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moestream" / "usage"


def model_identity(checkpoint, router_name: str | None) -> str:
    """A 16-hex-digit id of a checkpoint's identity, the same for every copy of it.

    Hashes (SHA-256) the config, every tensor's name, dtype and shape, and the stored
    bytes of one router weight (``router_name``: fine-tunes of one architecture differ
    there), so profiles of one model are never applied to another.
    """
    h = hashlib.sha256()
    h.update(json.dumps(checkpoint.config, sort_keys=True).encode())
    for name in sorted(checkpoint.tensors):
        t = checkpoint.tensors[name]
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
    if router_name is not None and router_name in checkpoint.tensors:
        w = checkpoint.read_tensor(router_name)
        h.update(w.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def default_profile_path(model_path: Path, model_id: str) -> Path:
    """Where the usage profile of a model lives by default."""
    return usage_dir() / f"{Path(model_path).name or 'model'}-{model_id}.json"


def _load_json(path: Path) -> tuple[object, str | None]:
    try:
        return json.loads(Path(path).read_text()), None
    except FileNotFoundError:
        return None, "does not exist"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"is not valid JSON ({e})"


def read_profile(path: Path, model_id: str, num_experts: dict[int, int]) -> tuple[dict[int, list[float]] | None, str]:
    """Read a usage profile; return ``(layer -> counts [num_experts], "")`` or ``(None, problem)``.

    ``problem`` says why the file cannot be used (not JSON, another model, wrong shape).
    """
    data, err = _load_json(path)
    if err:
        return None, err
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT or not isinstance(data.get("counts"), dict):
        return None, f"is not a moestream usage profile (needs format {PROFILE_FORMAT!r} and counts)"
    if data.get("model_id") != model_id:
        return None, f"belongs to another model (model_id {data.get('model_id')!r}, this model is {model_id!r})"
    counts: dict[int, list[float]] = {}
    for k, v in data["counts"].items():
        try:
            layer = int(k)
        except ValueError:
            return None, f"has layer {k!r}, not a layer index"
        n = num_experts.get(layer)
        if n is None:
            return None, f"has layer {layer}, which is not a MoE layer of this model"
        if (
            not isinstance(v, list) or len(v) != n
            or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c >= 0
                       for c in v)
        ):
            return None, f"layer {layer}: counts must be {n} finite numbers >= 0"
        counts[layer] = [float(c) for c in v]
    return counts, ""


def ranked(counts: dict[int, list[float]]) -> list[Key]:
    """Experts with a positive count, hottest first (ties: lower layer, then lower expert)."""
    keys = [(layer, e) for layer, row in counts.items() for e, c in enumerate(row) if c > 0]
    return sorted(keys, key=lambda k: (-counts[k[0]][k[1]], k))


def write_json_atomic(path: Path, data: object) -> None:
    """Write ``data`` as JSON to a temporary file beside ``path``, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)  # the rename itself survives a power cut, not only a kill
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (a rename) to disk, where the OS allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a folder: the rename is still atomic
    finally:
        os.close(fd)


def save_profile(
    path: Path, model_id: str, model_name: str, num_experts: dict[int, int], usage: dict[int, torch.Tensor]
) -> bool:
    """Merge this run's routing counts (``usage``: layer -> int64 [num_experts]) into the profile at ``path``.

    The merge is ``DECAY x previous + this run``. A run that routed nothing writes nothing.
    An existing file that cannot be used (corrupt, another model's, wrong shape) is left
    as it is, with a warning. Returns whether the profile was written.
    """
    run = {layer: [float(c) for c in usage[layer].tolist()] for layer in sorted(num_experts) if layer in usage}
    if not any(any(row) for row in run.values()):
        return False
    path = Path(path)
    merged = run
    if path.exists():
        prev, problem = read_profile(path, model_id, num_experts)
        if prev is None:
            warn(f"usage profile {path} {problem}; left as it is, this run's usage is not saved")
            return False
        merged = {
            layer: [DECAY * p + c for p, c in zip(prev.get(layer, [0.0] * len(row)), row)] for layer, row in run.items()
        }
    data = {
        "format": PROFILE_FORMAT, "version": 1, "model_id": model_id, "model": model_name, "decay": DECAY,
        "counts": {str(layer): row for layer, row in merged.items()},
    }
    try:
        write_json_atomic(path, data)
    except OSError as e:
        warn(f"usage profile {path}: cannot write ({e.strerror or e}); not saved")
        return False
    return True


def read_keys(path: Path, model_id: str, num_experts: dict[int, int]) -> tuple[list[Key] | None, str]:
    """Read a hot list or pin file ``{"pin": [[layer, expert], ...]}``; return ``(keys, "")`` or ``(None, problem)``.

    Duplicates are dropped (the first place counts). A ``model_id`` in the file must match.
    """
    data, err = _load_json(path)
    if err:
        return None, err
    if not isinstance(data, dict) or not isinstance(data.get("pin"), list):
        return None, 'is not {"pin": [[layer, expert], ...]}'
    if "model_id" in data and data["model_id"] != model_id:
        return None, f"belongs to another model (model_id {data['model_id']!r}, this model is {model_id!r})"
    keys: list[Key] = []
    for i, item in enumerate(data["pin"]):
        if (
            not isinstance(item, list) or len(item) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in item)
        ):
            return None, f"pin[{i}] is {item!r}, not [layer, expert]"
        layer, e = item
        if layer not in num_experts:
            return None, f"pin[{i}]: layer {layer} is not a MoE layer of this model"
        if not 0 <= e < num_experts[layer]:
            return None, f"pin[{i}]: expert {e} is out of range for layer {layer} ({num_experts[layer]} experts)"
        keys.append((layer, e))
    return list(dict.fromkeys(keys)), ""


def write_keys(path: Path, keys: list[Key], model_id: str) -> None:
    """Write a hot list (atomically)."""
    write_json_atomic(Path(path), {"model_id": model_id, "pin": [[layer, e] for layer, e in keys]})


class TraceWriter:
    """Writes a routing trace (JSON lines): a header, then one record per MoE layer per forward pass.

    Args:
        path: the file to create (replaced if it exists).
        header: model facts the simulator needs (``num_experts`` and ``expert_bytes`` per
            layer, ``top_k``, ``model_id``, ``ahead``, ``chunk_window``).
        predict: ``predict(layer, x)`` -> the experts the following MoE layers' routers predict
            from layer ``layer``'s input ``x`` [T, H] (``[(layer, [expert, ...]), ...]``, as
            ``--prefetch-ahead`` would read them); recorded as ``ahead`` so that ``cache-sim``
            can replay prefetch. None: not recorded.
        chunk: ``chunk(layer, x)`` -> for ``x`` of several tokens, the next MoE layer's experts in the
            order prefill reads them ahead (``[(layer, [expert, ...])]``, ``[]`` at the last layer:
            :func:`moestream.prefetch.predict_chunk`); recorded as ``chunk`` in records of more than
            one token, so that ``cache-sim`` replays prefill read-ahead. None: not recorded.

    Raises:
        MoestreamError: the file cannot be created (naming it).
    """

    def __init__(self, path: Path, header: dict, predict=None, chunk=None):
        self.path = Path(path)
        self.predict, self.chunk = predict, chunk
        try:
            self._f = open(self.path, "w")  # noqa: SIM115 -- closed by close()
        except OSError as e:
            raise MoestreamError(f"--trace {self.path}: cannot write: {e.strerror or e}") from None
        self._f.write(json.dumps({"format": TRACE_FORMAT, "version": 1, **header}) + "\n")
        self._token = 0
        self._last: tuple[int, int] | None = None  # (layer, tokens) of the last record

    def route(self, layer: int, idx: torch.Tensor, x: torch.Tensor | None = None) -> None:
        """Record that layer ``layer`` routed the tokens of this forward pass to ``idx`` [T, K]
        (``x`` [T, H]: the layer's MoE input, for the predictions of the following layers)."""
        if self._last is not None and layer <= self._last[0]:  # a new forward pass
            self._token += self._last[1]
        self._last = (layer, idx.shape[0])
        ahead = self.predict(layer, x) if self.predict is not None and x is not None else None
        self.record(self._token, layer, idx.tolist(), ahead, self.plan_chunk(layer, x))

    def plan_chunk(self, layer: int, x: torch.Tensor | None):
        """What ``chunk`` says for ``x`` [T, H] of more than one token; None otherwise (one token, or not recorded)."""
        return self.chunk(layer, x) if self.chunk is not None and x is not None and x.shape[0] > 1 else None

    def record(self, token: int, layer: int, experts: list[list[int]], ahead=None, chunk=None) -> None:
        """Write one record: tokens ``token``.. routed at ``layer`` to ``experts`` [T][K]; ``ahead``: the
        following layers' predicted experts ``[(layer, [expert, ...]), ...]``; ``chunk``: the next layer's
        experts in chunk read-ahead order ``[(layer, [expert, ...])]`` (either None: not recorded)."""
        rec = {"token": token, "layer": layer, "experts": experts}
        if ahead is not None:
            rec["ahead"] = [[nxt, es] for nxt, es in ahead]
        if chunk is not None:
            rec["chunk"] = [[nxt, es] for nxt, es in chunk]
        self._f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def read_trace(path: Path) -> tuple[dict, list[tuple[int, int, list[list[int]]]]]:
    """Read a moestream routing trace: ``(header, [(token, layer, experts [T][K]), ...])``.

    Other formats (public JSON lines, FLAME-MoE parquet) and the recorded predictions:
    :func:`moestream.traces.load_trace`.

    Raises:
        MoestreamError: the file is missing, not a moestream trace, or a line is malformed
            (naming file and line).
    """
    trace = load_trace(path)
    if trace.format != "moestream":
        raise MoestreamError(f"trace {path}: line 1 is not a moestream trace header")
    return trace.header, trace.records


class UsageState:
    """What a loaded engine must do at close: save the usage profile, close the trace."""

    def __init__(self, model_id: str, model_name: str, num_experts: dict[int, int], profile_path: Path | None,
                 trace: TraceWriter | None):
        self.model_id, self.model_name, self.num_experts = model_id, model_name, num_experts
        self.profile_path, self.trace = profile_path, trace

    def close(self, cache) -> None:
        """Merge the cache's routing counts into the profile (when learning); close the trace."""
        try:
            if self.profile_path is not None:
                save_profile(self.profile_path, self.model_id, self.model_name, self.num_experts, cache.usage)
        finally:
            if self.trace is not None:
                self.trace.close()


def setup_cache_policy(checkpoint, model, cache, num_experts: dict[int, int], options, trace=None,
                       owns=None) -> UsageState:
    """Apply the expert-usage options of an :class:`~moestream.options.EngineOptions` to a loaded
    model and its cache.

    Warns that ``max_active_experts`` changes the output below the model's top-k (the expert
    pipeline applies it); pins the experts of the pin file (up to the whole budget), then, when
    ``options.hot_fraction`` > 0, of the hot list and the usage profile (up to that share of the
    budget), saying how many; opens the routing trace ``trace`` (``UsageState.trace``, which the
    expert pipeline feeds, with the next layers' predicted experts as ``ahead``).
    Bad files are ignored with a warning naming them. ``owns`` (expert parallelism: this rank's
    ``(layer, expert) -> bool``) keeps pins to this rank's experts.

    Raises:
        MoestreamError: the trace file cannot be created.
        ReadError: an expert read fails while pinning.
    """
    max_active_experts, hotlist, pin_file = options.max_active_experts, options.hotlist, options.pin_file
    usage_file, learn_experts, hot_fraction = options.usage_file, options.learn_experts, options.hot_fraction
    top_k = model.top_k
    if max_active_experts:
        said = given(options.name("max_active_experts"), max_active_experts)
        if max_active_experts < top_k:
            warn(
                f"{said}: each token keeps only its {max_active_experts} "
                f"highest-weight routed experts of {top_k}; the output changes (it is not the model's own routing)"
            )
        elif max_active_experts > top_k:
            warn(f"{said} is above the model's top-k {top_k}: it has no effect")
    router = next((n + ".gate.weight" for n, m in model.named_modules() if isinstance(m, StreamedMoE)), None)
    model_id = model_identity(checkpoint, router)
    name = checkpoint.path.name
    budget = cache.budget_bytes
    if budget:  # nothing to pin with every expert resident (None) or no cache (0)
        if pin_file is not None:
            keys, problem = read_keys(Path(pin_file), model_id, num_experts)
            if keys is None:
                warn(f"pin file {pin_file} {problem}; ignored")
            else:
                keys = keys if owns is None else [k for k in keys if owns(k)]
                n = cache.pin(keys)
                note(f"pinned {n} of {len(keys)} experts from {pin_file} ({cache.pinned_bytes / 1e9:.2f} GB)")
        hot, sources = [], []
        hot_path = checkpoint.path / HOT_LIST
        if hot_fraction <= 0:  # off (the default): say so once if a hot list is there to be used
            if hotlist and hot_path.exists():
                note(f"hot list {hot_path} not pinned: --hot-fraction is 0 (the default; recency beats pinning "
                     "by frequency on trained models' routing)")
        elif hotlist and hot_path.exists():
            keys, problem = read_keys(hot_path, model_id, num_experts)
            if keys is None:
                warn(f"hot list {hot_path} {problem}; ignored")
            else:
                hot += keys
                sources.append(str(hot_path))
        if learn_experts and hot_fraction > 0:
            path = Path(usage_file) if usage_file is not None else default_profile_path(checkpoint.path, model_id)
            if path.exists():
                counts, problem = read_profile(path, model_id, num_experts)
                if counts is None:
                    warn(f"usage profile {path} {problem}; ignored")
                else:
                    hot += ranked(counts)
                    sources.append(str(path))
        if owns is not None:
            hot = [k for k in hot if owns(k)]
        if hot:
            before = cache.pinned_bytes
            n = cache.pin(hot, int(hot_fraction * budget))  # pins of the pin file count too
            note(
                f"pinned {n} hot experts ({(cache.pinned_bytes - before) / 1e9:.2f} GB, up to {hot_fraction:.0%} "
                f"of the cache budget) from {' and '.join(sources)}"
            )
    profile_path = None
    if learn_experts:
        profile_path = Path(usage_file) if usage_file is not None else default_profile_path(checkpoint.path, model_id)
    writer = None
    if trace is not None:
        # the prefetcher (started before this) reads prefill chunks ahead only on the CPU cache with a budget
        prefetcher = getattr(cache, "prefetcher", None)
        header = {
            "model_id": model_id, "model": name, "top_k": top_k, "max_active_experts": max_active_experts,
            "num_experts": {str(k): v for k, v in num_experts.items()},
            "expert_bytes": {str(k): cache.store.cached_nbytes((k, 0)) for k in num_experts},
            "ahead": TRACE_AHEAD, "chunk_window": prefetcher.window if prefetcher is not None else 0,
        }
        following = following_blocks(model.moe_blocks(), TRACE_AHEAD)
        writer = TraceWriter(Path(trace), header, lambda layer, x: predict_next(following.get(layer, ()), x),
                             lambda layer, x: predict_chunk(following.get(layer, ()), x))
    return UsageState(model_id, name, num_experts, profile_path, writer)
