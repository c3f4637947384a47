"""Layers of the hybrid Qwen families (Qwen3-Next, Qwen3.5/3.6 MoE): Gated DeltaNet linear
attention, gated full attention, their norms, the cache that holds both kinds of state,
and the MoE block with a gated shared expert.

References: transformers ``models/qwen3_next/modeling_qwen3_next.py`` and
``models/qwen3_5/modeling_qwen3_5.py`` (their torch fallback paths, without the fla and
causal_conv1d kernels); Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving
Mamba2 with Delta Rule" (arXiv:2412.06464) for the recurrence and its chunked form.

Activations are ``[T, hidden]`` for one sequence, as in :mod:`moestream.models.layers`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..errors import ConfigError
from ..quant import native
from . import ops
from .layers import MLP, HybridCache, KVCache
from .moe import StreamedMoE
from .rope import apply_rotary

# the chunk length of the chunked Gated DeltaNet form, as the reference's default
DELTANET_CHUNK = 64


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight`` (weight stored zero-centred), as transformers' ``Qwen3NextRMSNorm``.

    Normalizes and scales in float32, then casts to the input dtype (unlike
    :class:`~moestream.models.layers.RMSNorm`, which casts before scaling).
    """

    synth_init = {"weight": "zeros"}  # scale 1, as transformers initializes it

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, "one_plus")


class GatedRMSNorm(nn.Module):
    """RMSNorm then a SiLU gate, as transformers' ``Qwen3NextRMSNormGated``: ``weight * norm(x) * silu(z)``.

    ``x`` and ``z`` are [..., dim]; the norm is computed in float32 and cast to x's dtype
    before the weight, the gate is applied in float32, the result is in x's dtype.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = ops.rms_norm(x, self.weight, self.eps)
        return (h * ops.silu(z.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """Full attention with an output gate, as transformers' ``Qwen3NextAttention``.

    ``q_proj`` gives, per head, a query and a gate [head_dim each]; queries and keys get a
    zero-centred RMSNorm per head, then rotary embedding on their first ``rotary_dim``
    dimensions (partial rotary: the width of the model's cos/sin); softmax(q k^T / sqrt(head_dim)) v
    over the KV cache; the output is multiplied by sigmoid(gate) before ``o_proj``.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, bias: bool = False):
        super().__init__()
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.scale = head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, layer: int,
                start: int) -> torch.Tensor:
        """x [T, H] at positions ``start..start+T``, cos/sin [T, rotary_dim] -> [T, H]; appends to ``kv``."""
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(t, self.heads * self.head_dim)
        q = self.q_norm(q).transpose(0, 1)
        k = self.k_norm(self.k_proj(x).view(t, self.kv_heads, self.head_dim)).transpose(0, 1)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = kv.attend(layer, start, q, k, v, self.scale)
        out = out.transpose(0, 1).reshape(t, self.heads * self.head_dim)
        return self.o_proj(out * ops.sigmoid(gate))


def depthwise_causal_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise convolution without padding: ``out[c, t] = sum_j weight[c, j] * window[c, t + j]``.

    Args:
        window: [C, K - 1 + T]; weight: [C, K] (``conv1d.weight[:, 0]``), same dtype.

    Returns:
        [C, T] in window's dtype: summed in float32 over j = 0..K-1 in order and rounded once (each output
        depends only on its window: the same bits for any split of the sequence into calls), which gave the
        same bits as PyTorch's CPU bf16/fp16 depthwise ``conv1d`` (tests/test_family_qwen3_hybrid.py) at a
        fraction of its cost (about 60 ms per call whatever the length, on the build machine).
    """
    k = weight.shape[1]
    t = window.shape[1] - k + 1
    x, w = window.float(), weight.float()
    out = x[:, 0:t] * w[:, 0:1]
    for j in range(1, k):
        out = out + x[:, j : j + t] * w[:, j : j + 1]
    return out.to(window.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (the reference's ``l2norm``)."""
    return ops.rms_norm(x, None, eps, "l2") if x.device.type == "cpu" and native.selected() != "torch" else \
        x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    chunk: int = DELTANET_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a sequence, ``chunk`` tokens at a time (Yang et al. 2024, sec. 3).

    Per head, with state S [dk, dv]: ``S_t = a_t S_{t-1} + b_t k_t (v_t - a_t S_{t-1}^T k_t)^T``
    and ``o_t = S_t^T q_t``, where ``a_t = exp(g_t)``. Inside a chunk the updates are
    condensed by the UT transform (a unit lower-triangular solve); chunks are scanned in
    order. Computes what transformers' ``torch_chunk_gated_delta_rule`` computes.

    Args:
        q, k: [heads, T, dk] float32 (queries already l2-normalized and scaled).
        v: [heads, T, dv] float32; g: [heads, T] log decays (<= 0); beta: [heads, T].
        state: [heads, dk, dv] float32, the state before the first token.

    Returns:
        (outputs [heads, T, dv], the state after the last token [heads, dk, dv]), float32.
    """
    heads, t, dv = v.shape
    out = v.new_empty(heads, t, dv)
    for s in range(0, t, chunk):
        e = min(s + chunk, t)
        n = e - s
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e, None]
        cum = g[:, s:e].cumsum(-1)  # log of the decay from the chunk's start to each position
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [h, i, j]
        kb = kc * bc
        system = (kb @ kc.transpose(-1, -2)) * decay  # only its strict lower triangle is used
        u = torch.linalg.solve_triangular(system, vc * bc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
        v_new = u - w @ state
        intra = (qc @ kc.transpose(-1, -2)) * decay
        out[:, s:e] = (qc * cum.exp()[..., None]) @ state + intra @ v_new
        last = cum[:, -1:]
        state = state * last.exp()[..., None] + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ v_new
    return out, state


def gated_delta_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (decode), as transformers' ``torch_recurrent_gated_delta_rule``.

    Same arguments, recurrence and returns as :func:`gated_delta_chunked`.
    """
    out = v.new_empty(v.shape)
    for i in range(v.shape[1]):
        state = state * g[:, i].exp()[:, None, None]
        remembered = (state * k[:, i, :, None]).sum(dim=-2)  # S^T k: what the state predicts for v
        delta = (v[:, i] - remembered) * beta[:, i, None]
        state = state + k[:, i, :, None] * delta[:, None, :]
        out[:, i] = (state * q[:, i, :, None]).sum(dim=-2)
    return out, state


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention, as transformers' ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``.

    Projections give q, k (``key_heads`` x ``key_dim``), v and the output gate z
    (``value_heads`` x ``value_dim``), and per value head b (-> beta = sigmoid(b)) and
    a (-> log decay g = -exp(A_log) * softplus(a + dt_bias)). q, k, v pass through a
    depthwise causal convolution (``kernel`` taps, SiLU), q and k are l2-normalized and
    repeated to the value heads, the gated delta rule runs in float32 (chunked form for
    prefill, recurrent for one-token decode, as the reference), and the output goes
    through a gated RMSNorm (gate z) and ``out_proj``.

    Args:
        fused_projections: Qwen3-Next's ``in_proj_qkvz`` + ``in_proj_ba``, grouped per key
            head; otherwise Qwen3.5's separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.

    Checkpoint order, as synth lists the parameters: projections, ``conv1d``, ``dt_bias``,
    ``A_log``, ``norm``, ``out_proj``.

    ``out_order``: None, or the order of ``out_proj``'s input features its stored weight expects
    (a GGUF file's tiled value heads, whose quantized blocks cannot be moved back): the input is
    permuted to it before ``out_proj`` (set by the family's ``adapt_to_source``).
    """

    synth_init = {"dt_bias": "norm", "A_log": "zeros"}  # ones and zeros, as transformers initializes them
    synth_params_after = "conv1d"  # dt_bias and A_log stand after the convolution in the checkpoint

    def __init__(self, hidden: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int, kernel: int,
                 eps: float, fused_projections: bool):
        super().__init__()
        if value_heads % key_heads:
            raise ConfigError(
                f"linear_num_value_heads {value_heads} is not a multiple of linear_num_key_heads {key_heads}"
            )
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = key_heads, value_heads, key_dim, value_dim
        self.kernel, self.fused = kernel, fused_projections
        self.conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
        if fused_projections:
            self.in_proj_qkvz = nn.Linear(hidden, self.conv_dim + value_heads * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * value_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, value_heads * value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, value_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(value_heads))
        self.A_log = nn.Parameter(torch.zeros(value_heads))
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = nn.Linear(value_heads * value_dim, hidden, bias=False)
        self.out_order: tuple[int, ...] | None = None
        self._out_index: dict = {}  # device -> out_order as an index tensor

    def _project(self, x: torch.Tensor):
        """(qkv [T, conv_dim], z [T, value_heads, value_dim], b [T, value_heads], a [T, value_heads])."""
        t, hv, dv = x.shape[0], self.value_heads, self.value_dim
        if not self.fused:
            return self.in_proj_qkv(x), self.in_proj_z(x).view(t, hv, dv), self.in_proj_b(x), self.in_proj_a(x)
        per = hv // self.key_heads  # value heads per key head
        dk = self.key_dim
        qkvz = self.in_proj_qkvz(x).view(t, self.key_heads, 2 * dk + 2 * per * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, per * dv, per * dv], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(t, self.key_heads, 2 * per), [per, per], dim=-1)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return qkv, z.reshape(t, hv, dv), b.reshape(t, hv), a.reshape(t, hv)

    def forward(self, x: torch.Tensor, kv: HybridCache, layer: int, start: int) -> torch.Tensor:
        """x [T, H] following the ``start`` tokens already in ``kv`` -> [T, H]; updates the layer's state.

        Raises:
            ValueError: ``start`` is not where the cache ends (the state cannot rewind).
        """
        if start != kv.length:
            raise ValueError(f"linear-attention layer {layer}: a chunk at position {start} must follow the "
                             f"{kv.length} tokens already cached (its state cannot rewind)")
        t = x.shape[0]
        qkv, z, b, a = self._project(x)
        past = kv.conv[layer]
        if past is None:  # zeros before the first token, as the reference's left padding
            past = qkv.new_zeros(self.conv_dim, self.kernel - 1)
        window = torch.cat((past, qkv.t()), dim=1)  # [conv_dim, kernel - 1 + T]
        kv.conv[layer] = window[:, window.shape[1] - (self.kernel - 1) :].clone()
        qkv = ops.silu(depthwise_causal_conv(window, self.conv1d.weight[:, 0])).t()
        kd = self.key_heads * self.key_dim
        q, k, v = torch.split(qkv, [kd, kd, self.value_heads * self.value_dim], dim=-1)
        per = self.value_heads // self.key_heads
        q = q.reshape(t, self.key_heads, self.key_dim).repeat_interleave(per, dim=1)
        k = k.reshape(t, self.key_heads, self.key_dim).repeat_interleave(per, dim=1)
        v = v.reshape(t, self.value_heads, self.value_dim)
        beta = ops.sigmoid(b)
        g = -self.A_log.float().exp() * ops.softplus(a.float() + self.dt_bias)
        # [T, heads, d] -> [heads, T, d] in float32, as the reference's kernels
        q, k, v, beta, g = (y.transpose(0, 1).float().contiguous() for y in (q, k, v, beta, g))
        q, k = l2_normalize(q), l2_normalize(k)
        state = kv.recurrent[layer]
        if state is None:
            state = q.new_zeros(self.value_heads, self.key_dim, self.value_dim)
        got = native.delta_rule(*(y.transpose(0, 1) for y in (q * self.key_dim**-0.5, k, v)), g.t(), beta.t(), state)
        if got is not None:  # the recurrence on the compiled kernels: one form for prefill and decode
            out, state = got
            out = out.transpose(0, 1)
        elif t == 1:
            out, state = gated_delta_recurrent(q / self.key_dim**0.5, k, v, g, beta, state)
        else:
            out, state = gated_delta_chunked(q * self.key_dim**-0.5, k, v, g, beta, state)
        kv.recurrent[layer] = state
        out = out.transpose(0, 1).to(x.dtype)  # [T, value_heads, value_dim]
        out = self.norm(out.reshape(-1, self.value_dim), z.reshape(-1, self.value_dim))
        out = out.reshape(t, self.value_heads * self.value_dim)
        if self.out_order is not None:  # the stored out_proj's input order (see the class doc)
            index = self._out_index.get(out.device)
            if index is None:
                index = self._out_index[out.device] = torch.tensor(self.out_order, device=out.device)
            out = out.index_select(1, index)
        return self.out_proj(out)


class GatedSharedExpertMoE(StreamedMoE):
    """Streamed routed experts plus one resident shared expert behind a sigmoid gate,
    as transformers' ``Qwen3NextSparseMoeBlock``: ``routed(x) + sigmoid(shared_expert_gate x) * shared_expert(x)``.

    Args:
        shared_intermediate: the shared expert's SwiGLU width; the rest as :class:`StreamedMoE`.
    """

    def __init__(self, hidden: int, num_experts: int, layer: int, router: Callable, shared_intermediate: int,
                 renormalize: bool = False):
        super().__init__(hidden, num_experts, layer, router, renormalize=renormalize)
        self.shared_expert = MLP(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        routed = super().forward(x)
        return routed + ops.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def layer_types(cfg: dict, layers: int) -> list[str]:
    """``layer_types`` of a config, or the transformers default from ``full_attention_interval``
    (every interval-th layer full attention, the rest linear attention).

    Raises:
        ConfigError: a list of the wrong length or with unknown entries, or a bad interval.
    """
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"field 'full_attention_interval' = {interval!r} must be an integer >= 1")
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    known = {"full_attention", "linear_attention"}
    if not isinstance(types, list) or len(types) != layers or not set(types) <= known:
        raise ConfigError(
            f"field 'layer_types' must list {layers} entries of {sorted(known)} (one per layer), got {types!r:.200}"
        )
    return list(types)


def rotary_fraction(cfg: dict) -> float:
    """``partial_rotary_factor`` from ``rope_parameters`` or the top level (default 1)."""
    params = cfg.get("rope_parameters") or {}
    value = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"field 'partial_rotary_factor' = {value!r} must be in (0, 1]")
    return float(value)
