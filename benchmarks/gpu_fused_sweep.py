"""The fused MoE kernel's decode launch (moestream.fused_moe) at Qwen3-30B-A3B's expert shapes, per tile config.

For one token and for 8 tokens routed uniformly over a layer's 128 experts (8 of them each, bf16 slots),
GPU time per call inside a CUDA graph of 20 calls (median of 5 replays), the bytes of the distinct experts
read over that time, and whether 8 tokens in one call give each row's solo bits; for each (BLOCK_N,
BLOCK_K, num_warps, num_stages); and 8 tokens grouped by expert on the device (``align_blocks``, as a
prefill chunk) instead of one slot per block::

    python benchmarks/gpu_fused_sweep.py --out gpu_fused_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_dense import graph_time_us  # noqa: E402
from moestream import fused_moe as fm  # noqa: E402

H, INTER, E, K = 2048, 768, 128, 8
EXPERT_BYTES = 3 * H * INTER * 2


def routing(t: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[t, K] distinct expert ids per token (uniform) and softmax weights, on the GPU."""
    idx = torch.stack([torch.randperm(E, generator=g, device="cuda")[:K] for _ in range(t)])
    w = torch.softmax(torch.randn(t, K, generator=g, device="cuda"), -1)
    return idx, w


def run(cfg: tuple[int, int, int, int], x, pool, table, routes) -> dict:
    fm.BLOCK_N, fm.BLOCK_K, fm.NUM_WARPS, fm.NUM_STAGES = cfg
    gate, up, down = pool
    out = {}
    for t, (idx, w) in routes.items():
        us = graph_time_us(lambda xs=x[:t], w=w, idx=idx: fm.fused_moe(xs, w, idx, table, gate, up, down))
        distinct = idx.unique().numel()
        out[t] = {"us": round(us, 1), "distinct_experts": distinct,
                  "GB_per_s": round(distinct * EXPERT_BYTES / us / 1e3, 1)}
    idx, w = routes[8]
    both = fm.fused_moe(x[:8], w, idx, table, gate, up, down)
    solo = torch.cat([fm.fused_moe(x[i : i + 1], w[i : i + 1], idx[i : i + 1], table, gate, up, down)
                      for i in range(8)])
    out["rows_solo_bits"] = bool(torch.equal(both, solo))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_fused_sweep.json"))
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    slots = (torch.randn(E, 3, INTER * H, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    gate, up = slots[:, 0].view(E, INTER, H), slots[:, 1].view(E, INTER, H)
    down = slots[:, 2].view(E, H, INTER)
    table = torch.arange(E, dtype=torch.int32, device="cuda")
    x = torch.randn(8, H, device="cuda", generator=g).to(torch.bfloat16)
    routes = {1: routing(1, g), 8: routing(8, g)}
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "configs": []}
    default = (fm.BLOCK_N, fm.BLOCK_K, fm.NUM_WARPS, fm.NUM_STAGES)
    tiles = ((32, 128), (64, 128), (128, 128), (32, 256), (64, 256), (128, 64))
    configs = [default] + [(bn, bk, nw, ns) for (bn, bk), nw, ns in itertools.product(tiles, (4, 8), (3, 4))
                           if (bn, bk, nw, ns) != default]
    for cfg in configs:
        try:
            r = run(cfg, x, (gate, up, down), table, routes)
        except Exception as e:  # a config the GPU cannot hold (shared memory)
            r = {"error": str(e).splitlines()[0][:200]}
        r["config"] = dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), cfg))
        res["configs"].append(r)
        print(json.dumps(r), flush=True)
    fm.BLOCK_N, fm.BLOCK_K, fm.NUM_WARPS, fm.NUM_STAGES = default
    idx, w = routes[8]
    rows_max = fm.ROWS_MAX
    fm.ROWS_MAX = 0  # every call takes the prefill chunk's grouping
    try:
        grouped = {"us": round(graph_time_us(lambda: fm.fused_moe(x[:8], w, idx, table, gate, up, down)), 1)}
    finally:
        fm.ROWS_MAX = rows_max
    grouped["GB_per_s"] = round(idx.unique().numel() * EXPERT_BYTES / grouped["us"] / 1e3, 1)
    res["grouped_8"] = grouped
    print(json.dumps({"grouped_8": grouped}), flush=True)
    a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
