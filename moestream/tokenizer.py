"""Tokenizers and chat templates, through transformers' ``AutoTokenizer``.

moestream ships one tokenizer: Qwen3's byte-level BPE with its chat template (from the
Qwen3 releases, Apache-2.0; see NOTICE), which ``moestream synth`` copies into the
checkpoints it writes so that they work offline.
"""

from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError, InputError

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
    declared = _declared_tokenizer_class(folder)
    if declared is not None:
        # AutoTokenizer goes by config.json's model_type first: a Mixtral or gpt-oss
        # checkpoint written by `moestream synth` carries the Qwen3 tokenizer files
        try:
            return declared.from_pretrained(str(folder), local_files_only=True)
        except Exception:
            pass
    try:  # a model_type transformers does not know (kimi_k2): let the tokenizer files name the class
        from transformers import PretrainedConfig

        return AutoTokenizer.from_pretrained(
            str(folder), trust_remote_code=False, local_files_only=True, config=PretrainedConfig()
        )
    except Exception:
        raise CheckpointError(f"{folder}: cannot load the tokenizer: {error}") from None


def _declared_tokenizer_class(folder: Path):
    """The transformers class that ``tokenizer_config.json``'s ``tokenizer_class`` names, or None."""
    import json

    import transformers

    try:
        name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None


def encode_prompt(
    tokenizer, prompt: str, chat_template: bool = True, system: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of ``prompt``, rendered through the tokenizer's chat template unless disabled.

    Without a template (or when the tokenizer has none) the text is encoded as is.
    ``chat_template_kwargs`` go to the template (``{"enable_thinking": False}``: ``--no-think``).
    """
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return chat_ids(tokenizer, messages, chat_template_kwargs=chat_template_kwargs)
    return tokenizer.encode(prompt, add_special_tokens=False)


ROLES = ("system", "user", "assistant", "tool")


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError("messages: expected a non-empty list of {'role': ..., 'content': ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputError(f"messages[{i}]: expected an object with 'role' and 'content'")
        if m.get("role") not in ROLES:
            raise InputError(f"messages[{i}].role = {m.get('role')!r}: expected one of {', '.join(ROLES)}")
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and m["role"] == "assistant")):
            raise InputError(f"messages[{i}].content: expected a string")


def render_chat(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of a conversation, rendered by the checkpoint's own chat template.

    Args:
        messages: ``[{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...]``
            as in OpenAI's chat API (an assistant message may carry ``tool_calls`` and
            ``reasoning_content``; the template decides what it renders).
        tools: OpenAI-style tool (function) definitions, passed to the template as ``tools``.
        chat_template_kwargs: extra template variables, e.g. ``{"enable_thinking": False}``.
        add_generation_prompt: end with the opening of the assistant's turn.

    Raises:
        InputError: malformed messages, no chat template, or a template that fails on them.
    """
    _check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("the tokenizer has no chat template (use a plain prompt)")
    kwargs = dict(chat_template_kwargs or {})
    try:
        return tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as e:  # jinja2 raises TemplateError subclasses and plain errors from the template
        raise InputError(f"the chat template failed on these messages: {e}") from None


def chat_ids(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of :func:`render_chat` with the generation prompt (ready to generate the assistant's turn)."""
    text = render_chat(tokenizer, messages, tools, chat_template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


_SENTINEL = "\x00moestream-turn\x00"


def next_turn_ids(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids that follow the last assistant turn when the conversation continues with the messages after it.

    For a chat that keeps its KV cache between turns: ``messages`` is the whole
    conversation, ``[..., {"role": "assistant", ...}, <new messages>]``; the result is the
    template's text after that assistant message's content (its end-of-turn marker, the
    new messages, the generation prompt), to be appended to the tokens already in the KV
    cache. The model's own tokens for past turns stay as generated (templates such as
    Qwen3's would re-render them without their thinking block, which would change the
    prefix and force the whole conversation to be prefilled again).
    Found by rendering with a sentinel as that assistant message's content; when the
    template does not show the content verbatim, the new messages are rendered alone.

    Raises:
        InputError: when no assistant message precedes the new messages, or as :func:`render_chat`.
    """
    _check_messages(messages)
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None or last == len(messages) - 1:
        raise InputError("next_turn_ids needs an assistant message followed by new messages")
    probe = [dict(m) for m in messages]
    probe[last] = {"role": "assistant", "content": _SENTINEL}
    text = render_chat(tokenizer, probe, tools, chat_template_kwargs)
    if text.count(_SENTINEL) == 1:
        suffix = text.split(_SENTINEL, 1)[1]
    else:
        suffix = render_chat(tokenizer, messages[last + 1 :], tools, chat_template_kwargs)
    return tokenizer.encode(suffix, add_special_tokens=False)


def single_token_id(tokenizer, text: str) -> int | None:
    """The id of ``text`` when the tokenizer encodes it as exactly one token, else None."""
    if tokenizer is None:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def think_token_ids(tokenizer) -> tuple[int | None, int | None]:
    """Ids of ``<think>`` and ``</think>`` when each is one token of this tokenizer (Qwen3, DeepSeek-R1), else None."""
    return single_token_id(tokenizer, "<think>"), single_token_id(tokenizer, "</think>")


def current_turn(ids: list[int], end_of_turn: set[int]) -> list[int]:
    """The ids after the last end-of-turn (EOS) token: the turn the model is about to continue."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] in end_of_turn:
            return ids[i + 1 :]
    return ids


def prompt_opens_thinking(ids: list[int], think_ids: tuple[int | None, int | None], end_of_turn: set[int]) -> bool:
    """Whether the prompt's current turn leaves a thinking block open (``<think>`` with no ``</think>`` after it).

    Templates of QwQ, DeepSeek-R1 and later Qwen releases put ``<think>`` in the
    generation prompt, so the model's output starts inside the block.
    """
    open_id, close_id = think_ids
    if open_id is None:
        return False
    turn = current_turn(ids, end_of_turn)
    if open_id not in turn:
        return False
    after = turn[len(turn) - 1 - turn[::-1].index(open_id) :]
    return close_id not in after


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
