"""Qwen3's tokenizer (bundled with moestream) written into GGUF metadata as llama.cpp's ``convert_hf_to_gguf.py``
writes a Qwen3 checkpoint's: the real 151,936-token vocabulary and 151,387 merges, for tests of what a GGUF
file's tokenizer costs and builds (tests/test_gguf_tokenizer.py)."""

from __future__ import annotations

from pathlib import Path

import gguf

QWEN3_TOKENIZER = Path(__file__).resolve().parent.parent / "moestream" / "data" / "tokenizers" / "qwen3"
QWEN3_VOCAB = 151936  # Qwen3's config vocab_size: the tokenizer's 151,669 tokens padded as the checkpoints are


def qwen3_tokenizer_metadata(folder: Path = QWEN3_TOKENIZER, vocab_size: int = QWEN3_VOCAB):
    """An ``extra(writer)`` for ``tests.gguf_helpers.write_gguf`` writing the tokenizer of ``folder`` (Qwen3's,
    bundled) as llama.cpp's ``convert_hf_to_gguf.py`` does (``TextModel.get_vocab_base`` and ``_set_vocab_gpt2``): every
    id below ``vocab_size`` a token (``[PAD<id>]``, UNUSED, where the tokenizer has none), added tokens
    CONTROL when special or looking special (``<|...|>``) else USER_DEFINED, model ``gpt2``, pre ``qwen2``;
    merges, special token ids, ``add_bos_token`` and the chat template by the ``gguf`` package's own
    ``SpecialVocab``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added, decoder = tok.get_added_vocab(), tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        t = reverse[i]
        if t in added:
            special = decoder[i].special or (t.startswith("<|") and t.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(t)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens))
    # the ids SpecialVocab reads from a checkpoint's config.json and tokenizer.json (the bundled folder has
    # neither): Qwen3's bos_token_id and eos of config.json, its tokenizer_config's eos and pad tokens
    ids = tok.get_vocab()
    for typ, text in (("bos", "<|endoftext|>"), ("eos", tok.eos_token), ("pad", tok.pad_token)):
        special.special_token_ids.setdefault(typ, ids[text])

    def extra(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        special.add_to_gguf(w, quiet=True)

    return extra


def tiny_bpe_metadata(text: str, template: str):
    """A 290-token byte-level BPE tokenizer trained on ``text`` (20 times), and an ``extra(writer)`` for
    ``tests.gguf_helpers.write_gguf`` writing it and the chat ``template`` as GGUF metadata: (tokenizer, extra)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([text] * 20, trainer)
    vocab = bpe.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(bpe.to_str())["model"]["merges"]]

    def extra(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_eos_token_id(vocab["<|endoftext|>"])
        w.add_chat_template(template)

    return bpe, extra
