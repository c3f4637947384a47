"""Tokenizers and chat templates, through transformers' ``AutoTokenizer``.

moestream ships one tokenizer: Qwen3's byte-level BPE with its chat template (from the
Qwen3 releases, Apache-2.0; see NOTICE), which ``moestream synth`` copies into the
checkpoints it writes so that they work offline.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
import unicodedata
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from .errors import ChatTemplateError, CheckpointError, InputError, PromptTooLongError, TemplateVariableError

BUNDLED_QWEN3 = Path(__file__).parent / "data" / "tokenizers" / "qwen3"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def load_tokenizer(folder: str | Path):
    """Load the tokenizer in ``folder`` offline (never runs code from the folder).

    ``folder`` may be a GGUF file (:func:`load_gguf_tokenizer`).

    Raises:
        CheckpointError: when the folder holds no tokenizer files or they cannot be loaded.
    """
    folder = Path(folder)
    if folder.suffix == ".gguf" and folder.is_file():
        return load_gguf_tokenizer(folder)
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise CheckpointError(f"{folder}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    return _with_template_source(_load_folder(folder), _folder_template_source(folder))


def _load_folder(folder: Path):
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


# tokenizer -> where its chat template came from ("<folder>/tokenizer_config.json: field 'chat_template'"), named
# when a render of it passes its bounds
_TEMPLATE_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _with_template_source(tokenizer, source: str):
    try:
        _TEMPLATE_SOURCES[tokenizer] = source
    except TypeError:  # not weakly referable: the error names the template without its file
        pass
    return tokenizer


def _folder_template_source(folder: Path) -> str:
    """The file (and field) transformers reads a folder's chat template from: ``chat_template.jinja`` before
    ``tokenizer_config.json``'s ``chat_template``, then the older ``chat_template.json``."""
    if (folder / "chat_template.jinja").is_file():
        return str(folder / "chat_template.jinja")
    try:
        if "chat_template" in json.loads((folder / "tokenizer_config.json").read_text()):
            return f"{folder / 'tokenizer_config.json'}: field 'chat_template'"
    except (OSError, ValueError, TypeError):
        pass
    if (folder / "chat_template.json").is_file():
        return f"{folder / 'chat_template.json'}: field 'chat_template'"
    return f"{folder}: the chat template"


def template_source(tokenizer) -> str:
    """Where ``tokenizer``'s chat template came from (its file and field), as errors name it."""
    try:
        found = _TEMPLATE_SOURCES.get(tokenizer)
    except TypeError:
        found = None
    return found or f"{getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}: the chat template"


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer of a GGUF file: built by transformers from the file's metadata (``tokenizer.ggml.*``,
    ``tokenizer.chat_template``), else the tokenizer files in the folder beside it.

    The tokenizer is the one ``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` builds, made by
    the class it would pick (:func:`_gguf_tokenizer_class`) without the config it builds first.

    Raises:
        CheckpointError: when neither gives a tokenizer (naming both reasons; ``--tokenizer`` names a folder).
    """
    path = Path(path)
    from transformers import AutoTokenizer

    source = f"{path}: metadata 'tokenizer.chat_template'"
    try:
        cls = _gguf_tokenizer_class(path)
        if cls is None:
            return _with_template_source(
                AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True), source)
        return _with_template_source(cls.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         local_files_only=True), source)
    except Exception as e:  # transformers raises many kinds for metadata it cannot convert
        error = " ".join(str(e).split()) or type(e).__name__
    if any((path.parent / f).is_file() for f in TOKENIZER_FILES):
        return load_tokenizer(path.parent)
    raise CheckpointError(f"{path}: transformers cannot build a tokenizer from the GGUF metadata ({error}), and the "
                          f"folder beside it holds no tokenizer files; give a tokenizer folder with --tokenizer")


# GGUF architectures transformers' GGUF loader renames to its model type (modeling_gguf_pytorch_utils)
_GGUF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "gpt-oss": "gpt_oss", "qwen3moe": "qwen3_moe", "minimax-m2": "minimax_m2"}


def _gguf_tokenizer_class(path: Path):
    """The tokenizer class ``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` picks for the GGUF file
    ``path`` (transformers 5), or None where AutoTokenizer should decide itself.

    AutoTokenizer first builds the model's config from the file, for most architectures through
    ``load_gguf_checkpoint``, whose ``gguf.GGUFReader`` parses every item of the vocabulary and merges
    with two numpy views each: 11 of the 12 s it took on Qwen3's 151,936 tokens and 151,387 merges
    (the class's own read of the lists, in ``integrations.gguf``, and its BPE build take under a
    second). The class follows from
    the architecture alone when the folder has no ``tokenizer_config.json``: the config class of the
    model type transformers names the architecture, then ``TOKENIZER_MAPPING`` (``TokenizersBackend``
    where it has none), AutoTokenizer's last branch. Elsewhere -- a ``tokenizer_config.json`` beside
    the file, an architecture whose config transformers reads quickly itself (``GGUF_CONFIG_ARCHS``) or
    does not read, a Mistral backend, an older transformers -- None.

    Raises:
        ValueError: an architecture transformers' GGUF loader refuses (as AutoTokenizer would, without
            its 11 s parse first).
    """
    try:
        from transformers import CONFIG_MAPPING
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS, read_gguf_metadata
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if (path.parent / "tokenizer_config.json").is_file():
        return None
    meta, _ = read_gguf_metadata(str(path))
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch in GGUF_CONFIG_ARCHS or "t5" in arch:
        return None
    model_type = "mistral" if "llama" in arch and meta.get("general.name") == "mistral" else \
        _GGUF_MODEL_TYPES.get(arch, arch)
    if arch not in GGUF_SUPPORTED_ARCHITECTURES and model_type not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF model with architecture {arch} is not supported yet.")
    if model_type not in CONFIG_MAPPING:
        return None
    cls = TOKENIZER_MAPPING.get(CONFIG_MAPPING[model_type], TokenizersBackend)
    return None if cls is None or cls.__name__ == "MistralCommonBackend" else cls


def _declared_tokenizer_class(folder: Path):
    """The transformers class that ``tokenizer_config.json``'s ``tokenizer_class`` names, or None."""
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


# Names the renderer binds itself (transformers' render_jinja_template) and the globals a template
# calls (Jinja's defaults and transformers' additions), for when the compiled template cannot be asked.
_RENDERER_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "raise_exception",
                             "strftime_now", "range", "dict", "lipsum", "cycler", "joiner", "namespace"})


def check_template_kwargs(tokenizer, chat_template_kwargs: dict | None) -> None:
    """Refuse ``chat_template_kwargs`` keys that are not template variables a caller may set.

    ``chat_template_kwargs`` are values for the chat template's own variables
    (``enable_thinking``, ``reasoning_effort``). transformers' ``apply_chat_template`` also
    takes its own arguments from the same keywords, so ``chat_template`` would replace the
    checkpoint's template with the caller's (a 185-byte loop renders megabytes), and
    ``tokenize``, ``documents``, ``continue_final_message`` change what is rendered. Refused:
    every argument of the installed ``apply_chat_template``, the names the renderer binds
    (``messages``, ``tools``, ``add_generation_prompt``) and the globals a template calls
    (``raise_exception``, ``range``, ``namespace``), and the tokenizer's special tokens
    (``eos_token``: the renderer sets them from the tokenizer).

    Raises:
        TemplateVariableError: naming the first refused key.
    """
    if not chat_template_kwargs:
        return
    arguments = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    special = set(getattr(tokenizer, "special_tokens_map", {}) or {}) | {"bos_token", "eos_token", "unk_token",
                                                                          "sep_token", "pad_token", "cls_token",
                                                                          "mask_token", "additional_special_tokens"}
    for key in chat_template_kwargs:
        if key == "chat_template":
            why = "a request cannot supply its own chat template (the checkpoint's is used)"
        elif key in arguments:
            why = "an argument of the template renderer, not a template variable"
        elif key in _RENDERER_NAMES or key in _template_globals(tokenizer):
            why = "a name the renderer defines for the template"
        elif key in special:
            why = "a special token, which the renderer takes from the tokenizer"
        else:
            continue
        raise TemplateVariableError(f"chat_template_kwargs[{key!r}]: {why}", key)


def _template_globals(tokenizer) -> frozenset[str]:
    env = _compiled_environment(tokenizer, None)
    return frozenset(env.globals) if env is not None else frozenset()


def _compiled_environment(tokenizer, tools):
    """The Jinja environment of the template transformers renders for this tokenizer (its compile
    is cached, so this is the very object ``apply_chat_template`` uses), or None."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(tokenizer.get_chat_template(None, tools)).environment
    except Exception:  # no template, or a transformers without this internal: the render is not bounded
        return None


# ---- prompt length in bytes: a bound on the token count before tokenizing ----

# Unicode normalization (NFC, NFKC, NFD, NFKD) shrinks UTF-8 text at most this many times: the
# result's characters c have full decompositions d(c), every input code point decomposes to at
# least one of them, and a code point is at most 4 bytes, so the input has at most
# 4 * len(d(c)) bytes per len(c.encode()) bytes of output; the largest ratio over all of Unicode
# is 6 (U+01D5 and others; tests/test_generation_options.py computes it).
UNICODE_FORM_SHRINK = 6
_UNICODE_FORMS = ("NFC", "NFKC", "NFD", "NFKD")


@dataclass(frozen=True)
class PromptLimit:
    """At most ``max_tokens`` prompt tokens, checked on a text's length in bytes before tokenizing it.

    Sound for tokenizers in which every byte of the (normalized) text ends up in some token --
    byte-level BPE (Qwen, DeepSeek, gpt-oss, Kimi) and SentencePiece BPE with byte fallback
    (Mixtral) -- which :meth:`for_tokenizer` checks: no token spans more than ``token_bytes``
    bytes (128 for Qwen3: a run of spaces), so a text of B bytes after normalization has at
    least B / ``token_bytes`` tokens; the tokenizer's normalizer shrinks a text at most
    ``shrink`` times (1 for text already in its Unicode form). A text refused here would have
    been refused after tokenizing too; one let through is tokenized and counted exactly.
    """

    max_tokens: int
    token_bytes: int
    shrink: int = 1
    form: str | None = None  # the normalizer's Unicode form, when it is one alone

    @classmethod
    def for_tokenizer(cls, tokenizer, max_tokens: int) -> PromptLimit | None:
        """The limit for ``tokenizer``, or None when its pipeline gives no sound bound (a WordPiece
        model, a pre-tokenizer that drops characters, a normalizer of unknown shrink)."""
        try:
            found = _BOUNDS[tokenizer]
        except KeyError:
            found = _BOUNDS[tokenizer] = _bound_of(tokenizer)
        except TypeError:  # not weakly referable: not cached
            found = _bound_of(tokenizer)
        return None if found is None else cls(max_tokens, *found)

    @property
    def max_chars(self) -> int:
        """A text of more characters (so of more bytes) than this has more than ``max_tokens`` tokens."""
        return self.max_tokens * self.token_bytes * self.shrink

    def min_tokens(self, text: str) -> tuple[int, int, int]:
        """(at least this many tokens, ``text``'s UTF-8 bytes, the bytes per token the bound allows)."""
        n = len(text.encode("utf-8", "surrogatepass"))
        same = self.shrink == 1 or (self.form is not None and unicodedata.is_normalized(self.form, text))
        per = self.token_bytes * (1 if same else self.shrink)
        return -(-n // per), n, per

    def check(self, text: str) -> None:
        """Raise :class:`PromptTooLongError` when ``text`` has more than ``max_tokens`` tokens by its length."""
        if len(text) * 4 <= self.max_tokens * self.token_bytes:  # under the bound whatever the characters
            return
        at_least, n, per = self.min_tokens(text)
        if at_least > self.max_tokens:
            raise PromptTooLongError(
                f"the prompt is {n} bytes, so at least {at_least} tokens (no token of this tokenizer spans more "
                f"than {per} bytes{'' if per == self.token_bytes else ' of text before its normalization'})")


_BOUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (token_bytes, shrink, form) or None


def _bound_of(tokenizer) -> tuple[int, int, str | None] | None:
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())  # ~1 s for Qwen3's 151,646 tokens
    except Exception:  # a tokenizer without a tokenizers backend
        return None
    byte_level = _has_step(spec.get("pre_tokenizer"), "ByteLevel")
    token_bytes = _longest_token_bytes(spec, byte_level)
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if token_bytes is None or shrink is None or not _keeps_every_byte(spec, byte_level):
        return None
    form = (spec.get("normalizer") or {}).get("type")
    return token_bytes, shrink, form if form in _UNICODE_FORMS else None


def _has_step(step: dict | None, kind: str) -> bool:
    if not step:
        return False
    if step.get("type") == "Sequence":
        return any(_has_step(s, kind) for s in step.get("pretokenizers", step.get("normalizers", [])))
    return step.get("type") == kind


def _longest_token_bytes(spec: dict, byte_level: bool) -> int | None:
    """The most bytes of text one token stands for (a byte-level token's characters are bytes)."""
    vocab = spec.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        pieces = list(vocab)
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        pieces = [v[0] for v in vocab if isinstance(v, list) and v and isinstance(v[0], str)]
    else:
        return None
    pieces += [t.get("content", "") for t in spec.get("added_tokens", []) if isinstance(t, dict)]
    longest = max((len(p) if byte_level else len(p.encode("utf-8", "surrogatepass")) for p in pieces), default=0)
    return max(longest, 4)  # an unknown character is one token (a code point is at most 4 bytes)


def _normalizer_shrink(n: dict | None) -> int | None:
    """How many times the normalizer can shrink UTF-8 text, or None when not known."""
    if not n:
        return 1
    kind = n.get("type")
    if kind in _UNICODE_FORMS:
        return UNICODE_FORM_SHRINK
    if kind == "Prepend":
        return 1
    if kind == "Sequence":
        out = 1
        for part in n.get("normalizers", []):
            f = _normalizer_shrink(part)
            if f is None:
                return None
            out *= f
        return out
    if kind == "Replace":
        old, new = (n.get("pattern") or {}).get("String"), n.get("content")
        if not isinstance(old, str) or not isinstance(new, str) or not new:
            return None  # a regex, or a deletion: no bound
        return max(1, -(-len(old.encode()) // len(new.encode())))
    return None  # Lowercase, Strip, StripAccents, Precompiled, BertNormalizer...


_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts")


def _keeps_every_byte(spec: dict, byte_level: bool) -> bool:
    """Whether every byte of the normalized text ends up in a token of at most the longest token's size."""
    def keeps(step):
        if not step:
            return True
        if step.get("type") == "Sequence":
            return all(keeps(s) for s in step.get("pretokenizers", []))
        return step.get("type") in _KEEPING_PRE_TOKENIZERS and step.get("behavior") != "Removed"

    model = spec.get("model", {})
    if not keeps(spec.get("pre_tokenizer")):
        return False
    if model.get("type") == "BPE":  # an unknown character is its own token unless unknowns are fused
        return byte_level or bool(model.get("byte_fallback")) or not model.get("fuse_unk")
    if model.get("type") == "Unigram":
        return bool(model.get("byte_fallback"))
    return False  # WordPiece (an unknown word of up to 100 characters is one token), WordLevel


# ---- rendering, bounded in time and output ----

# A checkpoint's chat template is code from whoever made the checkpoint (tokenizer_config.json's chat_template, a
# GGUF file's tokenizer.chat_template). Every render of it is bounded: it may run RENDER_SECONDS and write
# RENDER_MAX_CHARS characters (a request's prompt bound, when one is given: PromptLimit.max_chars), else
# ChatTemplateError names the template. Real templates render a conversation in milliseconds.
RENDER_SECONDS = 5.0
RENDER_MAX_CHARS = 64 << 20  # without a prompt bound: past any context (64 Mi characters, over 500,000 tokens)
_TEMPLATE_FILE = "<template>"  # the file name Jinja compiles a template given as a string under

_RENDER_LIMIT: ContextVar[int | None] = ContextVar("moestream_render_limit", default=None)


class _RenderStopped(Exception):
    pass


class _RenderTimedOut(Exception):
    pass


def _bounded_concat(pieces) -> str:
    """Jinja's ``Environment.concat`` (``"".join`` over the pieces a render yields), stopping once
    they pass ``_RENDER_LIMIT`` characters: a template looping over a request's values cannot render
    more than the prompt bound. Output a template buffers itself (a macro, a ``{% set %}`` block) is
    one piece here, joined whole before the count sees it."""
    limit = _RENDER_LIMIT.get()
    if limit is None:
        return "".join(pieces)
    out, n = [], 0
    for piece in pieces:
        n += len(piece)
        if n > limit:
            raise _RenderStopped
        out.append(piece)
    return "".join(out)


@contextmanager
def _render_deadline(seconds: float):
    """Raise :class:`_RenderTimedOut` in a template's own code (the frames Jinja compiled from it) once
    ``seconds`` have passed, on this thread: a loop that writes nothing never reaches the output bound.
    The check runs on each line the template's code runs (``sys.settrace``, on this thread only, chained
    to a tracer already set, such as coverage's); other code runs untraced. A single long operation in C
    (one huge multiplication) is not interrupted."""
    deadline = time.monotonic() + seconds
    old = sys.gettrace()

    def in_template(inner):
        def local(frame, event, arg):
            nonlocal inner
            if inner is not None:
                inner = inner(frame, event, arg)
            if time.monotonic() > deadline:
                raise _RenderTimedOut
            return local

        return local

    def trace(frame, event, arg):
        inner = old(frame, event, arg) if old is not None else None
        if frame.f_code.co_filename != _TEMPLATE_FILE:
            return inner
        if time.monotonic() > deadline:  # a template calling its macros without a loop
            raise _RenderTimedOut
        return in_template(inner)

    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(old)  # a tracer that raised was unset already


def render_chat(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
    add_generation_prompt: bool = True, limit: PromptLimit | None = None,
) -> str:
    """The prompt text of a conversation, rendered by the checkpoint's own chat template.

    Args:
        messages: ``[{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...]``
            as in OpenAI's chat API (an assistant message may carry ``tool_calls`` and
            ``reasoning_content``; the template decides what it renders).
        tools: OpenAI-style tool (function) definitions, passed to the template as ``tools``.
        chat_template_kwargs: extra template variables, e.g. ``{"enable_thinking": False}``
            (never the template itself: :func:`check_template_kwargs`).
        add_generation_prompt: end with the opening of the assistant's turn.
        limit: when given, the render stops once past ``limit.max_chars`` characters, and the
            text is checked against the limit (:class:`PromptLimit`); without one, past
            :data:`RENDER_MAX_CHARS`. Every render stops after :data:`RENDER_SECONDS`.

    Raises:
        InputError: malformed messages, no chat template, or a template that fails on them.
        TemplateVariableError: a ``chat_template_kwargs`` key a caller may not set.
        PromptTooLongError: a rendered prompt over ``limit``.
        ChatTemplateError: a render past :data:`RENDER_SECONDS`, or past :data:`RENDER_MAX_CHARS` without
            ``limit``, naming the template's file and field.
    """
    _check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("the tokenizer has no chat template (use a plain prompt)")
    check_template_kwargs(tokenizer, chat_template_kwargs)
    kwargs = dict(chat_template_kwargs or {})
    max_chars = limit.max_chars if limit is not None else RENDER_MAX_CHARS
    token = _RENDER_LIMIT.set(max_chars if _bound_render(tokenizer, tools) else None)
    try:
        with _render_deadline(RENDER_SECONDS):
            text = tokenizer.apply_chat_template(
                list(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
    except _RenderStopped:
        if limit is None:
            raise ChatTemplateError(
                f"{template_source(tokenizer)}: the render wrote more than {max_chars:,} characters, the bound on "
                "rendering a checkpoint's template") from None
        raise PromptTooLongError(
            f"the rendered prompt passed {limit.max_chars} bytes, so more than {limit.max_tokens} tokens (no token "
            f"of this tokenizer spans more than {limit.token_bytes * limit.shrink} bytes of text)") from None
    except _RenderTimedOut:
        raise ChatTemplateError(
            f"{template_source(tokenizer)}: the render ran past {RENDER_SECONDS:g} s, the bound on rendering a "
            "checkpoint's template (it loops too long for these messages)") from None
    except Exception as e:  # jinja2 raises TemplateError subclasses and plain errors from the template
        raise InputError(f"the chat template failed on these messages: {e}") from None
    finally:
        _RENDER_LIMIT.reset(token)
    if limit is not None:
        limit.check(text)
    return text


def _bound_render(tokenizer, tools) -> bool:
    """Route the render of this tokenizer's template through :func:`_bounded_concat` (it acts only
    while ``_RENDER_LIMIT`` is set, so other renders of the same template are unchanged)."""
    env = _compiled_environment(tokenizer, tools)
    if env is None:
        return False
    if env.concat is not _bounded_concat:
        env.concat = _bounded_concat
    return True


def chat_ids(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
    limit: PromptLimit | None = None,
) -> list[int]:
    """Token ids of :func:`render_chat` with the generation prompt (ready to generate the assistant's turn).

    ``limit``: refuse a prompt over it by length, before tokenizing (:class:`PromptLimit`).
    """
    text = render_chat(tokenizer, messages, tools, chat_template_kwargs, limit=limit)
    return tokenizer.encode(text, add_special_tokens=False)


def encode_text(tokenizer, text: str, limit: PromptLimit | None = None) -> list[int]:
    """Token ids of ``text`` as is (no template, no special tokens added); with ``limit``, a text over
    it by length is refused (:class:`PromptTooLongError`) before tokenizing."""
    if limit is not None:
        limit.check(text)
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
