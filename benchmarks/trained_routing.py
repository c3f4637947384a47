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


def record(a) -> None:
    import torch

    from moestream.engine import load
    from moestream.synth import synth

    toks = json.loads(a.tokens.read_text()) if a.tokens else streams()
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
                with torch.inference_mode():
                    kv = engine.model.new_kv_cache(len(s["prompt"]) + len(s["stream"]) + 1)
                    ids = torch.tensor(s["prompt"], dtype=torch.int64)
                    for i in range(0, len(ids), 512):
                        engine.model(ids[i : i + 512], i, kv)
                    pos = len(s["prompt"])
                    t1 = time.perf_counter()
                    for tok in s["stream"]:
                        engine.model(torch.tensor([tok], dtype=torch.int64), pos, kv)
                        pos += 1
                    t2 = time.perf_counter()
            finally:
                engine.close()
            log(f"trace {trace.name}: {len(s['prompt'])} prompt + {len(s['stream'])} fed tokens, load+prefill "
                f"{t1 - t0:.0f} s, {(t2 - t1) / len(s['stream']) * 1e3:.0f} ms per fed token")
        if not a.keep:
            shutil.rmtree(model)


def replay(traces: dict, residency: float, policy: str, depth: int = 0, hot: bool = False) -> tuple[float, float]:
    """(decode hit rate, experts read per decode lookup) over ``traces`` (name -> Trace), each replayed from an empty
    cache of ``residency`` x the model's expert bytes; ``hot``: pinned, up to ``HOT_FRACTION`` of the budget, the
    hot list made from the other traces (as a usage profile learnt on other text)."""
    from moestream.cachesim import hot_keys, requests_of, simulate_policy
    from moestream.usage import HOT_FRACTION

    hits = looks = reads = 0
    for n, tr in traces.items():
        sizes = tr.expert_bytes
        one = max(sizes.values())
        budget = int(residency * sum(sizes[k] * v for k, v in tr.num_experts.items()))
        reqs, decode = requests_of(tr.records)
        pins = None
        if hot:
            pins = hot_keys([t for m, t in traces.items() if m != n])[: int(HOT_FRACTION * budget) // one]
        s = simulate_policy(policy, reqs, lambda k, s=sizes: s[k[0]], budget, decode, sum(tr.num_experts.values()),
                            pinned=pins, ahead=tr.ahead, depth=depth)
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
        cols = [(p, d, h) for p in ("lru", "layer") for d, h in ((0, False), (0, True), (1, False), (2, False),
                                                                 (1, True))]
        for init, traces in inits.items():
            out += ["", f"`{init}`: prefetch depth and hot list (decode hit rate, prefetch hits counted as the engine "
                    "counts them / experts read per decode lookup):", "",
                    "| residency | " + " | ".join(f"{p}{f' +{d} ahead' if d else ''}{' +hot' if h else ''}"
                                                 for p, d, h in cols) + " |", "|" + " --- |" * (1 + len(cols))]
            for r in res:
                cells = []
                for p, d, h in cols:
                    hit, reads = replay(traces, r, p, d, h)
                    cells.append(f"{hit:.1%} / {reads:.2f}")
                out.append(f"| {r:.0%} | " + " | ".join(cells) + " |")
    return "\n".join(out)


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
    t = sub.add_parser("tokens", help="write the streams' token ids as JSON (for a machine without ../shared)")
    t.add_argument("--out", type=Path, required=True)
    an = sub.add_parser("analyze")
    an.add_argument("--traces", type=Path, required=True)
    an.add_argument("--residency", default="0.1,0.2,0.3,0.4")
    a = p.parse_args()
    if a.cmd == "record":
        record(a)
    elif a.cmd == "tokens":
        a.out.write_text(json.dumps(streams()))
    else:
        print(analyze(a))


if __name__ == "__main__":
    main()
