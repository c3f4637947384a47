"""A GGUF file's tokenizer with the real Qwen3 vocabulary (151,936 tokens, 151,387 merges), written as llama.cpp's
convert_hf_to_gguf.py writes it (tests/gguf_vocab.py): moestream builds the very
tokenizer ``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` builds, without transformers' second parse
of the whole vocabulary, and it tokenizes as the Qwen3 tokenizer the file was made from; opening the file
(``open_gguf``, ``moestream inspect``) never parses the vocabulary."""

import gguf
import pytest
import transformers.modeling_gguf_pytorch_utils as gguf_utils
from transformers import AutoTokenizer

from moestream import gguf_format
from moestream import tokenizer as tokenizer_module
from moestream.engine import load
from moestream.errors import CheckpointError
from moestream.inspect import inspect
from moestream.sources import open_gguf
from moestream.tokenizer import load_gguf_tokenizer, load_tokenizer

from .gguf_helpers import make_model, write_gguf
from .gguf_vocab import QWEN3_TOKENIZER, QWEN3_VOCAB, qwen3_tokenizer_metadata

TEXTS = [
    "Hello, world! Why is the sky blue?",
    "def f(x):\n    return x ** 2  # 平方\n",
    "  leading   spaces\t\ttabs\n\n\nand blank lines   ",
    "数学很有趣 🤖 émoji ß straße Ünïcödé",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm</think>ok<|im_end|>",
    "12345678901234 3.14159 1e-9 0x1F",
    '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><|endoftext|>',
    "",
]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds",
                                            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory):
    """arch -> a tiny model's GGUF file carrying Qwen3's tokenizer (each in its own folder, nothing beside it)."""
    extra = qwen3_tokenizer_metadata()
    out = {}
    for arch, family in (("qwen3moe", "qwen3_moe"), ("llama", "mixtral")):
        path = tmp_path_factory.mktemp(arch) / "model.gguf"
        write_gguf(make_model(seed=5, family=family, vocab_size=QWEN3_VOCAB), path, "Q8_0", extra=extra)
        out[arch] = path
    return out


def _boom(*args, **kwargs):
    raise AssertionError("the slow GGUF parse ran")


@pytest.mark.parametrize("arch, cls", [("qwen3moe", "Qwen2Tokenizer"), ("llama", "TokenizersBackend")])
def test_the_tokenizer_is_the_one_transformers_builds(vocab_files, arch, cls, monkeypatch):
    path = vocab_files[arch]
    with monkeypatch.context() as m:  # moestream never takes transformers' load_gguf_checkpoint (11 s on Qwen3's)
        m.setattr(gguf_utils, "load_gguf_checkpoint", _boom)
        m.setattr(gguf.GGUFReader, "__init__", _boom)
        fast = load_gguf_tokenizer(path)
    full = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    assert type(fast) is type(full) and type(fast).__name__ == cls
    assert fast.backend_tokenizer.to_str() == full.backend_tokenizer.to_str()  # vocab, merges, added tokens, steps
    assert fast.init_kwargs == full.init_kwargs
    assert fast.special_tokens_map == full.special_tokens_map
    assert (fast.eos_token, fast.pad_token, fast.bos_token) == ("<|im_end|>", "<|endoftext|>", "<|endoftext|>")
    assert str(fast.added_tokens_decoder) == str(full.added_tokens_decoder)
    assert fast.chat_template == full.chat_template
    for text in TEXTS:
        ids = fast.encode(text, add_special_tokens=False)
        assert ids == full.encode(text, add_special_tokens=False)
        assert fast.decode(ids) == full.decode(ids) == text
        assert fast.decode(ids, skip_special_tokens=True) == full.decode(ids, skip_special_tokens=True)
        assert fast(text)["input_ids"] == full(text)["input_ids"]
    for kw in ({}, {"tools": TOOLS}, {"enable_thinking": False}):
        assert fast.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kw) == \
            full.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kw)


def test_it_tokenizes_as_the_qwen3_tokenizer_it_was_made_from(vocab_files):
    fast = load_gguf_tokenizer(vocab_files["qwen3moe"])
    qwen3 = load_tokenizer(QWEN3_TOKENIZER)  # the folder the file's lists were written from
    for text in TEXTS:
        ids = qwen3.encode(text, add_special_tokens=False)
        assert fast.encode(text, add_special_tokens=False) == ids
        assert fast.decode(ids) == text
        assert fast.decode(ids, skip_special_tokens=True) == qwen3.decode(ids, skip_special_tokens=True)
    assert fast.convert_tokens_to_ids(["<|im_start|>", "<think>", "</think>"]) == [151644, 151667, 151668]
    for kw in ({}, {"tools": TOOLS}, {"enable_thinking": False}):
        assert fast.apply_chat_template(MESSAGES, add_generation_prompt=True, **kw) == \
            qwen3.apply_chat_template(MESSAGES, add_generation_prompt=True, **kw)


def test_opening_and_inspecting_never_parse_the_vocabulary(vocab_files, monkeypatch):
    path = vocab_files["qwen3moe"]
    strings = []
    real = gguf_format._Header.text
    monkeypatch.setattr(gguf_format._Header, "text", lambda self, *a, **k: strings.append(a) or real(self, *a, **k))
    monkeypatch.setattr(gguf.GGUFReader, "__init__", _boom)  # moestream's own bounded walk reads the header
    ckpt = open_gguf(path)
    meta = ckpt.source_format.metadata
    ckpt.close()
    # every string held is read with _Header.text: 303,323 of them in the lists (stepped over), 300 or so elsewhere
    assert 0 < len(strings) < 1000
    assert meta["tokenizer.ggml.tokens"] == {"array_of": QWEN3_VOCAB}
    assert meta["tokenizer.ggml.token_type"] == {"array_of": QWEN3_VOCAB}
    assert meta["tokenizer.ggml.merges"] == {"array_of": 151387}
    assert meta["tokenizer.ggml.eos_token_id"] == 151645 and meta["tokenizer.ggml.model"] == "gpt2"
    strings.clear()
    monkeypatch.setattr(tokenizer_module, "load_gguf_tokenizer", _boom)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", _boom)
    got = inspect(str(path))
    assert got.can_stream and "GGUF v3, qwen3moe" in got.to_text()
    assert 0 < len(strings) < 1000


def test_a_file_cut_inside_the_vocabulary_is_refused(vocab_files, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(vocab_files["qwen3moe"].read_bytes()[:1_000_000])  # the lists take the first ~4 MB
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        open_gguf(cut)


def test_the_engine_loads_it(vocab_files):
    engine = load(vocab_files["qwen3moe"], cache_budget_gb="0", workers=1)
    try:
        assert type(engine.tokenizer).__name__ == "Qwen2Tokenizer"
        assert engine.tokenizer.encode(TEXTS[0], add_special_tokens=False) == \
            load_tokenizer(QWEN3_TOKENIZER).encode(TEXTS[0], add_special_tokens=False)
    finally:
        engine.close()
