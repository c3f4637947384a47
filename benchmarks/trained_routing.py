"""Routing traces of ``spread`` and ``trained`` synth checkpoints on the bench's token streams, and the cache
decisions replayed on them (docs/benchmarks.md, "Routing like trained models").

Record (real moestream runs; every expert resident, so nothing but the routing is measured):

    python benchmarks/trained_routing.py record --config ../shared/models/configs/Qwen3-30B-A3B.json \\
        --layers 12 --work /tmp/tr --out traces/ [--inits spread,trained] [--budget all] [--tokens tokens.json]

For each init: ``moestream synth`` of the config's first ``--layers`` layers (bf16), then each stream through
``moestream.engine.load`` with ``--trace``: its chat prompt prefilled in the CLI's 512-token chunks, then its
continuation fed one token per step, as ``benchmarks/bench_worker.py`` feeds every engine. The streams:
``bench`` (``../shared/bench/prompt.txt`` and ``continuation.txt``) and ``keeper`` (the side-by-side bench's
prompt and continuation, ``benchmarks/bench_text.py``), Qwen3 tokenizer. The checkpoint is deleted after its
runs unless ``--keep``.

Analyze (seconds; no model needed):

    python benchmarks/trained_routing.py analyze --traces traces/ [--residency 0.1,0.2,0.3,0.4]

prints, per shape and init, each stream's locality statistics and the cache-policy tables (lru, lfu, layer,
Belady's MIN; prefetch depth 0-2; hot list off, or made from the other stream's trace), as markdown.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared"


def streams(tokenizer: Path | None = None) -> dict[str, dict[str, list[int]]]:
    """name -> {"prompt": chat-templated prompt ids, "stream": continuation ids}."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(HERE))
    import bench_text

    tok = AutoTokenizer.from_pretrained(str(tokenizer or SHARED / "tokenizers/qwen3"), local_files_only=True)

    def chat(text: str) -> list[int]:
        t = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return tok.encode(t, add_special_tokens=False)

    return {
        "bench": {"prompt": chat((SHARED / "bench/prompt.txt").read_text()),
                  "stream": tok.encode((SHARED / "bench/continuation.txt").read_text(), add_special_tokens=False)},
        "keeper": {"prompt": chat(bench_text.INSTRUCTION + bench_text.PASSAGE),
                   "stream": tok.encode(bench_text.CONTINUATION, add_special_tokens=False)},
    }


def log(msg: str) -> None:
    print(f"[trained-routing {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class StepTrace:
    """The fast path's trace: the stream's tokens fed in prefill chunks, recorded as the one-token steps of a
    decode run (a record of one row per token and layer, its predictions from that token's row alone), in the
    order a decode run visits them (token by token, layer by layer); the prompt's chunks as they are."""

    def __init__(self, writer, prompt_len: int):
        self.writer, self.prompt_len, self.start = writer, prompt_len, 0
        self.records: list[tuple[int, int, list, list, list | None]] = []

    def route(self, layer, idx, x=None) -> None:
        rows = idx.tolist()
        if self.start < self.prompt_len:  # a prompt chunk: as the engine's prefill records it
            w = self.writer
            self.records.append((self.start, layer, rows, w.predict(layer, x), w.plan_chunk(layer, x)))
            return
        for j, row in enumerate(rows):
            self.records.append((self.start + j, layer, [row], self.writer.predict(layer, x[j : j + 1]), None))

    def flush(self) -> None:
        for token, layer, rows, ahead, chunk in sorted(self.records, key=lambda r: (r[0], r[1])):
            self.writer.record(token, layer, rows, ahead, chunk)
        self.records.clear()


def run_stream(engine, prompt: list[int], stream: list[int], fast: bool) -> float:
    """Feed ``prompt`` (prefilled in the CLI's 512-token chunks) then ``stream``: one token per step, or with
    ``fast`` in 512-token chunks traced as steps (:class:`StepTrace`). Returns seconds per fed token."""
    import torch

    model, kv = engine.model, engine.model.new_kv_cache(len(prompt) + len(stream) + 1)
    ids = torch.tensor(prompt + stream, dtype=torch.int64)
    # the fast path stands in for the expert pipeline's trace writer, and hands it back when done
    step = StepTrace(engine.pipeline.trace, len(prompt)) if fast else None
    if step is not None:
        engine.pipeline.trace = step
    with torch.inference_mode():
        for i in range(0, len(prompt), 512):
            if step is not None:
                step.start = i
            model(ids[i : min(i + 512, len(prompt))], i, kv)
        t0 = time.perf_counter()
        if fast:
            for i in range(len(prompt), len(ids), 512):
                step.start = i
                model(ids[i : i + 512], i, kv)
            step.flush()
            engine.pipeline.trace = step.writer
        else:
            for pos in range(len(prompt), len(ids)):
                model(ids[pos : pos + 1], pos, kv)
    return (time.perf_counter() - t0) / max(1, len(stream))


def record(a) -> None:
    from moestream.engine import load
    from moestream.synth import synth

    toks = json.loads(a.tokens.read_text()) if a.tokens else streams()
    toks = {n: s for n, s in toks.items() if a.streams is None or n in a.streams.split(",")}
    if a.max_fed:
        toks = {n: {"prompt": s["prompt"], "stream": s["stream"][: a.max_fed]} for n, s in toks.items()}
    a.out.mkdir(parents=True, exist_ok=True)
    shape = a.config.stem + f"-{a.layers}l"
    for init in a.inits.split(","):
        model = a.work / f"{shape}-{init}"
        if not model.exists():
            t0 = time.perf_counter()
            synth(a.config, model, layers=a.layers, init=init, seed=a.seed)
            log(f"synth {model.name}: {time.perf_counter() - t0:.0f} s")
        for name, s in toks.items():
            trace = a.out / f"{shape}-{init}-{name}.jsonl"
            t0 = time.perf_counter()
            engine = load(model, cache_budget_gb=a.budget, tokenizer=False, trace=trace, learn_experts=False)
            try:
                per = run_stream(engine, s["prompt"], s["stream"], a.fast)
            finally:
                engine.close()
            log(f"trace {trace.name}: {len(s['prompt'])} prompt + {len(s['stream'])} fed tokens "
                f"({'in chunks, traced as steps' if a.fast else 'one per step'}), {time.perf_counter() - t0:.0f} s, "
                f"{per * 1e3:.0f} ms per fed token")
        if not a.keep:
            shutil.rmtree(model)


def replay(traces: dict, residency: float, policy: str, depth: int = 0, hot: float = 0.0) -> tuple[float, float]:
    """(decode hit rate, experts read per decode lookup) over ``traces`` (name -> Trace), each replayed from an empty
    cache of ``residency`` x the model's expert bytes; ``hot``: the share of the budget pinned with the hot list
    made from the other traces (as a usage profile learnt on other text)."""
    from moestream.cachesim import hot_keys, requests_of, simulate_policy

    hits = looks = reads = 0
    for n, tr in traces.items():
        sizes = tr.expert_bytes
        one = max(sizes.values())
        budget = int(residency * sum(sizes[k] * v for k, v in tr.num_experts.items()))
        reqs, decode = requests_of(tr.records)
        pins = None
        if hot:
            pins = hot_keys([t for m, t in traces.items() if m != n])[: int(hot * budget) // one]
        s = simulate_policy(policy, reqs, lambda k, s=sizes: s[k[0]], budget, decode, sum(tr.num_experts.values()),
                            pinned=pins, ahead=tr.ahead, depth=depth, chunk=tr.chunk, window=tr.chunk_window)
        hits, looks, reads = hits + s.decode_hits, looks + s.decode_lookups, reads + s.decode_reads
    return hits / looks, reads / looks


def analyze(a) -> str:
    from moestream.cachesim import locality, requests_of
    from moestream.policies import POLICIES
    from moestream.traces import load_trace

    res = [float(x) for x in a.residency.split(",")]
    groups: dict[str, dict[str, dict]] = {}
    for f in sorted(a.traces.glob("*.jsonl")):
        shape, init, name = f.stem.rsplit("-", 2)
        groups.setdefault(shape, {}).setdefault(init, {})[name] = load_trace(f)
    out = []
    for shape, inits in sorted(groups.items()):
        out += ["", f"### {shape}", "", "Locality of each stream (decode steps and prefill alike, per layer, pooled):",
                "", "| init | stream | tokens (fed) | next-token reuse | reuse within 8 | reuse distance p50 / p90 | "
                "distinct experts / layer (min) | usage Gini | per-layer LRU 12.5% / 25% / 40% |", "|" + " --- |" * 9]
        for init, traces in inits.items():
            for n, tr in traces.items():
                _, decode = requests_of(tr.records)
                first = tr.records[0][1]
                fed = sum(1 for d, rec in zip(decode, tr.records) if d and rec[1] == first)
                loc = locality(tr.records, tr.num_experts)
                d, p = list(loc.distinct.values()), loc.reuse_distance
                out.append(
                    f"| `{init}` | {n} | {tr.tokens} ({fed}) | {loc.next_token_reuse:.1%} | {loc.reuse_within:.1%} | "
                    f"{p[50]:g} / {p[90]:g} | {sum(d) / len(d):.1f} ({min(d)}) of {max(tr.num_experts.values())} | "
                    f"{sum(loc.gini.values()) / len(loc.gini):.3f} | "
                    + " / ".join(f"{loc.lru[r]:.1%}" for r in (0.125, 0.25, 0.4)) + " |")
        pols = [*POLICIES, "belady"]
        out += ["", "Decode hit rate by cache policy (both streams, each from an empty cache):", "",
                "| residency | " + " | ".join(f"`{i}` {p}" for i in inits for p in pols) + " |",
                "|" + " --- |" * (1 + len(inits) * len(pols))]
        for r in res:
            out.append(f"| {r:.0%} | " + " | ".join(f"{replay(t, r, p)[0]:.1%}" for t in inits.values()
                                                      for p in pols) + " |")
        cols = [(p, d, h) for p in ("lru", "layer") for d, h in ((0, 0.0), (0, 0.1), (0, 0.5), (1, 0.0), (2, 0.0))]
        for init, traces in inits.items():
            out += ["", f"`{init}`: prefetch depth and hot list (decode hit rate, prefetch hits counted as the engine "
                    "counts them / experts read per decode lookup):", "",
                    "| residency | " + " | ".join(f"{p}{f' +{d} ahead' if d else ''}{f' +hot {h:.0%}' if h else ''}"
                                                 for p, d, h in cols) + " |", "|" + " --- |" * (1 + len(cols))]
            for r in res:
                cells = []
                for p, d, h in cols:
                    hit, reads = replay(traces, r, p, d, h)
                    cells.append(f"{hit:.1%} / {reads:.2f}")
                out.append(f"| {r:.0%} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def check(pa: Path, pb: Path) -> str:
    """How many (token, layer) routings and predictions two traces of one stream share, and whether their
    requests (what the cache sees, in order) are the same."""
    from moestream.cachesim import requests_of
    from moestream.traces import load_trace

    ta, tb = load_trace(pa), load_trace(pb)

    def per_token(tr):
        out, pred = {}, {}
        for (t0, layer, rows), ahead in zip(tr.records, tr.ahead):
            for j, row in enumerate(rows):
                out[(t0 + j, layer)] = row
            if len(rows) == 1:
                pred[(t0, layer)] = ahead
        return out, pred

    (ra, pa_), (rb, pb_) = per_token(ta), per_token(tb)
    same = sum(ra[k] == rb.get(k) for k in ra)
    sets = sum(set(ra[k]) == set(rb.get(k, ())) for k in ra)
    keys = set(pa_) & set(pb_)
    psame = sum(pa_[k] == pb_[k] for k in keys)
    pset = sum([(layer, set(es)) for layer, es in pa_[k]] == [(layer, set(es)) for layer, es in pb_[k]] for k in keys)
    qa, qb = requests_of(ta.records), requests_of(tb.records)
    return (f"{pa.name} vs {pb.name}: {same} of {len(ra)} (token, layer) routings identical in order, {sets} as sets; "
            f"{psame} of {len(keys)} one-token predictions identical in order, {pset} as sets; requests identical: "
            f"{qa == qb}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--config", type=Path, required=True)
    r.add_argument("--layers", type=int, required=True)
    r.add_argument("--work", type=Path, required=True, help="where the checkpoints go")
    r.add_argument("--out", type=Path, required=True, help="where the traces go")
    r.add_argument("--inits", default="spread,trained")
    r.add_argument("--budget", default="all", help="cache budget (GB or all; the routing is the same at any)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--tokens", type=Path, default=None, help="the streams as JSON (from `tokens`), else tokenized")
    r.add_argument("--keep", action="store_true")
    r.add_argument("--streams", default=None, help="comma-separated: bench, keeper (default both)")
    r.add_argument("--max-fed", type=int, default=None, help="feed only the first N tokens of each continuation")
    r.add_argument("--fast", action="store_true",
                   help="feed each stream in 512-token chunks, traced as one-token steps (the `check` command "
                        "measures that it routes as one token per step)")
    c = sub.add_parser("check", help="compare two traces of the same stream token by token (fast path vs steps)")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    t = sub.add_parser("tokens", help="write the streams' token ids as JSON (for a machine without ../shared)")
    t.add_argument("--out", type=Path, required=True)
    an = sub.add_parser("analyze")
    an.add_argument("--traces", type=Path, required=True)
    an.add_argument("--residency", default="0.1,0.2,0.3,0.4")
    a = p.parse_args()
    if a.cmd == "record":
        record(a)
    elif a.cmd == "check":
        print(check(a.a, a.b))
    elif a.cmd == "tokens":
        a.out.write_text(json.dumps(streams()))
    else:
        print(analyze(a))


if __name__ == "__main__":
    main()
