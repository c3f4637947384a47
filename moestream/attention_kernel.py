"""Attention on the GPU (Triton) whose bits depend only on a query and the keys it sees.

``attention(q, keys, values, start, scale, window, sinks)``: causal softmax attention of ``T`` queries at
positions ``start..start+T-1`` over a KV cache read in place (``keys`` [Hkv, S, D], ``values`` [Hkv, S, Dv]
as the cache holds them: no repeat per query head, no float32 copy), grouped-query (the ``Hq / Hkv`` query
heads of a key head share its loads), with a sliding window and gpt-oss's sink logits. The position being
decoded may be a device tensor (``pos``), so a CUDA graph replays one step at every position.

**The reduction order is fixed by position.** Keys go in blocks of :data:`BLOCK_N` positions aligned to
absolute position 0 (block ``b`` holds positions ``64 b .. 64 b + 63``). For each block, a query's partial
softmax state is computed on its own -- the block's maximum ``m_b`` (of the scaled logits, base 2), ``l_b =
sum_j 2^(s_j - m_b)`` and ``acc_b = sum_j 2^(s_j - m_b) v_j`` (``l_b`` and ``acc_b`` by the tensor cores from
the same rounded weights) -- and the blocks are merged into the running state in block order, starting
from the empty state (or the sink: ``m = sink``, ``l = 1``)::

    m' = max(m, m_b);  l' = l c + l_b c_b;  acc' = acc c + acc_b c_b;  c = 2^(m - m'), c_b = 2^(m_b - m')

(``c`` is exactly 1 where ``m`` is the maximum, and an empty block is an exact no-op). Positions a query
does not see (later ones, those beyond the window, those not yet written) enter as logit ``-inf``, weight
exactly 0: they never reach a sum. So a query's output depends only on its own values, the keys and values
it sees and the model's shapes (heads, head size, dtype): never on the capacity of the cache, on how many
queries share the call (a prefill chunk or one decode step) or on which of them share a tile.

Two ways to run it, with the same bits: **one pass** (a program per tile of queries loops over the blocks)
for a prefill chunk, and **split** for one tile of queries (a decode step): a program per block writes its
partial state (float32, exact), then a second launch merges them in block order. Both compute a block by
the same code (:func:`_partial`) and merge by the same code (:func:`_merge`), with explicit fused
multiply-adds, so the compiler has no contraction left to choose.

A tile is :data:`BLOCK_M` rows: ``Hq / Hkv`` heads of one key head (at most 64) times as many consecutive
queries as fit. Under Triton's interpreter (``TRITON_INTERPRET=1``) the kernels run on CPU tensors, which is
how the CPU tests check them against float64.
"""

from __future__ import annotations

import torch

from .fused_moe import interpreted, tl, triton

BLOCK_M = 64  # rows of a tile: (query, head) pairs
BLOCK_N = 64  # key positions per block: the unit of the reduction, aligned to position 0
LOG2E = 1.4426950408889634


def available(device: torch.device | str) -> bool:
    """Whether the kernel can run on ``device``: Triton on a CUDA device, or the interpreter (any device)."""
    return triton is not None and (interpreted() or torch.device(device).type == "cuda")


if triton is not None:

    @triton.jit
    def _partial(q, k_ptr, v_ptr, b, qpos, kv_len, sk1, sv1, qk_scale, window,
                 D: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
        # block b's softmax state for every row of the tile: (max [BM], sum of weights [BM], weighted values
        # [BM, BDV]); k_ptr / v_ptr point at the tile's key head
        kpos = b * BN + tl.arange(0, BN)
        kin = kpos < kv_len  # written positions (the rest may hold anything: never loaded)
        dd = tl.arange(0, BD)
        kt = tl.load(k_ptr + kpos[None, :].to(tl.int64) * sk1 + dd[:, None],
                     mask=kin[None, :] & (dd[:, None] < D), other=0.0)
        if UPCAST:  # the interpreter's tl.dot mistakes 16-bit floats
            s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision=PREC)
        else:
            s = tl.dot(q, kt, input_precision=PREC)
        s = s * qk_scale
        vis = kin[None, :] & (kpos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            vis = vis & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
        mb = tl.max(s, axis=1)
        ms = tl.where(mb == float("-inf"), 0.0, mb)
        p = tl.exp2(s - ms[:, None])  # 0 exactly where not seen
        dv = tl.arange(0, BDV)
        v = tl.load(v_ptr + kpos[:, None].to(tl.int64) * sv1 + dv[None, :],
                    mask=kin[:, None] & (dv[None, :] < DV), other=0.0)
        pv = p.to(v.dtype)  # the tensor cores' operand; the sum of weights from the same values
        ones = tl.full([BN, 16], 1.0, dtype=tl.float32).to(v.dtype)
        if UPCAST:
            pv, v, ones = pv.to(tl.float32), v.to(tl.float32), ones.to(tl.float32)
        accb = tl.dot(pv, v, input_precision=PREC)
        lb = tl.max(tl.dot(pv, ones, input_precision=PREC), axis=1)  # 16 equal columns
        return mb, lb, accb

    @triton.jit
    def _merge(m, den, acc, mb, lb, accb):
        # the running state (m, den, acc) and block b's, merged (exact no-op for a block a row does not see)
        mn = tl.maximum(m, mb)
        ms = tl.where(mn == float("-inf"), 0.0, mn)
        c = tl.where(m == mn, 1.0, tl.exp2(m - ms))
        cb = tl.where(mb == mn, 1.0, tl.exp2(mb - ms))
        den = tl.fma(den, c, lb * cb)
        acc = tl.fma(acc, c[:, None], accb * cb[:, None])
        return mn, den, acc

    @triton.jit
    def _rows(pid_h, pos_ptr, start, T, qt, G: tl.constexpr, HPT: tl.constexpr, QPT: tl.constexpr,
              NHT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, window, HAS_WINDOW: tl.constexpr,
              DEVICE_POS: tl.constexpr):
        # a tile's rows: key head, query head and query index of each, which rows are real, the first and
        # last block any of them sees
        kvh = pid_h // NHT
        r = tl.arange(0, BM)
        g = r % HPT
        tq = r // HPT
        hg = (pid_h % NHT) * HPT + g
        hq = kvh * G + hg
        if DEVICE_POS:
            start = tl.load(pos_ptr + tl.program_id(2)).to(tl.int32)  # axis 2: the sequence (batched decode)
        t = qt * QPT + tq
        valid = (tq < QPT) & (hg < G) & (t < T)
        qpos = start + t
        kv_len = start + T
        pmin = start + qt * QPT
        pmax = tl.minimum(pmin + QPT - 1, kv_len - 1)
        hi = pmax // BN
        if HAS_WINDOW:
            lo = tl.maximum(pmin - window + 1, 0) // BN
        else:
            lo = hi * 0
        return kvh, hq, t, valid, qpos, kv_len, lo, hi

    @triton.jit
    def _initial(sink_ptr, hq, valid, BM: tl.constexpr, BDV: tl.constexpr, HAS_SINKS: tl.constexpr):
        if HAS_SINKS:  # the sink's logit joins the denominator: the state of one key of value 0
            m = tl.load(sink_ptr + hq, mask=valid, other=0.0).to(tl.float32) * 1.4426950408889634
            den = tl.full([BM], 1.0, dtype=tl.float32)
        else:
            m = tl.full([BM], float("-inf"), dtype=tl.float32)
            den = tl.zeros([BM], dtype=tl.float32)
        return m, den, tl.zeros([BM, BDV], dtype=tl.float32)

    @triton.jit
    def _finish(o_ptr, hq, t, valid, den, acc, so0, so1, DV: tl.constexpr, BDV: tl.constexpr):
        o = acc / tl.where(den > 0.0, den, 1.0)[:, None]
        dv = tl.arange(0, BDV)
        tl.store(o_ptr + hq[:, None].to(tl.int64) * so0 + t[:, None].to(tl.int64) * so1 + dv[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=valid[:, None] & (dv[None, :] < DV))

    @triton.jit
    def _attn_fwd(q_ptr, k_ptr, v_ptr, o_ptr, sink_ptr, pos_ptr, pm_ptr, pacc_ptr, set_ptr,
                  start, T, sq0, sq1, sk0, sk1, sv0, sv1, so0, so1, sqb, skb, svb, sob, qk_scale, window,
                  G: tl.constexpr, HPT: tl.constexpr, QPT: tl.constexpr, NHT: tl.constexpr, D: tl.constexpr,
                  DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, DEVICE_POS: tl.constexpr,
                  SPLIT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, BATCHED: tl.constexpr):
        # one program: a tile of rows (axis 1: key head and head chunk); axis 0: the tile of queries (one
        # pass), or the block of keys whose partial state it writes (SPLIT: one tile of queries); axis 2:
        # the sequence of a batched decode step (its query, position and KV set), else 0
        pid0 = tl.program_id(0)
        pid_h = tl.program_id(1)
        if BATCHED:
            seq = tl.program_id(2)
            kset = tl.load(set_ptr + seq).to(tl.int64)
            q_ptr += seq.to(tl.int64) * sqb
            o_ptr += seq.to(tl.int64) * sob
            k_ptr += kset * skb
            v_ptr += kset * svb
            part = seq.to(tl.int64) * tl.num_programs(0) * tl.num_programs(1) * BM
            pm_ptr += part * 2
            pacc_ptr += part * BDV
        qt = 0 if SPLIT else pid0
        kvh, hq, t, valid, qpos, kv_len, lo, hi = _rows(pid_h, pos_ptr, start, T, qt, G, HPT, QPT, NHT, BM, BN,
                                                        window, HAS_WINDOW, DEVICE_POS)
        dd = tl.arange(0, BD)
        q = tl.load(q_ptr + hq[:, None].to(tl.int64) * sq0 + t[:, None].to(tl.int64) * sq1 + dd[None, :],
                    mask=valid[:, None] & (dd[None, :] < D), other=0.0)
        kp = k_ptr + kvh.to(tl.int64) * sk0
        vp = v_ptr + kvh.to(tl.int64) * sv0
        if SPLIT:
            b = pid0
            if (b >= lo) & (b <= hi):
                mb, lb, accb = _partial(q, kp, vp, b, qpos, kv_len, sk1, sv1, qk_scale, window, D, DV, BN, BD,
                                        BDV, HAS_WINDOW, PREC, UPCAST)
                r = tl.arange(0, BM)
                row = (b * tl.num_programs(1) + pid_h).to(tl.int64) * BM + r
                tl.store(pm_ptr + row * 2, mb, mask=valid)
                tl.store(pm_ptr + row * 2 + 1, lb, mask=valid)
                dv = tl.arange(0, BDV)
                tl.store(pacc_ptr + row[:, None] * BDV + dv[None, :], accb, mask=valid[:, None])
        else:
            m, den, acc = _initial(sink_ptr, hq, valid, BM, BDV, HAS_SINKS)
            for b in range(lo, hi + 1):
                mb, lb, accb = _partial(q, kp, vp, b, qpos, kv_len, sk1, sv1, qk_scale, window, D, DV, BN, BD,
                                        BDV, HAS_WINDOW, PREC, UPCAST)
                m, den, acc = _merge(m, den, acc, mb, lb, accb)
            _finish(o_ptr, hq, t, valid, den, acc, so0, so1, DV, BDV)

    @triton.jit
    def _attn_combine(o_ptr, sink_ptr, pos_ptr, pm_ptr, pacc_ptr, start, T, so0, so1, sob, nb, window,
                      G: tl.constexpr, HPT: tl.constexpr, QPT: tl.constexpr, NHT: tl.constexpr, DV: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BDV: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      HAS_SINKS: tl.constexpr, DEVICE_POS: tl.constexpr, BATCHED: tl.constexpr):
        # one program: a tile of rows; the split partial states merged in block order, as the one pass does
        # (axis 2: the sequence of a batched decode step)
        pid_h = tl.program_id(0)
        if BATCHED:
            seq = tl.program_id(2).to(tl.int64)
            o_ptr += seq * sob
            part = seq * nb * tl.num_programs(0) * BM
            pm_ptr += part * 2
            pacc_ptr += part * BDV
        kvh, hq, t, valid, qpos, kv_len, lo, hi = _rows(pid_h, pos_ptr, start, T, 0, G, HPT, QPT, NHT, BM, BN,
                                                        window, HAS_WINDOW, DEVICE_POS)
        m, den, acc = _initial(sink_ptr, hq, valid, BM, BDV, HAS_SINKS)
        r = tl.arange(0, BM)
        dv = tl.arange(0, BDV)
        for b in range(lo, hi + 1):
            row = (b * tl.num_programs(0) + pid_h).to(tl.int64) * BM + r
            mb = tl.load(pm_ptr + row * 2, mask=valid, other=float("-inf"))
            lb = tl.load(pm_ptr + row * 2 + 1, mask=valid, other=0.0)
            accb = tl.load(pacc_ptr + row[:, None] * BDV + dv[None, :], mask=valid[:, None], other=0.0)
            m, den, acc = _merge(m, den, acc, mb, lb, accb)
        _finish(o_ptr, hq, t, valid, den, acc, so0, so1, DV, BDV)


if triton is not None:

    @triton.jit
    def _qk_norm_rope(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, HQ, sqt, sqh, skt, skh, sct,
                      sot_q, sot_k, q_eps, k_eps, D: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr):
        # one program: token t, head h (query heads first, then key heads): RMSNorm over the head (rounded to
        # the dtype, as the norm's output), then the half-split rotation, in float32, rounded once
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, BD)
        m = d < D
        half = D // 2
        partner = tl.where(d < half, d + half, d - half)
        if h < HQ:
            src = q_ptr + t * sqt + h * sqh
            dst = qo_ptr + t * sot_q + h * D
            w_ptr = qw_ptr
            eps = q_eps
        else:
            src = k_ptr + t * skt + (h - HQ) * skh
            dst = ko_ptr + t * sot_k + (h - HQ) * D
            w_ptr = kw_ptr
            eps = k_eps
        x = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
        xp = tl.load(src + partner, mask=m, other=0.0).to(tl.float32)
        if NORM:
            r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + partner, mask=m, other=0.0).to(tl.float32)
            x = ((x * r).to(q_ptr.dtype.element_ty).to(tl.float32) * w).to(q_ptr.dtype.element_ty).to(tl.float32)
            xp = ((xp * r).to(q_ptr.dtype.element_ty).to(tl.float32) * wp).to(q_ptr.dtype.element_ty).to(tl.float32)
        c = tl.load(cos_ptr + t * sct + d, mask=m, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + t * sct + d, mask=m, other=0.0).to(tl.float32)
        rot = tl.where(d < half, 0.0 - xp, xp)
        tl.store(dst + d, (x * c + rot * sn).to(qo_ptr.dtype.element_ty), mask=m)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_norm, k_norm, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys as attention takes them, in one launch: each head's RMSNorm (``q_norm``/``k_norm``,
    :class:`~moestream.models.layers.RMSNorm` modules, or both None) and the rotary embedding (half-split,
    over the whole head).

    Args:
        q: [T, Hq, D], k: [T, Hkv, D] (the projections' views; the last dimension contiguous).
        cos, sin: [T, D].

    Returns:
        ``(q [Hq, T, D], k [Hkv, T, D])`` in q's dtype (views of [T, H, D] tensors): ``x * cos +
        rotate_half(x) * sin`` of the normed ``x`` (rounded to the dtype, as the norm's output), in float32
        and rounded once.
    """
    t, hq, d = q.shape
    hk = k.shape[1]
    qo = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    ko = torch.empty(t, hk, d, dtype=k.dtype, device=k.device)
    if t:
        norm = q_norm is not None
        qw = q_norm.weight if norm else qo
        kw = k_norm.weight if norm else ko
        cos, sin = cos.contiguous(), sin.contiguous()
        _qk_norm_rope[(t, hq + hk)](q, k, qw, kw, cos, sin, qo, ko, hq, q.stride(0), q.stride(1), k.stride(0),
                                    k.stride(1), cos.stride(0), qo.stride(0), ko.stride(0),
                                    float(q_norm.eps) if norm else 0.0, float(k_norm.eps) if norm else 0.0,
                                    D=d, BD=triton.next_power_of_2(d), NORM=norm, num_warps=1)
    return qo.transpose(0, 1), ko.transpose(0, 1)


def tiling(heads: int, kv_heads: int) -> tuple[int, int, int, int]:
    """(G, heads per tile, queries per tile, head tiles per key head) for ``heads`` query heads over
    ``kv_heads`` key heads: a function of the model's shapes only."""
    g = heads // kv_heads
    hpt = min(g, BLOCK_M)
    return g, hpt, BLOCK_M // hpt, -(-g // hpt)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
              window: int | None = None, sinks: torch.Tensor | None = None, *, pos: torch.Tensor | None = None,
              split: bool | None = None) -> torch.Tensor:
    """Causal softmax attention of one sequence's queries over its keys and values, read in place.

    Args:
        q: [Hq, T, D] queries at positions ``start..start+T-1`` (any strides, the last dimension contiguous).
        keys: [Hkv, S, D], values [Hkv, S, Dv]: the cache's tensors (views of it), Hq a multiple of Hkv;
            positions ``>= start + T`` are never read (they may hold anything).
        start: the first query's position; pos: instead, an int64 [1] device tensor holding it (``S`` bounds
            ``start + T``: a decode step or a prefill chunk captured once for every position; the same bits).
        scale: the logits' factor; window: each query sees only the last ``window`` positions up to its
            own, or None; sinks: [Hq] logits that join each softmax's denominator (gpt-oss), or None.
        split: run a single tile of queries as a partial state per block of keys plus a merge (default:
            when the queries fit one tile); the bits are the same either way.

    Returns:
        [Hq, T, Dv] in q's dtype (a view of a [T, Hq, Dv] tensor: ``out.transpose(0, 1).reshape(T, -1)``
        costs nothing).

    Raises:
        RuntimeError: when Triton is missing.
        ValueError: shapes that do not fit.
    """
    _check(q, keys, values)
    hq, t, d = q.shape
    out = torch.empty(t, hq, values.shape[2], dtype=q.dtype, device=q.device)
    if t == 0:
        return out.transpose(0, 1)
    qpt = tiling(hq, keys.shape[0])[2]
    if split is None:
        split = t <= qpt
    if split and t > qpt:
        raise ValueError(f"attention: split takes one tile of queries (at most {qpt}), not {t}")
    nb = triton.cdiv(keys.shape[1] if pos is not None else min(keys.shape[1], start + t), BLOCK_N)
    _launch(q, keys, values, out, start, t, scale, window, sinks, pos, None, split, nb, 1)
    return out.transpose(0, 1)


def attention_batch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sets: torch.Tensor,
                    pos: torch.Tensor, scale: float, window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of ``B`` sequences in one launch: sequence ``b``'s query attends over KV set ``sets[b]``
    up to position ``pos[b]`` (its own key already written there). Each sequence's rows are the tile, the key
    blocks and the merge of :func:`attention` with a device position over one set's ``[Hkv, S, D]`` tensors, so
    its bits are those of that sequence decoded alone over the same capacity ``S``.

    Args:
        q: [Hq, B, D] (one query per sequence; any strides, the last dimension contiguous).
        keys: [N, Hkv, S, D], values [N, Hkv, S, Dv]: ``N`` KV sets of ``S`` positions (a pool's stacked
            storage); positions past a sequence's own are never read.
        sets: int64 [B] on the device, each sequence's set; pos: int64 [B] on the device, its position.
        scale, window, sinks: as :func:`attention`.

    Returns:
        [Hq, B, Dv] in q's dtype (a view of a [B, Hq, Dv] tensor).

    Raises:
        RuntimeError: when Triton is missing.
        ValueError: shapes that do not fit.
    """
    if keys.dim() != 4 or values.dim() != 4 or sets.shape != pos.shape or sets.shape != (q.shape[1],):
        raise ValueError(f"attention_batch: q {list(q.shape)}, keys {list(keys.shape)}, values "
                         f"{list(values.shape)}, sets {list(sets.shape)}, pos {list(pos.shape)}")
    _check(q, keys[0], values[0])
    hq, b, _ = q.shape
    out = torch.empty(b, hq, values.shape[3], dtype=q.dtype, device=q.device)
    if b:
        _launch(q, keys, values, out, 0, 1, scale, window, sinks, pos, sets, True,
                triton.cdiv(keys.shape[2], BLOCK_N), b)
    return out.transpose(0, 1)


def _check(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("the attention kernel needs Triton, which this PyTorch lacks")
    hq, _, d = q.shape
    if keys.shape[2] != d or values.shape[:2] != keys.shape[:2] or hq % keys.shape[0]:
        raise ValueError(f"attention: q {list(q.shape)}, keys {list(keys.shape)}, values {list(values.shape)}")
    for x in (q, keys, values):
        if x.stride(-1) != 1:
            raise ValueError("attention: the last dimension of q, keys and values must be contiguous")


def _launch(q, keys, values, out, start, t, scale, window, sinks, pos, sets, split, nb, batch) -> None:
    """The kernels of :func:`attention` (``batch`` 1, ``keys`` [Hkv, S, D]) and :func:`attention_batch`
    (``keys`` [N, Hkv, S, D], ``sets``): ``nb`` key blocks when split."""
    hq, d, dv = q.shape[0], q.shape[2], values.shape[-1]
    batched = sets is not None
    hkv = keys.shape[-3]
    g, hpt, qpt, nht = tiling(hq, hkv)
    bd, bdv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    warps = 4 if max(bd, bdv) <= 128 else 8
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    upcast = interpreted() and q.dtype != torch.float32
    nh = hkv * nht
    dev_pos = pos is not None
    pos_arg = pos if dev_pos else out  # never read without DEVICE_POS
    sink_arg = sinks if sinks is not None else out
    set_arg = sets if batched else out
    has_window = window is not None
    common = dict(G=g, HPT=hpt, QPT=qpt, NHT=nht, BM=BLOCK_M, BN=BLOCK_N, BDV=bdv, HAS_WINDOW=has_window,
                  HAS_SINKS=sinks is not None, DEVICE_POS=dev_pos, BATCHED=batched)
    win = int(window) if has_window else 0
    qk_scale = float(scale) * LOG2E
    args = (q, keys, values, out, sink_arg, pos_arg)
    ks, vs = keys.stride(), values.stride()
    strides = (start if not dev_pos else 0, t, q.stride(0), q.stride(1), ks[-3], ks[-2], vs[-3], vs[-2],
               out.stride(1), out.stride(0), q.stride(1), ks[0] if batched else 0, vs[0] if batched else 0,
               out.stride(0), qk_scale, win)
    if not split:
        _attn_fwd[(triton.cdiv(t, qpt), nh, batch)](*args, out, out, set_arg, *strides, D=d, DV=dv, BD=bd,
                                                    SPLIT=False, PREC=prec, UPCAST=upcast, **common,
                                                    num_warps=warps, num_stages=2)
        return
    pm = torch.empty(batch, nb, nh, BLOCK_M, 2, dtype=torch.float32, device=q.device)
    pacc = torch.empty(batch, nb, nh, BLOCK_M, bdv, dtype=torch.float32, device=q.device)
    _attn_fwd[(nb, nh, batch)](*args, pm, pacc, set_arg, *strides, D=d, DV=dv, BD=bd, SPLIT=True, PREC=prec,
                               UPCAST=upcast, **common, num_warps=warps, num_stages=2)
    _attn_combine[(nh, 1, batch)](out, sink_arg, pos_arg, pm, pacc, strides[0], t, out.stride(1), out.stride(0),
                                  out.stride(0), nb, win, DV=dv, **common, num_warps=warps)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
              window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The same function in float64 on the CPU (the tests' independent reference): [Hq, T, Dv] float64."""
    hq, t, _ = q.shape
    rep = hq // keys.shape[0]
    end = start + t
    k = keys[:, :end].double().cpu().repeat_interleave(rep, 0)
    v = values[:, :end].double().cpu().repeat_interleave(rep, 0)
    logits = q.double().cpu() @ k.transpose(1, 2) * scale
    qp = torch.arange(start, end)[:, None]
    kp = torch.arange(end)[None, :]
    seen = kp <= qp
    if window is not None:
        seen &= kp > qp - window
    logits = logits.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.double().cpu()[:, None, None].expand(-1, t, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs @ v
