"""Sampling, incremental detokenization and memory accounting."""

import pytest
import torch

from moestream.generation import Sampler, SamplingParams
from moestream.memory import available_bytes, cgroup_limit_bytes
from moestream.tokenizer import BUNDLED_QWEN3, StreamDecoder, encode_prompt, load_tokenizer


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    best = int(logits.argmax())
    assert Sampler(SamplingParams())(logits) == best
    assert all(Sampler(SamplingParams(temperature=1.0, top_k=1, seed=s))(logits) == best for s in range(5))
    assert all(Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=s))(logits) == best for s in range(5))


def test_sampling_is_seeded_and_follows_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2, 0.0]))
    draws = [Sampler(SamplingParams(temperature=1.0, seed=s))(logits) for s in range(2000)]
    assert 3 not in draws
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert abs(freq[0] - 0.5) < 0.04 and abs(freq[1] - 0.3) < 0.04 and abs(freq[2] - 0.2) < 0.04
    s1, s2 = Sampler(SamplingParams(temperature=1.0, seed=9)), Sampler(SamplingParams(temperature=1.0, seed=9))
    assert [s1(logits) for _ in range(20)] == [s2(logits) for _ in range(20)]
    # top-k 2 never picks the third; top-p 0.6 keeps {0, 1} (0.5 alone is short of 0.6)
    assert {Sampler(SamplingParams(temperature=1.0, top_k=2, seed=s))(logits) for s in range(300)} == {0, 1}
    assert {Sampler(SamplingParams(temperature=1.0, top_p=0.6, seed=s))(logits) for s in range(300)} == {0, 1}


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=-0.1), dict(top_p=1.5), dict(top_k=-2),
                                 dict(min_p=1.5), dict(repetition_penalty=0), dict(repetition_context=-1),
                                 dict(frequency_penalty=2.5), dict(presence_penalty=-3)])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(BUNDLED_QWEN3)


def test_stream_decoder_pieces_join_to_the_full_text(tok):
    text = "Streaming 专家 from disk — naïve café 🚀🚀 done.\nNext line."
    ids = tok.encode(text)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_chat_template_is_applied(tok):
    ids = encode_prompt(tok, "hello", chat_template=True, system="be brief")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(encode_prompt(tok, "hello", chat_template=False)) == "hello"


def fake_tree(root, proc_cgroup, files):
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(proc_cgroup)
    (root / "proc/meminfo").write_text("MemTotal: 24000000 kB\nMemAvailable: 20000000 kB\n")
    for rel, text in files.items():
        p = root / "sys/fs/cgroup" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_cgroup_v1_limit(tmp_path):
    fake_tree(tmp_path, "12:memory:/capped\n11:cpu,cpuacct:/\n",
              {"memory/capped/memory.limit_in_bytes": "4294967296\n", "memory/capped/memory.usage_in_bytes": "1000\n"})
    assert cgroup_limit_bytes(tmp_path) == (4294967296, 1000)
    assert available_bytes(tmp_path) <= 4294967296


def test_cgroup_v2_limit_and_unlimited(tmp_path):
    fake_tree(tmp_path / "a", "0::/user.slice/job\n", {"user.slice/job/memory.max": "2147483648\n",
                                                       "user.slice/job/memory.current": "5\n"})
    assert cgroup_limit_bytes(tmp_path / "a") == (2147483648, 5)
    assert available_bytes(tmp_path / "a") <= 2147483648
    fake_tree(tmp_path / "b", "0::/\n", {"memory.max": "max\n"})
    assert cgroup_limit_bytes(tmp_path / "b") is None
    assert available_bytes(tmp_path / "b") == 20000000 * 1024
