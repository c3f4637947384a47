"""The fused MoE kernel (Triton): a layer's routed SwiGLU experts computed in place from their
VRAM slots.

For ``T`` tokens routed to ``K`` experts each (expert ids ``idx`` [T, K], routing weights
``weights`` [T, K]) and a layer's slot table (expert -> slot, int32 [E], on the device), the
experts' weights are read where the VRAM slot pool keeps them (``gate``/``up`` [S, I, H],
``down`` [S, H, I], strided views of one byte pool, :class:`moestream.tiered_cache.SlotPool`)
and

    out[t] = sum_{k = 0..K-1} weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t),  e = idx[t, k]

is computed with no host work, no ``torch.stack`` and no atomics:

- **few tokens** (``T * K <= ROWS_MAX``, decode): two launches. One program per (slot,
  block of I) computes gate and up as float32 dot products over H and writes
  ``silu(g) * u`` (float32); one program per (token, block of H) runs the down projection of
  each of the token's K experts in routing order, multiplies by the routing weight and adds
  them up in float32, k = 0 first, rounding once to the compute dtype. The expert id -> slot
  lookup happens inside the kernels.
- **many tokens** (prefill): vLLM's ``fused_moe`` scheme (arXiv 2309.06180's serving stack;
  the code here is written from its description): the ``T*K`` slots are grouped by expert into
  blocks of ``BLOCK_M`` rows of one expert (on the device: a stable sort and prefix sums of a
  fixed size, so no host sync), a fixed grid of at most ``ceil(T*K / BLOCK_M) + min(E, T*K)``
  blocks (the ones past the end exit at once), and three launches: gate/up with ``tl.dot``
  (float32 accumulation) and SiLU, written in the compute dtype; down with ``tl.dot`` times the
  routing weight (float32, per slot); the sum over k in routing order.

Determinism: each output element is written by exactly one program with a fixed loop order,
and the block shapes depend only on ``(T, K, E, H, I, dtype)``. So the bits depend only on
the inputs, the routing and the shapes -- never on which slot an expert sits in, which tier it
came from, or which other experts share a block. Source of the math: Qwen3-MoE's expert,
``down(silu(gate x) * up x)`` (transformers' ``Qwen3MoeMLP``), Shazeer 2020 (GLU variants).

On a machine without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
set before this module is imported), which is how the CPU tests check their logic.
"""

import os

import torch

try:  # Triton ships with CUDA builds of PyTorch; the CPU wheel has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None

ROWS_MAX = 64  # T*K up to this: the two-launch row path (decode); beyond: the blocked tl.dot path


def interpreted() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``): kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device | str) -> bool:
    """Whether the fused kernel can run on ``device``: Triton is importable and the device is a
    CUDA GPU, or the interpreter is on (any device)."""
    if triton is None:
        return False
    return interpreted() or torch.device(device).type == "cuda"


if triton is not None:
    # Loop extents (K, H, I) are run-time arguments on the GPU (one compiled kernel for every top-k):
    # the JIT reads this annotation's object, None. Triton's interpreter reads the annotation's text,
    # "constexpr", and makes them compile-time constants, which it needs (it cannot loop to a run-time
    # bound under NumPy 2.4). No ``from __future__ import annotations`` in this module.
    constexpr = tl.constexpr if interpreted() else None

    @triton.jit
    def _gate_up_rows(x_ptr, idx_ptr, table_ptr, wg_ptr, wu_ptr, h_ptr, K: constexpr, H: constexpr, NI: constexpr,
                      sx, sws, swn, sh, BN: tl.constexpr, BK: tl.constexpr):
        # one program: routing slot s = t*K + k, gate/up output features n in [nb*BN, nb*BN + BN)
        s = tl.program_id(0)
        nb = tl.program_id(1)
        t = s // K
        e = tl.load(idx_ptr + s)
        slot = tl.load(table_ptr + e).to(tl.int64)
        n = nb * BN + tl.arange(0, BN)
        nmask = n < NI
        accg = tl.zeros([BN], dtype=tl.float32)
        accu = tl.zeros([BN], dtype=tl.float32)
        wrow = slot * sws + n[:, None].to(tl.int64) * swn
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < H
            xv = tl.load(x_ptr + t * sx + kk, mask=km, other=0.0).to(tl.float32)
            m2 = nmask[:, None] & km[None, :]
            g = tl.load(wg_ptr + wrow + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            u = tl.load(wu_ptr + wrow + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            accg += tl.sum(g * xv[None, :], axis=1)
            accu += tl.sum(u * xv[None, :], axis=1)
        h = accg / (1.0 + tl.exp(-accg)) * accu
        tl.store(h_ptr + s * sh + n, h, mask=nmask)

    @triton.jit
    def _down_sum_rows(h_ptr, w_ptr, idx_ptr, table_ptr, wd_ptr, out_ptr, K: constexpr, H: constexpr, NI: constexpr,
                       sh, sds, sdn, so, BN: tl.constexpr, BK: tl.constexpr):
        # one program: token t, output features n in [nb*BN, nb*BN + BN), its K experts in routing order
        t = tl.program_id(0)
        nb = tl.program_id(1)
        n = nb * BN + tl.arange(0, BN)
        nmask = n < H
        out = tl.zeros([BN], dtype=tl.float32)
        for j in range(0, K):
            s = t * K + j
            e = tl.load(idx_ptr + s)
            slot = tl.load(table_ptr + e).to(tl.int64)
            wt = tl.load(w_ptr + s).to(tl.float32)
            drow = slot * sds + n[:, None].to(tl.int64) * sdn
            acc = tl.zeros([BN], dtype=tl.float32)
            for i0 in range(0, NI, BK):
                ii = i0 + tl.arange(0, BK)
                im = ii < NI
                hv = tl.load(h_ptr + s * sh + ii, mask=im, other=0.0)
                d = tl.load(wd_ptr + drow + ii[None, :], mask=nmask[:, None] & im[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(d * hv[None, :], axis=1)
            out += acc * wt
        tl.store(out_ptr + t * so + n, out.to(out_ptr.dtype.element_ty), mask=nmask)

    @triton.jit
    def _gate_up_blocks(x_ptr, rows_ptr, bexp_ptr, table_ptr, wg_ptr, wu_ptr, h_ptr, K: constexpr, TK, E,
                        H: constexpr, NI: constexpr,
                        sx, sws, swn, sh, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        PREC: tl.constexpr, UPCAST: tl.constexpr):
        # one program: a block of BM routing slots of one expert, gate/up features [nb*BN, nb*BN + BN)
        b = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(bexp_ptr + b)
        if e >= E:  # past the last block of this routing
            return
        slot = tl.load(table_ptr + e).to(tl.int64)
        rows = tl.load(rows_ptr + b * BM + tl.arange(0, BM))
        rmask = rows < TK
        tok = (rows // K).to(tl.int64)
        n = nb * BN + tl.arange(0, BN)
        nmask = n < NI
        accg = tl.zeros([BM, BN], dtype=tl.float32)
        accu = tl.zeros([BM, BN], dtype=tl.float32)
        wcol = slot * sws + n[None, :].to(tl.int64) * swn
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < H
            a = tl.load(x_ptr + tok[:, None] * sx + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            m2 = km[:, None] & nmask[None, :]
            g = tl.load(wg_ptr + wcol + kk[:, None], mask=m2, other=0.0)
            u = tl.load(wu_ptr + wcol + kk[:, None], mask=m2, other=0.0)
            if UPCAST:  # the interpreter's tl.dot mistakes 16-bit floats
                a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
            accg = tl.dot(a, g, accg, input_precision=PREC)
            accu = tl.dot(a, u, accu, input_precision=PREC)
        h = accg / (1.0 + tl.exp(-accg)) * accu
        tl.store(h_ptr + rows[:, None].to(tl.int64) * sh + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=rmask[:, None] & nmask[None, :])

    @triton.jit
    def _down_blocks(h_ptr, w_ptr, rows_ptr, bexp_ptr, table_ptr, wd_ptr, y_ptr, TK, E, H: constexpr, NI: constexpr,
                     sh, sds, sdn, sy, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     PREC: tl.constexpr, UPCAST: tl.constexpr):
        # one program: a block of BM routing slots of one expert, output features [nb*BN, nb*BN + BN)
        b = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(bexp_ptr + b)
        if e >= E:
            return
        slot = tl.load(table_ptr + e).to(tl.int64)
        rows = tl.load(rows_ptr + b * BM + tl.arange(0, BM))
        rmask = rows < TK
        r64 = rows.to(tl.int64)
        n = nb * BN + tl.arange(0, BN)
        nmask = n < H
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        dcol = slot * sds + n[None, :].to(tl.int64) * sdn
        for i0 in range(0, NI, BK):
            ii = i0 + tl.arange(0, BK)
            im = ii < NI
            a = tl.load(h_ptr + r64[:, None] * sh + ii[None, :], mask=rmask[:, None] & im[None, :], other=0.0)
            d = tl.load(wd_ptr + dcol + ii[:, None], mask=im[:, None] & nmask[None, :], other=0.0)
            if UPCAST:
                a, d = a.to(tl.float32), d.to(tl.float32)
            acc = tl.dot(a, d, acc, input_precision=PREC)
        wt = tl.load(w_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + r64[:, None] * sy + n[None, :], acc * wt[:, None], mask=rmask[:, None] & nmask[None, :])

    @triton.jit
    def _sum_k(y_ptr, out_ptr, K: constexpr, H: constexpr, sy, so, BN: tl.constexpr):
        # one program: token t, features [nb*BN, nb*BN + BN): sum over k = 0..K-1 in routing order
        t = tl.program_id(0)
        nb = tl.program_id(1)
        n = nb * BN + tl.arange(0, BN)
        nmask = n < H
        acc = tl.zeros([BN], dtype=tl.float32)
        for j in range(0, K):
            acc += tl.load(y_ptr + (t * K + j).to(tl.int64) * sy + n, mask=nmask, other=0.0)
        tl.store(out_ptr + t.to(tl.int64) * so + n, acc.to(out_ptr.dtype.element_ty), mask=nmask)


    @triton.jit
    def _rms_norm(x_ptr, w_ptr, out_ptr, D: constexpr, sx, so, eps, BD: tl.constexpr):
        # one program: one row; as RMSNorm.forward: float32 norm, rounded to x's dtype, times the weight
        r = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BD)
        m = d < D
        x = tl.load(x_ptr + r * sx + d, mask=m, other=0.0).to(tl.float32)
        h = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * so + d, (w * h).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`moestream.models.layers.RMSNorm`'s function in one launch: ``weight * (x * rsqrt(mean(x^2) + eps))``
    over the last dimension, the norm in float32 and rounded to x's dtype before the weight multiplies
    (as transformers' ``Qwen3MoeRMSNorm``). ``x`` [..., D], ``weight`` [D]; the result in the promoted dtype
    of the two. The reduction order is Triton's, so the low bits may differ from PyTorch's; the same
    for every budget (the GPU uses this one everywhere once chosen)."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        bd = triton.next_power_of_2(d)
        _rms_norm[(x2.shape[0],)](x2, weight, out, d, x2.stride(0), out.stride(0), eps, BD=bd,
                                  num_warps=max(1, min(8, bd // 256)))
    return out.view(x.shape)


def block_m(t: int, k: int, e: int) -> int:
    """Rows per block of the blocked path, from the shapes only: 16, 32 or 64 by the mean slots per expert."""
    mean = t * k / max(1, min(e, t * k))
    return 16 if mean <= 24 else 32 if mean <= 48 else 64


def align_blocks(flat: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group routing slots into blocks of ``bm`` rows of one expert, on the device, with no host sync.

    Args:
        flat: int64 [T*K] expert ids in routing order (slot ``s = t*K + k``).
        num_experts: E (ids are in ``[0, E)``); bm: rows per block.

    Returns:
        ``rows`` int32 [B*bm]: each block's slot positions, ascending within an expert
        (``T*K`` marks padding); ``block_expert`` int32 [B]: the expert of each block, ``E``
        for the blocks past the end. ``B = ceil(T*K / bm) + min(E, T*K)``, a bound that
        depends only on the shapes, so the grid is fixed.
    """
    tk = flat.numel()
    dev = flat.device
    nblocks = -(-tk // bm) + min(num_experts, tk)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.index_add_(0, flat, torch.ones_like(flat))  # integer counts: exact whatever the order
    blocks = (counts + bm - 1) // bm
    block_end = torch.cumsum(blocks, 0)
    first_row = (block_end - blocks) * bm  # where each expert's first block starts, in rows
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, ascending within one
    sorted_e = flat[order]
    run_start = torch.cumsum(counts, 0) - counts
    dest = first_row[sorted_e] + torch.arange(tk, device=dev) - run_start[sorted_e]
    rows = torch.full((nblocks * bm,), tk, dtype=torch.int32, device=dev)
    rows[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_end, torch.arange(nblocks, device=dev), right=True)
    return rows, block_expert.to(torch.int32)


def _rows_config(h: int, i: int) -> tuple[int, int, int, int]:
    """(BN, BK) of the gate/up row kernel and of the down row kernel: wide loads along the
    contiguous dimension, enough programs to fill the GPU for one token."""
    return 16, min(256, triton.next_power_of_2(h)), 8, min(1024, triton.next_power_of_2(i))


def fused_moe(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, table: torch.Tensor,
              gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """A layer's routed SwiGLU experts from their slots, summed over k in routing order.

    Args:
        x: [T, H] expert input (bf16, fp16 or fp32), last dimension contiguous.
        weights: [T, K] routing weights (float32 or x's dtype); multiplied in float32.
        idx: [T, K] int64 (or int32) expert ids in routing order.
        table: int32 [E] on x's device: expert -> slot; every id in ``idx`` must map to a slot
            that holds that expert (the pipeline fetches the layer's experts first).
        gate, up: [S, I, H]; down: [S, H, I]: the slot pool's views (any slot stride; the last
            two dimensions contiguous), x's dtype.
        out: optional [T, H] output buffer in x's dtype.

    Returns:
        [T, H] in x's dtype: ``sum_k weights[t, k] * down(silu(gate x_t) * up x_t)``, accumulated
        in float32 over k = 0..K-1 and rounded once.

    Raises:
        RuntimeError: when Triton is missing (see :func:`available`).
    """
    if triton is None:
        raise RuntimeError("the fused MoE kernel needs Triton (pip install triton), which this PyTorch lacks")
    t, h = x.shape
    k = idx.shape[1]
    s_, i_, h2 = gate.shape
    if h2 != h or tuple(down.shape[1:]) != (h, i_) or tuple(up.shape) != tuple(gate.shape):
        raise ValueError(f"expert shapes gate {list(gate.shape)}, up {list(up.shape)}, down {list(down.shape)} "
                         f"do not fit the input's width {h}")
    for w in (gate, up, down):
        if w.stride(-1) != 1 or w.stride(-2) != w.shape[-1]:
            raise ValueError("expert views must be contiguous in their last two dimensions")
    if out is None:
        out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    flat = idx.reshape(-1)
    wflat = weights.reshape(-1)
    tk = t * k
    if tk <= ROWS_MAX:
        bn1, bk1, bn2, bk2 = _rows_config(h, i_)
        hbuf = torch.empty(tk, i_, dtype=torch.float32, device=x.device)
        _gate_up_rows[(tk, triton.cdiv(i_, bn1))](
            x, flat, table, gate, up, hbuf, k, h, i_, x.stride(0), gate.stride(0), gate.stride(1), hbuf.stride(0),
            BN=bn1, BK=bk1, num_warps=4)
        _down_sum_rows[(t, triton.cdiv(h, bn2))](
            hbuf, wflat, flat, table, down, out, k, h, i_, hbuf.stride(0), down.stride(0), down.stride(1),
            out.stride(0), BN=bn2, BK=bk2, num_warps=4)
        return out
    e = table.numel()
    bm = block_m(t, k, e)
    rows, bexp = align_blocks(flat.to(torch.int64), e, bm)
    nblocks = bexp.numel()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    up16 = interpreted() and x.dtype != torch.float32
    bn, bk = 64, 64
    hbuf = torch.empty(tk, i_, dtype=x.dtype, device=x.device)
    _gate_up_blocks[(nblocks, triton.cdiv(i_, bn))](
        x, rows, bexp, table, gate, up, hbuf, k, tk, e, h, i_, x.stride(0), gate.stride(0), gate.stride(1),
        hbuf.stride(0), BM=bm, BN=bn, BK=bk, PREC=prec, UPCAST=up16, num_warps=4, num_stages=3)
    y = torch.empty(tk, h, dtype=torch.float32, device=x.device)
    _down_blocks[(nblocks, triton.cdiv(h, bn))](
        hbuf, wflat, rows, bexp, table, down, y, tk, e, h, i_, hbuf.stride(0), down.stride(0), down.stride(1),
        y.stride(0), BM=bm, BN=bn, BK=bk, PREC=prec, UPCAST=up16, num_warps=4, num_stages=3)
    _sum_k[(t, triton.cdiv(h, 128))](y, out, k, h, y.stride(0), out.stride(0), BN=128, num_warps=4)
    return out


def reference_moe(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, experts: dict[int, dict]) -> torch.Tensor:
    """The same function in float64 on the CPU, expert by expert (the tests' independent reference).

    ``experts``: id -> {"gate" [I, H], "up" [I, H], "down" [H, I]}. Returns [T, H] float64.
    """
    xd = x.double().cpu()
    out = torch.zeros(xd.shape, dtype=torch.float64)
    for t in range(xd.shape[0]):
        for j in range(idx.shape[1]):
            w = experts[int(idx[t, j])]
            g = w["gate"].double().cpu() @ xd[t]
            u = w["up"].double().cpu() @ xd[t]
            out[t] += float(weights[t, j]) * (w["down"].double().cpu() @ (torch.nn.functional.silu(g) * u))
    return out
