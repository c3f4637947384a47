"""The streamed MoE block: a resident router, and routed experts computed by the expert pipeline.

The block routes (the family's routing function on its router's logits) and hands the
routing to the :class:`~moestream.pipeline.ExpertPipeline` the engine attached, which
fetches, computes and sums the experts in routing order. This module also holds the
routing functions the families share and the float SwiGLU expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..pipeline import ExpertFn, ExpertPipeline, ExpertSpec, declares
from ..quant import native
from . import ops

Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def softmax_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing, as transformers' ``Qwen3MoeTopKRouter``.

    Softmax over ``logits`` [T, E] in float32, the ``top_k`` largest probabilities,
    renormalized to sum to 1 when ``norm_topk_prob``, cast to the logits' dtype.
    Returns ``(weights [T, K] in logits.dtype, indices [T, K] int64)``. On the CPU the compiled
    kernels' form (:func:`moestream.quant.native.route_softmax`: one fixed order of operations, the one
    the compiled decoder layer routes with), else PyTorch's.
    """
    if logits.device.type == "cpu" and logits.dim() == 2:
        got = native.route_softmax(logits, top_k, norm_topk_prob)
        if got is not None:
            return got
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), idx


@declares("swiglu")
def swiglu_expert(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """One SwiGLU expert on ``x`` [n, H]: ``down(silu(gate x) * up x)`` -> [n, H].

    ``w`` holds ``gate`` and ``up`` [I, H] and ``down`` [H, I] (nn.Linear orientation).
    On the CPU one call of the compiled kernels (:func:`moestream.models.ops.gated_mlp`: the
    bits depend only on x's row and the weights, wherever the store put them).
    """
    return ops.gated_mlp(x, w["gate"], w["up"], w["down"])


SWIGLU = ExpertSpec("swiglu", swiglu_expert)  # the plain SwiGLU expert most families declare


class StreamedMoE(nn.Module):
    """A MoE block whose router is resident and whose routed experts stream through the cache.

    Args:
        hidden: model width H; num_experts: E.
        layer: layer index; router: maps router logits [T, E] to (weights, indices).
        expert: what one expert computes, as the family declares it (an
            :class:`~moestream.pipeline.ExpertSpec`; a bare function is taken by
            :meth:`ExpertSpec.of <moestream.pipeline.ExpertSpec.of>`); the engine chooses the
            layer's expert kernel from it and the experts' stored format at load.
        renormalize: whether the family renormalizes its top-k weights (``norm_topk_prob``
            and the like), so that keeping fewer experts (``--max-active-experts``)
            renormalizes the kept ones the same way.

    The router's weight is ``gate.weight`` [E, H], the name transformers uses. The expert
    pipeline (:meth:`attach`) does the rest: ``--max-active-experts``, the routing trace,
    read-ahead, fetching, the expert kernels, expert parallelism and the routing-order sum.
    Other modules ask the block for :attr:`num_experts` and route through :meth:`route`, never
    the router's tensors: a quantized router (:class:`moestream.quant.resident.QuantLinear`)
    holds packed words, not a float weight.
    """

    def __init__(
        self, hidden: int, num_experts: int, layer: int, router: Router, expert: ExpertSpec | ExpertFn = SWIGLU,
        renormalize: bool = False,
    ):
        super().__init__()
        self.renormalize = renormalize
        self._num_experts = num_experts
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.layer = layer
        self.router = router
        self.expert = ExpertSpec.of(expert)
        self.pipeline: ExpertPipeline | None = None

    @property
    def expert_fn(self) -> ExpertFn:
        """One expert's float computation (the declared spec's function)."""
        return self.expert.fn

    @property
    def num_experts(self) -> int:
        """Routed experts of this layer (E), from the config (the router's output width)."""
        return self._num_experts

    def attach(self, pipeline: ExpertPipeline) -> None:
        """Hand the layer's expert work to ``pipeline`` (a :class:`~moestream.pipeline.ExpertPipeline`)."""
        self.pipeline = pipeline

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing of ``x`` [T, H]: ``(weights [T, K], indices [T, K] int64)``.

        A family whose router is not ``router(gate(x))`` (a bias, another name) overrides
        this; the prefetcher predicts the next layers' experts with it too.
        """
        return self.router(self.gate(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.routed(x)

    def routed(self, x: torch.Tensor, expert_input: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' weighted sum for tokens ``x`` [T, H], in routing order.

        Routes ``x`` (:meth:`route`) and runs the expert pipeline on ``expert_input``
        (default ``x``; Kimi K3's latent experts take a projection of it). Families that add
        shared experts or scale the sum call this from their ``forward``.
        """
        weights, idx = self.route(x)
        return self.pipeline(self, x, weights, idx, expert_input)


def _group_mask(choice: torch.Tensor, n_group: int, topk_group: int, group_score: str) -> torch.Tensor:
    """Boolean [T, E]: the experts of the ``topk_group`` best of ``n_group`` equal groups.

    A group's score is its best expert's (``"max"``, DeepSeek-V2) or the sum of its best
    two (``"top2_sum"``, DeepSeek-V3).
    """
    t, e = choice.shape
    grouped = choice.view(t, n_group, e // n_group)
    scores = grouped.max(dim=-1).values if group_score == "max" else grouped.topk(2, dim=-1)[0].sum(dim=-1)
    chosen = torch.topk(scores, topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, chosen, True)
    return mask[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)


def sigmoid_group_topk(
    logits: torch.Tensor,
    top_k: int,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid routing with a selection bias and group-limited top-k (DeepSeek-V3's ``noaux_tc``).

    As transformers' ``DeepseekV3TopkRouter`` (also GLM-4.5's ``Glm4MoeTopkRouter``):
    scores = sigmoid(``logits`` [T, E]) in float32; experts are *chosen* by
    ``scores + bias`` (``e_score_correction_bias`` [E], auxiliary-loss-free balancing,
    arXiv 2412.19437), within the ``topk_group`` groups of ``n_group`` whose best two
    biased scores sum highest; the *weights* are the unbiased scores of the chosen experts,
    divided by their sum (+1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``.

    Returns ``(weights [T, K] float32, indices [T, K] int64)``, in descending order of the
    biased score.
    """
    scores = ops.sigmoid(logits.float())
    choice = scores if bias is None else scores + bias.float()
    if topk_group < n_group:
        choice = choice.masked_fill(~_group_mask(choice, n_group, topk_group, "top2_sum"), float("-inf"))
    idx = torch.topk(choice, top_k, dim=-1)[1]
    weights = scores.gather(1, idx)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, idx


def softmax_group_topk(
    logits: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing with DeepSeek-V2's ``group_limited_greedy`` top-k (``greedy`` when ``topk_group >= n_group``).

    As transformers' ``DeepseekV2TopkRouter``: softmax over ``logits`` [T, E] in float32;
    experts outside the ``topk_group`` groups (of ``n_group``) whose best expert scores
    highest are zeroed; the top-k scores, times ``routed_scaling_factor``, are the weights
    (not renormalized). Returns ``(weights [T, K] float32, indices [T, K] int64)``, largest first.
    """
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if topk_group < n_group:
        scores = scores.masked_fill(~_group_mask(scores, n_group, topk_group, "max"), 0.0)
    weights, idx = torch.topk(scores, top_k, dim=-1)
    return weights * routed_scaling_factor, idx


class Float32Router(nn.Linear):
    """A router whose logits are computed in float32 (input and weight upcast), as
    transformers' DeepSeek and GLM-4.5 routers; [T, H] -> [T, E] float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            y = native.float_linear(x, self.weight, out_dtype=torch.float32)
            if y is not None:
                return y
        return ops.linear(x.float(), self.weight.float())
