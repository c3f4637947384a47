"""Checks every model family runs: against its transformers reference, and streamed against all-resident."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moestream.engine import load
from moestream.generation import SamplingParams, generate

from .helpers import NORMS, ends, redraw_


def save_tiny(family: str, cfg: dict, path: Path, seed: int, extra=None):
    """:func:`save_reference` of transformers' ``<family>ForCausalLM`` on ``<family>Config(**cfg)``."""
    import transformers

    config = getattr(transformers, family + "Config")(**cfg)
    return save_reference(getattr(transformers, family + "ForCausalLM"), config, path, seed, extra)


def save_reference(model_cls, cfg, path: Path, seed: int, extra=None):
    """Build a float32 transformers model of ``cfg``, randomize what init leaves trivial, save it; return it.

    Norm weights (init 1), routers (so routing discriminates) and every bias (init 0:
    router, expert, correction biases, sinks) are drawn at random, so a missing or
    misplaced one cannot hide. ``extra(name, param)`` may redraw more.
    """
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    redraw_(model.named_parameters(), NORMS,
            (ends("mlp.gate.weight", "router.weight", "block_sparse_moe.gate.weight"), 0.0, 0.5),
            (ends("bias", "sinks"), 0.0, 0.3), extra=extra)
    redraw_(model.named_buffers(), (ends("e_score_correction_bias"), 0.0, 0.3))  # a buffer in MiniMax-M2
    model.save_pretrained(path)
    return model


def assert_logits_match(path: Path, ref, n: int = 40, chunk: int = 16, vocab: int = 300):
    """Logits over an ``n``-token prompt, whole and in chunks through the KV cache, within 1e-5 of ``ref``."""
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    engine = load(path, cache_budget_gb=0.0001, tokenizer=False, workers=2)
    try:
        for size in (n, chunk):
            kv = engine.model.new_kv_cache()
            with torch.inference_mode():
                got = torch.cat([engine.model(ids[s : s + size], s, kv, all_logits=True) for s in range(0, n, size)])
            rel = (got - want).abs().max() / want.abs().max()
            assert rel < 1e-5, f"chunk {size}: max relative error {rel:.2e}"
    finally:
        engine.close()


def assert_greedy_matches(path: Path, ref, prompt_len: int = 12, tokens: int = 32, vocab: int = 300,
                          prompt: torch.Tensor | None = None, **options):
    """32 greedy tokens equal to the reference's greedy decoding, from ``prompt`` [T] (default: ``prompt_len``
    random ids); ``options`` go to ``generate`` (``prefill_chunk``)."""
    if prompt is None:
        prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = ref.generate(prompt[None], max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    assert len(want) == tokens
    engine = load(path, cache_budget_gb=0.0001, tokenizer=False)
    try:
        got = [s.token for s in generate(engine, prompt.tolist(), tokens, SamplingParams(), stop_at_eos=False,
                                         **options)]
    finally:
        engine.close()
    assert got == want


def _run(path: Path, budget, prompt: list[int], chunk: int, **options):
    engine = load(path, cache_budget_gb=budget, workers=3, tokenizer=False, learn_experts=False, **options)
    try:
        kv = engine.model.new_kv_cache()
        with torch.inference_mode():
            prefill = torch.cat([engine.model(torch.tensor(prompt[s : s + chunk]), s, kv, all_logits=True)
                                 for s in range(0, len(prompt), chunk)])
        sampling = SamplingParams(temperature=1.0, seed=4)
        steps = list(generate(engine, prompt, 16, sampling, stop_at_eos=False, keep_logits=True, prefill_chunk=chunk))
        return prefill, [s.logits for s in steps], engine.cache.stats
    finally:
        engine.close()


def assert_streaming_exact(path: Path, n: int = 23, chunk: int = 7, vocab: int = 300):
    """Prefill and 16 sampled decode steps at a budget of 0 are torch.equal to budget ``all``."""
    prompt = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(11)).tolist()
    ref_prefill, ref_steps, ref_stats = _run(path, "all", prompt, chunk)
    prefill, steps, stats = _run(path, "0", prompt, chunk)
    assert ref_stats.misses == 0 and stats.misses > 0
    assert torch.equal(prefill, ref_prefill)
    assert len(steps) == len(ref_steps) == 16
    for i, (a, b) in enumerate(zip(steps, ref_steps)):
        assert torch.equal(a, b), f"step {i} logits differ"
    # reading ahead with the next layers' routers (the family's own routing) changes nothing either
    prefill, steps, stats = _run(path, "0", prompt, chunk, prefetch_ahead=2)
    assert torch.equal(prefill, ref_prefill)
    assert all(torch.equal(a, b) for a, b in zip(steps, ref_steps))


def _logits(net, ids: torch.Tensor, chunk: int, capacity: int = 256) -> torch.Tensor:
    """Every position's logits of ``ids`` [n], prefilled ``chunk`` tokens at a time into a new KV cache."""
    kv = net.new_kv_cache(capacity)
    with torch.inference_mode():
        return torch.cat([net(ids[s : s + chunk], s, kv, all_logits=True) for s in range(0, ids.shape[0], chunk)])


def assert_invariant(path: Path, n: int = 40, vocab: int = 300):
    """A token's logits depend only on the model, its context and its position (the invariance promise,
    docs/reliability.md): every position's logits of an ``n``-token prompt are the same bits prefilled whole
    or in chunks of 1, 7 and 64 tokens, with a KV cache of another capacity, with 1, 2 or 4 intra-op threads
    (not held: no ``generate`` here), with the first 17 tokens prefilled in an earlier call, and batched with
    1 to 7 other sequences of other lengths (:meth:`CausalLM.forward_batch`); and a decode step after it is
    the same bits alone and batched."""
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(0, vocab, (n,), generator=g)
    engine = load(path, cache_budget_gb="all", tokenizer=False, workers=2, learn_experts=False)
    try:
        net = engine.model
        want = _logits(net, ids, n)
        for chunk in (1, 7, 64):
            assert torch.equal(_logits(net, ids, chunk), want), f"prefill in chunks of {chunk} tokens"
        for capacity in (n, 4096):
            assert torch.equal(_logits(net, ids, n, capacity), want), f"a KV cache of capacity {capacity}"
        threads = torch.get_num_threads()
        try:
            for nt in (1, 2, 4):
                torch.set_num_threads(nt)
                assert torch.equal(_logits(net, ids, 7), want), f"{nt} intra-op threads"
        finally:
            torch.set_num_threads(threads)
        kv = net.new_kv_cache()
        with torch.inference_mode():
            first = net(ids[:17], 0, kv, all_logits=True)
            rest = net(ids[17:], 17, kv, all_logits=True)
        assert torch.equal(torch.cat([first, rest]), want), "a prefix prefilled in an earlier call"
        others = [torch.randint(0, vocab, (m,), generator=g) for m in (3, 11, 29, 1, 17, 5, 2)]
        for k in range(1, 8):
            kvs = [net.new_kv_cache() for _ in range(k + 1)]
            seqs = [ids, *others[:k]]
            order = list(range(k + 1))
            order = order[k // 2:] + order[: k // 2]  # the sequence at another place in the batch each time
            with torch.inference_mode():
                got = net.forward_batch([(seqs[j], 0, kvs[j]) for j in order], all_logits=True)
            assert torch.equal(got[order.index(0)], want), f"batched with {k} other sequences"
            step = torch.tensor([int(want[-1].argmax())])
            with torch.inference_mode():
                nxt = net.forward_batch([(step if j == 0 else seqs[j][-1:], seqs[j].shape[0], kvs[j]) for j in order])
                alone_kv = net.new_kv_cache()
                net(ids, 0, alone_kv)
                alone = net(step, n, alone_kv)
            assert torch.equal(nxt[order.index(0)], alone), f"a decode step batched with {k} others"
    finally:
        engine.close()


def with_offset(src: Path, dst: Path, pad: int) -> Path:
    """A copy of checkpoint ``src`` whose tensors all lie ``pad`` bytes further into their shard (a float32
    tensor ``aaa_pad`` written first), so every expert's pieces land at another offset modulo 4 KiB."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            tensors["aaa_pad"] = torch.zeros(pad // 4, dtype=torch.float32)
            save_file(tensors, dst / f.name, metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    index = dst / "model.safetensors.index.json"
    if index.exists():
        body = json.loads(index.read_text())
        body["weight_map"]["aaa_pad"] = next(iter(body["weight_map"].values()))
        index.write_text(json.dumps(body))
    return dst


def assert_streaming_exact_at_offsets(path: Path, tmp: Path, n: int = 23, vocab: int = 300):
    """Streamed at a budget of 0 with every expert's pieces at other offsets modulo 4 KiB (5 placements: the
    store lays a piece out at its file offset modulo 4 KiB) and, for the expert buffers the cache holds, at
    budget ``all``: the logits of a prefill in chunks of 7 and 8 sampled steps are torch.equal to budget
    ``all`` of the checkpoint as written."""
    prompt = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(11)).tolist()

    def run(where, budget):
        engine = load(where, cache_budget_gb=budget, workers=2, tokenizer=False, learn_experts=False)
        try:
            kv = engine.model.new_kv_cache()
            with torch.inference_mode():
                pre = torch.cat([engine.model(torch.tensor(prompt[s : s + 7]), s, kv, all_logits=True)
                                 for s in range(0, n, 7)])
            steps = list(generate(engine, prompt, 8, SamplingParams(temperature=1.0, seed=4), stop_at_eos=False,
                                  keep_logits=True, prefill_chunk=7))
            return pre, [s.logits for s in steps]
        finally:
            engine.close()

    want_pre, want_steps = run(path, "all")
    for pad in (4, 64, 1028, 2052, 4092):
        moved = with_offset(path, tmp / f"pad{pad}", pad)
        for budget in ("0", "all"):
            pre, steps = run(moved, budget)
            assert torch.equal(pre, want_pre), f"pieces {pad} bytes further, budget {budget}: prefill"
            assert all(torch.equal(a, b) for a, b in zip(steps, want_steps)), f"pieces {pad} bytes further: steps"


def synth_and_generate(tmp_path: Path, cfg: dict, layers: int = 2) -> dict:
    """``synth`` of ``cfg`` cut to ``layers`` layers, then 4 sampled tokens streamed at budget 0 and at ``all``.

    Returns the written config; the two runs must give the same tokens.
    """
    from moestream.synth import synth
    from moestream.tokenizer import encode_prompt

    (tmp_path / "c.json").write_text(json.dumps(cfg))
    out = synth(tmp_path / "c.json", tmp_path / "m", layers=layers)
    runs = []
    for budget in ("0", "all"):
        engine = load(out, cache_budget_gb=budget, tokenizer=True, workers=2)
        try:
            ids = encode_prompt(engine.tokenizer, "Hi", chat_template=False)
            sampling = SamplingParams(temperature=1.0, seed=0)
            runs.append([s.token for s in generate(engine, ids, 4, sampling, stop_at_eos=False)])
            assert engine.cache.stats.misses > 0 or budget == "all"
        finally:
            engine.close()
    assert len(runs[0]) == 4 and runs[0] == runs[1]
    return json.loads((out / "config.json").read_text())


# The checks of a family test module whose ``model`` fixture gives (checkpoint folder, transformers
# reference): the module star-imports them (``__all__``) and pytest collects them there.
__all__ = ["test_logits_match_transformers", "test_greedy_tokens_match_transformers", "test_streaming_bit_identical",
           "test_invariant_to_chunks_capacity_threads_and_batch", "test_streaming_exact_wherever_the_pieces_lie"]


def test_logits_match_transformers(model):
    assert_logits_match(*model)  # 40 tokens, whole and in chunks (through any sliding window of the tiny model)


def test_greedy_tokens_match_transformers(model):
    assert_greedy_matches(*model)


def test_streaming_bit_identical(model):
    assert_streaming_exact(model[0])


def test_invariant_to_chunks_capacity_threads_and_batch(model):
    assert_invariant(model[0])


def test_streaming_exact_wherever_the_pieces_lie(model, tmp_path):
    assert_streaming_exact_at_offsets(model[0], tmp_path)
