"""What every model family shares: its config fields, the causal-LM skeleton, loading resident
weights by name, and the tensor list ``moestream synth`` writes.

A family module (one file per family, as in mlx-lm) defines ``ModelArgs`` (a
:class:`ConfigArgs` dataclass read from config.json by field name), ``Model`` (an
``nn.Module`` whose parameter names are the checkpoint's tensor names, minus the routed
experts), and ``synth_tensors``/``synth_config`` used by ``moestream synth``. Routed
experts are never parameters: the family's MoE blocks are
:class:`~moestream.models.moe.StreamedMoE` modules that fetch them through the cache.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..checkpoint import Checkpoint, torch_dtype
from ..errors import CheckpointError, ConfigError
from ..nnutil import set_submodule
from ..quant import registry
from .layers import Attention, AttentionProjections, BatchKV, KVCache, RMSNorm, run_layers
from .moe import StreamedMoE
from .rope import make_rope, rope_scaling_type, rope_theta


def field(cfg: dict, name: str, kind: type | tuple = int, default=...):
    """``cfg[name]`` checked to be of ``kind``; ``default`` when absent or null (required if none).

    Raises:
        ConfigError: naming the field when it is missing or of the wrong type.
    """
    if name not in cfg or cfg[name] is None:
        if default is ...:
            raise ConfigError(f"required field {name!r} is missing")
        return default
    return _checked(name, cfg[name], kind if isinstance(kind, tuple) else (kind,))


def _checked(name: str, value, kinds: tuple[type, ...]):
    """``value`` of field ``name`` if it is one of ``kinds`` (an int passes as a float), else ConfigError."""
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ConfigError(f"field {name!r} = {value!r} is not {' or '.join(k.__name__ for k in kinds)}")
    return value


def positive(cfg: dict, name: str, default=...) -> int:
    """An integer field that must be at least 1."""
    value = field(cfg, name, int, default)
    if value < 1:
        raise ConfigError(f"field {name!r} = {value} must be at least 1")
    return value


def config_field(default=dataclasses.MISSING, *, minimum: int | None = None, aliases: tuple[str, ...] = (),
                 default_from: str | None = None, read: Callable[[dict], object] | None = None):
    """A :class:`ConfigArgs` field, read from the config by its name.

    Args:
        default: the value when the config lacks the field or holds null (required when not given).
        minimum: the smallest value allowed (``must be at least N``; ``or null`` for an optional field).
        aliases: other names the config may use (transformers 5's ``num_local_experts`` for
            ``num_experts``...); the first name present is read, and a missing field is named
            by the last one.
        default_from: an earlier field whose value is the default (``num_key_value_heads``:
            the attention heads).
        read: ``read(cfg)`` gives the value instead (a field the config spells in several places).
    """
    meta = {"minimum": minimum, "aliases": aliases, "default_from": default_from, "read": read}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: default, metadata=meta)
    if default is dataclasses.MISSING and (default_from or read):
        default = None
    return dataclasses.field(default=default, metadata=meta)


def derived(default=None):
    """A :class:`ConfigArgs` field not read from the config: :meth:`ConfigArgs.check` sets it."""
    return dataclasses.field(default=default, metadata={"derived": True})


def _kinds(hint) -> tuple[tuple[type, ...], bool, bool]:
    """(types a config value may have, whether null is a value, whether it is a list read as a tuple)."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        optional = type(None) in args
        kinds = tuple(a for a in args if a is not type(None))
    else:
        kinds = (hint,)
    if any(typing.get_origin(k) is tuple for k in kinds):
        return (list,), optional, True
    return tuple(typing.get_origin(k) or k for k in kinds), optional, False


@dataclass(frozen=True, kw_only=True)
class ConfigArgs:
    """A family's config fields, as a frozen dataclass filled from the config dict by field name.

    Each field is read as its annotation says (``int``, ``float``, ``bool``, ``str``, ``dict``,
    ``X | None``, ``tuple[...]`` from a JSON list), with its default, minimum and aliases
    (:func:`config_field`); errors name the field: ``required field 'x' is missing``, ``field
    'x' = 'four' is not int``, ``field 'x' = 0 must be at least 1``. A family's
    :meth:`check` adds its cross-field checks and derived values. (After mlx-lm's
    ``BaseModelArgs``, which fills a dataclass from the config by name.)
    """

    @classmethod
    def from_config(cls, cfg: dict, **fixed):
        """Parse and check a config dict; ``fixed`` sets fields after they are read (a family's constants).

        Raises:
            ConfigError: naming the bad field.
        """
        hints = typing.get_type_hints(cls)
        values: dict = {}
        for f in dataclasses.fields(cls):
            if f.metadata.get("derived"):
                values[f.name] = f.default
            elif f.init:
                values[f.name] = _read(cfg, f, hints[f.name], values)
        values.update(fixed)
        cls.check(cfg, values)
        return cls(**values)

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        """Cross-field checks and derived values on the values read, ``v`` (field -> value), which it
        may change. A family extends it (calling ``super().check``) and raises ConfigError naming the fields."""


def _read(cfg: dict, f: dataclasses.Field, hint, values: dict):
    meta = f.metadata
    if meta.get("read") is not None:
        return meta["read"](cfg)
    names = (f.name, *meta.get("aliases", ()))
    name = next((n for n in names if cfg.get(n) is not None), None)
    if name is None:
        if meta.get("default_from"):
            return values[meta["default_from"]]
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        also = f" (nor its other name{'s' * (len(names) > 2)} {', '.join(map(repr, names[1:]))})" if names[1:] else ""
        raise ConfigError(f"required field {names[0]!r} is missing{also}")
    kinds, optional, as_tuple = _kinds(hint)
    value = _checked(name, cfg[name], kinds)
    minimum = meta.get("minimum")
    if minimum is not None and value < minimum:
        raise ConfigError(f"field {name!r} = {value} must be at least {minimum}" + (" or null" if optional else ""))
    return tuple(value) if as_tuple else value


@dataclass(frozen=True, kw_only=True)
class DecoderArgs(ConfigArgs):
    """The fields every decoder family reads alike (names as Hugging Face spells them).

    ``head_dim`` absent, null or 0 is ``hidden_size // num_attention_heads`` (refused when the heads do not
    divide the width, unless the family derives ``head_dim`` itself: MLA); ``num_attention_heads`` must be a
    multiple of ``num_key_value_heads``. A family
    whose experts take another activation than ``silu`` empties ``hidden_acts``; one
    reading its rope itself sets ``rope_types`` to None (else only those types are accepted).
    """

    family: ClassVar[str] = ""  # the name errors give (default: the config's model_type)
    hidden_acts: ClassVar[tuple[str, ...]] = ("silu",)
    rope_types: ClassVar[tuple[str, ...] | None] = ("default",)
    # the rope-type message's tail: "(only default)", or "yet (only default)"
    rope_refusal: ClassVar[str] = "(only default)"

    vocab_size: int = config_field(minimum=1)
    hidden_size: int = config_field(minimum=1)
    num_hidden_layers: int = config_field(minimum=1)
    num_attention_heads: int = config_field(minimum=1)
    num_key_value_heads: int = config_field(minimum=1, default_from="num_attention_heads")
    head_dim: int = config_field(None)
    rms_norm_eps: float = 1e-6
    rope_theta: float = config_field(read=rope_theta)
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None

    @classmethod
    def check(cls, cfg: dict, v: dict) -> None:
        super().check(cfg, v)
        heads, kv_heads = v["num_attention_heads"], v["num_key_value_heads"]
        if isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads:  # each serves a group of query heads
            raise ConfigError(f"field 'num_attention_heads' = {heads} is not a multiple of field "
                              f"'num_key_value_heads' = {kv_heads}")
        mla = cls.__dataclass_fields__["head_dim"].metadata.get("derived")  # MLA's head dims are fields of its own
        if not mla and not v["head_dim"] and v["hidden_size"] % heads:
            raise ConfigError(f"field 'hidden_size' = {v['hidden_size']} is not a multiple of field "
                              f"'num_attention_heads' = {heads}, and no 'head_dim' gives the head size")
        v["head_dim"] = v["head_dim"] or v["hidden_size"] // heads
        family = cls.family or cfg.get("model_type")
        if cls.hidden_acts:
            act = field(cfg, "hidden_act", str, "silu")
            if act not in cls.hidden_acts:
                raise ConfigError(f"hidden_act {act!r} is not supported for {family} (its experts use silu)")
        if cls.rope_types is not None and (kind := rope_scaling_type(cfg)) not in cls.rope_types:
            raise ConfigError(f"rope type {kind!r} is not supported for {family} {cls.rope_refusal}")


def check_top_k(top_k: int, experts: int, name: str = "num_experts_per_tok", experts_name: str = "num_experts"):
    """Top-k must be between 1 and the routed experts. Raises ConfigError naming both fields."""
    if not 1 <= top_k <= experts:
        raise ConfigError(f"{name} {top_k} must be between 1 and {experts_name} {experts}")


def _shown(value) -> str:
    """``repr(value)``, cut to 60 characters (a config may hold anything)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_shared_fields(cfg: dict) -> None:
    """Check the config fields every family reads the same way, before any family parses it.

    In the config and in its ``text_config`` (Qwen3.5 MoE, Kimi K3): ``rope_theta`` (top
    level, in ``rope_scaling`` / ``rope_parameters``, and in their per-layer-type entries,
    as Laguna's) is a finite number above 0; ``rope_scaling`` and ``rope_parameters`` are
    objects or null; ``rms_norm_eps`` is a finite number of at least 0; ``eos_token_id``
    is a token id (an integer of at least 0) or a list of them, or null. A value outside
    these gives NaN logits or a traceback later (a zero base makes every rotary frequency
    infinite, a negative eps a negative square root).

    Raises:
        ConfigError: naming the field (with its path inside the config) and its value.
    """
    scopes = [("", cfg)]
    if isinstance(cfg.get("text_config"), dict):
        scopes.append(("text_config.", cfg["text_config"]))
    for prefix, c in scopes:
        thetas = [(prefix, c)]
        for key in ("rope_scaling", "rope_parameters"):
            value = c.get(key)
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"field '{prefix}{key}' = {_shown(value)} is not an object")
            thetas.append((f"{prefix}{key}.", value))
            # per layer type (Laguna: {"full_attention": {...}, "sliding_attention": {...}})
            thetas += [(f"{prefix}{key}.{k}.", v) for k, v in value.items() if isinstance(v, dict)]
        for where, d in thetas:
            theta = d.get("rope_theta")
            if theta is not None and not (_is_number(theta) and theta > 0):
                raise ConfigError(f"field '{where}rope_theta' = {_shown(theta)} is not a number above 0")
        eps = c.get("rms_norm_eps")
        if eps is not None and not (_is_number(eps) and eps >= 0):
            raise ConfigError(f"field '{prefix}rms_norm_eps' = {_shown(eps)} is not a number of at least 0")
        eos = c.get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos]
        if eos is not None and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ConfigError(f"field '{prefix}eos_token_id' = {_shown(eos)} is not a token id or a list of them")


# a decoder layer's tensors: ``model.layers.N.``, ``model.language_model.layers.N.`` (Qwen3.5), ``mtp.layers.N.``
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layers_held(names) -> int:
    """How many layers a checkpoint's tensor names hold: the highest ``layers.N`` plus one (0 for none)."""
    return max((int(m[1]) + 1 for name in names if (m := _LAYER.search(name))), default=0)


def check_layer_count(cfg: dict, names) -> None:
    """Refuse a ``num_hidden_layers`` (top level, or ``text_config``'s) above the layers the checkpoint's tensors
    hold (``names``), before a family reads the config or a model of that size is built: a config of 10^9 layers
    over shards of 2 ran for minutes without a word. Values that are not a positive integer are left to the
    family's own check, which names them.

    Raises:
        ConfigError: naming the field, its value and the layers the tensors hold.
    """
    held = None
    for prefix, c in (("", cfg), ("text_config.", cfg.get("text_config"))):
        n = c.get("num_hidden_layers") if isinstance(c, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            continue
        held = layers_held(names) if held is None else held
        if n > held:
            raise ConfigError(f"field '{prefix}num_hidden_layers' = {n}, but the checkpoint's tensors hold "
                              + (f"{held} layers (layers.0 to layers.{held - 1})" if held else "no layers (layers.N)"))


@dataclass(frozen=True)
class SynthTensor:
    """A tensor ``moestream synth`` writes: name, shape, and how to initialize it.

    ``init`` is ``"embed"`` (token embeddings), ``"out"`` (a projection back into the
    residual stream: attention output, expert and shared-expert down projections),
    ``"norm"`` (ones), ``"zeros"``, or ``"normal"`` (everything else).
    """

    name: str
    shape: tuple[int, ...]
    init: str


class CausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm -> LM head, over one sequence.

    Subclasses fill ``self.decoder.layers``; each layer is called as
    ``layer(h, cos, sin, kv, index, start)`` and returns the new hidden states.
    Parameter names follow the Hugging Face checkpoint: the decoder lives at ``prefix``
    (``model``: ``model.embed_tokens.weight``, ``model.layers.N....``, ``model.norm.weight``;
    or ``model.language_model`` / ``language_model.model`` for multimodal checkpoints) and
    the LM head at ``head`` (``lm_head`` or ``language_model.lm_head``).
    """

    # the pieces each routed expert must have (see moestream.layout); a family with expert
    # biases or quantization scales lists more
    expert_roles: tuple[str, ...] = ("gate", "up", "down")
    # the checkpoint's names of a routed expert's gate, up and down projections (Mixtral's w1, w3, w2)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # the final norm's class (and the decoder layers', where the family builds them with it)
    Norm: type[nn.Module] = RMSNorm
    # where synth lists a decoder layer's attention biases (see synth_rank): after the post-attention
    # norm ("norm"), after the router ("router") or after everything else in the layer ("end")
    synth_biases_after = "norm"
    # one-token decode steps through static buffers (moestream.decode_graph.DecodeRunner), set by the engine
    decode_runner = None
    # KV storage reused by successive requests (moestream.models.layers.KVPool), set by the engine with a runner
    kv_pool = None

    def __init__(self, a: DecoderArgs, prefix: str = "model", head: str = "lm_head"):
        """The model of config ``a``: the skeleton (vocab_size, hidden_size, rms_norm_eps, tie_word_embeddings,
        max_position_embeddings), :meth:`make_rotary` and ``num_hidden_layers`` of :meth:`make_layer`."""
        super().__init__()
        self.args = a
        self.vocab_size = a.vocab_size
        self.max_context = a.max_position_embeddings
        self.decoder_path, self.head_path = prefix, head
        decoder = nn.Module()
        decoder.embed_tokens = _embedding(a.vocab_size, a.hidden_size)
        decoder.layers = nn.ModuleList()
        decoder.norm = self.Norm(a.hidden_size, a.rms_norm_eps)
        set_submodule(self, prefix, decoder)
        set_submodule(self, head, nn.Linear(a.hidden_size, a.vocab_size, bias=False))
        self.tie_word_embeddings = a.tie_word_embeddings
        self.rotary = self.make_rotary(a)
        self.decoder.layers.extend(self.make_layer(a, i) for i in range(a.num_hidden_layers))

    def make_rotary(self, a: DecoderArgs) -> nn.Module | None:
        """The rotary embedding, ``(positions [T], dtype) -> (cos, sin)`` for every layer: by default over
        ``head_dim`` with base ``rope_theta`` (:func:`~moestream.models.rope.make_rope`); None where a family
        has none."""
        return make_rope(a.head_dim, a.rope_theta)

    def make_layer(self, a: DecoderArgs, i: int) -> nn.Module:
        """Decoder layer ``i``, called as ``layer(h, cos, sin, kv, i, start)`` -> the new hidden states."""
        raise NotImplementedError

    @property
    def decoder(self) -> nn.Module:
        """The module holding ``embed_tokens``, ``layers`` and ``norm``."""
        return self.get_submodule(self.decoder_path)

    @property
    def head(self) -> nn.Linear:
        """The LM head."""
        return self.get_submodule(self.head_path)

    @property
    def embed_name(self) -> str:
        return f"{self.decoder_path}.embed_tokens.weight"

    @property
    def head_name(self) -> str:
        return f"{self.head_path}.weight"

    def expert_shape(self) -> tuple[int, int]:
        """(intermediate, width) of one routed expert's gate projection: the config's ``moe_intermediate_size``
        (``intermediate_size`` in a family whose MLPs are all MoE blocks, as Mixtral's) and ``hidden_size``.
        A family whose experts are shaped otherwise (gpt-oss, Kimi K3's latent width) overrides it."""
        a = self.args
        return getattr(a, "moe_intermediate_size", a.intermediate_size), a.hidden_size

    def moe_blocks(self) -> list[StreamedMoE]:
        """Every streamed MoE block, in layer order."""
        return [m for m in self.modules() if isinstance(m, StreamedMoE)]

    @property
    def top_k(self) -> int:
        """Routed experts per token, from the family's config as its ``ModelArgs`` read it
        (``num_experts_per_tok``; a family whose config spells it otherwise overrides this)."""
        return self.args.num_experts_per_tok

    @property
    def experts_per_layer(self) -> dict[int, int]:
        """MoE layer -> its routed experts (E), from the config."""
        return {b.layer: b.num_experts for b in self.moe_blocks()}

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV cache bytes one token adds at ``itemsize`` bytes per element: keys and values of every
        attention layer (:class:`~moestream.models.layers.Attention`)."""
        return sum(2 * m.kv_heads * m.head_dim * itemsize for m in self.modules() if isinstance(m, Attention))

    def new_kv_cache(self, capacity: int = 256) -> KVCache:
        """An empty KV cache (from :attr:`kv_pool`'s kept storage when the engine set one: the GPU's decode
        graphs then replay for every request)."""
        if self.kv_pool is not None:
            return self.kv_pool.new_cache(len(self.decoder.layers), capacity)
        return KVCache(len(self.decoder.layers), capacity)

    def forward(self, ids: torch.Tensor, start: int, kv: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Logits for token ids ``ids`` [T] (int64) at positions ``start..start+T``.

        Appends the chunk to ``kv``. Returns [T, vocab] when ``all_logits``, else [1, vocab]
        for the last position only (prefill needs no more), in the model's dtype.
        One token, or a prefill chunk, goes to the engine's :attr:`decode_runner` when there is one (its static
        path, a CUDA graph on the GPU), unless that declines (no KV cache yet to decode into; for a chunk, a
        partial budget or a cache outside the engine's KV pool).
        """
        t = ids.shape[0]
        if self.decode_runner is not None and (t == 1 or not all_logits):
            run = self.decode_runner.step if t == 1 else self.decode_runner.prefill
            out = run(ids, start, kv)
            if out is not None:
                kv.length = start + t
                return out
        decoder = self.decoder
        h = decoder.embed_tokens(ids)
        positions = torch.arange(start, start + ids.shape[0], device=ids.device)
        cos, sin = self.rotary(positions, h.dtype)
        h = run_layers(decoder.layers, h, cos, sin, kv, start)  # on the CPU the compiled layers in one call
        if not all_logits:
            h = h[-1:]
        kv.length = start + ids.shape[0]
        return self.head(decoder.norm(h))


    @property
    def batchable(self) -> bool:
        """Whether :meth:`forward_batch` runs several sequences in one pass: the plain skeleton (this class's
        forward and KV cache) with decoder layers whose attention keeps its keys through ``kv.attend``
        (:class:`~moestream.models.layers.Attention` and the variants of :mod:`~moestream.models.variants`).
        Other families (MLA, linear attention) run the sequences of a batch one after the other."""
        if type(self).forward is not CausalLM.forward or type(self).new_kv_cache is not CausalLM.new_kv_cache:
            return False
        for layer in self.decoder.layers:
            attn = getattr(layer, "self_attn", None)
            if not isinstance(attn, AttentionProjections):
                return False
        return True

    def forward_batch(self, parts: list[tuple[torch.Tensor, int, KVCache]], all_logits: bool = False
                      ) -> list[torch.Tensor]:
        """Logits of several sequences in one forward pass: ``parts`` is ``[(ids [T_i] int64, start_i, kv_i)]``.

        Their tokens go through every layer together, laid end to end ([sum T_i, H]): each MoE layer computes
        every token's experts in one pass (an expert routed by several sequences is fetched once), each
        sequence attends over its own cache. A token's logits are the bits of the same sequence run alone
        (every op's result on a row depends only on that row; attention only on the sequence's own keys), so
        batching changes what is read and how long it takes, never the output. Returns per part [1, vocab]
        (its last position) or with ``all_logits`` [T_i, vocab]. A family that is not :attr:`batchable` runs
        the parts one after the other.
        """
        if len(parts) == 1 or not self.batchable:
            return [self(ids, start, kv, all_logits) for ids, start, kv in parts]
        if self.decode_runner is not None and self.kv_pool is not None:
            out = self._decode_rows_apart(parts, all_logits)
            if out is not None:
                return out
        batch = BatchKV([(kv, start, ids.shape[0]) for ids, start, kv in parts])
        decoder = self.decoder
        ids = torch.cat([p[0] for p in parts])
        h = decoder.embed_tokens(ids)
        positions = torch.cat([torch.arange(start, start + i.shape[0], device=ids.device) for i, start, _ in parts])
        cos, sin = self.rotary(positions, h.dtype)
        for i, layer in enumerate(decoder.layers):
            h = layer(h, cos, sin, batch, i, 0)
        if not all_logits:
            ends = torch.tensor(batch.offsets[1:], device=h.device) - 1
            h = h[ends]
        for (_, start, kv), n in zip(parts, batch.lengths):
            kv.length = start + n
        out = self.head(decoder.norm(h))
        if not all_logits:
            return [out[j : j + 1] for j in range(len(parts))]
        return [out[a:b] for a, b in zip(batch.offsets[:-1], batch.offsets[1:])]

    def _decode_rows_apart(self, parts: list[tuple[torch.Tensor, int, KVCache]], all_logits: bool
                           ) -> list[torch.Tensor] | None:
        """With kept KV storage (the GPU's graphs): the parts' one-token rows as one batched decode step (a graph
        per batch size), each longer part (a prefill chunk) through :meth:`forward` on its own (its static path: a
        graph for a length seen before); None when the decode runner declines the rows, or with no rows unless
        every expert is resident. The same bits as one pass (every
        row's do not depend on the rows beside it); every expert is resident then, so two passes read nothing twice."""
        rows = [i for i, (ids, _, _) in enumerate(parts) if ids.shape[0] == 1]
        got = self.decode_runner.step_batch([parts[i] for i in rows]) if rows else []
        if got is None or not (rows or self.decode_runner.all_resident):
            return None
        out: list = [None] * len(parts)
        for i, logits in zip(rows, got):
            out[i] = logits
        for i, (ids, start, kv) in enumerate(parts):
            if out[i] is None:
                out[i] = self(ids, start, kv, all_logits)
        return out

    def synth_experts(self, block: str, num_experts: int) -> list[SynthTensor]:
        """The routed experts of the MoE block at ``block`` as ``moestream synth`` writes them: per expert,
        ``<block>.experts.E.<name>.weight`` for the gate, up and down names of :attr:`expert_names`, shaped
        by :meth:`expert_shape` (gate and up [I, W], down [W, I]). A family storing them otherwise
        (gpt-oss's fused tensors) overrides this."""
        inter, width = self.expert_shape()
        gate, up, down = self.expert_names
        out = []
        for e in range(num_experts):
            x = f"{block}.experts.{e}."
            out += [SynthTensor(x + gate + ".weight", (inter, width), "normal"),
                    SynthTensor(x + up + ".weight", (inter, width), "normal"),
                    SynthTensor(x + down + ".weight", (width, inter), "out")]
        return out

    def synth_rank(self, name: str) -> int:
        """Where tensor ``name`` of a decoder layer (relative to it: ``self_attn.q_proj.bias``) stands in
        synth's list: a stable sort key over the layer's tensors in module order. synth's shards are cut
        in list order, so the order is part of what it writes. The feed-forward block comes last; the
        attention's own biases stand where :attr:`synth_biases_after` says."""
        if name.startswith("self_attn.") and name.count(".") == 2 and name.endswith(".bias"):
            return 1
        after = self.synth_biases_after
        if after == "end" or not name.startswith(("mlp.", "block_sparse_moe.")):
            return 0
        if after == "router" and name.startswith(("mlp.gate.", "block_sparse_moe.gate.")):
            return 0
        return 2

    def synth_tensors(self) -> list[SynthTensor]:
        """Every tensor of a checkpoint of this model, as ``moestream synth`` writes it (build the model
        on the meta device: only names and shapes are read).

        The parameters in module order (a module's own parameters first, or after its child named
        by its ``synth_params_after``; a tied LM head once, as the embedding), followed, for
        a MoE block, by its routed experts (:meth:`synth_experts`); each decoder layer's tensors
        ordered by :meth:`synth_rank`. Inits by name: the embedding ``embed``, biases ``zeros``,
        norms ``norm``, projections back into the residual stream (``o_proj``, ``down_proj``,
        ``out_proj``) ``out``, the rest ``normal``; a module's ``synth_init`` dict (parameter name
        relative to it -> init) overrides that for its own tensors.
        """
        own = {f"{path}.{k}" if path else k: init for path, m in self.named_modules()
               for k, init in getattr(m, "synth_init", {}).items()}
        tied = {self.head_name} if self.tie_word_embeddings else set()
        blocks = {path: m.num_experts for path, m in self.named_modules() if isinstance(m, StreamedMoE)}
        out, pending = [], None
        for name, p in _declared_parameters(self):
            block = next((b for b in blocks if name.startswith(b + ".")), None)
            if pending is not None and block != pending:
                out += self.synth_experts(pending, blocks[pending])
            pending = block
            if name not in tied:
                out.append(SynthTensor(name, tuple(p.shape), own.get(name) or _synth_init(name)))
        if pending is not None:
            out += self.synth_experts(pending, blocks[pending])
        return self._synth_ordered(out)

    def _synth_ordered(self, tensors: list[SynthTensor]) -> list[SynthTensor]:
        """``tensors`` with each decoder layer's run sorted (stably) by :meth:`synth_rank`."""
        layer = re.compile(re.escape(self.decoder_path) + r"\.layers\.\d+\.")
        out = []
        for prefix, run in itertools.groupby(tensors, key=lambda t: (m := layer.match(t.name)) and m.group()):
            out += sorted(run, key=lambda t: self.synth_rank(t.name[len(prefix):]) if prefix else 0)
        return out


def _declared_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``named_parameters()`` (each parameter once), except that a module with ``synth_params_after =
    "child"`` has its own parameters after that child's (PyTorch lists them before its children's)."""

    def walk(m: nn.Module, prefix: str) -> list:
        own = [(prefix + n, p) for n, p in m._parameters.items() if p is not None]
        after = getattr(m, "synth_params_after", None)
        out = [] if after else own
        for name, child in m._modules.items():
            if child is not None:
                out += walk(child, f"{prefix}{name}.")
            if name == after:
                out += own
        return out

    seen = set()
    return [(n, p) for n, p in walk(module, "") if id(p) not in seen and not seen.add(id(p))]


# projections back into the residual stream: synth's "out" init
OUT_PROJECTIONS = ("o_proj", "down_proj", "out_proj")


def _synth_init(name: str) -> str:
    """synth's init of parameter ``name`` by its name (see :meth:`CausalLM.synth_tensors`)."""
    module, _, param = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf == "embed_tokens":
        return "embed"
    if param.endswith("bias"):
        return "zeros"
    if "norm" in leaf:
        return "norm"
    return "out" if leaf in OUT_PROJECTIONS else "normal"


def synth_tensors_of(model_cls: type[CausalLM], args_cls: type[ConfigArgs]) -> Callable[[dict], list[SynthTensor]]:
    """A family's ``synth_tensors(cfg)``: every tensor of a checkpoint of ``cfg``'s shapes, as ``moestream
    synth`` writes it (:meth:`CausalLM.synth_tensors` of the model on the meta device). Raises ConfigError
    naming the bad field."""

    def synth_tensors(cfg: dict) -> list[SynthTensor]:
        """Every tensor of a checkpoint of ``cfg``'s shapes, as ``moestream synth`` writes it."""
        return meta_model(model_cls, args_cls.from_config(cfg)).synth_tensors()

    return synth_tensors


def _embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)``; on the meta device without its random init, whose meta ``normal_`` imports
    torch._dynamo (1.5 s of every command's start)."""
    w = torch.empty(num, dim)
    return nn.Embedding(num, dim, _weight=w) if w.is_meta else nn.Embedding(num, dim)


def meta_model(model_cls: type[CausalLM], args) -> CausalLM:
    """``model_cls(args)`` on the meta device: its names and shapes, no memory (what synth and the engine read)."""
    with torch.device("meta"):
        return model_cls(args)


def load_resident(
    model: nn.Module,
    checkpoint: Checkpoint,
    skip: set[str],
    dtype: torch.dtype,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Fill ``model``'s parameters from the checkpoint tensors of the same names.

    Float tensors are cast to ``dtype``, except those whose names end with one of the
    model's ``float32_parameters`` suffixes, kept in float32 (DeepSeek's routers). When
    the model ties its LM head to the embedding (``tie_word_embeddings``), the head is the
    embedding, as in transformers, and a head weight in the checkpoint is unused. A model
    with a ``checkpoint_name(param, tensors)`` method maps a parameter to its tensor's
    name. ``skip`` names tensors that are not resident (routed experts). Returns the
    names of checkpoint tensors the model does not use.
    fp8 weights and quantization scales (``moestream.quant``) keep their stored dtype.

    Raises:
        CheckpointError: a parameter missing from the checkpoint, or of the wrong shape.
    """
    tied = getattr(model, "tie_word_embeddings", False)
    keep_fp32 = tuple(getattr(model, "float32_parameters", ()))  # name suffixes kept in float32 (routers)
    state = {}
    wanted = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    expected = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    embed_name = getattr(model, "embed_name", "model.embed_tokens.weight")
    head_name = getattr(model, "head_name", "lm_head.weight")
    if tied:
        wanted.remove(head_name)
    # a family whose checkpoints name a tensor in more than one way maps a parameter to its tensor
    rename = getattr(model, "checkpoint_name", None)
    source = {n: rename(n, checkpoint.tensors) if rename else n for n in wanted}
    for name in wanted:
        info = checkpoint.tensors.get(source[name])
        if info is None:
            raise CheckpointError(f"{checkpoint.path}: tensor {source[name]!r} is missing from the checkpoint")
        if info.shape != expected[name]:
            raise CheckpointError(
                f"{info.file}: tensor {info.name!r} has shape {list(info.shape)}, the config implies "
                f"{list(expected[name])}"
            )
        t = checkpoint.read_tensor(source[name])
        want = torch.float32 if keep_fp32 and name.endswith(keep_fp32) else dtype
        # fp8 codes and quantization parameters (scales, biases) keep their stored dtype (moestream.quant)
        keep = t.element_size() == 1 or name.endswith(tuple("." + r for r in registry.quant_params()))
        keep = keep or name in getattr(model, "stored_dtype_parameters", ())  # turboquant codebooks, signs
        if t.is_floating_point() and t.dtype != want and not keep:
            t = t.to(want)
        state[name] = t
        if progress is not None:
            progress(info.nbytes)
    if tied:
        state[head_name] = state[embed_name]
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.head.weight = model.decoder.embed_tokens.weight
    model.requires_grad_(False)
    used = set(source.values()) | skip
    return sorted(n for n in checkpoint.tensors if n not in used)


def checkpoint_dtype(checkpoint: Checkpoint, name: str = "model.embed_tokens.weight") -> torch.dtype:
    """The dtype the checkpoint stores its embedding in: the compute dtype by default."""
    info = checkpoint.tensors.get(name)
    if info is None:
        raise CheckpointError(f"{checkpoint.path}: tensor {name!r} is missing from the checkpoint")
    return torch_dtype(info.dtype)
