"""Qwen3.5 and Qwen3.6 MoE (Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B, Qwen3.6-35B-A3B):
``model_type: qwen3_5_moe``.

Reference: transformers ``models/qwen3_5_moe/modeling_qwen3_5_moe.py`` (torch fallback
path). The text decoder is Qwen3-Next's hybrid (see :mod:`moestream.models.qwen3_next`)
with these differences: the config is nested under ``text_config``; the decoder lives at
``model.language_model`` (LM head ``lm_head``); the DeltaNet input projections are four
separate tensors (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``); every
layer is a MoE layer; the top-k routing weights are always renormalized.

The rotary embedding is multimodal (``mrope_section``); for text every position has equal
temporal, height and width indices, so it is the ordinary partial rotary embedding.
The vision tower (``model.visual.*``) and the multi-token-prediction layer (``mtp.*``)
are not loaded; :func:`describe_skipped` names them on load.

The text model alone, as transformers' ``Qwen3_5MoeForCausalLM.save_pretrained`` writes it
(a fine-tune or text-only export), is ``model_type: qwen3_5_moe_text``: the text config at
the top level and the decoder at ``model`` (``model.layers.N...``, LM head ``lm_head``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..gguf_format import ATTN, DELTANET, QK_NORM, ROUTED, SHARED_EXPERT, GGUFArchitecture
from .base import derived, synth_tensors_of
from .qwen3_next import Model as NextModel
from .qwen3_next import ModelArgs as NextArgs
from .qwen3_next import adapt_to_source as _next_adapt
from .qwen3_next import gguf_config, gguf_tensors, skipped_note

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
TEXT_ONLY = "qwen3_5_moe_text"
PREFIX, HEAD = "model.language_model", "lm_head"
TEXT_PREFIX = "model"  # the decoder of a text-only checkpoint (Qwen3_5MoeForCausalLM)


def text_config(cfg: dict) -> dict:
    """The text config of a Qwen3.5 MoE config: its ``text_config``, or the config itself for
    ``qwen3_5_moe_text``. Raises ConfigError when a multimodal config has none."""
    if cfg.get("model_type") == TEXT_ONLY:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("field 'text_config' is missing or not an object")
    return text


@dataclass(frozen=True, kw_only=True)
class ModelArgs(NextArgs):
    """Qwen3-Next's fields, read from ``text_config`` (or the top level: ``text_only``)."""

    family = "qwen3_5_moe"
    fixed = {"fused_projections": False, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": ()}

    text_only: bool = derived(False)

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Parse and check a Qwen3.5/3.6 MoE config.json dict. Raises ConfigError naming the bad field."""
        text = text_config(cfg)
        text_only = text is cfg
        # transformers ties the head by the top-level field of the multimodal config
        tie = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        try:
            return super().from_config(text, text_only=text_only, tie_word_embeddings=tie)
        except ConfigError as e:
            raise ConfigError(str(e) if text_only else f"text_config: {e}") from None


class Model(NextModel):
    """Qwen3.5/3.6 MoE text decoder (at ``model.language_model``) with streamed experts."""

    def __init__(self, a: ModelArgs):
        super().__init__(a, prefix=TEXT_PREFIX if a.text_only else PREFIX, head=HEAD)


def adapt_to_source(net: Model, source) -> None:
    """Qwen3-Next's (:func:`moestream.models.qwen3_next.adapt_to_source`): a GGUF file's stored input orders."""
    _next_adapt(net, source)


def describe_skipped(unused: list[str]) -> tuple[str | None, list[str]]:
    """A one-line note naming the vision tower and the multi-token-prediction layer the
    checkpoint holds (not loaded), and the unused tensor names they do not explain."""
    parts = {"model.visual.": "the vision tower", "mtp.": "the multi-token-prediction layer"}
    return skipped_note("qwen3_5_moe", unused, parts)


def synth_config(cfg: dict, layers: int) -> dict:
    """``cfg`` with its ``text_config`` cut to the first ``layers`` decoder layers, without the
    multi-token-prediction layer (``mtp_num_hidden_layers`` 0: synth does not write ``mtp.*``).

    Raises:
        ConfigError: ``layers`` beyond the config's.
    """
    text_only = cfg.get("model_type") == TEXT_ONLY
    text = dict(text_config(cfg))
    total = text.get("num_hidden_layers")
    if isinstance(total, int) and layers > total:
        raise ConfigError(f"--layers {layers}: must be between 1 and the config's {total} layers")
    text["num_hidden_layers"] = layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:layers]
    if "mtp_num_hidden_layers" in text:  # synth writes no multi-token-prediction layer (mtp.*)
        text["mtp_num_hidden_layers"] = 0
    return text if text_only else {**cfg, "text_config": text}


synth_tensors = synth_tensors_of(Model, ModelArgs)


# -- llama.cpp's GGUF files of this family: its GGUFArchitecture (moestream.gguf_format, docs/gguf.md) -----------
GGUF = GGUFArchitecture("qwen35moe", "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM",  # the text model at model.layers
                        ATTN + QK_NORM + ROUTED + DELTANET + SHARED_EXPERT + (
                            "linear_attn.in_proj_b", "linear_attn.in_proj_a"),
                        gguf_config, gguf_tensors, added=7)  # Qwen3-Next's builder and rewrites (qwen3_next.py)
