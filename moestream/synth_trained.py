"""The ``trained`` init of ``moestream synth``: ordinary weights whose routing reuses experts as trained models do.

Random weights route each token by its embedding alone, so consecutive tokens share
experts at chance (``spread``). A trained model's router also reads the context, which
changes slowly from token to token. This init builds that into the weights, and nothing
else changes: the model math, the tensor names and shapes are the family's own, so every
engine that reads the family reads the checkpoint.

The residual stream (hidden size H) is laid out in five blocks of coordinates:

* ``T`` (the rest, about 66% of H): the token's embedding, unit variance, as ``spread``;
* ``K`` (H/16): the token's cluster: each token id belongs to one of ``E / CLUSTER_EXPERTS``
  clusters (E experts per layer), a unit direction of the block (rms 1 per coordinate);
* ``B`` (H/32): a constant 1 in every embedding row, which layer 0's queries, keys, gates
  and decays read (so they do not depend on the token);
* ``F`` and ``S`` (H/8 each): a fast and a slow context, written by layer 0's token mixer:
  running averages of random projections of the past tokens' embeddings over about
  ``FAST_WINDOWS`` and ``SLOW_WINDOWS`` tokens, less ``MEAN_REMOVAL`` times the average over
  ``LONG_WINDOW`` tokens (the text's persistent mean, which would otherwise favour the same
  experts throughout and leave others unused). In Qwen3-MoE (softmax attention) each query
  head of layer 0 attends to the past through a positional kernel made of RoPE
  frequencies (constant queries and keys: a key's score depends only on its distance),
  ``A exp(-d / tau)`` from a Lorentzian spectrum, whose softmax is an exponential moving
  average. In the hybrids (Qwen3-Next, Qwen3.5) layer 0 is Gated DeltaNet: constant unit
  keys and queries make its state an exact exponential moving average of the values, with
  ``beta`` and the decay setting the window; its gated norm makes each head's output rms 1.

Every router reads, with ``ROUTER_WEIGHTS``, the current token, the fast and the slow
context (through rows of a random orthonormal frame, so no expert is favoured by
construction), and the token's cluster (``CLUSTER_EXPERTS`` experts of the layer prefer
each cluster, a different pair in every layer); logits are about ``LOGIT_STD``. Deeper
layers' token mixers and all experts keep the ``spread`` init (the experts add small noise
to the stream). Each layer's router is drawn independently, so routing is uncorrelated
across layers while each layer reuses experts over time.

The constants were calibrated on the bench's token stream with layer 0's output and
independent routers (docs/benchmarks.md, "Routing like trained models", has the figures of
real runs). What it models: temporal locality of routing (reuse at the next token and
within a few tokens, per-layer LRU hit rates), usage skewed by the text's frequent tokens,
token-specific experts, every expert used over a long run. What it does not: meaning,
domain-specialized experts, structure beyond a few hundred tokens, correlation of routing
across layers, trained expert weights, or how well the next layers' routers predict
their experts in a trained model (here the stream changes little between layers, so
reading ahead predicts better).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from .errors import ConfigError
from .models import qwen3_5_moe, qwen3_moe, qwen3_next
from .models.base import SynthTensor

FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe")

# Calibrated on the bench's token stream (docs/benchmarks.md, "Routing like trained models").
FAST_WINDOWS = (2.0,)  # tokens: the fast context's exponential moving averages
SLOW_WINDOWS = (48.0,)
LONG_WINDOW = 256.0  # tokens: the running average of the text, partly taken out of the slow context
MEAN_REMOVAL = 0.85  # how much of it
ROUTER_WEIGHTS = {"token": 0.26, "fast": 0.1, "slow": 1.0, "cluster": 0.9}  # weight of each signal in the logits
CLUSTER_EXPERTS = 2  # experts of each layer that prefer a token cluster
LOGIT_STD = 1.5  # typical standard deviation of router logits
V_PREACT = 0.5  # DeltaNet: std of the values before their SiLU (centred, see silu_centre)
Z_PREACT = 2.0  # DeltaNet: the output gate's constant pre-activation
DECAY = 0.999  # DeltaNet: the state's decay per token


@dataclass(frozen=True)
class Blocks:
    """Coordinate ranges of the residual stream (start, stop)."""

    token: tuple[int, int]
    cluster: tuple[int, int]
    const: tuple[int, int]
    fast: tuple[int, int]
    slow: tuple[int, int]

    @classmethod
    def of(cls, hidden: int) -> "Blocks":
        sizes = [0, max(1, hidden // 16), max(1, hidden // 32), max(1, hidden // 8), max(1, hidden // 8)]
        sizes[0] = hidden - sum(sizes)
        if sizes[0] < 1:
            raise ConfigError(f"--init trained needs hidden_size >= 16, got {hidden}")
        ends = [sum(sizes[: i + 1]) for i in range(5)]
        return cls(*[(e - n, e) for e, n in zip(ends, sizes)])

    @staticmethod
    def size(r: tuple[int, int]) -> int:
        return r[1] - r[0]


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(("trained:" + name).encode()))


def frame(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """[rows, cols] float32 with unit-norm rows: orthonormal when rows <= cols, else a random tight frame."""
    m = torch.randn(max(rows, cols), min(rows, cols), generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(m)  # reduced: orthonormal columns
    q = q * torch.sign(torch.diagonal(r))[None, :]
    q = q.T if rows <= cols else q
    return (q / q.norm(dim=1, keepdim=True)).float()


KERNEL_DEPTH = 20.0  # score of the current token above a distant one in layer 0's attention


def rope_kernel(window: float, inv_freq: list[float]) -> list[float]:
    """Weights ``c_i >= 0`` over RoPE frequencies ``w_i`` whose score ``sum_i c_i cos(w_i d)`` at lag ``d``
    makes softmax attention an exponential moving average of about ``window`` tokens.

    The score is ``A exp(-d / tau)`` (a Lorentzian spectrum, whose cosine transform is an
    exponential, sampled at the RoPE frequencies): attention weights fall as
    ``exp(-A d / tau)`` over the near past, so ``A / tau = -log(1 - 1 / window)``, and
    tokens far in the past sit ``A`` = ``KERNEL_DEPTH`` below the current one. The lowest
    frequency is left at 0 (it is constant over any context, see :meth:`TrainedInit._q_pattern`).
    """
    a = KERNEL_DEPTH
    tau = -a / math.log(1.0 - 1.0 / window)
    dlog = math.log(inv_freq[0] / inv_freq[1])  # log spacing of the frequencies
    c = [a * (2 * tau / math.pi) * w * dlog / (1.0 + (w * tau) ** 2) for w in inv_freq[:-1]]
    return c + [0.0]


def silu_centre(std: float) -> float:
    """The offset ``c`` for which ``silu(c + std n)``, ``n ~ N(0, 1)``, has mean 0 (bisection on a fixed
    quadrature grid: deterministic)."""
    grid = [i / 100.0 for i in range(-800, 801)]
    dens = [math.exp(-x * x / 2) for x in grid]
    norm = sum(dens)

    def mean(c: float) -> float:
        return sum(d * (c + std * x) / (1.0 + math.exp(-(c + std * x))) for x, d in zip(grid, dens)) / norm

    lo, hi = -2.0, 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Role:
    """What one head of layer 0's token mixer does: feed the ``fast`` or ``slow`` context, or (``long``)
    take ``MEAN_REMOVAL`` of its running average out of the slow context of head ``partner``, whose
    values it shares."""

    kind: str
    window: float
    partner: int | None = None


def roles(heads: int, group: int) -> list[Role]:
    """Roles of ``heads`` heads, ``group`` consecutive ones sharing their values (GQA; 1: none shared).

    In every four heads: fast, slow, fast, long (partner: the slow one), when the long head can share
    the slow one's values; fast and slow alternate otherwise.
    """
    out = []
    for h in range(heads):
        i = h // 4
        match h % 4:
            case 0 | 2:
                out.append(Role("fast", FAST_WINDOWS[(h // 2) % len(FAST_WINDOWS)]))
            case 1:
                out.append(Role("slow", SLOW_WINDOWS[i % len(SLOW_WINDOWS)]))
            case _:
                if group % 4 == 0 or group == 1:
                    out.append(Role("long", LONG_WINDOW, h - 2))
                else:
                    out.append(Role("slow", SLOW_WINDOWS[i % len(SLOW_WINDOWS)]))
    return out


class TrainedInit:
    """The ``trained`` tensors of one config: :meth:`tensor` gives a tensor's values, or None for ``spread``'s."""

    def __init__(self, cfg: dict):
        mt = cfg.get("model_type")
        if mt not in FAMILIES:
            raise ConfigError(f"--init trained: model_type {mt!r} is not calibrated; it is for "
                              f"{', '.join(FAMILIES)} (use spread or plain)")
        if mt == "qwen3_moe":
            self.args, self.prefix, self.mixer = qwen3_moe.ModelArgs.from_config(cfg), "model", "attention"
            self.rotary = self.args.head_dim
        else:
            mod = qwen3_next if mt == "qwen3_next" else qwen3_5_moe
            self.args = mod.ModelArgs.from_config(cfg)
            self.prefix = "model" if mt == "qwen3_next" else qwen3_5_moe.PREFIX
            if self.args.layer_types[0] != "linear_attention":
                raise ConfigError("--init trained: layer 0 must be a linear-attention layer in a hybrid config")
            self.mixer = "deltanet"
        a = self.args
        self.hidden = a.hidden_size
        self.blocks = Blocks.of(a.hidden_size)
        b = self.blocks
        # the first RMSNorm's scale: embedding rows are N(0, 1) on T and 1 on B, 0 elsewhere
        self.rms0 = math.sqrt((b.size(b.token) + b.size(b.const)) / a.hidden_size)
        self._kernels: dict[float, torch.Tensor] = {}

    # -- layer 0's positional kernels (softmax attention) ------------------------------------------------
    def _inv_freq(self) -> list[float]:
        d = self.rotary
        return [self.args.rope_theta ** (-i / d) for i in range(0, d, 2)]

    def kernel(self, window: float) -> list[float]:
        if window not in self._kernels:
            self._kernels[window] = rope_kernel(window, self._inv_freq())
        return self._kernels[window]

    def _gamma(self) -> float:
        """q_norm's scale: every query head's pattern has norm sqrt(2) x gamma (see :meth:`_q_pattern`)."""
        need = max(math.sqrt(sum(c * c for c in self.kernel(w))) for w in {*FAST_WINDOWS, *SLOW_WINDOWS, LONG_WINDOW})
        return need / math.sqrt(2) * 1.01

    def _q_pattern(self, window: float) -> torch.Tensor:
        """A query head's constant direction [head_dim] float32.

        Queries and keys read block B only, so after q_norm (scale gamma) and k_norm (1) a query
        is ``q sqrt(head_dim) gamma / |q|`` and a key is sqrt(2) on the first dimension of every
        rotary pair; the score at lag d is then ``sum_i q_i cos(w_i d)`` when
        ``|q| = sqrt(2) gamma``. The norm the kernel does not use goes to the lowest frequency,
        which adds the same score at every lag of a context (it rotates by under 0.01 radian
        over 4096 tokens).
        """
        c = self.kernel(window)
        total = 2 * self._gamma() ** 2
        spare = math.sqrt(max(total - sum(x * x for x in c[:-1]), 0.0))
        q = torch.zeros(self.args.head_dim, dtype=torch.float64)
        q[: len(c)] = torch.tensor(c[:-1] + [spare], dtype=torch.float64)
        return q.float()

    def _ctx_scale(self, window: float) -> float:
        """1 / the per-dimension rms of a head's output over distinct tokens, for values of rms 1:
        1 / sqrt(sum of squared attention weights) (softmax attention); 1 for DeltaNet, whose
        gated norm gives rms 1 already."""
        if self.mixer == "deltanet":
            return 1.0
        c = torch.tensor(self.kernel(window), dtype=torch.float64)
        lags = torch.arange(4096, dtype=torch.float64)
        score = torch.cos(lags[:, None] * torch.tensor(self._inv_freq(), dtype=torch.float64)[None, :]) @ c
        p = torch.softmax(score, 0)
        return 1.0 / math.sqrt(float((p**2).sum()))

    # -- tensors -----------------------------------------------------------------------------------------
    def tensor(self, t: SynthTensor, seed: int) -> torch.Tensor | None:
        """The float32 values of ``t`` under ``trained``; None where ``spread``'s apply."""
        name, p0 = t.name, f"{self.prefix}.layers.0."
        if name == f"{self.prefix}.embed_tokens.weight":
            return self._embedding(t, seed)
        if name.endswith(".mlp.gate.weight") and len(t.shape) == 2 and t.shape[1] == self.hidden:
            return self._router(t, seed)
        if name.startswith(p0 + "self_attn.") and self.mixer == "attention":
            return self._attention(t, seed)
        if name.startswith(p0 + "linear_attn.") and self.mixer == "deltanet":
            return self._deltanet(t, seed)
        return None

    def _clusters(self, seed: int) -> tuple[int, torch.Tensor]:
        """(clusters C, their unit directions [C, |K|] in block K): each token belongs to one cluster, and in every
        layer ``CLUSTER_EXPERTS`` experts prefer each cluster (which ones differs by layer)."""
        c = max(1, self.args.num_experts // CLUSTER_EXPERTS)
        return c, frame(c, self.blocks.size(self.blocks.cluster), _gen(seed, "clusters"))

    def _embedding(self, t: SynthTensor, seed: int) -> torch.Tensor:
        b = self.blocks
        out = torch.zeros(t.shape, dtype=torch.float32)
        g = _gen(seed, t.name)
        out[:, b.token[0] : b.token[1]] = torch.randn(t.shape[0], b.size(b.token), generator=g)
        c, dirs = self._clusters(seed)
        which = torch.randint(c, (t.shape[0],), generator=g)
        out[:, b.cluster[0] : b.cluster[1]] = dirs[which] * math.sqrt(b.size(b.cluster))  # rms 1 per dimension
        out[:, b.const[0] : b.const[1]] = 1.0
        return out

    def _router(self, t: SynthTensor, seed: int) -> torch.Tensor:
        b, (e, h) = self.blocks, t.shape
        g = _gen(seed, t.name)
        w = ROUTER_WEIGHTS
        lam = LOGIT_STD / math.sqrt(sum(w[k] ** 2 for k in ("token", "fast", "slow")))
        out = torch.zeros(e, h, dtype=torch.float32)
        for key, blk in (("token", b.token), ("fast", b.fast), ("slow", b.slow)):
            out[:, blk[0] : blk[1]] = lam * w[key] * frame(e, b.size(blk), g)
        c, dirs = self._clusters(seed)
        mine = torch.randperm(e, generator=g) % c  # each expert's cluster in this layer
        out[:, b.cluster[0] : b.cluster[1]] = lam * w["cluster"] * dirs[mine] / math.sqrt(b.size(b.cluster))
        return out

    def _const_reader(self, rows: torch.Tensor, pre: torch.Tensor | float) -> torch.Tensor:
        """[n, H] weights giving pre-activation ``pre`` [n] on layer 0's normalized input (reading block B)."""
        b = self.blocks
        out = torch.zeros(rows.shape[0], self.hidden, dtype=torch.float32)
        out[:, b.const[0] : b.const[1]] = (torch.as_tensor(pre, dtype=torch.float32) * rows)[:, None] * (
            self.rms0 / b.size(b.const)
        )
        return out

    def _value_reader(self, n: int, g: torch.Generator, std: float) -> torch.Tensor:
        """[n, H] weights reading random projections of the token block, of std ``std`` on layer 0's input."""
        b = self.blocks
        out = torch.zeros(n, self.hidden, dtype=torch.float32)
        out[:, b.token[0] : b.token[1]] = frame(n, b.size(b.token), g) * (std * self.rms0)
        return out

    def _writer(self, rs: list[Role], dim: int, g: torch.Generator, gain: float) -> torch.Tensor:
        """[H, heads x dim]: each head's output into the fast or slow block through a random frame (unit rows:
        the per-dimension rms is kept), scaled to rms 1 (``gain`` x :meth:`_ctx_scale`); a long head's
        columns are ``-MEAN_REMOVAL`` times its partner's, so the partner's running average of the
        same values is partly taken out."""
        b = self.blocks
        out = torch.zeros(self.hidden, len(rs) * dim, dtype=torch.float32)
        cols = lambda i: slice(i * dim, (i + 1) * dim)  # noqa: E731
        for kind, blk in (("fast", b.fast), ("slow", b.slow)):
            heads = [i for i, r in enumerate(rs) if r.kind == kind]
            if not heads:
                continue
            f = frame(b.size(blk), len(heads) * dim, g)
            for j, i in enumerate(heads):
                out[blk[0] : blk[1], cols(i)] = f[:, j * dim : (j + 1) * dim] * (gain * self._ctx_scale(rs[i].window))
        for i, r in enumerate(rs):
            if r.kind == "long":
                out[:, cols(i)] = -MEAN_REMOVAL * out[:, cols(r.partner)]
        return out

    def _attention(self, t: SynthTensor, seed: int) -> torch.Tensor | None:
        a, name = self.args, t.name.rsplit(".", 2)[-2]
        hd, nq, nkv = a.head_dim, a.num_attention_heads, a.num_key_value_heads
        rs = roles(nq, nq // nkv)
        g = _gen(seed, t.name)
        if name == "q_proj" and t.init != "zeros":
            pats = torch.stack([self._q_pattern(r.window) for r in rs]).reshape(-1)
            return self._const_reader(pats, 1.0)
        if name == "k_proj" and t.init != "zeros":
            k = torch.zeros(hd)
            k[: self.rotary // 2] = 1.0
            return self._const_reader(k.repeat(nkv), 1.0)
        if name == "v_proj" and t.init != "zeros":
            w = self._value_reader(nkv * hd, g, 1.0)
            if nq == nkv:  # no GQA: a long head copies its partner's values
                for i, r in enumerate(rs):
                    if r.partner is not None:
                        w[i * hd : (i + 1) * hd] = w[r.partner * hd : (r.partner + 1) * hd]
            return w
        if name == "o_proj" and t.init != "zeros":
            return self._writer(rs, hd, g, 1.0)
        if name == "q_norm":
            return torch.full(t.shape, self._gamma())
        if name == "k_norm":
            return torch.ones(t.shape)
        return None

    def _deltanet(self, t: SynthTensor, seed: int) -> torch.Tensor | None:
        a, name = self.args, t.name.rsplit(".", 2)[-2] if t.name.endswith(".weight") else t.name.rsplit(".", 1)[-1]
        hk, hv = a.linear_num_key_heads, a.linear_num_value_heads
        dk, dv = a.linear_key_head_dim, a.linear_value_head_dim
        per = hv // hk
        rs = roles(hv, 1)
        g = _gen(seed, t.name)
        betas = torch.tensor([1.0 - (1.0 - 1.0 / r.window) / DECAY for r in rs])
        q = self._const_reader(torch.ones(hk * dk), 1.0)  # silu(1) in every key dimension: one constant direction

        def v() -> torch.Tensor:  # centred values (mean 0 after the SiLU); a long head copies its partner's
            w = self._value_reader(hv * dv, g, V_PREACT) + self._const_reader(torch.ones(hv * dv),
                                                                               silu_centre(V_PREACT))
            for i, r in enumerate(rs):
                if r.partner is not None:
                    w[i * dv : (i + 1) * dv] = w[r.partner * dv : (r.partner + 1) * dv]
            return w

        z = self._const_reader(torch.ones(hv * dv), Z_PREACT)
        bb = self._const_reader(torch.ones(hv), torch.log(betas / (1 - betas)))
        aa = torch.zeros(hv, self.hidden)
        if name == "in_proj_qkv":
            return torch.cat([q, q, v()])
        if name == "in_proj_z":
            return z
        if name == "in_proj_b":
            return bb
        if name == "in_proj_a":
            return aa
        if name == "in_proj_qkvz":  # Qwen3-Next: grouped per key head [q, k, v (per value heads), z (per)]
            vv = v()
            parts = []
            for j in range(hk):
                parts += [q[j * dk : (j + 1) * dk], q[j * dk : (j + 1) * dk], vv[j * per * dv : (j + 1) * per * dv],
                          z[j * per * dv : (j + 1) * per * dv]]
            return torch.cat(parts)
        if name == "in_proj_ba":  # per key head [b (per), a (per)]
            parts = []
            for j in range(hk):
                parts += [bb[j * per : (j + 1) * per], aa[j * per : (j + 1) * per]]
            return torch.cat(parts)
        if name == "conv1d":
            w = torch.zeros(t.shape)
            w[:, 0, -1] = 1.0  # the current token only
            return w
        if name == "dt_bias":  # softplus(dt_bias) = -log(DECAY), with A_log = 0
            return torch.full(t.shape, math.log(math.expm1(-math.log(DECAY))))
        if name == "A_log":
            return torch.zeros(t.shape)
        if name == "out_proj":
            return self._writer(rs, dv, g, 1.0 / (Z_PREACT * torch.sigmoid(torch.tensor(Z_PREACT)).item()))
        return None
