"""The streamed MoE block: resident router, routed experts fetched through the expert cache.

For ``T`` tokens routed to ``K`` experts each, every expert the layer needs is computed
once on the tokens routed to it (cached experts first, missing ones as their reads
complete), and its weighted output is written into slot ``(t, k)`` of a ``[T, K, H]``
buffer. The layer's output is then the sum over ``k = 0..K-1`` in routing order. The
order in which reads finished therefore never reaches the arithmetic, and every cache
state -- any budget, any number of reader threads -- gives bit-identical results.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import ExpertCache
from .linear import linear

Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ExpertFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def softmax_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing, as transformers' ``Qwen3MoeTopKRouter``.

    Softmax over ``logits`` [T, E] in float32, the ``top_k`` largest probabilities,
    renormalized to sum to 1 when ``norm_topk_prob``, cast to the logits' dtype.
    Returns ``(weights [T, K] in logits.dtype, indices [T, K] int64)``.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), idx


def swiglu_expert(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """One SwiGLU expert on ``x`` [n, H]: ``down(silu(gate x) * up x)`` -> [n, H].

    ``w`` holds ``gate`` and ``up`` [I, H] and ``down`` [H, I] (nn.Linear orientation).
    Matmuls through :func:`moestream.models.linear.linear` (float32 for wide bf16 inputs on
    CPUs without native bf16).
    """
    return linear(F.silu(linear(x, w["gate"])) * linear(x, w["up"]), w["down"])


def streamed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    layer: int,
    cache: ExpertCache,
    expert_fn: ExpertFn = swiglu_expert,
) -> torch.Tensor:
    """Sum of routed expert outputs for ``x`` [T, H], summed in routing order.

    Args:
        weights: [T, K] routing weights (x's dtype, or float32); idx: [T, K] expert indices.
        layer: the layer index (the cache key's first half).
        cache: where experts come from.
        expert_fn: computes one expert on its tokens.

    Returns:
        [T, H]: ``sum_k weights[t, k] * expert_{idx[t, k]}(x[t])``, accumulated k = 0..K-1.
    """
    t, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert
    sorted_ids = flat[order]
    experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    span = {e: (s, c) for e, s, c in zip(experts.tolist(), starts.tolist(), counts.tolist())}
    # experts in order of first use in routing order (token-major, rank-minor)
    first = torch.full((int(experts.max()) + 1,), t * k, dtype=torch.int64, device=flat.device)
    first.scatter_reduce_(0, flat, torch.arange(t * k, device=flat.device), reduce="amin")
    needed = sorted(span, key=first.tolist().__getitem__)
    slots = x.new_empty(t * k, x.shape[1])
    flat_w = weights.reshape(-1)
    for e, ew in cache.fetch(layer, needed, [span[e][1] for e in needed]):
        s, c = span[e]
        sl = order[s : s + c]
        tok = sl // k
        # float32 routing weights (DeepSeek; Mixtral's reference scales in float32) multiply in float32
        # and round once, as transformers
        slots[sl] = (expert_fn(x[tok], ew.tensors) * flat_w[sl, None]).to(slots.dtype)
    slots = slots.view(t, k, -1)
    out = slots[:, 0].clone()
    for j in range(1, k):
        out += slots[:, j]
    return out


def batched_swiglu_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    layer: int,
    cache: ExpertCache,
) -> torch.Tensor:
    """:func:`streamed_experts` for SwiGLU experts, computed as one batched matmul chain.

    The layer's experts are fetched (all of them before any compute), stacked into
    ``gate``/``up`` [n, I, H] and ``down`` [n, H, I] in ascending expert id, and each
    expert's tokens are laid out in a zero-padded [n, m, H] block (``m`` = most tokens any
    one expert got), so the whole layer is three ``torch.bmm`` launches instead of a
    chain per expert. Each expert's result depends only on its weights, its tokens and
    the shapes -- (n, m), fixed by the routing -- never on which tier an expert came from,
    so every cache budget gives the same bits on one device. The weighted outputs fill
    slots [T, K, H], summed over k = 0..K-1 in routing order as in :func:`streamed_experts`.
    (Its bits differ from the per-expert chain's: the GPU path uses this one for every
    budget, ``all`` included.)

    Args:
        x: [T, H]; weights: [T, K] (x's dtype or float32); idx: [T, K] int64.
        layer: the cache key's layer; cache: where experts come from.

    Returns:
        [T, H] in x's dtype.
    """
    t, k = idx.shape
    slots = batched_swiglu_slots(x, weights, idx, layer, cache).view(t, k, -1)
    out = slots[:, 0].clone()
    for j in range(1, k):
        out += slots[:, j]
    return out


def batched_swiglu_slots(
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    layer: int,
    cache: ExpertCache,
    owned: set[int] | None = None,
) -> torch.Tensor:
    """The weighted slot outputs [T*K, H] of :func:`batched_swiglu_experts`, before the sum.

    Slot ``t*K + k`` holds ``weights[t, k] * expert_{idx[t, k]}(x[t])`` in x's dtype. With
    ``owned`` (expert parallelism), only those experts are fetched; the others enter the
    batched matmuls as zero weights, so the shapes (n, m) -- and with them every owned
    slot's bits -- are those of the whole layer on one device; the other slots hold zeros.
    """
    t, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, ascending id
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    n_e = experts.numel()
    rows = torch.repeat_interleave(torch.arange(n_e, device=flat.device), counts)  # each sorted slot's expert row
    # first routing position of each distinct expert: the smallest slot index in its group
    firstpos = torch.full((n_e,), t * k, dtype=torch.int64, device=flat.device)
    firstpos = firstpos.scatter_reduce(0, rows, order, reduce="amin", include_self=True)
    meta = torch.cat([experts, counts, firstpos]).tolist()  # one device -> host sync for the layer
    ids, cnt, fpos = meta[:n_e], meta[n_e : 2 * n_e], meta[2 * n_e :]
    needed = [ids[i] for i in sorted(range(n_e), key=fpos.__getitem__)]  # order of first use
    if owned is not None:
        needed = [e for e in needed if e in owned]
    row_of = {e: i for i, e in enumerate(ids)}
    got: dict[int, dict[str, torch.Tensor]] = {}
    for e, ew in cache.fetch(layer, needed, [cnt[row_of[e]] for e in needed]):
        got[e] = ew.tensors  # the dict stays alive here even if the cache evicts the expert
    slots = x.new_zeros(t * k, x.shape[1]) if owned is not None else x.new_empty(t * k, x.shape[1])
    if not got:
        return slots
    ref = next(iter(got.values()))
    zero = {role: torch.zeros_like(ref[role]) for role in ("gate", "up", "down")} if len(got) < n_e else None
    gate = torch.stack([got.get(e, zero)["gate"] for e in ids])
    up = torch.stack([got.get(e, zero)["up"] for e in ids])
    down = torch.stack([got.get(e, zero)["down"] for e in ids])
    m = max(cnt)
    starts = torch.cumsum(counts, 0) - counts
    cols = torch.arange(t * k, device=flat.device) - starts[rows]
    xin = x.new_zeros(n_e, m, x.shape[1])
    xin[rows, cols] = x[order // k]
    h = F.silu(torch.bmm(xin, gate.transpose(1, 2))) * torch.bmm(xin, up.transpose(1, 2))
    y = torch.bmm(h, down.transpose(1, 2))[rows, cols]  # [T*K, H], slots in sorted order
    slots[order] = (y * weights.reshape(-1)[order, None]).to(slots.dtype)
    return slots


def keep_top_experts(
    weights: torch.Tensor, idx: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each token's ``k`` highest-weight routed experts (``--max-active-experts``).

    Args:
        weights: [T, K] routing weights; idx: [T, K] expert indices (K > k >= 1).
        k: experts to keep per token.
        renormalize: whether the family renormalizes its top-k weights; if so the kept
            weights are rescaled (in float32) to sum to what the full top-k's weights
            summed (which also keeps any routed scaling factor); if not they are kept as
            they are, as the family would weigh them.

    Returns:
        ``(weights [T, k] in weights.dtype, idx [T, k] int64)``, the kept slots in their
        routing order. This changes the model's output: it is an approximation the user
        opts into.
    """
    pos = torch.topk(weights.float(), k, dim=-1).indices.sort(dim=-1).values  # routing order kept
    kept_w, kept_i = torch.gather(weights, 1, pos), torch.gather(idx, 1, pos)
    if renormalize:
        w = kept_w.float()
        kept_w = (w * (weights.float().sum(-1, keepdim=True) / w.sum(-1, keepdim=True))).to(weights.dtype)
    return kept_w, kept_i


class StreamedMoE(nn.Module):
    """A MoE block whose router is resident and whose routed experts stream through the cache.

    Args:
        hidden: model width H; num_experts: E.
        layer: layer index; router: maps router logits [T, E] to (weights, indices).
        cache: the expert cache (set before the first forward; see :meth:`attach`).
        expert_fn: one expert's computation.
        renormalize: whether the family renormalizes its top-k weights (``norm_topk_prob``
            and the like), so that keeping fewer experts (``--max-active-experts``)
            renormalizes the kept ones the same way.

    Attribute ``max_active`` (default 0: the model's own routing, exact) keeps at most that
    many experts per token (:func:`keep_top_experts`); set by ``engine.load``. Attribute
    ``batched`` (set by ``engine.load`` on a GPU, for SwiGLU experts) computes the layer's
    experts with :func:`batched_swiglu_experts`. Attribute ``parallel`` (set by ``engine.load``
    under torchrun) computes this rank's experts and gathers the others'
    (:class:`moestream.parallel.ExpertParallel`), with the bits of :func:`streamed_experts`.

    The router's weight is ``gate.weight`` [E, H], the name transformers uses.
    """

    def __init__(
        self, hidden: int, num_experts: int, layer: int, router: Router, expert_fn: ExpertFn = swiglu_expert,
        renormalize: bool = False,
    ):
        super().__init__()
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.layer = layer
        self.router = router
        self.expert_fn = expert_fn
        self.cache: ExpertCache | None = None
        self.max_active = 0
        self.batched = False  # set by engine.load on a GPU: one batched matmul chain per layer
        self.parallel = None  # set by engine.load under torchrun: a moestream.parallel.ExpertParallel

    def attach(self, cache: ExpertCache) -> None:
        self.cache = cache

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

        Routes ``x`` (:meth:`route`), keeps the ``--max-active-experts`` best, records the
        trace, lets the prefetcher plan the next layers, then runs the experts on
        ``expert_input`` (default ``x``; Kimi K3's latent experts take a projection of it).
        Families that add shared experts or scale the sum call this from their ``forward``.
        """
        weights, idx = self.route(x)
        if 0 < self.max_active < idx.shape[1]:
            weights, idx = keep_top_experts(weights, idx, self.max_active, self.renormalize)
        trace = getattr(self.cache, "trace", None)
        if trace is not None:
            trace.route(self.layer, idx, x)
        pf = getattr(self.cache, "prefetcher", None)
        if pf is not None:  # --prefetch-ahead: read the next layers' likely experts while this one computes
            pf.plan(self.layer, x)
        inp = x if expert_input is None else expert_input
        if self.parallel is not None:  # expert parallel: owned experts here, the rest from the other ranks
            return self.parallel(inp, weights, idx, self.layer, self.cache, self.expert_fn,
                                 batched=self.batched and self.expert_fn is swiglu_expert)
        if self.batched and self.expert_fn is swiglu_expert:
            return batched_swiglu_experts(inp, weights, idx, self.layer, self.cache)
        return streamed_experts(inp, weights, idx, self.layer, self.cache, self.expert_fn)


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
    scores = logits.float().sigmoid()
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
        return F.linear(x.float(), self.weight.float())
