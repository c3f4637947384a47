"""The GPU dense linear (moestream.dense_kernel) under Triton's interpreter on the CPU, and on a GPU at the
real widths of Qwen3-30B-A3B: against float64, and a row's bits the same alone, among other rows, in any
tile and row count."""

import pytest
import torch

from moestream import dense_kernel as dk
from moestream import fused_moe as fm

CUDA = torch.cuda.is_available()
interpreted = pytest.mark.skipif(fm.triton is None or not fm.interpreted(),
                                 reason="needs Triton's interpreter (pip install triton; TRITON_INTERPRET=1)")


def gpu(test):
    """A GPU test: the ``gpu`` mark, skipped without CUDA and Triton."""
    skip = pytest.mark.skipif(not CUDA or fm.triton is None, reason="needs a CUDA GPU and Triton")
    return pytest.mark.gpu(skip(test))


def _operands(m, n, k, dtype, device, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def _check(x, w, b, tol):
    y = dk.linear(x, w, b)
    assert y is not None and y.shape == (*x.shape[:-1], w.shape[0]) and y.dtype == x.dtype
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    err = float((y.double() - ref).abs().max() / ref.abs().max())
    assert err < tol, err
    return y


def _rows_invariant(x, w, b):
    """Each row's bits: whole call, alone, and in calls of other row counts and offsets (other tiles)."""
    whole = dk.linear(x, w, b)
    m = x.shape[0]
    for i in sorted({0, 1, m // 2, m - 1}):
        assert torch.equal(dk.linear(x[i : i + 1], w, b), whole[i : i + 1]), f"row {i} alone"
    for a, c in ((1, 8), (3, m), (0, 17)):
        c = min(c, m)
        assert torch.equal(dk.linear(x[a:c], w, b), whole[a:c]), f"rows {a}..{c}"


@interpreted
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("m,n,k,bias", [(1, 70, 200, False), (19, 130, 384, True), (33, 64, 128, False)])
def test_against_float64_under_the_interpreter(dtype, tol, m, n, k, bias):
    """Odd output counts (a partial last tile), inputs that end inside a K step, a bias, one row and several
    tiles of rows; split and unsplit (``splits`` cuts every one of these K ranges)."""
    x, w, b = _operands(m, n, k, dtype, "cpu", m + n + k, bias)
    _check(x, w, b, tol)


@interpreted
def test_a_row_has_its_bits_whatever_shares_the_call_under_the_interpreter():
    x, w, b = _operands(21, 90, 300, torch.bfloat16, "cpu", 3, bias=True)
    assert dk.splits(90, 300)[0] > 1  # the two-launch form, whose part order must hold too
    _rows_invariant(x, w, b)


def test_the_split_depends_on_the_weight_alone():
    """The reduction's cut is a function of (N, K): every part holds whole K steps, the parts cover K once,
    and a one-row GEMV of the real shapes gets enough programs (or all of K's steps) to fill the GPU."""
    if fm.triton is None:
        pytest.skip("needs Triton")
    for n, k in ((4096, 2048), (512, 2048), (2048, 4096), (128, 2048), (151936, 2048), (70, 200)):
        split, per = dk.splits(n, k)
        steps = -(-k // dk.BLOCK_K)
        assert (split - 1) * per < steps <= split * per
        tiles = -(-n // dk.BLOCK_N)
        assert tiles * split >= min(dk.TARGET_PROGRAMS, tiles * steps) // 2


def test_operands_the_kernel_does_not_take_are_left_to_the_caller():
    x, w, _ = _operands(2, 8, 16, torch.float32, "cpu", 0)
    if not dk.available("cpu"):
        assert dk.linear(x, w) is None
        return
    assert dk.linear(x, w.to(torch.float16)) is None  # mixed dtypes
    assert dk.linear(x, w.t().contiguous().t()) is None  # strided weight
    assert dk.linear(x.to(torch.int32), w.to(torch.int32)) is None


@gpu
@pytest.mark.parametrize("n,k", [(4096, 2048), (512, 2048), (2048, 4096), (128, 2048), (151936, 2048)])
def test_real_widths_on_the_gpu(n, k):
    """Qwen3-30B-A3B's q, k/v, o, router and LM head: against float64 (bf16 one rounding) and each row's bits
    alone, in a decode step of 8 sequences, in prefill chunks of 7 and 512 rows."""
    x, w, _ = _operands(512, n, k, torch.bfloat16, "cuda", n + k)
    whole = _check(x, w, None, 1e-2)
    for i in (0, 5, 511):
        assert torch.equal(dk.linear(x[i : i + 1], w), whole[i : i + 1]), i
    assert torch.equal(dk.linear(x[:8], w), whole[:8])
    assert torch.equal(dk.linear(x[100:107], w), whole[100:107])


@gpu
def test_float32_and_bias_on_the_gpu():
    x, w, b = _operands(40, 300, 1000, torch.float32, "cuda", 9, bias=True)
    _check(x, w, b, 1e-6)
    _rows_invariant(x, w, b)
