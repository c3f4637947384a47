"""Sampling: the options (:class:`SamplingParams`), the penalties (:func:`apply_penalties`), the sampler
(:class:`Sampler`: temperature, top-k, top-p, min-p), and the defaults a checkpoint's
``generation_config.json`` gives (:func:`generation_defaults`, :func:`resolve_sampling`). Used by
:func:`moestream.generation.generate` and the scheduler alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConfigError, InputError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    Each option has a value that disables it: ``temperature`` 0 means greedy (argmax);
    ``top_k`` 0, ``top_p`` 0 or 1.0, ``min_p`` 0, ``repetition_penalty`` 1.0 and
    ``frequency_penalty``/``presence_penalty`` 0 are off. ``seed`` makes sampling repeatable.

    Penalties act first, on the model's float32 logits (and so steer greedy picks too):

    - ``repetition_penalty`` (CTRL, Keskar et al. 2019; as transformers'
      ``RepetitionPenaltyLogitsProcessor``): each distinct token among the last
      ``repetition_context`` tokens (prompt included, as mlx-lm and llama.cpp) has its logit
      divided by the penalty when positive and multiplied by it when negative.
    - ``frequency_penalty`` and ``presence_penalty`` (OpenAI's definition, range [-2, 2]):
      ``logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty``,
      counting the tokens generated so far (not the prompt).

    Then the filters, in transformers' order: temperature, top-k, top-p (nucleus, Holtzman
    et al. 2019), min-p (Nguyen et al. 2024: drop tokens whose probability is below
    ``min_p`` times the most likely token's, as transformers' ``MinPLogitsWarper``).

    Raises:
        InputError: a value out of range (naming the option and its CLI flag).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # None: each Sampler draws a fresh seed from the system
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 256
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):
            raise InputError(f"temperature (--temp) must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise InputError(f"top_p (--top-p) must be in [0, 1] (0 or 1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k (--top-k) must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InputError(f"seed (--seed) must be between 0 and 2^63 - 1, got {self.seed}")
        if not 0 <= self.min_p <= 1:
            raise InputError(f"min_p (--min-p) must be in [0, 1] (0 = off), got {self.min_p}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise InputError(
                f"repetition_penalty (--rep-penalty) must be a finite number > 0 (1 = off), "
                f"got {self.repetition_penalty}"
            )
        if self.repetition_context < 0:
            raise InputError(f"repetition_context (--rep-ctx) must be >= 0, got {self.repetition_context}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InputError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on."""
        rep = self.repetition_penalty != 1.0 and self.repetition_context > 0
        return rep or bool(self.frequency_penalty or self.presence_penalty)


def apply_penalties(
    logits: torch.Tensor, context: list[int], generated: list[int], params: SamplingParams
) -> torch.Tensor:
    """The logits [vocab] (float32) after the penalties of ``params``; the input is not changed.

    ``context``: every token id before the next one (prompt and generated); the repetition
    penalty looks at its last ``params.repetition_context``. ``generated``: the ids generated
    so far, counted by the frequency and presence penalties. See :class:`SamplingParams`.
    """
    p = params
    out = logits
    if p.repetition_penalty != 1.0 and p.repetition_context > 0 and context:
        out = out.clone()
        ids = torch.tensor(sorted(set(context[-p.repetition_context :])), dtype=torch.int64)
        picked = out[ids]
        out[ids] = torch.where(picked < 0, picked * p.repetition_penalty, picked / p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and generated:
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=out.shape[0])
        counts = counts.to(out.device, out.dtype)  # logits on the GPU: the counts beside them
        out = out - (counts * p.frequency_penalty + (counts > 0).to(out.dtype) * p.presence_penalty)
    return out


class Sampler:
    """Temperature, top-k, top-p (nucleus, Holtzman et al. 2019) and min-p sampling over float32 logits.

    Penalties are applied before (:func:`apply_penalties`); see :class:`SamplingParams`.
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """The float32 logits [vocab] sampling draws from: divided by the temperature, with the tokens
        that top-k, top-p and min-p remove at -inf (temperature > 0 only).

        A temperature so small that the division overflows float32 (1e-40 for logits near 1) is
        sampled at its limit: every token below the top logit has probability
        exp(-(top - logit) / temperature), which is exactly 0 in float32 and float64 once
        top / temperature overflows (the gap is at least one float32 step of ``top``, about
        6e-8 * top, so the exponent is below -2e31), so the draw is uniform over the tokens tied at
        the top (the argmax when there is one). Top-p keeps at least the most likely token, as
        transformers' ``TopPLogitsWarper(min_tokens_to_keep=1)``, whatever ``top_p`` rounds to in
        float32 (1e-300 is 0 there). Neither changes a draw that worked before, bit for bit.
        """
        p = self.params
        raw = logits.float().cpu()
        logits = raw / p.temperature
        if not torch.isfinite(logits.max()):  # overflowed (+inf, or NaN from 0 / a temperature 0 in float32)
            logits = torch.zeros_like(raw).masked_fill(raw != raw.max(), float("-inf"))
        if p.top_k and p.top_k < logits.shape[0]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if 0 < p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, dim=-1) >= p.top_p  # keep the smallest set reaching top_p
            drop[0] = False  # and at least the most likely token
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
        if p.min_p > 0:
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))  # the top token always stays
        return logits

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick a token id from ``logits`` [vocab]."""
        if self.params.temperature == 0:
            return int(torch.argmax(logits.float().cpu()))
        probs = torch.softmax(self.warp(logits), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


GENERATION_CONFIG = "generation_config.json"


_DEFAULT_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float}


def generation_defaults(folder: str | Path) -> dict:
    """Sampling defaults from a checkpoint's ``generation_config.json`` (empty without one).

    Returns the fields present among ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
    ``repetition_penalty`` (``SamplingParams`` names, ``repetition_penalty`` included).
    An explicit ``"do_sample": false`` makes the default greedy (``temperature`` 0), as in
    transformers; otherwise the values are taken as given, as vLLM does.

    Raises:
        ConfigError: naming the file or field, when the file is not a JSON object or a
            field is not a number.
    """
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read it as JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    out = {}
    for name, kind in _DEFAULT_FIELDS.items():
        v = cfg.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
            raise ConfigError(f"{path}: field {name!r} = {v!r} is not {'an integer' if kind is int else 'a number'}")
        out[name] = kind(v)
    if cfg.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def resolve_sampling(
    defaults: dict | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    **fixed,
) -> SamplingParams:
    """:class:`SamplingParams` from explicit values, then ``defaults`` (:func:`generation_defaults`), then built-ins.

    The five options that a checkpoint's ``generation_config.json`` may set take None for
    "not given"; ``fixed`` holds the other fields (``seed``, ``repetition_context``,
    ``frequency_penalty``, ``presence_penalty``) as given.

    Raises:
        InputError: a value out of range (see :class:`SamplingParams`).
    """
    defaults = defaults or {}
    given = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                 repetition_penalty=repetition_penalty)
    values = {k: v if v is not None else defaults.get(k, getattr(SamplingParams, k)) for k, v in given.items()}
    return SamplingParams(**values, **fixed)
