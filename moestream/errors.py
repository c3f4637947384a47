"""Errors moestream raises for bad input and failed I/O.

Every error a user can cause (a missing file, a corrupt checkpoint, a budget that
cannot fit, an unsupported model) is a :class:`MoestreamError` whose message names
the file, tensor or field involved. The CLI prints these as one line, without a
traceback; anything else escaping is a bug.
"""


class MoestreamError(Exception):
    """Base class of every error moestream raises on purpose."""


class CheckpointError(MoestreamError):
    """A checkpoint folder, shard, index or safetensors header is missing or invalid."""


class ConfigError(MoestreamError):
    """A config.json field is missing, malformed or unsupported."""


class LayoutError(MoestreamError):
    """The experts of a checkpoint are not laid out in a form moestream can stream."""


class ReadError(MoestreamError):
    """Reading bytes from a shard failed (an OS error) or returned short (a truncated file)."""


class InputError(MoestreamError, ValueError):
    """A generation request is invalid: an empty prompt, a token outside the vocabulary, a
    prompt longer than the model's context, out-of-range sampling parameters."""


class BudgetError(MoestreamError):
    """A cache budget is malformed or cannot fit in the memory available."""


class EngineClosedError(MoestreamError):
    """An engine (or its expert store) was used after ``close()``."""


class TemplateVariableError(InputError):
    """A chat-template variable a caller may not set: it names the template itself, an argument of the
    renderer, or a value the renderer defines (``messages``, a special token). ``key`` is its name."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


class PromptTooLongError(InputError):
    """A prompt refused by its length in bytes, before it was tokenized (see ``tokenizer.PromptLimit``)."""


class ChatTemplateError(MoestreamError):
    """A checkpoint's chat template went past the bounds of a render: it ran longer than
    ``tokenizer.RENDER_SECONDS`` or wrote more than its output bound. The message names the template's
    file and field (``tokenizer_config.json``'s ``chat_template``, a GGUF file's ``tokenizer.chat_template``)."""
