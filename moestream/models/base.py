"""What every model family shares: config field access, the causal-LM skeleton, and
loading resident weights by name.

A family module (one file per family, as in mlx-lm) defines ``ModelArgs`` (parsed from
config.json), ``Model`` (an ``nn.Module`` whose parameter names are the checkpoint's
tensor names, minus the routed experts), and ``synth_tensors``/``synth_config`` used by
``moestream synth``. Routed experts are never parameters: the family's MoE blocks are
:class:`~moestream.models.moe.StreamedMoE` modules that fetch them through the cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..checkpoint import Checkpoint, torch_dtype
from ..errors import CheckpointError, ConfigError
from .layers import Attention, KVCache, RMSNorm, RotaryEmbedding
from .moe import StreamedMoE


def field(cfg: dict, name: str, kind: type | tuple = int, default=...):
    """``cfg[name]`` checked to be of ``kind``; ``default`` when absent (required if none).

    Raises:
        ConfigError: naming the field when it is missing or of the wrong type.
    """
    if name not in cfg or cfg[name] is None:
        if default is ...:
            raise ConfigError(f"required field {name!r} is missing")
        return default
    value = cfg[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
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
    # one-token decode steps through static buffers (moestream.decode_graph.DecodeRunner), set by the engine
    decode_runner = None

    def __init__(
        self, vocab: int, hidden: int, eps: float, rope_dim: int, rope_theta: float, tie: bool,
        max_context: int | None = None, prefix: str = "model", head: str = "lm_head",
    ):
        super().__init__()
        self.vocab_size = vocab
        self.max_context = max_context
        self.decoder_path, self.head_path = prefix, head
        decoder = nn.Module()
        decoder.embed_tokens = nn.Embedding(vocab, hidden)
        decoder.layers = nn.ModuleList()
        decoder.norm = RMSNorm(hidden, eps)
        _set_submodule(self, prefix, decoder)
        _set_submodule(self, head, nn.Linear(hidden, vocab, bias=False))
        self.tie_word_embeddings = tie
        with torch.device("cpu"):
            self.rotary = RotaryEmbedding(rope_dim, rope_theta)

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
        return KVCache(len(self.decoder.layers), capacity)

    def forward(self, ids: torch.Tensor, start: int, kv: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Logits for token ids ``ids`` [T] (int64) at positions ``start..start+T``.

        Appends the chunk to ``kv``. Returns [T, vocab] when ``all_logits``, else [1, vocab]
        for the last position only (prefill needs no more), in the model's dtype.
        One token goes to the engine's :attr:`decode_runner` when there is one (its static path, a
        CUDA graph on the GPU), unless that declines (no KV cache yet to decode into).
        """
        if self.decode_runner is not None and ids.shape[0] == 1:
            out = self.decode_runner.step(ids, start, kv)
            if out is not None:
                kv.length = start + 1
                return out
        decoder = self.decoder
        h = decoder.embed_tokens(ids)
        positions = torch.arange(start, start + ids.shape[0], device=ids.device)
        cos, sin = self.rotary(positions, h.dtype)
        for i, layer in enumerate(decoder.layers):
            h = layer(h, cos, sin, kv, i, start)
        if not all_logits:
            h = h[-1:]
        kv.length = start + ids.shape[0]
        return self.head(decoder.norm(h))


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    """Place ``module`` at dotted ``path`` under ``root``, making empty parents as needed."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        if not hasattr(node, name):
            setattr(node, name, nn.Module())
        node = getattr(node, name)
    setattr(node, leaf, module)


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
        keep = t.element_size() == 1 or name.endswith((".scales", ".biases", ".weight_scale_inv", ".weight_scale"))
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
