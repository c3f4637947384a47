"""One benchmark run of one engine, in its own process (started by ``benchmarks/bench.py``).

Every engine gets the same token ids: a chat prompt (prefilled at once), then a fixed
natural-language continuation fed one token per step (``forced``: the varied token stream
of a real conversation, the same for every engine) or, as a secondary line, each step's
argmax (``greedy``: random weights repeat one token, which flatters every cache).

Progress goes to a JSON-lines file as it happens (one line after the load, after the
prefill and after each decoded token, each with this process's ``/proc/self/io``
read_bytes), so a run killed by the memory cap or stopped at the wall-clock limit still
leaves its figures; the full result is written to ``--out`` at the end.

    python bench_worker.py --engine moestream|llama|transformers|fastllm --model PATH --tokens tokens.json \
        --progress progress.jsonl --out result.json [engine options]

Engines (all with 2 compute threads):
- ``moestream``: ``moestream.engine.load`` with the CLI's defaults unless flags say otherwise;
  a fresh usage profile per run (``--usage-file``), so no run learns from an earlier one.
- ``llama``: llama-cpp-python's ``Llama`` (``n_ctx`` 1024, ``n_batch`` 512) on a GGUF file,
  ``use_mmap`` on (its default) or off, its CPU weight repack (``use_extra_bufts``) on (its default) or off.
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(device_map="auto",
  max_memory={"cpu": ...}, offload_folder=...)``: accelerate's disk offload.
- ``fastllm``: ``ftllm``'s ``llm.model`` with its disk MoE mode (experts read into a RAM cache of
  ``--moe-cpu-cache-gb``), bf16; it decodes its own greedy tokens after the prompt (see
  :func:`run_fastllm`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

THREADS = 2


def proc_io() -> dict:
    """This process's ``/proc/self/io`` counters (bytes; read_bytes = fetched from the block device)."""
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        k, v = line.split(":")
        out[k.strip()] = int(v)
    return out


def cpu_seconds() -> float:
    """CPU time (user + system) of this process so far, all threads: on a machine shared with other
    work, wall time measures the others too; CPU time much less (spinning threads still count)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Progress:
    """Appends one JSON line per event, flushed at once (the run may be killed any time)."""

    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)
        self.t0 = time.perf_counter()

    def __call__(self, **event) -> None:
        io = proc_io()
        event.update(wall=time.perf_counter() - self.t0, read_bytes=io["read_bytes"], write_bytes=io["write_bytes"],
                     cpu_s=cpu_seconds())
        self.f.write(json.dumps(event) + "\n")


def run_moestream(a, prompt: list[int], stream: list[int], progress: Progress) -> dict:
    # moestream first: it sets its OpenMP wait policy before torch loads OpenMP (moestream/__init__.py)
    from moestream.engine import load  # noqa: I001
    import torch

    torch.set_num_threads(THREADS)
    opts = json.loads(a.moestream_options)
    t0 = time.perf_counter()
    eng = load(a.model, cache_budget_gb=a.budget, tokenizer=False, usage_file=a.usage_file, **opts)
    load_s = time.perf_counter() - t0
    progress(phase="loaded", load_s=load_s, resident_gb=eng.resident_bytes / 1e9,
             experts_per_layer=max(lay.num_experts for lay in eng.layout.layers.values()))
    model, cache, store = eng.model, eng.cache, eng.store
    pipe, pf = eng.pipeline, eng.io.prefetcher if eng.io else None

    def split() -> dict:
        """CPU seconds so far of the reader threads and of the expert kernels (the rest is the difference)."""
        return {"reader_cpu_s": store.reader_cpu_seconds(), "kernel_cpu_s": pipe.kernel_cpu_seconds}

    res: dict = {"load_s": load_s, "resident_gb": eng.resident_bytes / 1e9,
                 "experts_per_layer": max(lay.num_experts for lay in eng.layout.layers.values()),
                 "read_path": "page cache" if eng.io and eng.io.use_page_cache else "O_DIRECT"}
    with torch.inference_mode():
        kv = model.new_kv_cache(len(prompt) + len(stream) + 1)
        ids = torch.tensor(prompt, dtype=torch.int64)
        t0 = time.perf_counter()
        logits = None
        for s in range(0, len(prompt), 512):  # the CLI's prefill chunk
            logits = model(ids[s:s + 512], s, kv)
        prefill_s = time.perf_counter() - t0
        progress(phase="prefill", prefill_s=prefill_s, **split())
        pf0 = pf.stats.as_dict() if pf is not None else None
        usage0 = {k: v.clone() for k, v in cache.usage.items()}
        h0, l0 = cache.stats.hits, cache.stats.lookups
        b0, p0 = store.stats.bytes_read, store.stats.prefetch_bytes
        pos = len(prompt)
        t0 = time.perf_counter()
        for i in range(len(stream)):
            tok = stream[i] if a.mode == "forced" else int(logits[-1].float().argmax())
            logits = model(torch.tensor([tok], dtype=torch.int64), pos, kv)
            pos += 1
            # the cache's figures so far, so that a run stopped at the limit still reports them
            progress(phase="token", i=i + 1, decode_s=time.perf_counter() - t0, hits=cache.stats.hits - h0,
                     lookups=cache.stats.lookups - l0, decode_bytes=store.stats.bytes_read - b0,
                     decode_prefetch_bytes=store.stats.prefetch_bytes - p0,
                     distinct_experts={int(k): int(((v - usage0[k]) > 0).sum()) for k, v in cache.usage.items()},
                     **split())
        decode_s = time.perf_counter() - t0
    lookups = cache.stats.lookups - l0
    distinct = {int(k): int(((v - usage0[k]) > 0).sum()) for k, v in cache.usage.items()}
    res.update(
        prefill_s=prefill_s, decode_s=decode_s, decoded=len(stream),
        hit_rate=(cache.stats.hits - h0) / lookups if lookups else 0.0,
        decode_bytes=store.stats.bytes_read - b0, decode_prefetch_bytes=store.stats.prefetch_bytes - p0,
        distinct_experts=distinct,
        experts_per_layer=max(lay.num_experts for lay in eng.layout.layers.values()),
        cache_peak_gb=cache.peak_bytes / 1e9,
        budget_gb="all" if cache.budget_bytes is None else cache.budget_bytes / 1e9,
    )
    if pf is not None:  # read-ahead: prefill's (chunks) and decode's accuracy per layer read for
        now = pf.stats.as_dict()
        per = {k: [a - b for a, b in zip(v, pf0["per_layer"].get(k, [0, 0, 0]))] for k, v in now["per_layer"].items()}
        hits, wasted = sum(v[1] for v in per.values()), sum(v[2] for v in per.values())
        res.update(prefill_read_ahead=[pf0["chunk_issued"], pf0["chunk_hits"], pf0["chunk_wasted"]],
                   decode_prefetch_per_layer=per, decode_prefetch_accuracy=hits / (hits + wasted) if hits + wasted
                   else None, decode_prefetch_plan_cpu_s=now["plan_cpu_seconds"] - pf0["plan_cpu_seconds"],
                   prefetch_status=now["disabled"] or "on")
    eng.close()
    return res


def run_llama(a, prompt: list[int], stream: list[int], progress: Progress) -> dict:
    import llama_cpp.llama_cpp as lib
    import numpy as np
    from llama_cpp import Llama

    if a.repack == "off":
        # Llama() (0.3.36) takes no use_extra_bufts argument (its **kwargs swallow one silently) and builds its
        # model params from llama_model_default_params() at load: hand it defaults with the repack off
        default = lib.llama_model_default_params

        def no_repack():
            params = default()
            params.use_extra_bufts = False
            return params

        lib.llama_model_default_params = no_repack
    t0 = time.perf_counter()
    llm = Llama(model_path=a.model, n_ctx=1024, n_batch=512, n_threads=THREADS, n_threads_batch=THREADS,
                use_mmap=a.mmap == "on", verbose=False)
    load_s = time.perf_counter() - t0
    extra = bool(llm.model_params.use_extra_bufts)  # what the model was loaded with, not what was asked
    if extra != (a.repack == "on"):
        raise SystemExit(f"use_extra_bufts is {extra}, asked --repack {a.repack}")
    progress(phase="loaded", load_s=load_s, use_extra_bufts=extra)
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - t0
    progress(phase="prefill", prefill_s=prefill_s)
    t0 = time.perf_counter()
    for i in range(len(stream)):
        tok = stream[i] if a.mode == "forced" else int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([tok])
        progress(phase="token", i=i + 1, decode_s=time.perf_counter() - t0)
    decode_s = time.perf_counter() - t0
    return {"load_s": load_s, "prefill_s": prefill_s, "decode_s": decode_s, "decoded": len(stream),
            "use_extra_bufts": extra}


def run_transformers(a, prompt: list[int], stream: list[int], progress: Progress) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        a.model, dtype=torch.bfloat16, device_map="auto", max_memory={"cpu": int(a.cpu_gb * 1e9)},
        offload_folder=a.offload_folder)
    model.eval()
    load_s = time.perf_counter() - t0
    placement = sorted({str(v) for v in getattr(model, "hf_device_map", {}).values()})
    progress(phase="loaded", load_s=load_s, placement=placement)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        prefill_s = time.perf_counter() - t0
        progress(phase="prefill", prefill_s=prefill_s)
        past, logits = out.past_key_values, out.logits
        t0 = time.perf_counter()
        for i in range(len(stream)):
            tok = stream[i] if a.mode == "forced" else int(logits[0, -1].float().argmax())
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits
            progress(phase="token", i=i + 1, decode_s=time.perf_counter() - t0)
        decode_s = time.perf_counter() - t0
    return {"load_s": load_s, "prefill_s": prefill_s, "decode_s": decode_s, "decoded": len(stream),
            "placement": placement}


def run_fastllm(a, prompt: list[int], stream: list[int], progress: Progress) -> dict:
    """fastllm (``ftllm``) with its disk MoE mode: experts stream from the safetensors into a RAM cache of
    ``--moe-cpu-cache-gb`` (``--moe_device disk --moe_cpu_cache N`` of its CLI), bf16 weights and activations.

    fastllm has no call that feeds a fixed continuation one token per step without recomputing (a launch per
    step with its history cache took 3-3.6 s per step on a 2-layer synth against 1.1 s per token within one
    generation), so it decodes its own greedy tokens for ``len(stream)`` steps after the same prompt: one
    launch, the prompt prefilled (time to the first token), then one token per step.
    """
    import ctypes

    from ftllm import llm
    from ftllm.llm import fastllm_lib

    llm.set_cpu_threads(THREADS)
    llm.set_device_map("cpu")
    if a.moe_cpu_cache_gb >= 0:
        llm.set_moe_cpu_cache(int(a.moe_cpu_cache_gb * 1e9))
        llm.set_device_map("disk", True)  # the MoE experts on "disk": read on demand into the RAM cache
    t0 = time.perf_counter()
    model = llm.model(a.model, dtype="bfloat16", moe_dtype="bfloat16")
    model.set_atype("bfloat16")  # its default fp16 activations do not multiply bf16 weights
    load_s = time.perf_counter() - t0
    progress(phase="loaded", load_s=load_s)
    stop_len, stop_list = model.stop_token_ctypes(None)
    ids = (ctypes.c_int * len(prompt))(*prompt)
    t0 = time.perf_counter()
    handle = fastllm_lib.launch_response_llm_model(model.model, len(prompt), ids, len(stream) + 1, 0, False, 1.0, 1,
                                                   1.0, 1.0, False, stop_len, stop_list)
    tokens, prefill_s, t1 = [], None, None
    while True:
        tok = fastllm_lib.fetch_response_llm_model(model.model, handle)
        now = time.perf_counter()
        if tok <= -1:
            break
        if prefill_s is None:  # the first token comes out of the prefill
            prefill_s, t1 = now - t0, now
            progress(phase="prefill", prefill_s=prefill_s)
            continue
        tokens.append(tok)
        progress(phase="token", i=len(tokens), decode_s=now - t1)
    decode_s = (time.perf_counter() - t1) if t1 is not None else None
    return {"load_s": load_s, "prefill_s": prefill_s, "decode_s": decode_s, "decoded": len(tokens),
            "note": "its own greedy tokens (no fed continuation)", "tokens": tokens}


ENGINES = {"moestream": run_moestream, "llama": run_llama, "transformers": run_transformers, "fastllm": run_fastllm}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--model", required=True, help="checkpoint folder (moestream, transformers) or GGUF file (llama)")
    p.add_argument("--tokens", type=Path, required=True, help='JSON {"prompt": [ids], "stream": [ids]}')
    p.add_argument("--mode", choices=("forced", "greedy"), default="forced")
    p.add_argument("--progress", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget", default="3", help="moestream: --cache-budget-gb")
    p.add_argument("--moestream-options", default="{}", help="moestream: load() keyword arguments as JSON")
    p.add_argument("--usage-file", default=None, help="moestream: usage profile (a fresh one per run)")
    p.add_argument("--mmap", choices=("on", "off"), default="on", help="llama: use_mmap")
    p.add_argument("--repack", choices=("on", "off"), default="on",
                   help="llama: use_extra_bufts, its CPU weight repack into anonymous memory (default on, its own)")
    p.add_argument("--cpu-gb", type=float, default=2.0, help="transformers: max_memory for the CPU, GB")
    p.add_argument("--offload-folder", default=None, help="transformers: accelerate's offload folder")
    p.add_argument("--moe-cpu-cache-gb", type=float, default=2.0,
                   help="fastllm: its RAM cache of disk experts, GB (--moe_cpu_cache; below 0: all in memory)")
    a = p.parse_args()
    toks = json.loads(a.tokens.read_text())
    progress = Progress(a.progress)
    progress(phase="start", pid=os.getpid())
    res = ENGINES[a.engine](a, toks["prompt"], toks["stream"], progress)
    io = proc_io()
    res.update(read_bytes=io["read_bytes"], write_bytes=io["write_bytes"], cpu_s=cpu_seconds(),
               peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)
    a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
