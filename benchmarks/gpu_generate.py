"""The user's path on the GPU (issue 33): ``generate`` (what ``moestream generate`` and ``serve`` call) with
every expert in VRAM, timed like transformers' ``generate`` in benchmarks/peers/hf_decode.py; the bare
model step; the prefill; the decode graphs captured once over several requests; the bits independent of
``max_tokens``; the attention and fused MoE kernels alone; a profile of one decode step.

One command on a CUDA machine (it writes the checkpoint when the folder does not exist, drawing the
random values on the GPU):

    python benchmarks/gpu_generate.py --model /dev/shm/q30-48 --layers 48 --out gpu_generate.json

1. ``moestream synth`` of the Qwen3-30B-A3B config at ``--layers`` (bf16, ``spread`` init), timed; the HBM
   copy rate (2 GB device-to-device, bytes read + written).
2. The kernels alone, at the model's shapes (GPU time per call, CUDA graphs of 20 calls, median of 5):
   attention (this engine's kernel against PyTorch's SDPA with a boolean mask, the former path) for a
   decode step at several context lengths and a 512-token prefill; the fused MoE kernel for one token.
3. Budget ``all``: ``load``; ``generate`` of ``--tokens`` after a ``--prompt``-token prompt of varied ids,
   greedy, ``--requests`` times in a row, and of 1 token the same way: ms per token ``(t(N) - t(1)) / (N - 1)``
   (the prefill and the first step drop out, as for the peer), the runner's captures and replays; the
   bare model step (fed tokens, each synchronized); the prefill of ``--prompt`` tokens (after one
   untimed).
4. The first 100 tokens and logits of ``generate`` with 100 and 200 tokens, with the kept KV storage and
   without (capacities prompt + 100 and prompt + 200).
5. A torch.profiler table of ``--profile`` decode steps (GPU time by kernel).

Writes ``--out`` (JSON) as it goes; prints a table last.
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

from _common import gpu_run, hbm_rate, log, prefill_seconds  # noqa: E402

from moestream.engine import load  # noqa: E402
from moestream.generation import GenerationStats, generate  # noqa: E402

CONFIG = HERE / "benchmarks/configs/Qwen3-30B-A3B.json"


def graph_us(fn, calls: int = 20, reps: int = 5) -> float:
    """GPU microseconds per call of ``fn``, from a CUDA graph of ``calls`` calls (median of ``reps``)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(times)[reps // 2]


def kernels_alone(res, dev):
    """Attention (kernel vs SDPA with a mask, enable_gqa) and the fused MoE decode, at Qwen3-30B-A3B's shapes."""
    import torch.nn.functional as F

    from moestream import attention_kernel as ak
    from moestream import fused_moe as fm
    from moestream.slot_pool import SlotLayout

    torch.backends.cuda.enable_cudnn_sdp(False)  # as the engine
    g = torch.Generator("cuda").manual_seed(0)
    hq, hkv, d, cap = 32, 4, 128, 4096
    k = torch.randn(hkv, cap, d, generator=g, device=dev).to(torch.bfloat16)
    v = torch.randn(hkv, cap, d, generator=g, device=dev).to(torch.bfloat16)
    out = {}
    for n in (128, 640, 2048):
        q = torch.randn(hq, 1, d, generator=g, device=dev).to(torch.bfloat16)
        pos = torch.tensor([n - 1], device=dev)
        mask = (torch.arange(cap, device=dev) <= n - 1)[None]
        bucket = 64
        while bucket < n:
            bucket *= 2
        out[f"decode_{n}"] = {
            "kernel_device_pos_us": graph_us(lambda q=q, pos=pos: ak.attention(q, k, v, 0, d ** -0.5, pos=pos)),
            "kernel_us": graph_us(lambda q=q, n=n: ak.attention(q, k[:, :n], v[:, :n], n - 1, d ** -0.5)),
            "sdpa_bucket_mask_us": graph_us(lambda q=q, b=bucket, m=mask: F.scaled_dot_product_attention(
                q[None], k[None, :, :b], v[None, :, :b], attn_mask=m[:, :b], scale=d ** -0.5, enable_gqa=True)),
        }
    q = torch.randn(hq, 512, d, generator=g, device=dev).to(torch.bfloat16)
    causal = torch.ones(512, 512, dtype=torch.bool, device=dev).tril()
    out["prefill_512"] = {
        "kernel_us": graph_us(lambda: ak.attention(q, k[:, :512], v[:, :512], 0, d ** -0.5)),
        "sdpa_mask_us": graph_us(lambda: F.scaled_dot_product_attention(
            q[None], k[None, :, :512], v[None, :, :512], attn_mask=causal, scale=d ** -0.5, enable_gqa=True)),
        "sdpa_causal_flash_us": graph_us(lambda: F.scaled_dot_product_attention(
            q[None], k[None, :, :512].repeat_interleave(8, 1), v[None, :, :512].repeat_interleave(8, 1),
            is_causal=True, scale=d ** -0.5)),
    }
    res["attention"] = out
    log("attention:", json.dumps(out))
    e, kk, h, i = 128, 8, 2048, 768
    layout = SlotLayout.of([("gate", torch.bfloat16, (i, h)), ("up", torch.bfloat16, (i, h)),
                            ("down", torch.bfloat16, (h, i))])
    storage = torch.empty(e, layout.slot_bytes, dtype=torch.uint8, device=dev)
    views = layout.views(storage)
    for vv in views.values():
        vv.copy_((torch.randn(vv.shape, generator=g, device=dev) / vv.shape[-1] ** 0.5).to(torch.bfloat16))
    table = torch.arange(e, dtype=torch.int32, device=dev)
    moe = {}
    for t in (1, 512):
        x = torch.randn(t, h, generator=g, device=dev).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(e, generator=g, device=dev)[:kk] for _ in range(t)])
        w = torch.rand(t, kk, generator=g, device=dev)
        us = graph_us(lambda x=x, idx=idx, w=w: fm.fused_moe(x, w, idx, table, views["gate"], views["up"],
                                                           views["down"]))
        moe[f"tokens_{t}"] = {"us": us, "expert_gb_s": min(t * kk, e) * layout.slot_bytes / us / 1e3}
    res["fused_moe"] = moe
    log("fused MoE:", json.dumps(moe))
    sweep = {}
    keep = fm.BLOCK_M, fm.BLOCK_N, fm.BLOCK_K
    for bm, bn, bk in ((16, 64, 64), (32, 64, 64), (64, 64, 64), (16, 128, 64), (64, 128, 64), (16, 64, 128)):
        fm.BLOCK_M, fm.BLOCK_N, fm.BLOCK_K = bm, bn, bk
        row = {}
        for t in (1, 512):
            x = torch.randn(t, h, generator=g, device=dev).to(torch.bfloat16)
            idx = torch.stack([torch.randperm(e, generator=g, device=dev)[:kk] for _ in range(t)])
            w = torch.rand(t, kk, generator=g, device=dev)
            row[f"tokens_{t}_us"] = graph_us(lambda x=x, idx=idx, w=w: fm.fused_moe(
                x, w, idx, table, views["gate"], views["up"], views["down"]))
        sweep[f"bm{bm}_bn{bn}_bk{bk}"] = row
    fm.BLOCK_M, fm.BLOCK_N, fm.BLOCK_K = keep
    res["fused_moe_tiles"] = sweep
    log("fused MoE tiles:", json.dumps(sweep))


def floor_bytes(engine) -> int:
    """Bytes one decode token reads: resident weights but the embedding table (one row), plus top-k experts
    per MoE layer (as benchmarks/gpu_decode.py)."""
    net = engine.model
    emb = net.decoder.embed_tokens.weight
    resident = engine.resident_bytes - emb.numel() * emb.element_size() + emb.shape[1] * emb.element_size()
    one = engine.store.cached_nbytes((next(iter(engine.layout.layers)), 0))
    return resident + net.top_k * len(engine.layout.layers) * one


def ids(seed: int, n: int, top: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, top) for _ in range(n)]


def timed_generate(engine, prompt, n, stamps=None, **kw):
    """Seconds of a whole ``generate`` call, its steps and stats; ``stamps`` gets each step's arrival time."""
    stats = GenerationStats()
    torch.cuda.synchronize()
    t = time.perf_counter()
    steps = []
    for s in generate(engine, prompt, n, stop_at_eos=False, stats=stats, **kw):
        steps.append(s)
        if stamps is not None:
            stamps.append(time.perf_counter())
    torch.cuda.synchronize()
    return time.perf_counter() - t, steps, stats


def through_generate(a, res, engine, top, save):
    runner = engine.model.decode_runner
    reqs = []
    for r in range(a.requests):
        prompt = ids(10 + r, a.prompt, top)
        t1, _, _ = timed_generate(engine, prompt, 1)
        stamps = []
        tn, steps, st = timed_generate(engine, prompt, a.tokens, stamps)
        ms = (tn - t1) / (a.tokens - 1) * 1e3
        streamed = (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3  # first token to last, as a client sees
        reqs.append({"ms_per_token": ms, "tok_s": 1e3 / ms, "streamed_ms_per_token": streamed,
                     "streamed_tok_s": 1e3 / streamed, "t1_s": t1, "tN_s": tn,
                     "decode_tok_s_stats": st.decode_tok_s, "prefill_tok_s_stats": st.prefill_tok_s,
                     "runner": runner.stats.as_dict() if runner else None})
        log(f"generate request {r}: {reqs[-1]}")
        save()
    res["generate"] = reqs
    save()


def bare_steps(a, res, engine, dev, top):
    net = engine.model
    kv = net.new_kv_cache(a.prompt + a.tokens + 8)
    toks = ids(3, a.tokens, top)
    times = []
    with torch.inference_mode():
        net(torch.tensor(ids(4, a.prompt, top), device=dev), 0, kv)
        for n, tok in enumerate(toks):
            x = torch.tensor([tok], device=dev)
            torch.cuda.synchronize()
            t = time.perf_counter()
            net(x, a.prompt + n, kv)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    times = sorted(times[4:])
    res["bare_step"] = {"ms_mean": sum(times) / len(times) * 1e3, "ms_median": times[len(times) // 2] * 1e3}
    log("bare model step:", res["bare_step"])
    del kv


def prefill(a, res, engine, dev, top):
    net = engine.model
    prompt = torch.tensor(ids(5, a.prompt, top), device=dev)
    runner = net.decode_runner
    before = runner.stats.as_dict() if runner is not None else {}
    with torch.inference_mode():
        out = prefill_seconds(net, prompt, 6)  # eager, eager + capture (a length's second time), replays
    after = runner.stats.as_dict() if runner is not None else {}
    paths = {k: after[k] - before.get(k, 0) for k in ("prefill_eager", "prefill_captures", "prefill_replays")
             if k in after}
    dt = sorted(out[2:])[len(out[2:]) // 2]  # the median of the runs after the capture
    res["prefill"] = {"tokens": a.prompt, "seconds": dt, "tok_s": a.prompt / dt, "all_s": out,
                      "first_s": out[0], "paths": paths}
    log("prefill:", res["prefill"])


def capacity_invariance(a, res, engine, top):
    prompt = ids(6, a.prompt, top)
    got = {}
    pool = engine.model.kv_pool
    for kept in (True, False):
        engine.model.kv_pool = pool if kept else None
        for n in (100, 200):
            _, steps, _ = timed_generate(engine, prompt, n, keep_logits=True)
            got[(kept, n)] = ([s.token for s in steps[:100]], [s.logits for s in steps[:100]])
    engine.model.kv_pool = pool
    ref_t, ref_l = got[(True, 100)]
    res["max_tokens_invariance"] = {
        f"{'kept' if kept else 'own'}_{n}": {
            "tokens_equal": t == ref_t, "logits_equal": all(torch.equal(x, y) for x, y in zip(lg, ref_l))}
        for (kept, n), (t, lg) in got.items()}
    log("first 100 of 100 and 200 tokens:", res["max_tokens_invariance"])


def profile(a, res, engine, dev, top, out: Path):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    net = engine.model
    kv = net.new_kv_cache(600)
    with torch.inference_mode():
        net(torch.tensor(ids(7, 512, top), device=dev), 0, kv)
        for n in range(3):
            net(torch.tensor([1000 + n], device=dev), 512 + n, kv)
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for n in range(a.profile):
                net(torch.tensor([2000 + n], device=dev), 515 + n, kv)
            torch.cuda.synchronize()
    del kv
    table = p.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    kv = net.new_kv_cache(a.prompt + 8)
    x = torch.tensor(ids(8, a.prompt, top), device=dev)
    with torch.inference_mode():
        net(x, 0, kv)
        kv = net.new_kv_cache(a.prompt + 8)
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p2:
            net(x, 0, kv)
            torch.cuda.synchronize()
    table2 = p2.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    out.with_suffix(".profile.txt").write_text(f"decode ({a.profile} steps after a 512-token prompt):\n{table}\n\n"
                                               f"prefill of {a.prompt} tokens:\n{table2}\n")
    log("profile:\n" + table + "\n" + table2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--profile", type=int, default=4, help="decode steps profiled (0: none)")
    p.add_argument("--skip", default="", help="comma list of stages to skip: kernels,generate,bare,prefill,"
                                              "invariance")
    p.add_argument("--out", type=Path, default=Path("gpu_generate.json"))
    a = p.parse_args()
    skip = set(a.skip.split(","))
    dev = torch.device("cuda")
    res, save = gpu_run(a, dev, CONFIG)
    res["hbm_gb_s"] = hbm_rate(dev)
    log(f"HBM {res['hbm_gb_s']:.0f} GB/s")
    if "kernels" not in skip:
        kernels_alone(res, dev)
    save()
    t = time.perf_counter()
    engine = load(a.model, cache_budget_gb="all", device="cuda", tokenizer=False, hotlist=False,
                  learn_experts=False, progress=False)
    res["load_seconds"] = time.perf_counter() - t
    log(f"loaded (budget all) in {res['load_seconds']:.1f} s")
    vocab = engine.model.vocab_size
    top = min(vocab, 150000)
    try:
        res["floor_ms"] = floor_bytes(engine) / (res["hbm_gb_s"] * 1e9) * 1e3
        if "generate" not in skip:
            through_generate(a, res, engine, top, save)
        if "bare" not in skip:
            bare_steps(a, res, engine, dev, top)
        save()
        if "prefill" not in skip:
            prefill(a, res, engine, dev, top)
        save()
        if "invariance" not in skip:
            capacity_invariance(a, res, engine, top)
        save()
        if a.profile:
            profile(a, res, engine, dev, top, a.out)
    finally:
        engine.close()
    save()
    log("")
    for r in res.get("generate", []):
        log(f"generate: {r['streamed_ms_per_token']:.2f} ms/token first to last ({r['streamed_tok_s']:.1f} tok/s); "
            f"(t(N) - t(1)) / (N - 1) {r['ms_per_token']:.2f} ms; floor {res['floor_ms']:.2f} ms; "
            f"captures {r['runner']['captures'] if r['runner'] else '-'}")
    if "bare_step" in res:
        log(f"bare step: {res['bare_step']['ms_median']:.2f} ms (median)")
    if "prefill" in res:
        log(f"prefill {a.prompt}: {res['prefill']['seconds'] * 1e3:.1f} ms ({res['prefill']['tok_s']:.0f} tok/s)")


if __name__ == "__main__":
    main()
