"""Errors moestream raises for bad input and failed I/O.

Every error a user can cause (a missing file, a corrupt checkpoint, a budget that
cannot fit, an unsupported model) is a :class:`MoestreamError` whose message names
the file, tensor or field involved. The CLI prints these as one line, without a
traceback; anything else escaping is a bug.

An engine option is named in a message the way its caller gave it: by its CLI flag (:func:`flag`,
``--max-context``) when the CLI built the options, by ``moestream.load``'s keyword (:func:`keyword`,
``context_tokens=``) when the Python API did (:meth:`moestream.options.EngineOptions.name`).
"""

# options whose CLI flag is not the field's name with dashes
_FLAGS = {"workers": "--prefetch-workers", "cache_budget": "--cache-budget-gb", "host_cache": "--host-cache-gb",
          "prefix_cache": "--prefix-cache-gb", "context_tokens": "--max-context", "hotlist": "--no-hotlist",
          "learn_experts": "--no-learn-experts", "cuda_graphs": "--no-cuda-graphs"}
# options whose keyword of moestream.load is not the field's name
_KEYWORDS = {"cache_budget": "cache_budget_gb", "host_cache": "host_cache_gb", "prefix_cache": "prefix_cache_gb"}


def flag(option: str) -> str:
    """The CLI flag of engine option ``option`` (``workers`` is ``--prefetch-workers``)."""
    return _FLAGS.get(option, "--" + option.replace("_", "-"))


def keyword(option: str) -> str:
    """The keyword of ``moestream.load`` for engine option ``option``, as messages name it (``cache_budget`` is
    ``cache_budget_gb=``)."""
    return _KEYWORDS.get(option, option) + "="


def given(name: str, value, sep: str = " ") -> str:
    """An option's name (:func:`flag` or :func:`keyword`) with the value given, as its caller wrote it:
    ``--pin-file x`` (``sep`` between a flag and its value) or ``pin_file=x``; a switch turned on (``value``
    True) is its flag alone (``--wire-memory``, ``wire_memory=True``)."""
    if name.endswith("="):
        return f"{name}{value}"
    return name if value is True else f"{name}{sep}{value}"


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
