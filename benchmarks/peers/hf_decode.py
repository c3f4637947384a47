"""The transformers baseline beside benchmarks/gpu_decode.py: the same checkpoint on the same GPU, one
stream, greedy decode with a static KV cache, out of the box and with ``torch.compile``.

    python benchmarks/peers/hf_decode.py --model /dev/shm/q30-48 --out hf_decode.json

Per mode: ``generate`` of ``--tokens`` new tokens after a ``--warm``-token prompt, timed after one
untimed run (which compiles); the decode time per token is ``(t(N) - t(1)) / (N - 1)``, so the
prefill and the first step's overhead drop out. Then the prefill of ``--prefill`` tokens (one forward).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def timed_generate(model, ids, n: int, **kw) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--warm", type=int, default=256)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--modes", default="eager,compile")
    p.add_argument("--out", type=Path, default=Path("hf_decode.json"))
    a = p.parse_args()
    import transformers
    from transformers import AutoModelForCausalLM

    res = {"command": " ".join(sys.argv), "transformers": transformers.__version__, "torch": torch.__version__}
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).cuda().eval()
    res["load_seconds"] = time.perf_counter() - t
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 150000, (1, a.warm), generator=g).cuda()
    for mode in a.modes.split(","):
        if mode == "compile":
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        kw = {"cache_implementation": "static"}
        with torch.inference_mode():
            timed_generate(model, ids, a.tokens, **kw)  # compiles / warms up
            one = timed_generate(model, ids, 1, **kw)
            many = timed_generate(model, ids, a.tokens, **kw)
        ms = (many - one) / (a.tokens - 1) * 1e3
        res[mode] = {"ms_per_token": ms, "tok_s": 1e3 / ms}
        print(mode, res[mode], flush=True)
        a.out.write_text(json.dumps(res, indent=1))
    prompt = torch.randint(1000, 150000, (1, a.prefill), generator=g).cuda()
    with torch.inference_mode():
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model(prompt)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
    res["prefill"] = {"tokens": a.prefill, "seconds": dt, "tok_s": a.prefill / dt}
    print("prefill", res["prefill"], flush=True)
    a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
