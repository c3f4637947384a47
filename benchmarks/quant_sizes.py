"""Disk size, resident GB and expert bytes per token of a real config at each ``moestream convert`` setting.

Computed from the config alone (no weights): the tensors ``moestream synth`` would write
for the config, sized as ``moestream convert`` writes them (same categories and bit widths,
bf16 scales and biases, the 4 KiB alignment of every expert counted at its worst case).

    python benchmarks/quant_sizes.py --config ../shared/models/configs/Qwen3-30B-A3B.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from moestream.convert import ALIGN, FLOAT_BITS, ROUTER_BITS, ConvertSpec, _category, _qshapes
from moestream.models import family_for

SETTINGS = [
    ("bf16 (no convert)", None),
    ("--bits 8 --group-size 64", ConvertSpec(64, 8, 8, 8, 8)),
    ("--bits 4 --group-size 64", ConvertSpec(64, 4, 4, 4, 4)),
    ("--bits 4 --group-size 32", ConvertSpec(32, 4, 4, 4, 4)),
    ("--bits 3 --group-size 64", ConvertSpec(64, 3, 3, 3, 3)),
    ("--bits 2 --group-size 64", ConvertSpec(64, 2, 2, 2, 2)),
    ("--expert-bits 2 --attn-bits 4 --bits 4", ConvertSpec(64, 2, 2, 4, 4)),
    ("--expert-bits 3 --expert-down-bits 4 --bits 4", ConvertSpec(64, 3, 4, 4, 4)),
]


def sizes(cfg: dict, spec: ConvertSpec | None) -> dict:
    family = family_for(cfg)
    args = family.ModelArgs.from_config(cfg)
    expert_bytes, resident = 0, 0
    per_expert = None
    for t in family.synth_tensors(cfg):
        n = math.prod(t.shape)
        if ".experts." in t.name:
            if spec is None:
                b = 2 * n
            else:
                bits = spec.expert_down_bits if "down_proj" in t.name else spec.expert_bits
                b = sum(o.nbytes for o in _qshapes(t.name, *t.shape, bits, spec.group_size, "BF16"))
            expert_bytes += b
            continue
        linear = t.name.endswith(".weight") and len(t.shape) == 2 and "norm" not in t.name
        if spec is None or not linear:
            resident += 2 * n
            continue
        bits = {"attn": spec.attn_bits, "router": ROUTER_BITS, "other": spec.other_bits}[_category(t.name)]
        if t.shape[1] % spec.group_size:
            bits = FLOAT_BITS
        resident += sum(o.nbytes for o in _qshapes(t.name, *t.shape, bits, spec.group_size, "BF16"))
    layers = sum(1 for i in range(args.num_hidden_layers) if args.is_moe_layer(i))
    count = layers * args.num_experts
    per_expert = expert_bytes / count
    aligned = per_expert + (ALIGN - 1 if spec is not None else 0)
    return dict(expert_mb=per_expert / 1e6, disk_gb=(count * aligned + resident) / 1e9, resident_gb=resident / 1e9,
                token_gb=layers * args.num_experts_per_tok * per_expert / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True)
    cfg = json.loads(ap.parse_args().config.read_text())
    print("| setting | expert MB | disk GB | resident GB | expert GB per token (no hits) |")
    print("| --- | --- | --- | --- | --- |")
    for name, spec in SETTINGS:
        s = sizes(cfg, spec)
        cells = f"{s['expert_mb']:.2f} | {s['disk_gb']:.2f} | {s['resident_gb']:.2f} | {s['token_gb']:.3f}"
        print(f"| `{name}` | {cells} |")


if __name__ == "__main__":
    main()
