"""The GPU attention kernel (moestream.attention_kernel) under Triton's interpreter: against float64, and
its bits independent of what a query does not see -- the cache's capacity, what lies past the written
positions, how many queries share the call, the prefill chunk, a device or host position, one pass or
split. The same on a GPU at real shapes: test_gpu_attention.py."""

import pytest
import torch

from moestream import attention_kernel as ak
from moestream import fused_moe as fm

pytestmark = pytest.mark.skipif(fm.triton is None or not fm.interpreted(),
                                reason="needs Triton's interpreter (pip install triton; TRITON_INTERPRET=1)")


def tensors(hq, hkv, d, cap, dtype, g, t=1):
    q = torch.randn(hq, t, d, generator=g).to(dtype)
    k = torch.randn(hkv, cap, d, generator=g).to(dtype)
    v = torch.randn(hkv, cap, d, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("hq,hkv,d,window,sinks", [(4, 2, 16, None, False), (6, 2, 24, 50, False),
                                                  (4, 4, 16, None, True), (8, 2, 16, 70, True)])
def test_against_float64(dtype, tol, hq, hkv, d, window, sinks):
    """Grouped-query heads (odd head sizes, a group of 3), a window, sinks; a prefill chunk starting past 0
    and spanning block edges, and one decode query; every output element written."""
    g = torch.Generator().manual_seed(hq * 100 + d)
    q, k, v = tensors(hq, hkv, d, 200, dtype, g, t=90)
    s = torch.randn(hq, generator=g) if sinks else None
    for start, t in ((60, 90), (0, 1), (130, 1), (0, 70)):
        out = ak.attention(q[:, :t], k, v, start, 0.3, window, s)
        assert out.shape == (hq, t, d) and out.dtype == dtype and not torch.isnan(out).any()
        ref = ak.reference(q[:, :t], k, v, start, 0.3, window, s)
        assert float((out.double() - ref).norm() / ref.norm()) < tol, (start, t)


@pytest.mark.parametrize("window,sinks", [(None, False), (40, True)])
def test_a_query_has_the_same_bits_whatever_it_does_not_see(window, sinks):
    """One prompt's rows: prefilled whole, in chunks of 1, 7 and 64 tokens, decoded one by one (host or device
    position, one pass or split), over caches of other capacities whose unwritten positions hold NaN: the
    same bits for every row."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, n = 4, 2, 16, 140
    q, k, v = tensors(hq, hkv, d, n, torch.bfloat16, g, t=n)
    s = torch.randn(hq, generator=g) if sinks else None
    whole = ak.attention(q, k, v, 0, 0.25, window, s)
    for chunk in (1, 7, 64):
        for a in range(0, n, chunk):
            if chunk == 1 and a % 9:
                continue  # a sample of single steps (the interpreter is slow)
            b = min(n, a + chunk)
            for cap in (b, 256):
                kk = torch.full((hkv, cap, d), float("nan"), dtype=torch.bfloat16)
                vv = kk.clone()
                kk[:, :b], vv[:, :b] = k[:, :b], v[:, :b]
                got = ak.attention(q[:, a:b], kk, vv, a, 0.25, window, s)
                assert torch.equal(got, whole[:, a:b]), (chunk, a, cap)
                if b - a == 1:
                    pos = torch.tensor([a])
                    assert torch.equal(ak.attention(q[:, a:b], kk, vv, 0, 0.25, window, s, pos=pos), got)
                    assert torch.equal(ak.attention(q[:, a:b], kk, vv, a, 0.25, window, s, split=False), got)


@pytest.mark.parametrize("window,sinks", [(None, False), (40, True)])
def test_a_batched_decode_step_gives_each_sequence_its_solo_bits(window, sinks):
    """attention_batch: four sequences at different positions over sets of one stacked store (in any order,
    one set unused, NaN past every written position) give each the bits of its own decode step alone
    (:func:`attention` with a device position over its set), and agree with float64."""
    g = torch.Generator().manual_seed(11)
    hq, hkv, d, cap, n = 8, 2, 16, 160, 5
    keys = torch.full((n, hkv, cap, d), float("nan"), dtype=torch.bfloat16)
    values = keys.clone()
    sets, positions = [3, 0, 4, 1], [0, 63, 64, 150]
    q = torch.randn(hq, len(sets), d, generator=g).to(torch.bfloat16)
    for st, p in zip(sets, positions):
        keys[st, :, : p + 1] = torch.randn(hkv, p + 1, d, generator=g).to(torch.bfloat16)
        values[st, :, : p + 1] = torch.randn(hkv, p + 1, d, generator=g).to(torch.bfloat16)
    s = torch.randn(hq, generator=g) if sinks else None
    got = ak.attention_batch(q, keys, values, torch.tensor(sets), torch.tensor(positions), 0.25, window, s)
    assert got.shape == (hq, len(sets), d)
    for b, (st, p) in enumerate(zip(sets, positions)):
        solo = ak.attention(q[:, b : b + 1], keys[st], values[st], 0, 0.25, window, s, pos=torch.tensor([p]))
        assert torch.equal(got[:, b : b + 1], solo), b
        ref = ak.reference(q[:, b : b + 1], keys[st], values[st], p, 0.25, window, s)
        assert float((got[:, b : b + 1].double() - ref).norm() / ref.norm()) < 1e-2, b


def test_reads_the_cache_in_place_with_its_strides():
    """q as the model hands it (a transposed view), keys and values as views of a larger cache; the result is
    a [Hq, T, D] view of [T, Hq, D] memory."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(9, 8, 16, generator=g).transpose(0, 1)  # [8 heads, 9 tokens, 16]
    cache = torch.randn(2, 300, 16, generator=g)
    k, v = cache[:, :50], torch.randn(2, 300, 16, generator=g)[:, :50]
    out = ak.attention(q, k, v, 41, 0.25)
    assert out.shape == (8, 9, 16) and out.transpose(0, 1).is_contiguous()
    torch.testing.assert_close(out.double(), ak.reference(q, k, v, 41, 0.25), rtol=1e-5, atol=1e-6)
    # a prefill chunk with its start on the device (a captured chunk) over the caches' whole capacity: the same
    # bits, split into key blocks or in one pass (positions past 50 hold anything: never read)
    vals = torch.cat([v, torch.full((2, 250, 16), float("nan"))], 1)
    keys = torch.cat([k, torch.full((2, 250, 16), float("nan"))], 1)
    for split in (False, True):
        got = ak.attention(q, keys, vals, 0, 0.25, pos=torch.tensor([41]), split=split)
        assert torch.equal(got, out)


def test_ops_attend_takes_the_kernel_off_the_cpu(monkeypatch):
    """ops.attend's non-CPU branch calls the kernel (on the GPU; here its branch taken with the CPU kernels
    declined)."""
    from moestream.models import ops

    calls = []
    monkeypatch.setattr(ops, "_cpu", lambda x: False)
    monkeypatch.setattr(ak, "attention", lambda *a, **kw: calls.append(a) or "kernel")
    q, k, v = tensors(4, 2, 16, 10, torch.float32, torch.Generator().manual_seed(0))
    assert ops.attend(q, k, v, 3, 0.5) == "kernel" and len(calls) == 1


@pytest.mark.parametrize("dtype,norm", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_qk_norm_rope_is_the_norm_then_the_rotation(dtype, norm):
    """The one-launch q/k RMSNorm + rotary: the model's composition (per-head RMSNorm, then the half-split
    rotation) computed in float32 and rounded once; a token's row the same alone or among others."""
    from moestream.models.layers import RMSNorm
    from moestream.models.rope import apply_rotary, make_rope

    g = torch.Generator().manual_seed(3)
    t, hq, hk, d = 5, 4, 2, 16
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hk, d, generator=g).to(dtype)
    qn, kn = RMSNorm(d, 1e-6), RMSNorm(d, 1e-5)
    for n in (qn, kn):
        n.weight.data = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    cos, sin = make_rope(d, 10000.0)(torch.arange(40, 40 + t), dtype)
    got_q, got_k = ak.qk_norm_rope(q, k, qn if norm else None, kn if norm else None, cos, sin)
    want_q = apply_rotary((qn(q) if norm else q).transpose(0, 1).float(), cos.float(), sin.float())
    want_k = apply_rotary((kn(k) if norm else k).transpose(0, 1).float(), cos.float(), sin.float())
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)  # a few bf16 steps
    torch.testing.assert_close(got_q.float(), want_q, **tol)
    torch.testing.assert_close(got_k.float(), want_k, **tol)
    one_q, one_k = ak.qk_norm_rope(q[2:3], k[2:3], qn if norm else None, kn if norm else None, cos[2:3], sin[2:3])
    assert torch.equal(one_q, got_q[:, 2:3]) and torch.equal(one_k, got_k[:, 2:3])
