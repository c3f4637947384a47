"""Dense linears on the GPU (Triton) whose bits for a row depend only on that row.

cuBLAS picks its GEMM kernel (tile sizes, split-K, the reduction order) by the number of rows in the call,
so a token's q/k/v/o projections, router and LM head computed alone (a decode step of one sequence) and among other
sequences' tokens (a batched step, a prefill chunk) give other low bits. This kernel fixes the order by
the weight's shape alone (the norms' per-row kernel is :func:`moestream.fused_moe.rms_norm`):

- :func:`linear` ``x [M, K] @ w[N, K]^T (+ b)``: a program per tile of :data:`BLOCK_M` rows x
  :data:`BLOCK_N` outputs over a range of ``K`` in steps of :data:`BLOCK_K`, float32 accumulation through
  ``tl.dot``; every row count, one token included, runs the same tile, and a row's products never meet
  another row's. The ``K`` range is cut into ``split`` parts chosen from ``(N, K)`` only
  (:func:`splits`: enough programs for a decode step's GEMV to fill the GPU); each part's float32 sums are
  then added in part order by a second launch, with the bias, and rounded once to the input's dtype.

So a row's output depends on its own values and the model's shapes, never on how many rows share the call
or which tile they fall in. Under Triton's interpreter (``TRITON_INTERPRET=1``) the kernels run on CPU
tensors, which is how the CPU tests check them against float64.
"""

from __future__ import annotations

import torch

from .fused_moe import interpreted, tl, triton

BLOCK_M = 16  # rows of a tile: the tensor cores' smallest; a decode step's one row pads to it
BLOCK_N = 64  # outputs of a tile
BLOCK_K = 128  # inputs per step of the reduction
TARGET_PROGRAMS = 256  # programs a one-row call should give (about two per SM of an H100/H200), fixed: not the device's
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run on ``device``: Triton on a CUDA device, or the interpreter (any device)."""
    return triton is not None and (interpreted() or torch.device(device).type == "cuda")


def splits(n: int, k: int) -> tuple[int, int]:
    """``(split, blocks_per_split)`` of a weight [n, k]: the parts its reduction is cut into and the
    :data:`BLOCK_K` steps of each. Chosen from the weight's shape alone, so that every call on this weight
    (any number of rows) adds the same partial sums in the same order."""
    kb = triton.cdiv(k, BLOCK_K)
    want = max(1, TARGET_PROGRAMS // triton.cdiv(n, BLOCK_N))
    per = triton.cdiv(kb, min(want, kb))
    return triton.cdiv(kb, per), per


if triton is not None:

    @triton.jit
    def _linear_part(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sys_, sym, per,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                     FINAL: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
        # one tile's float32 sum over K blocks [s * per, (s + 1) * per): FINAL writes y (bias, rounding),
        # else the part's sums to the float32 partials at y_ptr + s * sys_
        pn, pm, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        mm, mn = rm < M, rn < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(s * per, (s + 1) * per):
            kk = kb * BK + rk
            mk = kk < K
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + kk[None, :], mask=mm[:, None] & mk[None, :],
                        other=0.0)
            w = tl.load(w_ptr + rn[None, :].to(tl.int64) * swn + kk[:, None], mask=mn[None, :] & mk[:, None],
                        other=0.0)
            if UPCAST:  # the interpreter's tl.dot mistakes 16-bit floats
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=PREC)
            else:
                acc = tl.dot(x, w, acc, input_precision=PREC)
        out = y_ptr + s * sys_ + rm[:, None].to(tl.int64) * sym + rn[None, :]
        if FINAL:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])
        else:
            tl.store(out, acc, mask=mm[:, None] & mn[None, :])

    @triton.jit
    def _linear_sum(p_ptr, b_ptr, y_ptr, M, N, split, sps, spm, sym,
                    BN: tl.constexpr, HAS_BIAS: tl.constexpr):
        # one row's outputs [BN]: the parts' float32 sums added in part order, the bias, one rounding
        m, pn = tl.program_id(0), tl.program_id(1)
        rn = pn * BN + tl.arange(0, BN)
        mn = rn < N
        acc = tl.zeros((BN,), dtype=tl.float32)
        for s in range(0, split):
            acc += tl.load(p_ptr + s * sps + m.to(tl.int64) * spm + rn, mask=mn, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=mn, other=0.0).to(tl.float32)
        tl.store(y_ptr + m.to(tl.int64) * sym + rn, acc.to(y_ptr.dtype.element_ty), mask=mn)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` with a row's bits independent of the rows beside it (module docstring).

    Args:
        x: [..., K] bf16, fp16 or float32 on the kernels' device, unit stride along K.
        weight: [N, K] of x's dtype, unit stride along K; bias: [N] or None.

    Returns:
        [..., N] in x's dtype (float32 accumulation, one rounding), or None when the operands do not fit
        the kernel (another dtype, a strided weight, an empty input): the caller runs ``F.linear``.
    """
    if (not available(x.device) or x.dtype not in _DTYPES or weight.dtype != x.dtype or weight.dim() != 2
            or weight.stride(1) != 1 or x.shape[-1] != weight.shape[1] or x.numel() == 0
            or (bias is not None and (bias.dim() != 1 or bias.stride(0) != 1))):
        return None
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split, per = splits(n, k)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    up = interpreted() and x.dtype != torch.float32
    has_b = bias is not None
    b = bias if has_b else y
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M), split)
    common = dict(BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, HAS_BIAS=has_b, PREC=prec, UPCAST=up, num_warps=4,
                  num_stages=3)
    if split == 1:
        _linear_part[grid](x2, weight, b, y, m, n, k, x2.stride(0), weight.stride(0), 0, y.stride(0), per,
                           FINAL=True, **common)
    else:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        _linear_part[grid](x2, weight, b, part, m, n, k, x2.stride(0), weight.stride(0), part.stride(0),
                           part.stride(1), per, FINAL=False, **common)
        _linear_sum[(m, triton.cdiv(n, 256))](part, b, y, m, n, split, part.stride(0), part.stride(1), y.stride(0),
                                              BN=256, HAS_BIAS=has_b, num_warps=4)
    return y.view(*x.shape[:-1], n)
