"""bf16 matmuls on this CPU: PyTorch's bf16 kernel against moestream's float32 path (models/linear.py).

Times ``[T, H] x [H, I]`` (an expert's gate projection, Qwen3-30B-A3B: H 2048, I 768) for
several row counts T, median of ``--repeats`` after a warm-up, both ways side by side in
one process, and prints a Markdown table for ``docs/benchmarks.md``.

    .venv/bin/python benchmarks/cpu_linear.py [--hidden 2048 --inter 768 --repeats 30]
"""

from __future__ import annotations  # noqa: I001 -- moestream is imported before torch, on purpose

import argparse

from _common import median_ms
from moestream.models import linear as lin  # first: moestream sets its OpenMP wait policy
import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    w = torch.randn(a.inter, a.hidden).bfloat16()
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16 {lin.native_bf16()}, "
          f"threads {torch.get_num_threads()}, torch {torch.__version__}")
    print("\n| rows T | bf16 kernel (ms) | float32 path (ms) | speed-up | moestream uses |")
    print("| --- | --- | --- | --- | --- |")
    lin.UPCAST = True
    for t in (1, 2, 4, 8, 16, 32, 128, 512):
        x = torch.randn(t, a.hidden).bfloat16()
        bf = median_ms(lambda x=x: F.linear(x, w), a.repeats, warmup=1)
        up = median_ms(lambda x=x: lin._upcast_linear(x, w, None), a.repeats, warmup=1)
        use = "float32" if t >= lin.UPCAST_ROWS and not lin.native_bf16() else "bf16"
        print(f"| {t} | {bf:.2f} | {up:.2f} | {bf / up:.2f}x | {use} |")


if __name__ == "__main__":
    main()
