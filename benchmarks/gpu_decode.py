"""GPU decode benchmark (issue 22): decode and prefill speed with every expert in VRAM, as CUDA graphs
and eagerly, and with part of the experts in VRAM behind the host tier or the disk, against the
memory-bound floor and the copy rates measured in the same run.

One command on a CUDA machine (it writes the checkpoint when the folder does not exist, drawing the
random values on the GPU):

    python benchmarks/gpu_decode.py --model /dev/shm/q30-48 --layers 48 --out gpu_decode.json

1. ``moestream synth`` of the Qwen3-30B-A3B config at ``--layers`` (bf16, ``spread`` init), timed.
2. The HBM copy rate (device-to-device, bytes read + written) and the pinned host-to-device rate.
3. Budget ``all``: ``load``, a ``--warm``-token prefill of varied ids, ``--tokens`` decode steps fed fixed
   ids as CUDA graphs (timed, each step synchronized), the same steps again at the same positions
   eagerly (timed; logits ``torch.equal`` to the graph's), then the prefill of ``--prefill`` tokens (timed,
   after one untimed). The floor: bytes a decode token touches (resident weights but the embedding
   table, plus top-k experts per MoE layer) over the HBM rate.
4. Each ``--tiered`` configuration (``fraction:host``, host ``auto``/``none``/GB): the same warm-up and timed
   steps, logits compared with budget all's; the floor ``max(H2D bytes / pinned rate, t_all)`` with a
   host tier, ``disk bytes / disk rate + t_all`` without.

Stops a stage that would start after ``--deadline`` seconds. Prints a table last; writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from _common import T0, add_decode_args, gpu_run, hbm_rate, log, prefill_seconds  # noqa: E402

from moestream.engine import load  # noqa: E402

CONFIG = HERE / "benchmarks/configs/Qwen3-30B-A3B.json"
KV_ROOM = 256  # decode positions the KV cache holds past the warm-up


def pinned_rate(dev, piece: int, count: int = 32) -> float:
    src = torch.empty(count, piece, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    dst = torch.empty(count, piece, dtype=torch.uint8, device=dev)
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(count):
            dst[i].copy_(src[i], non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, count * piece / (time.perf_counter() - t) / 1e9)
    return best


def step_times(model, kv, tokens, pos, dev):
    """Decode ``tokens`` from ``pos`` (fed, one at a time, each synchronized): (seconds each, logits)."""
    times, logits = [], []
    for n, tok in enumerate(tokens):
        ids = torch.tensor([tok], device=dev)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(ids, pos + n, kv)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        logits.append(out.float().cpu())
    return times, logits


def summary(times) -> dict:
    s = sorted(times)
    return {"ms_per_token": sum(s) / len(s) * 1e3, "median_ms": s[len(s) // 2] * 1e3,
            "tok_s": len(s) / sum(s)}


def _ids(seed: int, n: int, top: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, top) for _ in range(n)]


def _kv(net, a):
    """A KV cache of one capacity for every stage and --tokens (the capacity sets the attention span)."""
    return net.new_kv_cache(max(a.warm, a.tiered_warm) + a.warm_decode + KV_ROOM)


def warm_up(net, kv, warm, tokens, warm_decode, dev) -> int:
    """Prefill ``warm``, then ``warm_decode`` decode steps fed ``tokens`` in turn: the next position."""
    net(torch.tensor(warm, device=dev), 0, kv)
    pos = len(warm)
    for n in range(warm_decode):
        net(torch.tensor([tokens[n % len(tokens)]], device=dev), pos + n, kv)
    return pos + warm_decode


def floor_bytes(engine) -> int:
    """Bytes one decode token reads: resident weights but the embedding table (one row), plus top-k experts
    per MoE layer."""
    net = engine.model
    emb = net.decoder.embed_tokens.weight
    resident = engine.resident_bytes - emb.numel() * emb.element_size() + emb.shape[1] * emb.element_size()
    one = engine.store.cached_nbytes((next(iter(engine.layout.layers)), 0))
    return resident + net.top_k * len(engine.layout.layers) * one


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    add_decode_args(p, layers=48, tokens=48, warm_decode=4, tokens_help="timed decode steps (at most KV_ROOM, 256)")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--tiered", default="", help="comma list of fraction:host[:prefetch-ahead] (host: auto, none or GB)")
    p.add_argument("--tiered-warm", type=int, default=16, help="warm-up prefill tokens of the tiered runs")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--deadline", type=float, default=1e9, help="seconds after which no new stage starts")
    p.add_argument("--skip-all", action="store_true",
                   help="only the --tiered runs, against the budget-all results of an earlier run's --ref")
    p.add_argument("--ref", type=Path, default=None, help="where budget all's time and logits are kept between runs")
    p.add_argument("--out", type=Path, default=Path("gpu_decode.json"))
    a = p.parse_args()
    dev = torch.device("cuda")
    res, save = gpu_run(a, dev, CONFIG)
    res["checkpoint_gb"] = sum(f.stat().st_size for f in a.model.glob("*.safetensors")) / 1e9
    res["hbm_gb_s"] = hbm_rate(dev)
    log(f"HBM {res['hbm_gb_s']:.0f} GB/s")
    save()

    # each list from its own generator, so the first steps are the same ids whatever --tokens says, and a
    # later run's steps (--skip-all) can be compared with the reference's
    vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]
    top = min(vocab, 150000)
    tokens = _ids(1, a.tokens, top)
    warm = _ids(2, max(a.warm, a.tiered_warm), top)
    prompt = torch.tensor(_ids(3, a.prefill, top), device=dev)

    if a.skip_all:
        kept = torch.load(a.ref)
        res |= kept["res"]
        ref_logits = kept["logits"]
    else:
        ref_logits = all_resident(a, res, dev, tokens, warm, prompt, save)
        if a.ref is not None:
            torch.save({"res": {k: res[k] for k in ("all_graphs", "pinned_gb_s", "floor_ms")}, "logits": ref_logits},
                       a.ref)
    tiered(a, res, dev, tokens, warm, ref_logits, save)
    report(res)
    save()


def all_resident(a, res, dev, tokens, warm, prompt, save):
    """Budget all: decode as CUDA graphs and eagerly at the same positions, then the prefill."""
    t = time.perf_counter()
    engine = load(a.model, cache_budget_gb="all", device="cuda", tokenizer=False, hotlist=False,
                  learn_experts=False, workers=a.workers, progress=False)
    res["load_all_seconds"] = time.perf_counter() - t
    log(f"loaded (budget all) in {res['load_all_seconds']:.1f} s")
    ref_logits = None
    try:
        net, runner = engine.model, engine.model.decode_runner
        res["pinned_gb_s"] = pinned_rate(dev, engine.store.cached_nbytes((0, 0)))
        res["floor_bytes"] = floor_bytes(engine)
        res["floor_ms"] = res["floor_bytes"] / (res["hbm_gb_s"] * 1e9) * 1e3
        kv = _kv(net, a)
        with torch.inference_mode():
            pos = warm_up(net, kv, warm[: a.warm], tokens, a.warm_decode, dev)
            gt, glog = step_times(net, kv, tokens, pos, dev)
            res["all_graphs"] = summary(gt) | {"runner": runner.stats.as_dict() if runner else None}
            log("budget all, graphs:", res["all_graphs"])
            if runner is not None:
                was = runner.graphs
                runner.graphs = False
                et, elog = step_times(net, kv, tokens, pos, dev)  # the same positions again, eagerly
                runner.graphs = was
                res["all_eager"] = summary(et)
                res["graph_equals_eager"] = all(torch.equal(x, y) for x, y in zip(glog, elog))
                log("budget all, eager:", res["all_eager"], "equal:", res["graph_equals_eager"])
            ref_logits = glog
            save()
            # prefill: one untimed, one timed, each on a fresh KV cache
            dt = prefill_seconds(net, prompt, 2)[-1]
            res["prefill"] = {"tokens": a.prefill, "seconds": dt, "tok_s": a.prefill / dt}
            log("prefill:", res["prefill"])
            save()
    finally:
        engine.close()
        del engine
        torch.cuda.empty_cache()
    return ref_logits


def tiered(a, res, dev, tokens, warm, ref_logits, save):
    """Each ``--tiered`` configuration, against budget all's time and logits."""
    experts_total = None
    for spec in [s for s in a.tiered.split(",") if s]:
        if time.perf_counter() - T0 > a.deadline:
            log(f"skipped {spec}: past the deadline")
            res.setdefault("skipped", []).append(spec)
            continue
        frac, host, *rest = spec.split(":")  # fraction:host[:prefetch-ahead]
        ahead = int(rest[0]) if rest else 0
        from moestream.checkpoint import Checkpoint
        from moestream.layout import discover_experts

        if experts_total is None:
            with Checkpoint(a.model) as ck:
                lay = discover_experts(ck.tensors)
                experts_total = sum(lay.expert_nbytes(i, e) for i, x in lay.layers.items()
                                    for e in range(x.num_experts))
        t = time.perf_counter()
        engine = load(a.model, cache_budget_gb=str(float(frac) * experts_total / 1e9),
                      host_cache_gb=None if host == "none" else host, device="cuda", tokenizer=False, hotlist=False,
                      learn_experts=False, workers=a.workers, progress=False, use_page_cache=False,
                      prefetch_ahead=ahead)
        r = {"fraction": float(frac), "host": host, "prefetch_ahead": ahead, "load_seconds": time.perf_counter() - t}
        try:
            net, c = engine.model, engine.cache
            ts, st = c.tier_stats, engine.store.stats
            kv = _kv(net, a)
            with torch.inference_mode():
                pos = warm_up(net, kv, warm[: a.tiered_warm], tokens, a.warm_decode, dev)
                s0 = (c.stats.lookups, c.stats.hits, ts.host_hits, ts.h2d_bytes, st.bytes_read)
                tt, tlog = step_times(net, kv, tokens, pos, dev)
                s1 = (c.stats.lookups, c.stats.hits, ts.host_hits, ts.h2d_bytes, st.bytes_read)
            d = [y - x for x, y in zip(s0, s1)]
            n = len(tokens)
            r |= summary(tt) | {"vram_hit_rate": d[1] / max(1, d[0]), "host_hit_rate": d[2] / max(1, d[0]),
                                "h2d_mb_per_token": d[3] / n / 1e6, "disk_mb_per_token": d[4] / n / 1e6,
                                "read_gb_s_busy": st.bytes_read / st.busy_seconds / 1e9 if st.busy_seconds else 0.0,
                                "runner": net.decode_runner.stats.as_dict() if net.decode_runner else None}
            if ref_logits is not None and a.tiered_warm == a.warm:
                r["logits_equal_all"] = all(torch.equal(x, y) for x, y in zip(tlog, ref_logits))
            t_all = res["all_graphs"]["ms_per_token"]
            if host != "none":
                r["floor_ms"] = max(r["h2d_mb_per_token"] * 1e6 / (res["pinned_gb_s"] * 1e9) * 1e3, t_all)
            elif r["read_gb_s_busy"]:
                r["floor_ms"] = r["disk_mb_per_token"] * 1e6 / (r["read_gb_s_busy"] * 1e9) * 1e3 + t_all
            if r.get("floor_ms"):
                r["ratio_to_floor"] = r["ms_per_token"] / r["floor_ms"]
            log(spec, r)
        finally:
            engine.close()
            del engine
            torch.cuda.empty_cache()
        res.setdefault("tiered", []).append(r)
        save()


def report(res):
    g = res["all_graphs"]
    log("")
    log(f"{'configuration':<28} {'ms/token':>9} {'tok/s':>8} {'floor ms':>9} {'x floor':>8}")
    log(f"{'all, CUDA graphs':<28} {g['ms_per_token']:9.2f} {g['tok_s']:8.1f} {res['floor_ms']:9.2f} "
        f"{g['ms_per_token'] / res['floor_ms']:8.2f}")
    if "all_eager" in res:
        e = res["all_eager"]
        log(f"{'all, eager':<28} {e['ms_per_token']:9.2f} {e['tok_s']:8.1f}")
    for r in res.get("tiered", []):
        name = f"{r['fraction']} + {r['host']}, ahead {r.get('prefetch_ahead', 0)}"
        log(f"{name:<28} {r['ms_per_token']:9.2f} {r['tok_s']:8.1f} "
            f"{r.get('floor_ms', 0):9.2f} {r.get('ratio_to_floor', 0):8.2f}")
    if "prefill" in res:
        log(f"prefill {res['prefill']['tokens']} tokens: {res['prefill']['tok_s']:.0f} tok/s")


if __name__ == "__main__":
    main()
