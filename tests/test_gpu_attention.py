"""On a CUDA GPU (``pytest -m gpu``): the attention kernel (moestream.attention_kernel) at real shapes against
float64, and its bits independent of what a query does not see: the cache's capacity, NaN past the written
positions, the prefill chunk, a decode step's device position, one pass or split. The same logic runs on
the CPU under Triton's interpreter (test_attention_kernel.py)."""

import pytest
import torch

from moestream import attention_kernel as ak
from moestream import fused_moe as fm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(fm.triton is None, reason="needs Triton")]

# (heads, kv heads, head size, window, sinks): Qwen3-30B-A3B; gpt-oss-20b's sliding layers; a group of 5
SHAPES = [(32, 4, 128, None, False), (64, 8, 64, 128, True), (40, 8, 128, None, False)]


def tensors(hq, hkv, d, cap, t, dtype, g):
    q = torch.randn(hq, t, d, generator=g, device="cuda").to(dtype)
    k = torch.randn(hkv, cap, d, generator=g, device="cuda").to(dtype)
    v = torch.randn(hkv, cap, d, generator=g, device="cuda").to(dtype)
    return q, k, v


@pytest.mark.parametrize("hq,hkv,d,window,sinks", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)])
def test_against_float64(hq, hkv, d, window, sinks, dtype, tol):
    g = torch.Generator("cuda").manual_seed(hq + d)
    q, k, v = tensors(hq, hkv, d, 1100, 512, dtype, g)
    s = torch.randn(hq, generator=g, device="cuda") if sinks else None
    for start, t in ((0, 512), (523, 512), (1000, 1), (37, 1)):
        out = ak.attention(q[:, :t], k, v, start, d ** -0.5, window, s)
        assert not torch.isnan(out).any()
        ref = ak.reference(q[:, :t], k, v, start, d ** -0.5, window, s)
        err = float((out.double().cpu() - ref).norm() / ref.norm())
        assert err < tol, (start, t, err)


@pytest.mark.parametrize("hq,hkv,d,window,sinks", SHAPES)
def test_bits_independent_of_capacity_chunk_and_position_source(hq, hkv, d, window, sinks):
    """A 300-token prompt prefilled whole; in chunks of 7 and 64; decoded one by one with the position on the
    device (the CUDA graph's form) and on the host, split and one pass; over caches of 300 and 4096 positions
    with NaN past the written ones: every row bit-identical."""
    g = torch.Generator("cuda").manual_seed(3)
    n = 300
    q, k, v = tensors(hq, hkv, d, n, n, torch.bfloat16, g)
    s = torch.randn(hq, generator=g, device="cuda") if sinks else None
    scale = d ** -0.5
    whole = ak.attention(q, k, v, 0, scale, window, s)
    caches = {}
    for cap in (n, 4096):
        kk = torch.full((hkv, cap, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        vv = kk.clone()
        kk[:, :n], vv[:, :n] = k, v
        caches[cap] = (kk, vv)
    for chunk in (7, 64):
        parts = [ak.attention(q[:, a : a + chunk], *caches[4096], a, scale, window, s) for a in range(0, n, chunk)]
        assert torch.equal(torch.cat(parts, dim=1), whole), chunk
    for a in range(0, n, 3):
        for cap, (kk, vv) in caches.items():
            # the cache as a decode step sees it: written up to a
            kv = (kk[:, : a + 1], vv[:, : a + 1]) if cap == n else (kk, vv)
            one = ak.attention(q[:, a : a + 1], *kv, a, scale, window, s)
            assert torch.equal(one, whole[:, a : a + 1]), (a, cap)
            pos = torch.tensor([a], device="cuda")
            assert torch.equal(ak.attention(q[:, a : a + 1], kk, vv, 0, scale, window, s, pos=pos), one), (a, cap)
            assert torch.equal(ak.attention(q[:, a : a + 1], *kv, a, scale, window, s, split=False), one), (a, cap)


def test_a_decode_step_replays_as_a_graph_at_every_position():
    """One graph captured at one position replays at others (the position read on the device), giving the
    eager call's bits."""
    g = torch.Generator("cuda").manual_seed(4)
    q, k, v = tensors(32, 4, 128, 2048, 1, torch.bfloat16, g)
    pos = torch.tensor([5], device="cuda")
    ak.attention(q, k, v, 0, 0.1, pos=pos)  # compiles
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = ak.attention(q, k, v, 0, 0.1, pos=pos)
    torch.cuda.current_stream().wait_stream(stream)
    for p in (0, 63, 64, 700, 2047):
        pos.fill_(p)
        graph.replay()
        assert torch.equal(out, ak.attention(q, k[:, : p + 1], v[:, : p + 1], p, 0.1)), p


def test_fused_qk_norm_rope_and_router_at_real_shapes():
    """The one-launch q/k norm + rotary and softmax top-k router (on the GPU's decode path) against the
    model's composition of PyTorch ops: to bf16 rounding; the router's experts the same."""
    from moestream.models.layers import RMSNorm
    from moestream.models.moe import softmax_topk
    from moestream.models.rope import apply_rotary, make_rope

    g = torch.Generator("cuda").manual_seed(5)
    t, hq, hk, d = 300, 32, 4, 128
    q = torch.randn(t, hq, d, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(t, hk, d, generator=g, device="cuda").to(torch.bfloat16)
    qn, kn = RMSNorm(d, 1e-6).cuda(), RMSNorm(d, 1e-6).cuda()
    for n in (qn, kn):
        n.weight.data = (1 + 0.3 * torch.randn(d, generator=g, device="cuda")).to(torch.bfloat16)
    cos, sin = make_rope(d, 1e6).cuda()(torch.arange(1000, 1000 + t, device="cuda"), torch.bfloat16)
    got_q, got_k = ak.qk_norm_rope(q, k, qn, kn, cos, sin)
    for got, x, n in ((got_q, q, qn), (got_k, k, kn)):
        want = apply_rotary(n(x).transpose(0, 1).float(), cos.float(), sin.float())
        err = float((got.float() - want).norm() / want.norm())
        assert err < 5e-3, err
    logits = torch.randn(t, 128, generator=g, device="cuda")
    w, idx = fm.softmax_topk(logits, 8, True)
    rw, ridx = softmax_topk(logits, 8, True)
    assert torch.equal(idx, ridx)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hq,hkv,d,window,sinks", SHAPES)
def test_a_batched_decode_step_gives_each_sequence_its_solo_bits(hq, hkv, d, window, sinks):
    """attention_batch at real shapes: eight sequences over sets of one stacked store of 4096 positions (NaN past
    each written one), at positions on both sides of block edges, give each the bits of its own decode step
    (attention with a device position over its set), also when captured as a graph and replayed."""
    g = torch.Generator("cuda").manual_seed(hq * d)
    n, cap = 9, 4096
    keys = torch.full((n, hkv, cap, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    values = keys.clone()
    sets = [8, 0, 3, 5, 1, 7, 2, 6]
    positions = [0, 63, 64, 127, 1000, 2047, 3001, 4095]
    for st, p in zip(sets, positions):
        keys[st, :, : p + 1] = torch.randn(hkv, p + 1, d, generator=g, device="cuda").to(torch.bfloat16)
        values[st, :, : p + 1] = torch.randn(hkv, p + 1, d, generator=g, device="cuda").to(torch.bfloat16)
    q = torch.randn(hq, len(sets), d, generator=g, device="cuda").to(torch.bfloat16)
    s = torch.randn(hq, generator=g, device="cuda") if sinks else None
    st_t, pos_t = torch.tensor(sets, device="cuda"), torch.tensor(positions, device="cuda")
    got = ak.attention_batch(q, keys, values, st_t, pos_t, d ** -0.5, window, s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = ak.attention_batch(q, keys, values, st_t, pos_t, d ** -0.5, window, s)
    graph.replay()
    torch.cuda.synchronize()
    for b, (st, p) in enumerate(zip(sets, positions)):
        solo = ak.attention(q[:, b : b + 1], keys[st], values[st], 0, d ** -0.5, window, s,
                            pos=torch.tensor([p], device="cuda"))
        assert torch.equal(got[:, b : b + 1], solo), (b, p)
        assert torch.equal(replayed[:, b : b + 1], solo), (b, p)
