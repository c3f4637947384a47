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


def kernel_bench(dev, reps: int = 50, h: int = 2048, i: int = 768, s: int = 128, tokens=(1, 512)) -> dict:
    """The fused kernel alone at Qwen3-30B-A3B's expert shape (H 2048, I 768, 128 slots, top-8): median GPU
    us per call (calls replayed as a CUDA graph) for one token and for a 512-token prefill, bf16 experts
    against each stored format (random bytes: the timing does not depend on the values), and the stored
    bytes of the routed experts per us."""
    from moestream import fused_moe as fm
    from moestream.quant.formats import ExpertFormat, LinearFormat, Scheme
    from moestream.slot_pool import SlotLayout

    k = 8
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
            idx = torch.stack([torch.randperm(s, device=dev, generator=g)[:k] for _ in range(t)])
            w = torch.rand(t, k, device=dev, generator=g)
            outb = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
            for _ in range(3):
                fm.fused_moe(x, w, idx, table, *proj, out=outb)
            n = 20 if t == 1 else 3  # calls per graph: GPU time per call, without the host's launch cost
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(n):
                        fm.fused_moe(x, w, idx, table, *proj, out=outb)
                run = graph.replay
            except RuntimeError as err:  # not capturable: eager calls (the host's launches included)
                log(f"  {name} T={t}: no graph ({err}); timed eagerly")

                def run(n=n, args=(x, w, idx, table, *proj), outb=outb):
                    for _ in range(n):
                        fm.fused_moe(*args, out=outb)
            times = []
            for _ in range(reps if t == 1 else 10):
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
    p.add_argument("--sweep", default="", help="decode block sizes to time, bn1:bk1:bn2:bk2 separated by commas")
    a = p.parse_args()
    dev = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "layers": a.layers}
    if not a.skip_kernels:
        result["kernels"] = kernel_bench(dev)
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
    models = {"bf16": a.root / "bf16", "q4": a.root / "q4"}
    sizes = {m: expert_bytes(path) for m, path in models.items()}
    result["expert_gb"] = {m: s / 1e9 for m, s in sizes.items()}
    shards = sorted(models["bf16"].glob("*.safetensors"))
    result["disk_gb_s"] = disk_rate(shards, total=2 << 30)
    rng = random.Random(7)
    tokens = [rng.randrange(100, 150000) for _ in range(a.tokens)]
    warm = [rng.randrange(100, 150000) for _ in range(a.warm)]
    vram = 0.25 * sizes["bf16"] / 1e9  # the same VRAM budget for both models: 25% of the bf16 expert bytes
    tiers = {"all": ("all", None), "25% + host": (str(vram), "auto"), "25% + disk": (str(vram), None)}
    if a.only:
        tiers = {k: v for k, v in tiers.items() if k in a.only.split(",")}
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
