"""``moestream synth`` (random-weight checkpoints of real configs) and ``moestream convert`` (quantized builds)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import MoestreamError


def _add_synth_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, type=Path, help="a published config.json (real shapes)")
    p.add_argument("--out", required=True, type=Path, help="checkpoint folder to create")
    p.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default all)")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--seed", type=int, default=0, help="weights depend on the seed and tensor name only (default 0)")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder to copy (default: bundled Qwen3)")
    p.add_argument("--init", default="spread", choices=["spread", "plain", "trained"],
                   help="spread (default): near-uniform routing, the hard case for a cache; trained: routing that "
                        "reuses experts over time as trained models do (Qwen3-MoE, Qwen3-Next, Qwen3.5); "
                        "plain: all std 0.02")
    p.add_argument("--shard-gb", type=float, default=5.0, help="shard size in GB (default 5)")


def run_synth(args: argparse.Namespace) -> Path:
    from ..engine import progress_bar
    from ..synth import plan_synth, write_synth

    plan = plan_synth(args.config, args.layers, args.dtype, args.seed, args.tokenizer, args.init, args.shard_gb)
    with progress_bar(plan.nbytes, f"writing {args.out.name}", log_lines=True) as bar:
        out = write_synth(plan, args.out, bar.update)
    print(f"wrote {out} ({plan.nbytes / 1e9:.2f} GB of weights)")
    return out


def _add_convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint folder or Hub id (bf16, fp16, fp32 or fp8)")
    p.add_argument("--out", type=Path, default=None, help="folder to create (default: <model>-e<bits>g<group>...)")
    p.add_argument("--bits", type=int, default=4,
                   help="bits for every part not given below (default 4): 2-6, 8; 16 = float (--bits 16 alone: the "
                   "float model, routers included, in the streaming layout, no quantization)")
    p.add_argument("--group-size", type=int, default=64, help="weights per scale and bias: 32, 64 or 128 (default 64)")
    p.add_argument("--expert-bits", type=int, default=None,
                   help="routed experts' gate and up (default --bits; 16 = float)")
    p.add_argument("--expert-down-bits", type=int, default=None, help="routed experts' down (default --expert-bits)")
    p.add_argument("--attn-bits", type=int, default=None, help="attention projections (default --bits; 16 = float)")
    p.add_argument("--other-bits", type=int, default=None,
                   help="embedding, LM head, dense MLPs (default --bits; 16 = float); routers take 8 bits unless "
                   "every part is 16")
    p.add_argument("--shard-gb", type=float, default=5.0, help="shard size in GB (default 5)")


def run_convert(args: argparse.Namespace) -> Path:
    from ..convert import ConvertSpec, plan_convert, write_convert
    from ..engine import progress_bar
    from ..quant.affine import BITS

    if args.bits not in (*BITS, 16):
        raise MoestreamError(f"--bits {args.bits}: expected one of {BITS} or 16 (float)")
    expert = args.expert_bits or args.bits
    spec = ConvertSpec(args.group_size, expert, args.expert_down_bits or expert, args.attn_bits or args.bits,
                       args.other_bits or args.bits)
    job = plan_convert(args.model, args.out, spec, args.shard_gb)  # every check before the first progress line
    with progress_bar(job.nbytes, f"writing {job.out.name}", log_lines=True) as bar:
        out = write_convert(job, bar.update)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({size / 1e9:.2f} GB)")
    return out
