"""Generation options on a tiny streamed model with the bundled Qwen3 tokenizer: stop strings,
the </think> mask, logprobs, the KV cache kept between chat turns, the CLI flags, the Python
API, and exactness against budget ``all``."""

import argparse
import io
import json
from contextlib import contextmanager

import pytest
import torch

import moestream
from moestream import generation
from moestream.cli import run_generate
from moestream.engine import load
from moestream.generation import (
    GenerationStats,
    SamplingParams,
    Session,
    apply_penalties,
    eos_ids,
    generate,
    whole_model_hint,
)
from moestream.tokenizer import chat_ids, next_turn_ids, think_token_ids

from .helpers import tiny_synth_fixture

ckpt = tiny_synth_fixture("gen")


@pytest.fixture(scope="module")
def engine(ckpt):
    e = load(ckpt, cache_budget_gb="all", workers=2, progress=False)
    yield e
    e.close()


@pytest.fixture(scope="module")
def engine0(ckpt):
    e = load(ckpt, cache_budget_gb=0, workers=3, progress=False)
    yield e
    e.close()


@pytest.fixture
def loaded(monkeypatch, engine, engine0):
    """``run_generate`` gets the module's engines (budget all or 0) instead of loading the model again."""
    import dataclasses

    from moestream.cli import engine_args as cli_module

    def load_engine(args, options, tokenizer=True):
        e = dataclasses.replace(engine if args.cache_budget_gb == "all" else engine0)
        e.close = lambda: None
        return e

    monkeypatch.setattr(cli_module, "load_engine", load_engine)


@contextmanager
def forced(engine, schedule):
    """Make the model strongly prefer ``schedule(step)`` (a token id or None) at each step."""
    model, calls = engine.model, [0]
    real = model.forward

    def forward(ids, start, kv, all_logits=False):
        out = real(ids, start, kv, all_logits)
        t = schedule(calls[0])
        calls[0] += 1
        if t is not None:
            out = out.clone()
            out[..., t] += 1e4
        return out

    model.forward = forward
    try:
        yield
    finally:
        del model.forward


def prompt(engine, text="Tell me about disks.", **kw):
    return chat_ids(engine.tokenizer, [{"role": "user", "content": text}], **kw)


def test_stop_string_split_across_tokens_ends_generation_before_it(engine):
    ids = prompt(engine)
    steps = list(generate(engine, ids, 16, stop_at_eos=False))
    texts = [s.text for s in steps]
    full = "".join(texts)
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    for i in range(1, len(texts) - 1):
        stop = texts[i][1:] + texts[i + 1][:1]  # from inside token i to inside token i + 1
        if len(texts[i]) >= 2 and texts[i + 1] and full.find(stop) == offsets[i] + 1:
            break
    else:
        pytest.fail("no token boundary to split a stop string across")
    got = list(generate(engine, ids, 16, stop_at_eos=False, stop=["never-there", stop]))
    assert "".join(s.text for s in got) == full[: offsets[i] + 1]
    assert len(got) == i + 2 and [s.token for s in got] == [s.token for s in steps[: i + 2]]
    assert got[-1].finish_reason == "stop" and all(s.finish_reason is None for s in got[:-1])
    assert steps[-1].finish_reason == "length"


def test_second_think_end_is_masked_unless_multi_think(engine):
    open_id, close_id = think_token_ids(engine.tokenizer)
    with forced(engine, lambda step: close_id):
        default = [s.token for s in generate(engine, prompt(engine), 5, stop_at_eos=False)]
        multi = [s.token for s in generate(engine, prompt(engine), 5, stop_at_eos=False, multi_think=True)]
        no_think = [s.token for s in generate(engine, prompt(engine, chat_template_kwargs={"enable_thinking": False}),
                                              5, stop_at_eos=False)]
    assert default[0] == close_id and close_id not in default[1:]
    assert multi == [close_id] * 5
    assert close_id not in no_think  # the --no-think prompt already closed the block


def test_logprobs_are_post_penalty_pre_temperature(engine):
    ids = prompt(engine)
    sampled = SamplingParams(temperature=0.5, seed=1, frequency_penalty=1.0)
    for params in (SamplingParams(repetition_penalty=1.5), sampled):
        steps = list(generate(engine, ids, 6, params, stop_at_eos=False, keep_logits=True, logprobs=4))
        gen = []
        for s in steps:
            want = torch.log_softmax(apply_penalties(s.logits, ids + gen, gen, params), -1)
            assert s.logprob.logprob == pytest.approx(float(want[s.token]), abs=1e-5)
            top = torch.topk(want, 4)
            assert [t for t, _ in s.logprob.top] == top.indices.tolist()
            assert [v for _, v in s.logprob.top] == pytest.approx(top.values.tolist(), abs=1e-5)
            if params.temperature == 0:
                assert s.logprob.top[0][0] == s.token
            gen.append(s.token)


def test_session_keeps_the_kv_cache_between_turns(engine):
    tok, eos = engine.tokenizer, eos_ids(engine)
    messages = [{"role": "user", "content": "Hello there."}]
    first = chat_ids(tok, messages)
    session = Session()
    turn1 = [s.token for s in generate(engine, first, 6, session=session)]
    assert session.ids == first + turn1[:-1] and session.kv.length == len(session.ids)
    reply = tok.decode(turn1)
    conversation = first + [t for t in turn1 if t not in eos]
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    second = conversation + next_turn_ids(tok, messages)
    stats = GenerationStats()
    turn2 = [s.token for s in generate(engine, second, 6, stats=stats, session=session)]
    assert stats.prompt_cached_tokens == len(first) + len(turn1) - 1  # only the new turn is prefilled
    fresh = [s.token for s in generate(engine, second, 6)]
    assert turn2 == fresh


def args(model, **kw):
    return argparse.Namespace(**{**dict(model=str(model), cache_budget_gb="all", prefetch_workers=2, max_tokens=6),
                                 **kw})


def cli(model, inp="", **kw):
    out, err = io.StringIO(), io.StringIO()
    stats = run_generate(args(model, **kw), out=out, err=err, inp=io.StringIO(inp))
    return out.getvalue(), err.getvalue(), stats


def test_prompt_from_stdin_and_file(ckpt, tmp_path, loaded):
    text = "Tell me about disks.\nTwo lines."
    (tmp_path / "p.txt").write_text(text)
    want = cli(ckpt, prompt=text, quiet=True)[0]
    assert cli(ckpt, inp=text, prompt="-", quiet=True)[0] == want
    assert cli(ckpt, prompt_file=tmp_path / "p.txt", quiet=True)[0] == want
    with pytest.raises(moestream.MoestreamError, match="--prompt-file"):
        cli(ckpt, prompt_file=tmp_path / "missing.txt")
    with pytest.raises(moestream.MoestreamError, match="--prompt -: stdin is empty"):
        cli(ckpt, prompt="-", inp="")


def test_defaults_from_generation_config_and_flags_override(ckpt, monkeypatch, loaded):
    seen = []
    real = generation.generate

    def spy(engine, ids, max_tokens, sampling, *a, **kw):
        seen.append(sampling)
        return real(engine, ids, max_tokens, sampling, *a, **kw)

    monkeypatch.setattr(generation, "generate", spy)
    cli(ckpt, prompt="hi")
    assert seen[-1] == SamplingParams()  # no generation_config.json: greedy, every filter off
    config = ckpt / "generation_config.json"
    config.write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}))
    try:
        _, err, _ = cli(ckpt, prompt="hi", seed=0)
        assert "sampling defaults from generation_config.json: temperature 0.6, top_p 0.95, top_k 20" in err
        assert seen[-1] == SamplingParams(0.6, 0.95, 20, 0, repetition_penalty=1.1)
        cli(ckpt, prompt="hi", temp=0.0, top_k=0, rep_penalty=1.0, min_p=0.05)
        assert seen[-1] == SamplingParams(0.0, 0.95, 0, None, min_p=0.05, repetition_penalty=1.0)
    finally:
        config.unlink()


def test_chat_cli_prefills_only_the_new_turn(ckpt, tmp_path, loaded):
    out, err, stats = cli(ckpt, chat=True, inp="Hello there.\n\nAnd then?\n", stats_json=tmp_path / "s.json",
                          system="be brief")
    turns = [line for line in err.splitlines() if line.startswith("[") and "prefilled" in line]
    assert len(turns) == 2 and len(out.splitlines()) == 2
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["prompt_cached_tokens"] == stats.prompt_cached_tokens > 10
    assert saved["prompt_tokens"] - saved["prompt_cached_tokens"] < 20  # the second turn only


def test_streamed_output_is_bit_identical_to_budget_all_with_every_option(ckpt, engine, engine0, loaded):
    flags = dict(prompt="Tell me about disks.", temp=0.0, rep_penalty=1.3, rep_ctx=8, min_p=0.2, no_think=True,
                 hide_think=True, stop=["zzz"], max_tokens=10)
    out_all, _, stats_all = cli(ckpt, **flags)
    out_0, err_0, stats_0 = cli(ckpt, **dict(flags, cache_budget_gb="0"))
    assert out_0 == out_all and stats_0.generated_token_ids == stats_all.generated_token_ids
    assert stats_0.experts_read > 0 and stats_all.experts_read == 0
    assert "--cache-budget-gb all keeps every expert resident" in err_0  # the tiny model fits in memory
    ids = prompt(engine)
    params = SamplingParams(repetition_penalty=1.2, presence_penalty=0.5)
    a = list(generate(engine, ids, 8, params, keep_logits=True, logprobs=3, stop=["zzz"]))
    b = list(generate(engine0, ids, 8, params, keep_logits=True, logprobs=3, stop=["zzz"]))
    assert [(s.token, s.text, s.logprob, s.finish_reason) for s in a] == \
           [(s.token, s.text, s.logprob, s.finish_reason) for s in b]
    assert all(torch.equal(x.logits, y.logits) for x, y in zip(a, b))


def test_whole_model_hint_needs_room(engine, engine0, monkeypatch):
    assert whole_model_hint(engine) is None  # budget all already
    assert "GB available" in whole_model_hint(engine0)
    monkeypatch.setattr(generation, "available_bytes", lambda: 1000)
    assert whole_model_hint(engine0) is None


def test_python_api_mirrors_the_cli(engine):
    open_id, close_id = think_token_ids(engine.tokenizer)
    text, stats = moestream.generate(engine, "Tell me about disks.", max_tokens=6, return_stats=True)
    assert text == engine.tokenizer.decode(stats.generated_token_ids, skip_special_tokens=False).removesuffix(
        "<|im_end|>")
    assert moestream.generate(engine, "Tell me about disks.", max_tokens=6) == text
    assert moestream.generate(engine, prompt(engine), max_tokens=6) == text  # token ids
    assert moestream.generate(engine, [{"role": "user", "content": "Tell me about disks."}], max_tokens=6) == text
    plan = {0: open_id, 3: close_id}  # <think> a b </think> c d ...
    with forced(engine, plan.get):
        rs = list(moestream.stream_generate(engine, "Hi", max_tokens=8, hide_think=True))
    assert [r.finish_reason for r in rs] == [None] * 7 + ["length"]
    assert [r.generation_tokens for r in rs] == list(range(1, 9)) and rs[0].prompt_tokens > 5
    assert all(0 <= r.cache_hit_rate <= 1 and r.peak_rss_gb > 0 for r in rs)
    tokens = [r.token for r in rs]
    assert tokens[0] == open_id and tokens[3] == close_id
    dec = engine.tokenizer.decode
    assert "".join(r.reasoning for r in rs) == dec(tokens[1:3]).strip("\n")
    assert "".join(r.text for r in rs) == "".join(r.answer for r in rs) == dec(tokens[4:]).strip("\n")


def test_device_side_greedy_loop_is_the_plain_loop(engine, monkeypatch):
    """The decode loop that picks greedy tokens on the device and queues each step before reading the last
    one's token (on CUDA) gives the plain loop's tokens, text, finish reasons, logits and digest, with the
    </think> mask, stop strings, an EOS and a session (whose tokens and KV length it leaves the same)."""
    from moestream import generation

    open_id, close_id = think_token_ids(engine.tokenizer)
    eos = sorted(eos_ids(engine))[0]

    def runs():
        out = []
        with forced(engine, lambda step: close_id if step in (1, 3) else None):
            for kw in ({}, {"multi_think": True}, {"stop": ["e"]}):
                stats = GenerationStats()
                steps = list(generate(engine, prompt(engine), 9, stop_at_eos=False, keep_logits=True, stats=stats,
                                      **kw))
                out.append(([(s.token, s.text, s.finish_reason) for s in steps], [s.logits for s in steps],
                            stats.logits_sha256))
        session = Session()
        with forced(engine, lambda step: eos if step == 4 else None):
            steps = list(generate(engine, prompt(engine), 9, session=session))
        out.append(([(s.token, s.finish_reason) for s in steps], [], (list(session.ids), session.kv.length)))
        return out

    plain = runs()
    monkeypatch.setattr(generation, "PIPELINE_DEVICES", ("cpu",))
    calls = []
    real = generation._DevicePicker.pick
    monkeypatch.setattr(generation._DevicePicker, "pick", lambda self, x: calls.append(1) or real(self, x))
    piped = runs()
    assert calls  # the device-side loop ran
    for (a, la, da), (b, lb, db) in zip(plain, piped):
        assert a == b and da == db
        assert all(torch.equal(x, y) for x, y in zip(la, lb))
    assert plain[-1][0][-1] == (eos, "stop") and len(plain[-1][0]) == 5
