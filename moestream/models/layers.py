"""Layers shared by the model families: RMSNorm, attention with a KV cache, the dense SwiGLU
MLP and the pre-norm decoder layer (rotary embeddings are in :mod:`moestream.models.rope`).

Activations are 2-D ``[T, hidden]`` tensors for one sequence of ``T`` tokens. The math follows
the transformers reference implementations named in each docstring; the arithmetic is
:mod:`moestream.models.ops`' (on the CPU moestream's compiled kernels, whose bits depend only on
the values they combine).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, InputError
from ..quant import native
from . import ops
from .moe import StreamedMoE, softmax_topk
from .ops import attention_mask
from .rope import apply_rotary


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), as transformers' ``Qwen3MoeRMSNorm``.

    Normalizes in float32, casts back to the input dtype, then scales by ``weight`` [dim].
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.fused = None  # the same function in one GPU launch (moestream.fused_moe.rms_norm), set by the engine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.is_cuda:
            return self.fused(x, self.weight, self.eps)
        return ops.rms_norm(x, self.weight, self.eps)


class KVCache:
    """Keys and values of one sequence for every attention layer.

    Each layer holds ``k`` and ``v`` of shape [kv_heads, capacity, head_dim]; capacity
    grows (doubling) as tokens are appended. ``length`` is the tokens cached so far.
    """

    def __init__(self, num_layers: int, capacity: int = 256, storage: KVStorage | None = None):
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.capacity = capacity
        self.length = 0
        self.storage = storage  # preallocated tensors leased from a KVPool (the same for successive requests)
        self.version = 0  # counts changes of the layers' tensors (a static decode step's graphs are per tensors)

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` [kv_heads, T, head_dim] at positions ``start..start+T``.

        Returns the layer's keys and values for positions ``0..start+T``.
        """
        end = start + k.shape[1]
        entry = self._room(layer, end, k, v, k.shape[0], v.shape[0], k.shape[2], v.shape[2], keep=start)
        entry[0][:, start:end] = k
        entry[1][:, start:end] = v
        return entry[0][:, :end], entry[1][:, :end]

    def attention_mask(self, start: int, t: int, window: int | None, device) -> torch.Tensor | None:
        """The mask of :func:`attention_mask` for the keys :meth:`update` returned (a static decode
        cache, :mod:`moestream.decode_graph`, computes it on the device instead)."""
        return attention_mask(start, t, window, device)

    def reserve(self, layer: int, end: int, like: torch.Tensor, kv_heads: int, head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value storage [kv_heads, capacity, head_dim] with room for positions ``0..end``
        (grown as :meth:`update` grows it; ``like`` gives the dtype and device): for a kernel that writes into it."""
        return self._room(layer, end, like, like, kv_heads, kv_heads, head_dim, head_dim)

    def _room(self, layer: int, end: int, k_like: torch.Tensor, v_like: torch.Tensor, k_heads: int, v_heads: int,
              k_dim: int, v_dim: int, keep: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value storage with room for positions ``0..end``: leased from the pool on first
        use, else grown (the capacity doubled past the need, at least twice the old one), a grown one keeping
        its first ``keep`` positions (None: all of them). ``version`` counts each change of the tensors."""
        entry = self.layers[layer]
        if entry is None and self.storage is not None:
            entry = self.storage.tensors(layer, k_heads, k_dim, v_dim, k_like, end)
            if entry is not None:
                self.layers[layer] = entry
                self.version += 1
        if entry is None or entry[0].shape[1] < end:
            self.version += 1
            cap = max(self.capacity, end)
            while cap < end:
                cap *= 2
            if entry is not None:
                cap = max(cap, 2 * entry[0].shape[1])
            nk = k_like.new_empty(k_heads, cap, k_dim)
            nv = v_like.new_empty(v_heads, cap, v_dim)
            n = 0 if entry is None else entry[0].shape[1] if keep is None else keep
            if n:
                nk[:, :n] = entry[0][:, :n]
                nv[:, :n] = entry[1][:, :n]
            entry = self.layers[layer] = (nk, nv)
        return entry

    def attend(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store ``k``, ``v`` [kv_heads, T, head_dim] at positions ``start..start+T`` (:meth:`update`), then
        attention of ``q`` [heads, T, head_dim] over the positions each query sees (:func:`ops.attend`):
        [heads, T, head_dim] in q's dtype."""
        keys, values = self.update(layer, start, k, v)
        return ops.attend(q, keys, values, start, scale, window, sinks)

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in filter(None, self.layers))


class KVStorage:
    """One set of a :class:`KVPool`'s KV tensors, leased to one :class:`KVCache` at a time
    (:meth:`KVPool.new_cache`): set :attr:`index` of the pool's stacked tensors, layer by layer."""

    def __init__(self, pool: KVPool, index: int):
        self.pool, self.index = pool, index

    def tensors(self, layer: int, kv_heads: int, dk: int, dv: int, like: torch.Tensor, end: int):
        """The layer's (keys [kv_heads, capacity, dk], values [kv_heads, capacity, dv]) in ``like``'s dtype and
        device (views of the pool's stacks), or None when ``end`` positions do not fit (the cache then allocates
        its own, as without a pool)."""
        if end > self.pool.capacity:
            return None
        keys, values = self.pool.stack(layer, kv_heads, dk, dv, like)
        return keys[self.index], values[self.index]


class KVPool:
    """KV storage kept for the engine's life and reused by successive requests, so that a decode step
    captured as a CUDA graph over one cache's tensors replays for the next request's cache
    (:class:`moestream.decode_graph.DecodeRunner` keys its graphs by the tensors).

    ``capacity``: positions per set (the engine's context tokens); ``sets``: sets at most (caches alive at once
    beyond that allocate their own tensors, as without a pool). A layer's sets are one stacked tensor pair
    [sets, kv_heads, capacity, d], made at the layer's first use, so that one batched decode step reads every
    running sequence's keys from one tensor (its set by index: :meth:`set_of`). A set is leased by
    :meth:`new_cache` and comes back when that cache is garbage.
    """

    def __init__(self, capacity: int, sets: int = 2):
        self.capacity, self.max_sets = capacity, sets
        self._free: list[KVStorage] = []
        self._stacks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.made = 0  # storage sets leased out so far (at most ``sets``)
        self.leases = 0  # caches that got a set
        self.version = 0  # counts new stacked tensors (a batched step's graphs are per tensors)

    def new_cache(self, num_layers: int, capacity: int, cls: type | None = None) -> KVCache:
        """A :class:`KVCache` (or ``cls``) whose layers take a free storage set's tensors (when one is free or
        another may be made)."""
        storage = None
        if self._free:
            storage = self._free.pop()
        elif self.made < self.max_sets:
            storage = KVStorage(self, self.made)
            self.made += 1
        kv = (cls or KVCache)(num_layers, capacity)
        if storage is not None:
            kv.storage = storage
            self.leases += 1
            weakref.finalize(kv, self._free.append, storage)
        return kv

    def stack(self, layer: int, kv_heads: int, dk: int, dv: int, like: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s stacked (keys [sets, kv_heads, capacity, dk], values [.., dv]) in ``like``'s dtype and
        device, made at its first use (and again, as new tensors, if asked for other shapes)."""
        got = self._stacks.get(layer)
        want = ((self.max_sets, kv_heads, self.capacity, dk), (self.max_sets, kv_heads, self.capacity, dv),
                like.dtype, like.device)
        if got is None or (got[0].shape, got[1].shape, got[0].dtype, got[0].device) != want:
            got = (like.new_empty(want[0]), like.new_empty(want[1]))
            self._stacks[layer] = got
            self.version += 1
        return got

    def stacked(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s stacked tensors as :meth:`stack` made them.

        Raises:
            KeyError: the layer has none yet."""
        return self._stacks[layer]

    def set_of(self, kv: KVCache) -> int | None:
        """The set whose tensors every attention layer of ``kv`` uses (the pool's stacks, as leased), or None
        (a cache of its own, one grown past the capacity, or a layer not yet written)."""
        storage = getattr(kv, "storage", None)
        if type(kv) is not KVCache or storage is None or storage.pool is not self or not kv.layers:
            return None
        for layer, entry in enumerate(kv.layers):
            got = self._stacks.get(layer)
            if entry is None or got is None or entry[0].data_ptr() != got[0][storage.index].data_ptr() \
                    or entry[0].shape[1] != self.capacity:
                return None
        return storage.index


class AttentionProjections(nn.Module):
    """The q, k, v and o projections of grouped-query attention (``heads`` query heads sharing ``kv_heads``
    key/value heads of ``head_dim``; biases when ``bias``), its sliding ``window`` and softmax scale.

    Raises:
        ConfigError: ``heads`` not a multiple of ``kv_heads`` (``heads_name`` names the heads in the message).
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False,
                 window: int | None = None, heads_name: str = "num_attention_heads"):
        super().__init__()
        if heads % kv_heads:
            raise ConfigError(f"{heads_name} {heads} is not a multiple of num_key_value_heads {kv_heads}")
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, head_dim, window
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.scale = 1.0 / math.sqrt(head_dim)


class Attention(AttentionProjections):
    """Grouped-query attention with optional per-head q/k RMSNorm (Qwen3) and KV cache.

    As transformers' ``Qwen3MoeAttention``: q/k/v projections, per-head RMSNorm of q and
    k (before rotary), rotary embedding, softmax(q k^T / sqrt(head_dim)) v, o projection.

    Args:
        hidden: model width H; heads / kv_heads / head_dim: attention shape;
        bias: whether q/k/v/o carry biases; qk_norm_eps: eps of q/k norms, None for none;
        window: sliding-window length, None for full attention.
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        bias: bool = False,
        qk_norm_eps: float | None = None,
        window: int | None = None,
    ):
        super().__init__(hidden, heads, kv_heads, head_dim, bias, window)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # q/k norm and rotary in one GPU launch (moestream.attention_kernel.qk_norm_rope), set by the engine
        self.fused_rope = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, layer: int, start: int
    ) -> torch.Tensor:
        """x [T, H] at positions ``start..start+T`` -> [T, H]; appends this chunk's keys/values to ``kv``."""
        t = x.shape[0]
        if x.device.type == "cpu" and type(kv) is KVCache:  # the whole block in one call of the compiled kernels
            out = self._block(x, cos, sin, kv, layer, start)
            if out is not None:
                return out
        q = self.q_proj(x).view(t, self.heads, self.head_dim)
        k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        if self.fused_rope is not None and x.is_cuda:
            q, k = self.fused_rope(q, k, self.q_norm, self.k_norm, cos, sin)
            v = v.transpose(0, 1)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = kv.attend(layer, start, q, k, v, self.scale, self.window)
        return self.o_proj(out.transpose(0, 1).reshape(t, self.heads * self.head_dim))


    def _block(self, x, cos, sin, kv: KVCache, layer: int, start: int) -> torch.Tensor | None:
        """:func:`moestream.quant.native.attention_block` (the same bits as the ops one by one), or None where it
        does not apply (biases, a projection the kernels do not cover, another dtype)."""
        specs = tuple(kernel_spec(p) for p in (self.q_proj, self.k_proj, self.v_proj, self.o_proj))
        if any(sp is None for sp in specs):
            return None
        keys, values = kv.reserve(layer, start + x.shape[0], x, self.kv_heads, self.head_dim)
        qn = None if self.q_norm is None else self.q_norm.weight
        kn = None if self.k_norm is None else self.k_norm.weight
        eps = 0.0 if self.q_norm is None else self.q_norm.eps
        if self.q_norm is not None and (type(self.q_norm) is not RMSNorm or self.k_norm.eps != eps):
            return None
        return native.attention_block(x, specs, qn, kn, eps, cos, sin, keys, values, start, self.heads,
                                      self.kv_heads, self.head_dim, self.scale, self.window)


def kernel_spec(module: nn.Module):
    """A projection's kernel view (made once, kept until its weight changes): a float ``nn.Linear`` or a
    quantized one (:class:`moestream.quant.resident.QuantLinear`) without a bias; None for others."""
    if getattr(module, "bias", None) is not None:
        return None
    if isinstance(module, nn.Linear):
        return native.spec_of(module.weight, native.float_spec)
    make = getattr(module, "kernel_spec", None)
    return make() if make is not None else None


class MLP(nn.Module):
    """Dense SwiGLU MLP, ``down(silu(gate(x)) * up(x))`` (Shazeer 2020), as transformers' ``Qwen3MoeMLP``."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projs = (self.gate_proj, self.up_proj, self.down_proj)
        if x.device.type == "cpu" and all(isinstance(p, nn.Linear) and p.bias is None for p in projs):
            return ops.gated_mlp(x, *(p.weight for p in projs))  # one call of the compiled kernels
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BatchKV:
    """The KV caches of several sequences whose tokens one forward pass carries laid end to end.

    ``parts``: ``[(kv, start, n)]``, sequence j's ``n`` tokens at positions ``start..start+n`` of its own
    ``kv``, in the order their rows come. Attention layers call :meth:`attend` as on one cache; each
    sequence's queries attend over its own keys only (:meth:`KVCache.attend` per part).
    """

    def __init__(self, parts: list[tuple[KVCache, int, int]]):
        self.parts = parts
        self.lengths = [n for _, _, n in parts]
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)

    def attend(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`KVCache.attend` of every part on its rows of ``q``, ``k``, ``v`` [heads, sum n, d] (``start`` is
        each part's own); [heads, sum n, d]."""
        outs = [kv.attend(layer, s, q[:, a : a + n], k[:, a : a + n], v[:, a : a + n], scale, window, sinks)
                for (kv, s, n), a in zip(self.parts, self.offsets)]
        return torch.cat(outs, dim=1)


class HybridCache(KVCache):
    """Decode state of one sequence for a hybrid model (Qwen3-Next's Gated DeltaNet, Kimi's KDA).

    Attention layers use the inherited :meth:`KVCache.update` (tensors [n, capacity, d]
    growing by doubling). Linear-attention layers keep ``conv[layer]`` [C, kernel-1] (the
    last inputs of the short convolution, in the model dtype) and ``recurrent[layer]``
    [H, Dk, Dv] (float32), plus the number of tokens they have consumed: a recurrent
    state cannot be rewound, so a linear layer accepts only the next position.
    """

    def __init__(self, num_layers: int, capacity: int = 256):
        super().__init__(num_layers, capacity)
        self.conv: list[torch.Tensor | None] = [None] * num_layers
        self.recurrent: list[torch.Tensor | None] = [None] * num_layers
        self.consumed = [0] * num_layers

    def linear_state(self, layer: int, start: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv, recurrent) state of a linear layer before position ``start`` (None, None at 0).

        Raises:
            InputError: ``start`` is not the next position of that layer's state.
        """
        if start != self.consumed[layer]:
            raise InputError(
                f"layer {layer} is a linear-attention layer holding the state after {self.consumed[layer]} tokens; "
                f"it cannot continue at position {start} (a recurrent state cannot be rewound)"
            )
        return self.conv[layer], self.recurrent[layer]

    def set_linear_state(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor, end: int) -> None:
        self.conv[layer], self.recurrent[layer], self.consumed[layer] = conv, recurrent, end

    @property
    def nbytes(self) -> int:
        states = [t for t in self.conv + self.recurrent if t is not None]
        return super().nbytes + sum(t.numel() * t.element_size() for t in states)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``.

    The two norms are ``norm(hidden, eps)`` (``input_layernorm``, ``post_attention_layernorm``);
    ``mlp_name`` is the checkpoint's name of the feed-forward block (``mlp``, or Mixtral's
    ``block_sparse_moe``); ``rope_key`` picks this layer's cos/sin when the model's rotary
    embedding returns one per layer type (:class:`~moestream.models.rope.PerTypeRope`).
    """

    def __init__(self, hidden: int, eps: float, attn: nn.Module, mlp: nn.Module, mlp_name: str = "mlp",
                 rope_key: str | None = None, norm: type[nn.Module] = RMSNorm):
        super().__init__()
        self.input_layernorm = norm(hidden, eps)
        self.self_attn = attn
        self.post_attention_layernorm = norm(hidden, eps)
        self.mlp_name, self.rope_key = mlp_name, rope_key
        setattr(self, mlp_name, mlp)

    def forward(self, h: torch.Tensor, cos, sin, kv: KVCache, i: int, start: int) -> torch.Tensor:
        if h.device.type == "cpu" and type(kv) is KVCache:  # the whole layer in one call of the compiled kernels
            out = self._compiled(h, cos, sin, kv, i, start)
            if out is not None:
                return out
        if self.rope_key is not None:
            cos, sin = cos[self.rope_key], sin[self.rope_key]
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, i, start)
        return h + getattr(self, self.mlp_name)(self.post_attention_layernorm(h))

    def _compiled(self, h: torch.Tensor, cos, sin, kv: KVCache, i: int, start: int) -> torch.Tensor | None:
        """This layer through :func:`moestream.quant.native.decoder_layer` (the same bits as :meth:`forward`'s
        ops one by one), or None where it does not apply (:meth:`compiled_call`). A routed expert the cache does not
        hold stops the call after routing; the pipeline then fetches and computes the experts from there."""
        call = self.compiled_call(h, cos, sin, kv, i, start)
        if call is None:
            return None
        return self.finish_compiled(call, native.run_layer(call))

    def compiled_call(self, h: torch.Tensor, cos, sin, kv: KVCache, i: int, start: int) -> native.LayerCall | None:
        """The :class:`moestream.quant.native.LayerCall` of this layer on ``h`` [T, H] (its KV cache storage
        reserved), or None where the compiled layer does not apply: a layer that is not norm, attention, norm and
        softmax-routed streamed experts on the kernels, or an expert pipeline that does more than compute cached
        experts (:meth:`moestream.pipeline.ExpertPipeline.native_table`). ``cos``/``sin`` as :meth:`forward`
        takes them."""
        if h.device.type != "cpu" or type(kv) is not KVCache or h.dim() != 2:
            return None
        plan = self._plan
        if plan is False:
            return None
        if plan is None or not plan.still(self):
            plan = self._plan = _LayerPlan.of(self) or False
            if plan is False:
                return None
        if self.rope_key is not None:
            cos, sin = cos[self.rope_key], sin[self.rope_key]
        mlp = plan.mlp
        table = mlp.pipeline.native_table(mlp, plan.args.k, h.shape[0]) if mlp.pipeline is not None else None
        if table is None or h.dtype != plan.args.dt or cos.dtype != h.dtype or sin.dtype != h.dtype \
                or not (cos.is_contiguous() and sin.is_contiguous()) or table.act != plan.args.act \
                or table.params != plan.args.params:
            return None
        attn = self.self_attn
        keys, values = kv.reserve(i, start + h.shape[0], h, attn.kv_heads, attn.head_dim)
        if keys.dtype != h.dtype or keys.stride(2) != 1 or keys.stride() != values.stride():
            return None
        call = native.layer_call(h, plan.args, cos, sin, keys, values, start, table.c)
        if call is not None:
            call.owner = self
        return call

    def finish_compiled(self, call: native.LayerCall, status: int) -> torch.Tensor:
        """The layer's output after its compiled call returned ``status``: 0, its experts counted in the cache;
        1, the pipeline's experts on the call's routing added to h1."""
        mlp = self._plan.mlp
        if status == 0:
            mlp.pipeline.record_compiled(mlp.layer, *call.hits())
            return call.ho
        # a routed expert not cached: the pipeline fetches and computes from the routing
        return call.ho + mlp.pipeline(mlp, call.x2, call.weights, call.idx)

    _plan = None  # the compiled layer's arguments (_LayerPlan), False where it does not apply


class _LayerPlan:
    """A :class:`DecoderLayer`'s arguments for the compiled decoder layer, made once (kept while its projections'
    kernel views and norms stay the same objects)."""

    def __init__(self, mlp, args: native.LayerArgs, parts: tuple):
        self.mlp, self.args, self.parts = mlp, args, parts

    @staticmethod
    def _parts(layer: DecoderLayer) -> tuple:
        """What the plan's C arrays were made of: the modules, the router, the norms' eps and the softmax scale,
        and the storage address of every tensor they point into (the projections' parameters, the norms'
        weights). A replaced module, parameter, storage (``weight.data = ...``) or setting makes a new plan; a
        change in place is read where it lies."""
        ms = layer._modules
        attn, mlp = ms["self_attn"], ms[layer.mlp_name]
        n1, n2 = ms["input_layernorm"], ms["post_attention_layernorm"]
        am = attn._modules
        qn, kn = am.get("q_norm"), am.get("k_norm")
        mods = (am.get("q_proj"), am.get("k_proj"), am.get("v_proj"), am.get("o_proj"), mlp._modules.get("gate"),
                n1, n2, qn, kn)
        ptrs = tuple(t.data_ptr() for m in mods if m is not None for t in m._parameters.values() if t is not None)
        return (attn, mlp, *mods, getattr(mlp, "router", None), n1.eps, n2.eps, attn.scale, attn.window,
                None if qn is None else qn.eps, None if kn is None else kn.eps, ptrs)

    def still(self, layer: DecoderLayer) -> bool:
        """Whether ``layer``'s parts are those this plan was made of."""
        return self._parts(layer) == self.parts

    @classmethod
    def of(cls, layer: DecoderLayer) -> _LayerPlan | None:
        """The plan of ``layer``, or None when the compiled decoder layer does not compute it."""
        attn, mlp = layer.self_attn, getattr(layer, layer.mlp_name)
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        if type(attn) is not Attention or type(mlp) is not StreamedMoE or type(n1) is not RMSNorm \
                or type(n2) is not RMSNorm or n1.eps != n2.eps or n1.weight.dtype != n2.weight.dtype \
                or n1.weight.device.type != "cpu":
            return None
        router = mlp.router
        kw = getattr(router, "keywords", None)
        if getattr(router, "func", None) is not softmax_topk or getattr(router, "args", ()) or kw is None \
                or set(kw) != {"top_k", "norm_topk_prob"}:
            return None
        if attn.q_norm is not None and (type(attn.q_norm) is not RMSNorm or type(attn.k_norm) is not RMSNorm
                                        or attn.q_norm.eps != attn.k_norm.eps):
            return None
        parts = cls._parts(layer)
        specs = tuple(kernel_spec(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        gate = kernel_spec(mlp.gate)
        if any(sp is None for sp in specs) or gate is None or gate.out != mlp.num_experts:
            return None
        dt = n1.weight.dtype
        qn = None if attn.q_norm is None else attn.q_norm.weight
        kn = None if attn.k_norm is None else attn.k_norm.weight
        if any(w is not None and (w.dtype != dt or not w.is_contiguous()) for w in (qn, kn)) \
                or not (n1.weight.is_contiguous() and n2.weight.is_contiguous()):
            return None
        kernel = mlp.pipeline.kernels.get(mlp.layer) if mlp.pipeline is not None else None
        act, params = getattr(kernel, "act", "silu"), getattr(kernel, "params", (1.0, float("nan")))
        args = native.LayerArgs(specs, gate, n1.weight, n2.weight, n1.eps, qn, kn,
                                0.0 if attn.q_norm is None else attn.q_norm.eps, attn.heads, attn.kv_heads,
                                attn.head_dim, attn.scale, attn.window, kw["top_k"], bool(kw["norm_topk_prob"]),
                                act, params)
        return cls(mlp, args, parts)


STACK_TOKENS = 16  # calls of at most this many tokens run the compiled layers in one call (run_layers)


def run_layers(layers: list, h: torch.Tensor, cos, sin, kv: KVCache, start: int) -> torch.Tensor:
    """The decoder ``layers`` (each called as ``layer(h, cos, sin, kv, i, start)``) on ``h`` [T, H]: on the CPU,
    for up to :data:`STACK_TOKENS` tokens, the consecutive layers the compiled decoder layer covers go in one call
    (:func:`moestream.quant.native.decoder_stack`, no return to Python between them), the same bits as layer by
    layer; a longer chunk calls them one layer at a time. A layer that stops after
    routing (an expert to read) is finished by its pipeline and the stack goes on after it; the others run
    their own forward."""
    i, n = 0, len(layers)
    # a few tokens (decode): the layers in one call; a prefill chunk layer by layer (a call of a chunk through every
    # layer would hold off Ctrl-C for seconds, and Python's share of a chunk is small)
    stack = h.device.type == "cpu" and type(kv) is KVCache and h.shape[0] <= STACK_TOKENS
    while i < n:
        calls: list[native.LayerCall] = []
        x = h
        for j in range(i, n if stack else i):
            layer = layers[j]
            call = layer.compiled_call(x, cos, sin, kv, j, start) if type(layer) is DecoderLayer else None
            if call is None:
                break
            calls.append(call)
            x = call.ho
        if not calls:
            h = layers[i](h, cos, sin, kv, i, start)
            i += 1
            continue
        done, stopped = native.decoder_stack(calls) if len(calls) > 1 else (lambda s: (1 - s, bool(s)))(
            native.run_layer(calls[0]))
        for call in calls[:done]:
            call.owner.finish_compiled(call, 0)
        h = calls[done].owner.finish_compiled(calls[done], 1) if stopped else calls[done - 1].ho
        i += done + (1 if stopped else 0)
    return h
