"""Quantized experts on the GPU against bf16 ones: the same Qwen3-30B-A3B-shaped synth in bf16 and converted
by ``moestream convert`` to 4-bit MLX affine (group 64), decoded fed the same varied tokens, in three tiers:

- every expert in VRAM (budget ``all``, CUDA graphs);
- a VRAM budget of 25% of the bf16 model's expert bytes plus the host tier (``--host-cache-gb auto``);
- the same VRAM budget with the disk behind it and no host tier.

One command on a CUDA machine (it writes the checkpoints when their folders do not exist):

    python benchmarks/gpu_quant.py --root /tmp/gq --layers 24 --out gpu_quant.json

Per configuration (``gpu_tiers.run_config``: a warm-up prefill of ``--warm`` tokens and ``--warm-decode``
steps first, so the tiers start warm): ms per token (mean and median), VRAM / host / disk shares of the
lookups, MB per token over PCIe and from disk; the 4-bit / bf16 decode-rate ratio per tier, against the
issue's targets (>= 2.5x with the host tier, >= 1x all in VRAM, >= 3x from disk); and, per model, whether
every tier's logits equal budget all's (``torch.equal``). Writes everything to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _common import add_decode_args  # noqa: E402
from gpu_tiers import CONFIG, disk_rate, run_config  # noqa: E402

TARGETS = {"all": 1.0, "25% + host": 2.5, "25% + disk": 3.0}


def log(*a):
    print(*a, flush=True)


def prepare(root: Path, layers: int) -> dict:
    """The bf16 synth and its 4-bit conversion under ``root`` (written when missing); seconds each took."""
    from moestream.convert import ConvertSpec, convert
    from moestream.synth import plan_synth, write_synth

    took = {}
    bf16, q4 = root / "bf16", root / "q4"
    if not bf16.exists():
        t0 = time.perf_counter()
        write_synth(plan_synth(CONFIG, layers, "bf16", 0, None, "spread", 5.0), bf16, device="cuda")
        os.sync()
        took["synth_s"] = time.perf_counter() - t0
    if not q4.exists():
        t0 = time.perf_counter()
        convert(bf16, q4, ConvertSpec(64, 4, 4, 4, 4))
        os.sync()
        took["convert_s"] = time.perf_counter() - t0
    return took


def kernel_bench(dev, reps: int = 50, h: int = 2048, i: int = 768, s: int = 128, tokens=(1, 512), kinds=None,
                 outputs: dict | None = None, errors: dict | None = None) -> dict:
    """The fused kernel alone at Qwen3-30B-A3B's expert shape (H 2048, I 768, 128 slots, top-8): median GPU
    us per call (calls replayed as a CUDA graph, each call its own random routing) for each count of
    ``tokens`` (one token, a 512-token prefill), bf16 experts against each stored format (random bytes: the
    timing does not depend on the values), and the stored bytes of the routed experts per us. ``kinds``: the
    formats to time (None: all); ``outputs``, when given, receives each format's one-token output [1, H] bf16
    (for the sweep's check); ``errors``, each affine format's relative error (norm) of that output from float64
    over its dequantized weights."""
    from moestream import fused_moe as fm
    from moestream.quant.formats import ExpertFormat, LinearFormat, Scheme
    from moestream.slot_pool import SlotLayout

    k = 8
    only = kinds
    kinds = {
        "bf16": None,
        "affine4-g64": (Scheme("affine", 4, 64), [("", torch.uint32, 4 / 32), ("scales", torch.bfloat16, 1 / 64),
                                                   ("biases", torch.bfloat16, 1 / 64)]),
        "affine8-g64": (Scheme("affine", 8, 64), [("", torch.uint32, 8 / 32), ("scales", torch.bfloat16, 1 / 64),
                                                   ("biases", torch.bfloat16, 1 / 64)]),
        "affine3-g64": (Scheme("affine", 3, 64), [("", torch.uint32, 3 / 32), ("scales", torch.bfloat16, 1 / 64),
                                                   ("biases", torch.bfloat16, 1 / 64)]),
        "fp8-128": (Scheme("fp8", 8, 128, (128, 128)), [("", torch.uint8, 1.0)]),
        "mxfp4": (Scheme("mxfp4", 4, 32), [("", torch.uint8, 0.5), ("scales", torch.uint8, 1 / 32)]),
    }
    out = {}
    g = torch.Generator(device=dev).manual_seed(0)
    for name, spec in kinds.items():
        if only is not None and name not in only:
            continue
        pieces = []
        for role, (o, n) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            if spec is None:
                pieces.append((role, torch.bfloat16, (o, n)))
                continue
            sch, parts = spec
            for suffix, dt, per in parts:
                pieces.append((role + ("." + suffix if suffix else ""), dt, (o, int(n * per))))
            if sch.method == "fp8":
                pieces.append((role + ".weight_scale_inv", torch.float32, (-(-o // 128), -(-n // 128))))
        layout = SlotLayout.of(pieces)
        storage = torch.randint(0, 256, (s, layout.slot_bytes), dtype=torch.uint8, device=dev, generator=g)
        views = layout.views(storage)
        for role, v in views.items():  # small finite scales (random bytes could be NaN or huge as floats)
            if v.dtype in (torch.bfloat16, torch.float32):
                v.copy_(torch.rand(v.shape, generator=g, device=dev) * 0.01)
            elif role.endswith(".scales") and v.dtype == torch.uint8:
                v.fill_(120)
            elif v.dtype == torch.uint8 and spec is not None and spec[0].method == "fp8":
                v.bitwise_and_(0x3F)  # finite e4m3 values
        if spec is None:
            proj = fm.expert_projections(views)
        else:
            sch = spec[0]
            fmt = ExpertFormat({"gate": LinearFormat("gate", sch, i, h), "up": LinearFormat("up", sch, i, h),
                                "down": LinearFormat("down", sch, h, i)})
            proj = fm.expert_projections(views, fmt)
        table = torch.randperm(s, device=dev, generator=g).to(torch.int32)
        res = {"slot_bytes": layout.slot_bytes}
        for t in tokens:
            x = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16) * 0.1
            n = 20 if t <= 8 else 3  # calls per graph: GPU time per call, without the host's launch cost
            # each call its own routing, so that the calls of a graph read other experts than the one before (one
            # token's 8 experts, 21-75 MB, would otherwise stay in the 60 MB L2 across calls)
            idxs = [torch.stack([torch.randperm(s, device=dev, generator=g)[:k] for _ in range(t)]) for _ in range(n)]
            w = torch.rand(t, k, device=dev, generator=g)
            outb = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
            for _ in range(3):
                fm.fused_moe(x, w, idxs[0], table, *proj, out=outb)
            if outputs is not None and t == 1:
                outputs[name] = outb.clone()
            if errors is not None and t == 1 and spec is not None and spec[0].method == "affine":
                errors[name] = affine_error(views, spec[0], table, x, w, idxs[0], outb)

            def calls(args=(x, w), idxs=idxs, outb=outb, rest=(table, *proj)):
                for idx in idxs:
                    fm.fused_moe(*args, idx, *rest, out=outb)
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    calls()
                run = graph.replay
            except RuntimeError as err:  # not capturable: eager calls (the host's launches included)
                log(f"  {name} T={t}: no graph ({err}); timed eagerly")
                run = calls
            times = []
            for _ in range(reps if t <= 8 else 10):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / n)
            times.sort()
            med = times[len(times) // 2]
            res[f"t{t}_us"] = med
            if t == 1:
                res["t1_stored_gb_s"] = k * layout.slot_bytes / med / 1e3
        out[name] = res
        log(f"kernel {name}: {res}")
    return out


def affine_error(views, sch, table, x, w, idx, out) -> float:
    """||out - ref|| / ||ref|| for a one-token call on affine experts, ref in float64 from the dequantized weights."""
    from moestream.fused_moe import reference_moe
    from moestream.quant import affine

    experts = {}
    for e in idx.reshape(-1).tolist():
        slot = int(table[e])
        experts[e] = {r: affine.dequantize(views[r][slot], views[r + ".scales"][slot], views[r + ".biases"][slot],
                                           sch.bits, sch.group_size, torch.float64) for r in ("gate", "up", "down")}
    ref = reference_moe(x, w, idx, experts)
    return float((out.double().cpu() - ref).norm() / ref.norm())


# (rows per program, words of a row per step, warps) tried by affine_sweep: tiles whose sm_90 build (compiled
# without a GPU) keeps under ~170 registers and few instructions per weight at 4 bits, group 64, H 2048, I 768
GATE_UP_TILES = [(8, 128, 2), (4, 128, 2), (4, 256, 2), (8, 256, 4), (8, 128, 4), (4, 128, 1), (2, 256, 1),
                 (16, 128, 2), (16, 64, 2), (8, 64, 2), (8, 64, 1), (32, 64, 4), (16, 64, 4)]
DOWN_TILES = [(16, 32, 1), (8, 32, 1), (4, 64, 1), (8, 64, 1), (16, 64, 2), (16, 64, 1), (32, 32, 1), (16, 32, 2),
              (32, 64, 2), (64, 32, 2)]


def affine_sweep(dev, kinds: list[str], budget_s: float) -> dict:
    """fused_moe.AFFINE_ROWS candidates for one token, in two rounds, each keeping the best so far (by the first
    of ``kinds``, starting from the defaults): gate/up's rows per program, words per step and warps
    (:data:`GATE_UP_TILES`), then down's (:data:`DOWN_TILES`). Per candidate: us per kind and the largest
    difference of its output from the defaults' (relative to the largest output), and for the defaults and the
    best the error from float64 (:func:`affine_error`); a candidate that fails to compile or run is recorded with
    its error. Each round gets half of ``budget_s`` seconds; a candidate past its round's share is skipped.
    Leaves AFFINE_ROWS at the best found; returns the rounds' records and the best."""
    from moestream import fused_moe as fm

    refs: dict = {}
    errors: dict = {}
    kernel_bench(dev, tokens=(1,), kinds=kinds, outputs=refs, errors=errors)
    log(f"sweep: the defaults' error from float64 {errors}")
    best, best_us, trials = dict(fm.AFFINE_ROWS), None, []
    deadline = 0.0

    def trial(cfg):
        nonlocal best, best_us
        if time.perf_counter() > deadline:
            trials.append({"cfg": cfg, "skipped": "past the round's time"})
            return
        fm.AFFINE_ROWS.clear()
        fm.AFFINE_ROWS.update(cfg)
        got: dict = {}
        try:
            res = kernel_bench(dev, tokens=(1,), kinds=kinds, outputs=got)
        except Exception as err:  # a candidate the compiler or the GPU refuses
            trials.append({"cfg": cfg, "error": repr(err)[:300]})
            log(f"sweep {cfg}: {err!r}"[:300])
            return
        us = {n: r["t1_us"] for n, r in res.items()}
        diff = {n: float((got[n].float() - refs[n].float()).abs().max() / refs[n].float().abs().max())
                for n in got}
        trials.append({"cfg": cfg, "us": us, "diff": diff})
        log(f"sweep {cfg}: {us} diff {diff}")
        if best_us is None or us[kinds[0]] < best_us:
            best, best_us = dict(cfg), us[kinds[0]]

    base = dict(best)
    deadline = time.perf_counter() + 0.5 * budget_s
    for bn, wk, w in GATE_UP_TILES:
        trial({**base, "bn1": bn, "wk1": wk, "w1": w})
    base = dict(best)
    deadline = time.perf_counter() + 0.5 * budget_s
    for bn, wk, w in DOWN_TILES:
        trial({**base, "bn2": bn, "wk2": wk, "w2": w})
    fm.AFFINE_ROWS.clear()
    fm.AFFINE_ROWS.update(best)
    best_errors: dict = {}
    kernel_bench(dev, tokens=(1,), kinds=kinds, errors=best_errors)
    log(f"sweep: best {best}, {best_us} us; error from float64 {best_errors}")
    return {"trials": trials, "best": best, "best_us": best_us, "default_errors": errors, "best_errors": best_errors}


def expert_bytes(path: Path) -> int:
    from moestream.checkpoint import Checkpoint
    from moestream.layout import discover_experts

    with Checkpoint(path) as c:
        lay = discover_experts(c.tensors)
        return sum(lay.expert_nbytes(i, e) for i, x in lay.layers.items() for e in range(x.num_experts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, required=True, help="folder for the bf16 and q4 checkpoints")
    add_decode_args(p, layers=24, tokens=24, warm_decode=8)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--only", default="", help="comma-separated tiers to run (all, 25%% + host, 25%% + disk)")
    p.add_argument("--out", type=Path, default=Path("gpu_quant.json"))
    p.add_argument("--prepare-only", action="store_true", help="write the checkpoints and stop")
    p.add_argument("--kernels-only", action="store_true", help="time the fused kernel per format and stop")
    p.add_argument("--skip-kernels", action="store_true", help="no kernel timing before the model runs")
    p.add_argument("--sweep", default="", help="decode block sizes of fp8, MXFP4 and 3/5/6-bit affine experts "
                   "to time (fused_moe.QUANT_ROWS), bn1:bk1:bn2:bk2 separated by commas")
    p.add_argument("--sweep-affine", action="store_true",
                   help="choose fused_moe.AFFINE_ROWS (the affine 2/4/8-bit decode kernels) by a sweep first")
    p.add_argument("--sweep-budget-s", type=float, default=180.0, help="seconds the affine sweep may take")
    p.add_argument("--sweep-kinds", default="affine4-g64,affine8-g64",
                   help="formats the affine sweep times, the first ranking the candidates")
    p.add_argument("--models", default="bf16,q4", help="comma-separated models to run (bf16, q4)")
    p.add_argument("--kinds", default="", help="comma-separated formats for the kernel timing (default: all)")
    p.add_argument("--kernel-tokens", default="1,512", help="token counts of the kernel timing")
    a = p.parse_args()
    dev = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "layers": a.layers}
    kinds = a.kinds.split(",") if a.kinds else None
    if a.sweep_affine:
        from moestream import fused_moe as fm

        result["affine_sweep"] = affine_sweep(dev, a.sweep_kinds.split(","), a.sweep_budget_s)
        result["affine_rows"] = dict(fm.AFFINE_ROWS)
        a.out.write_text(json.dumps(result, indent=2))
    if not a.skip_kernels:
        result["kernels"] = kernel_bench(dev, tokens=tuple(map(int, a.kernel_tokens.split(","))), kinds=kinds)
    if a.sweep:  # fused_moe.QUANT_ROWS candidates, the one-token case
        from moestream import fused_moe as fm

        default = dict(fm.QUANT_ROWS)
        result["sweep"] = {}
        for cfg in a.sweep.split(","):
            fm.QUANT_ROWS.update(zip(("bn1", "bk1", "bn2", "bk2"), map(int, cfg.split(":"))))
            result["sweep"][cfg] = {n: r["t1_us"] for n, r in kernel_bench(dev, tokens=(1,)).items() if n != "bf16"}
            log(f"sweep {cfg}: {result['sweep'][cfg]}")
        fm.QUANT_ROWS.update(default)
    a.out.write_text(json.dumps(result, indent=2))
    if a.kernels_only:
        return
    result["prepare"] = prepare(a.root, a.layers)
    log("prepared", result["prepare"])
    if a.prepare_only:
        return
    models = {m: a.root / m for m in a.models.split(",")}
    sizes = {m: expert_bytes(a.root / m) for m in ("bf16", "q4")}
    result["expert_gb"] = {m: s / 1e9 for m, s in sizes.items()}
    rng = random.Random(7)
    tokens = [rng.randrange(100, 150000) for _ in range(a.tokens)]
    warm = [rng.randrange(100, 150000) for _ in range(a.warm)]
    vram = 0.25 * sizes["bf16"] / 1e9  # the same VRAM budget for both models: 25% of the bf16 expert bytes
    tiers = {"all": ("all", None), "25% + host": (str(vram), "auto"), "25% + disk": (str(vram), None)}
    if a.only:
        tiers = {k: v for k, v in tiers.items() if k in a.only.split(",")}
    if "25% + disk" in tiers:  # O_DIRECT reads (not on a tmpfs)
        result["disk_gb_s"] = disk_rate(sorted((a.root / "bf16").glob("*.safetensors")), total=2 << 30)
    runs, exact = {}, {}
    for m, path in models.items():
        ref = None
        for tier, (budget, host) in tiers.items():
            log(f"{m} {tier} ...")
            res, logits = run_config(path, budget, host, tokens, warm, a.warm_decode, dev, a.workers)
            runs[f"{m} {tier}"] = res
            log(f"  {res['median_ms']:.2f} ms/token median, {res['tok_s']:.1f} tok/s, "
                f"h2d {res['h2d_mb_per_token']:.1f} MB/token, disk {res['disk_mb_per_token']:.1f} MB/token")
            if ref is None:
                ref = logits
            else:
                exact[f"{m} {tier}"] = all(torch.equal(x, y) for x, y in zip(ref, logits))
            result["runs"], result["exact_vs_first_tier"] = runs, exact
            a.out.write_text(json.dumps(result, indent=2))
    ratios = {}
    for tier in tiers:
        b, q = runs.get(f"bf16 {tier}"), runs.get(f"q4 {tier}")
        if b and q:
            r = b["median_ms"] / q["median_ms"]
            ratios[tier] = {"q4_over_bf16": r, "target": TARGETS[tier], "met": r >= TARGETS[tier]}
    result["ratios"] = ratios
    a.out.write_text(json.dumps(result, indent=2))
    log(json.dumps({"ratios": ratios, "exact": exact}, indent=2))


if __name__ == "__main__":
    main()
