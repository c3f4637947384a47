"""The GPU dense linear (moestream.dense_kernel) beside cuBLAS (``F.linear``) at Qwen3-30B-A3B's shapes.

GPU time per call inside a CUDA graph of 20 calls (median of 5 replays), for one row (a decode step), 8 rows
(8 sequences batched) and 512 rows (a prefill chunk); the weight's bytes over that time; whether the kernel's
rows are the same bits alone and in the batch, and cuBLAS's::

    python benchmarks/gpu_dense.py --out gpu_dense.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moestream import dense_kernel as dk  # noqa: E402

SHAPES = {"q_proj": (4096, 2048), "k_proj": (512, 2048), "o_proj": (2048, 4096), "router": (128, 2048),
          "lm_head": (151936, 2048)}


def graph_time_us(fn, reps: int = 20) -> float:
    """Median GPU time of one call of ``fn`` over 5 replays of a CUDA graph of ``reps`` calls, microseconds."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_dense.json"))
    a = p.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    total = {"kernel": {1: 0.0, 8: 0.0, 512: 0.0}, "cublas": {1: 0.0, 8: 0.0, 512: 0.0}}
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
        x = torch.randn(512, k, device="cuda", generator=g).to(torch.bfloat16)
        row = {"split": dk.splits(n, k)}
        for m in (1, 8, 512):
            xm = x[:m].contiguous()
            tk = graph_time_us(lambda xm=xm, w=w: dk.linear(xm, w))
            tc = graph_time_us(lambda xm=xm, w=w: F.linear(xm, w))
            total["kernel"][m] += tk
            total["cublas"][m] += tc
            row[m] = {"kernel_us": tk, "cublas_us": tc, "kernel_gb_s": w.numel() * 2 / tk / 1e3,
                      "cublas_gb_s": w.numel() * 2 / tc / 1e3}
        whole_k, whole_c = dk.linear(x[:8], w), F.linear(x[:8], w)
        row["kernel_row_alone_equal"] = bool(torch.equal(dk.linear(x[:1], w), whole_k[:1]))
        row["cublas_row_alone_equal"] = bool(torch.equal(F.linear(x[:1], w), whole_c[:1]))
        row["kernel_vs_cublas_max_abs"] = float((whole_k.float() - whole_c.float()).abs().max())
        res["shapes"][name] = row
        print(name, json.dumps(row), flush=True)
    # one layer's dense decode work (q, k, v, o, router) and the LM head, summed
    layer = {kind: sum(res["shapes"][s][1][f"{kind}_us"] for s in ("q_proj", "k_proj", "k_proj", "o_proj", "router"))
             for kind in ("kernel", "cublas")}
    res["decode_layer_us"] = layer
    res["decode_step_48_layers_ms"] = {kind: (48 * layer[kind] + res["shapes"]["lm_head"][1][f"{kind}_us"]) / 1e3
                                       for kind in layer}
    print("one decode step's dense work at 48 layers, ms:", res["decode_step_48_layers_ms"])
    a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
