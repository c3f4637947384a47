"""Tokenizers and chat templates, through transformers' ``AutoTokenizer``.

moestream ships one tokenizer: Qwen3's byte-level BPE with its chat template (from the
Qwen3 releases, Apache-2.0; see NOTICE), which ``moestream synth`` copies into the
checkpoints it writes so that they work offline.
"""

from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError

BUNDLED_QWEN3 = Path(__file__).parent / "data" / "tokenizers" / "qwen3"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def load_tokenizer(folder: str | Path):
    """Load the tokenizer in ``folder`` offline (never runs code from the folder).

    Raises:
        CheckpointError: when the folder holds no tokenizer files or they cannot be loaded.
    """
    folder = Path(folder)
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise CheckpointError(f"{folder}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False, local_files_only=True)
    except Exception as e:  # transformers raises many kinds for unreadable tokenizer files
        error = e
    try:  # a model_type transformers does not know (kimi_k2): let the tokenizer files name the class
        from transformers import PretrainedConfig

        return AutoTokenizer.from_pretrained(
            str(folder), trust_remote_code=False, local_files_only=True, config=PretrainedConfig()
        )
    except Exception:
        raise CheckpointError(f"{folder}: cannot load the tokenizer: {error}") from None


def encode_prompt(tokenizer, prompt: str, chat_template: bool = True, system: str | None = None) -> list[int]:
    """Token ids of ``prompt``, rendered through the tokenizer's chat template unless disabled.

    Without a template (or when the tokenizer has none) the text is encoded as is.
    """
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


class StreamDecoder:
    """Turns generated token ids into text pieces as they arrive.

    Decodes a short window of recent ids and emits only the new text, holding back a
    piece while it ends in an incomplete UTF-8 sequence (shown as U+FFFD), in the
    manner of transformers' ``TextStreamer``.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the decode window
        self.read = 0  # ids whose text has been emitted

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def push(self, token: int) -> str:
        """Add one id; return the text that became final (may be empty)."""
        self.ids.append(token)
        before = self._text(self.ids[self.prefix : self.read])
        after = self._text(self.ids[self.prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Text still held back at the end of generation."""
        before = self._text(self.ids[self.prefix : self.read])
        after = self._text(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]
