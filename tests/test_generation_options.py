"""Generation options without a model: penalties, min-p, stop strings, the reasoning splitter,
generation_config.json defaults and chat-template helpers."""

import json
import random

import pytest
import torch

from moestream.errors import ConfigError, InputError
from moestream.sampling import Sampler, SamplingParams, apply_penalties, generation_defaults, resolve_sampling
from moestream.textstream import ReasoningSplitter, StopStrings
from moestream.tokenizer import (
    BUNDLED_QWEN3,
    UNICODE_FORM_SHRINK,
    PromptLimit,
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


def test_top_p_keeps_at_least_the_most_likely_token_as_transformers():
    """top_p below float32's smallest number (1e-300 is 0 there) used to drop every token."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.randn(300, generator=torch.Generator().manual_seed(2)) * 2
    for top_p in (1e-300, 1e-45, 1e-3, 0.3, 0.9):
        got = Sampler(SamplingParams(temperature=0.8, top_p=top_p)).warp(logits)
        ref = TopPLogitsWarper(top_p, min_tokens_to_keep=1)(None, TemperatureLogitsWarper(0.8)(None, logits[None]))[0]
        assert torch.equal(torch.isinf(got), torch.isinf(ref)), top_p
        assert not torch.isinf(got[logits.argmax()])
    assert Sampler(SamplingParams(temperature=1.0, top_p=1e-300, seed=3))(logits) == int(logits.argmax())


def test_a_temperature_that_overflows_the_logits_samples_their_limit():
    """At a temperature where logits / temperature overflows float32, every token below the top one has
    probability exp(-(top - logit) / temperature) = 0: the pick is the top token (uniform among exact ties).
    A temperature that does not overflow divides as before, bit for bit."""
    logits = torch.randn(500, generator=torch.Generator().manual_seed(4)) * 3
    top = int(logits.argmax())
    for temp in (1e-40, 1e-45, 1e-300, 5e-324):
        assert {Sampler(SamplingParams(temperature=temp, seed=s))(logits) for s in range(20)} == {top}, temp
    big = logits * 1e30  # overflows at a temperature that is not subnormal
    assert {Sampler(SamplingParams(temperature=1e-9, seed=s))(big) for s in range(20)} == {top}
    tied = logits.clone()
    tied[7] = tied[top]
    draws = {Sampler(SamplingParams(temperature=1e-40, seed=s))(tied) for s in range(200)}
    assert draws == {top, 7}
    negative = -logits.abs() - 1  # every logit negative: the top one underflows to -inf too
    assert Sampler(SamplingParams(temperature=1e-40, seed=0))(negative) == int(negative.argmax())
    for temp in (0.3, 1.0, 1e-6):
        assert torch.equal(Sampler(SamplingParams(temperature=temp)).warp(logits), logits / temp)


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


def test_unicode_normalization_shrinks_text_at_most_six_times():
    """The bound PromptLimit takes for an NFC/NFKC/NFD/NFKD normalizer: a normalized character c comes from
    input code points that each decompose to at least one of c's full decomposition's code points (4 bytes at
    most each), so the input has at most 4 * len(decomposition(c)) bytes per len(c.encode()) bytes."""
    import sys
    import unicodedata

    worst = {}
    for form, full in (("NFC", "NFD"), ("NFKC", "NFKD"), ("NFD", "NFD"), ("NFKD", "NFKD")):
        ratio = 0.0
        for cp in range(sys.maxunicode + 1):
            c = chr(cp)
            if 0xD800 <= cp < 0xE000 or unicodedata.normalize(form, c) != c:
                continue  # only characters a normalized text can hold
            ratio = max(ratio, 4 * len(unicodedata.normalize(full, c)) / len(c.encode()))
        worst[form] = ratio
    assert max(worst.values()) <= UNICODE_FORM_SHRINK, worst
    # and the shrink is real: decomposed Hangul (9 bytes a syllable) composes to 3 bytes
    assert len(unicodedata.normalize("NFC", "\u1100\u1161\u11a8").encode()) == 3


def test_prompt_limit_bounds_the_qwen3_token_count_from_below(tok):
    limit = PromptLimit.for_tokenizer(tok, 100)
    assert (limit.token_bytes, limit.shrink, limit.form) == (128, UNICODE_FORM_SHRINK, "NFC")
    vocab = sorted(tok.get_vocab(), key=len, reverse=True)
    rng = random.Random(0)
    texts = [" " * 12800, "\n" * 5000, "a" * 10000, "".join(tok.convert_tokens_to_string([t]) for t in vocab[:200]),
             "\u1100\u1161\u11a8" * 3000, "e\u0301" * 4000, "<|im_start|>" * 500, "\U0001d400" * 2000,
             "".join(chr(rng.randrange(32, 0x2FFFF)) for _ in range(3000)).encode("utf-8", "ignore").decode()]
    texts += ["".join(rng.choice(vocab[:2000]) for _ in range(300)) for _ in range(5)]
    for text in texts:
        at_least, n, per = limit.min_tokens(text)
        got = len(tok.encode(text, add_special_tokens=False))
        assert got >= at_least, (text[:40], got, at_least, n, per)
    assert limit.min_tokens(" " * 12800)[0] == len(tok.encode(" " * 12800, add_special_tokens=False))  # tight
    with pytest.raises(InputError, match="bytes, so at least 101 tokens"):
        limit.check(" " * 128 * 101)
    limit.check(" " * 128 * 100)


def test_prompt_limit_is_none_where_no_sound_bound_is_known():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "a": 1, "b": 2}
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    assert PromptLimit.for_tokenizer(PreTrainedTokenizerFast(tokenizer_object=wordpiece), 10) is None
    bpe = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert PromptLimit.for_tokenizer(PreTrainedTokenizerFast(tokenizer_object=bpe), 10).token_bytes == 4
    bpe.normalizer = normalizers.Strip()  # removes text: no bound
    assert PromptLimit.for_tokenizer(PreTrainedTokenizerFast(tokenizer_object=bpe), 10) is None
