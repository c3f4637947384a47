"""Kimi Delta Attention (KDA), the linear attention of Kimi-Linear and Kimi K3, and the
hybrid decode state its models carry.

KDA (Kimi Team 2025, "Kimi Linear", arXiv:2510.26692) is gated DeltaNet with a decay per
key channel instead of per head. Per head, with a state ``S`` [Dk, Dv], for each token::

    S <- diag(exp(g_t)) S                        # per-channel forget gate, g_t <= 0
    S <- S + k_t (beta_t (v_t - S^T k_t))^T      # delta rule
    o_t = S^T q_t

with ``q``, ``k`` L2-normalized (``q`` also scaled by Dk^-1/2) after a causal depthwise
short convolution and SiLU. Decode runs that recurrence one token at a time; prefill runs
the equivalent chunked form (chunks of 64 tokens: within a chunk the delta rule is a
unit lower-triangular solve, between chunks the state carries over). Everything inside
KDA is computed in float32, as the reference (transformers ``models/kimi_linear``, its
torch path without the fla kernels) does; the state is kept in float32.

:class:`HybridCache` is the decode cache of a model that mixes attention layers (their
keys and values, or latents, in the :class:`~moestream.models.layers.KVCache` part) with
linear-attention layers (a convolution state and a recurrent state each).
"""

from __future__ import annotations

import torch
from torch import nn

from ..quant import native
from . import ops
from .hybrid import depthwise_causal_conv, l2_normalize
from .layers import HybridCache

CHUNK = 64  # the reference's chunk_size for prefill


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, as fla's l2norm (eps inside the root)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(
    f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Per-channel log forget gate g [T, H, Dk] (float32, <= 0) from the gate projection ``f``.

    ``f`` [T, H, Dk] (any float dtype), ``a_log`` [H] (one decay rate per head),
    ``dt_bias`` [H * Dk]. Without ``lower_bound``: ``-exp(A_log) * softplus(f + dt_bias)``
    (transformers ``KimiLinearForgetGate``, softplus linear above 20). With it (Kimi K3's
    "safe gate", fla ``ops/kda/gate.py``): ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``.
    """
    t, h, dk = f.shape
    x = f.float() + dt_bias.float().view(h, dk)
    a = torch.exp(a_log.float()).view(h, 1)
    if lower_bound is None:
        return -a * ops.softplus(x, 20.0)
    return lower_bound * ops.sigmoid(a * x)


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA one token at a time (decode). All float32.

    q, k [T, H, Dk] (normalized and scaled), v [T, H, Dv], g [T, H, Dk] (log decay),
    beta [T, H], state [H, Dk, Dv]. Returns (o [T, H, Dv], the final state).
    """
    out = v.new_empty(v.shape)
    for i in range(q.shape[0]):
        state = state * g[i].exp()[..., None]
        recalled = (state * k[i][..., None]).sum(-2)  # S^T k, [H, Dv]
        delta = (v[i] - recalled) * beta[i][:, None]
        state = state + k[i][..., None] * delta[:, None, :]
        out[i] = (state * q[i][..., None]).sum(-2)
    return out, state


def kda_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over a prompt chunk by chunk (prefill), equal in exact arithmetic to :func:`kda_recurrent`.

    Same arguments and result. Within a chunk of ``C`` tokens, with ``G`` the cumulative
    log decay, the delta-rule updates ``u`` solve ``(I + diag(beta) A) u = diag(beta)
    (v - (k * exp(G)) S0)`` where ``A[i, j] = sum_d k_i k_j exp(G_i - G_j)`` for ``j < i``
    (the WY form of the reference's chunk_kimi_delta_attention); then
    ``o = (q * exp(G)) S0 + tril(Q K^decay) u`` and the state moves to the chunk's end.
    """
    n = q.shape[0]
    out = v.new_empty(v.shape)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        qc, kc, vc, bc = (x[s:e].transpose(0, 1) for x in (q, k, v, beta))  # [H, C, .]
        gc = g[s:e].transpose(0, 1).cumsum(1)  # [H, C, Dk]
        c = e - s
        strict = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        # decay[i, j] = exp(G_i - G_j), only where j <= i (else exp would overflow)
        diff = (gc[:, :, None, :] - gc[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
        decay = diff.exp()  # [H, C, C, Dk]
        a = torch.einsum("hid,hjd,hijd->hij", kc, kc, decay) * strict
        lhs = torch.eye(c, device=q.device) + bc[..., None] * a
        egc = gc.exp()
        rhs = bc[..., None] * (vc - (kc * egc) @ state)
        u = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)  # [H, C, Dv]
        qk = torch.einsum("hid,hjd,hijd->hij", qc, kc, decay) * causal
        out[s:e] = ((qc * egc) @ state + qk @ u).transpose(0, 1)
        last = gc[:, -1:, :]  # [H, 1, Dk]
        state = state * last.transpose(1, 2).exp() + ((last - gc).exp() * kc).transpose(1, 2) @ u
    return out, state


class KimiDeltaAttention(nn.Module):
    """A KDA layer: projections, short convolutions, gates, the KDA core, gated norm, output.

    Args:
        hidden: model width H; heads, head_dim: KDA heads and their width (Dk = Dv).
        conv_kernel: short convolution length; eps: the output norm's epsilon.
        full_rank_gate: the output gate is one projection ``g_proj`` [heads*head_dim, H]
            (Kimi K3's ``use_full_rank_gate``) instead of ``g_b_proj(g_a_proj(x))``.
        lower_bound: Kimi K3's ``gate_lower_bound`` (see :func:`kda_gate`); None for Kimi-Linear.

    Parameter names are the checkpoint's (``q_conv1d``/``k_conv1d``/``v_conv1d`` [D, 1, kernel],
    ``A_log`` with one value per head first -- Kimi-Linear stores [1, 1, heads, 1], Kimi K3
    a [head_dim] vector of which the first ``heads`` are used, as fla's kernel reads it --
    ``dt_bias`` [D], ``f_a_proj``/``f_b_proj``, ``b_proj``, ``o_norm``, ``o_proj``).
    Reference: transformers ``KimiLinearDeltaAttention``; K3's gate as in Moonshot's
    released ``modeling_kimi_linear.py`` (read through public ports).
    """

    synth_init = {"A_log": "zeros"}
    synth_params_after = "v_conv1d"  # A_log and dt_bias stand after the convolutions in the checkpoint

    def __init__(
        self, hidden: int, heads: int, head_dim: int, conv_kernel: int, eps: float,
        full_rank_gate: bool = False, lower_bound: float | None = None, a_log_size: int | None = None,
    ):
        super().__init__()
        d = heads * head_dim
        self.heads, self.head_dim, self.kernel = heads, head_dim, conv_kernel
        self.eps, self.lower_bound = eps, lower_bound
        for name in "qkv":  # declared in checkpoint order: each projection, then its convolution
            setattr(self, f"{name}_proj", nn.Linear(hidden, d, bias=False))
            conv = nn.Module()
            conv.weight = nn.Parameter(torch.empty(d, 1, conv_kernel), requires_grad=False)
            setattr(self, f"{name}_conv1d", conv)
        self.A_log = nn.Parameter(
            torch.empty(1, 1, heads, 1) if a_log_size is None else torch.empty(a_log_size), requires_grad=False
        )
        self.dt_bias = nn.Parameter(torch.empty(d), requires_grad=False)
        self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, d, bias=False)
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        if full_rank_gate:
            self.g_proj = nn.Linear(hidden, d, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, head_dim, bias=False)
            self.g_b_proj = nn.Linear(head_dim, d, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)
        self.o_proj = nn.Linear(d, hidden, bias=False)

    def _conv(self, x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise convolution + SiLU of x [T, C] after ``state`` [C, kernel-1] -> ([T, C], new state)."""
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])  # [C, 1, kernel]
        xt = x.t()
        if state is None:
            state = xt.new_zeros(xt.shape[0], self.kernel - 1)
        full = torch.cat([state.to(xt.dtype), xt], dim=1)
        out = depthwise_causal_conv(full.to(w.dtype), w[:, 0])
        return ops.silu(out).to(x.dtype).t(), full[:, -(self.kernel - 1):].clone()

    def forward(self, x: torch.Tensor, kv: HybridCache, layer: int, start: int) -> torch.Tensor:
        """x [T, hidden] at positions ``start..start+T`` -> [T, hidden]; advances the layer's state in ``kv``."""
        t, h, dk = x.shape[0], self.heads, self.head_dim
        conv_state, state = kv.linear_state(layer, start)
        mixed, conv_state = self._conv(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1), conv_state)
        q, k, v = (z.reshape(t, h, dk).float() for z in mixed.split(h * dk, dim=-1))
        q, k = l2_normalize(q) * dk**-0.5, l2_normalize(k)
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(t, h, dk), self.A_log.reshape(-1)[:h], self.dt_bias,
                     self.lower_bound)
        beta = ops.sigmoid(self.b_proj(x)).float()
        if state is None:
            state = x.new_zeros(h, dk, dk, dtype=torch.float32)
        got = native.delta_rule(q, k, v, g, beta, state)  # the compiled recurrence: one form for any chunk
        o, state = got if got is not None else (kda_recurrent if t == 1 else kda_chunked)(q, k, v, g, beta, state)
        kv.set_linear_state(layer, conv_state, state, start + t)
        gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        # gated RMSNorm over each head, strictly in float32 (transformers KimiLinearRMSNormGated)
        o = ops.rms_norm(o.to(x.dtype).float(), self.o_norm.weight.float(), self.eps)
        o = (o * ops.sigmoid(gate.view(t, h, dk).float())).to(x.dtype)
        return self.o_proj(o.reshape(t, h * dk))
