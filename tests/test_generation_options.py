"""Generation options without a model: penalties, min-p, stop strings, the reasoning splitter,
generation_config.json defaults and chat-template helpers."""

import json
import random

import pytest
import torch

from moestream.errors import ConfigError
from moestream.generation import Sampler, SamplingParams, apply_penalties, generation_defaults, resolve_sampling
from moestream.textstream import ReasoningSplitter, StopStrings
from moestream.tokenizer import (
    BUNDLED_QWEN3,
    chat_ids,
    current_turn,
    encode_prompt,
    load_tokenizer,
    next_turn_ids,
    prompt_opens_thinking,
    think_token_ids,
)


def test_repetition_penalty_is_the_ctrl_penalty_as_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g) * 3
    context = [3, 7, 7, 11, 20, 3, 42]
    assert (logits[context] < 0).any() and (logits[context] > 0).any()
    params = SamplingParams(repetition_penalty=1.3)
    out = apply_penalties(logits, context, [], params)
    for t in range(50):
        if t in context:
            want = logits[t] / 1.3 if logits[t] > 0 else logits[t] * 1.3
            assert torch.equal(out[t], want), t
        else:
            assert torch.equal(out[t], logits[t])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([context]), logits[None].clone())[0]
    assert torch.equal(out, ref)
    assert torch.equal(logits, logits.clone())  # input untouched
    # only the last rep_ctx tokens count; 0 or penalty 1 is off
    short = apply_penalties(logits, context, [], SamplingParams(repetition_penalty=1.3, repetition_context=2))
    assert torch.equal(short, RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[3, 42]]), logits[None].clone())[0])
    assert not SamplingParams(repetition_penalty=1.3, repetition_context=0).penalized
    assert not SamplingParams(repetition_penalty=1.0).penalized


def test_frequency_and_presence_penalties_as_openai_defines_them():
    logits = torch.linspace(-2, 2, 10)
    generated = [1, 1, 1, 4]
    out = apply_penalties(logits, [9, 9] + generated, generated,
                          SamplingParams(frequency_penalty=0.5, presence_penalty=0.25))
    want = logits.clone()
    want[1] -= 3 * 0.5 + 0.25
    want[4] -= 1 * 0.5 + 0.25
    assert torch.allclose(out, want) and out[9] == logits[9]  # the prompt is not counted


def test_min_p_removes_what_transformers_removes():
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    logits = torch.randn(200, generator=torch.Generator().manual_seed(1)) * 2
    for temp, min_p in ((1.0, 0.1), (0.7, 0.05), (1.5, 0.3)):
        got = Sampler(SamplingParams(temperature=temp, min_p=min_p)).warp(logits)
        ref = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temp)(None, logits[None].clone()))[0]
        assert torch.equal(torch.isinf(got), torch.isinf(ref))
        probs = torch.softmax(logits / temp, -1)
        assert torch.equal(torch.isinf(got), probs < min_p * probs.max())
        kept = set(torch.nonzero(~torch.isinf(got)).flatten().tolist())
        assert 1 < len(kept) < 200
        draws = {Sampler(SamplingParams(temperature=temp, min_p=min_p, seed=s))(logits) for s in range(200)}
        assert draws <= kept


def test_zero_disables_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    assert torch.equal(Sampler(SamplingParams(temperature=1.0, top_p=0.0)).warp(logits), logits)


def pieces_of(text, cuts):
    out, prev = [], 0
    for c in sorted(cuts) + [len(text)]:
        out.append(text[prev:c])
        prev = c
    return out


def run_stops(pieces, stops):
    s = StopStrings(stops)
    out = []
    for p in pieces:
        text, hit = s.push(p)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + s.flush(), False


def test_stop_strings_end_before_the_stop_even_split_across_pieces():
    text = "The answer is 42.\n\nUser: next question"
    rng = random.Random(0)
    for _ in range(200):
        pieces = pieces_of(text, rng.sample(range(1, len(text)), rng.randint(0, 12)))
        assert run_stops(pieces, ["\n\nUser:"]) == ("The answer is 42.", True)
        assert run_stops(pieces, ["User", "42"]) == ("The answer is ", True)  # the earliest stop wins
        assert run_stops(pieces, ["Assistant:"]) == (text, False)
        assert run_stops(pieces, []) == (text, False)
    # a held-back prefix that turns out not to be the stop string is emitted
    s = StopStrings(["abc"])
    assert s.push("xxab") == ("xx", False)
    assert s.push("d") == ("abd", False)
    assert s.push("ab") == ("", False) and s.flush() == "ab"


def split_all(pieces, **kw):
    sp = ReasoningSplitter(**kw)
    r, a = [], []
    for p in pieces:
        x = sp.push(p)
        r.append(x.reasoning)
        a.append(x.answer)
    x = sp.flush()
    return "".join(r) + x.reasoning, "".join(a) + x.answer


def test_reasoning_splitter_separates_thinking_from_the_answer_as_it_streams():
    text = "<think>\nLet me think.\nStill <thinking>.\n</think>\n\nThe answer\n\nis 4."
    rng = random.Random(1)
    for _ in range(200):
        pieces = pieces_of(text, rng.sample(range(1, len(text)), rng.randint(0, 15)))
        assert split_all(pieces) == ("Let me think.\nStill <thinking>.", "The answer\n\nis 4.")
        assert split_all(pieces, strip=False) == ("\nLet me think.\nStill <thinking>.\n", "\n\nThe answer\n\nis 4.")
    # the generation prompt already opened the block (QwQ, DeepSeek-R1)
    assert split_all(["Hmm", ".\n</th", "ink>\n\nYes"], start_in_reasoning=True) == ("Hmm.", "Yes")
    # no thinking at all; an unfinished block
    assert split_all(["Just ", "an answer."]) == ("", "Just an answer.")
    assert split_all(["<think>", "still going"]) == ("still going", "")


def test_generation_config_defaults_and_overrides(tmp_path):
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [1, 2]}))
    d = generation_defaults(tmp_path)
    assert d == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    p = resolve_sampling(d, seed=3)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.seed) == (0.6, 0.95, 20, 0.0, 1.0, 3)
    p = resolve_sampling(d, temperature=0.0, top_k=0, repetition_penalty=1.1)  # given values win, 0 included
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.0, 0.95, 0, 1.1)
    assert resolve_sampling({}) == SamplingParams()
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert generation_defaults(tmp_path) == {"temperature": 0.0}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": "twenty"}))
    with pytest.raises(ConfigError, match="generation_config.json: field 'top_k'"):
        generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="generation_config.json"):
        generation_defaults(tmp_path)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(BUNDLED_QWEN3)


def test_no_think_renders_an_empty_thinking_block(tok):
    think = tok.decode(encode_prompt(tok, "hi", chat_template_kwargs={"enable_thinking": False}))
    assert think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(encode_prompt(tok, "hi")).endswith("<|im_start|>assistant\n")
    open_id, close_id = think_token_ids(tok)
    assert tok.decode([open_id, close_id]) == "<think></think>"
    eos = {tok.eos_token_id}
    ids = chat_ids(tok, [{"role": "user", "content": "hi"}], chat_template_kwargs={"enable_thinking": False})
    assert close_id in current_turn(ids, eos) and not prompt_opens_thinking(ids, (open_id, close_id), eos)
    assert prompt_opens_thinking(ids + tok.encode("<think>\n"), (open_id, close_id), eos)


def test_chat_helpers_tools_roles_and_next_turn(tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "<think>\nneed tool\n</think>\n\ncalling"},
            {"role": "tool", "content": "sunny"}]
    text = tok.decode(chat_ids(tok, msgs, tools=tools))
    assert "get_weather" in text and "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # the next turn: everything after the assistant's content, to append to the tokens in the KV cache
    nxt = tok.decode(next_turn_ids(tok, msgs[:3] + [{"role": "user", "content": "thanks"}]))
    assert nxt == "<|im_end|>\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match=r"messages\[1\].role"):
        chat_ids(tok, [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
