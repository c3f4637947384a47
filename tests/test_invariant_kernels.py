"""The compiled CPU kernels' invariance promise (moestream.quant.native, csrc/kernels.h): a result's bits depend
only on the values it is made of -- never on the compiled path (AVX-512, AVX2, portable: one reduction), the
number of rows in the call, the thread count, where the operands lie in memory, the KV cache's capacity or
how a sequence was split into calls -- and each kernel is right against an independent float64 reference.

Every stored form the kernels read is covered at a real width (Qwen3-30B-A3B's expert, hidden 2048 and
intermediate 768) and an odd one. The paths this CPU lacks are skipped (say which in the test id); the one
this machine runs them on is in the closing notes (lscpu).
"""

import ctypes
import platform
import subprocess

import pytest
import torch
import torch.nn.functional as F

from moestream.quant import affine, fp8, ggml, mxfp4, native
from moestream.quant.formats import LinearFormat, Scheme

from .quant_helpers import fp8_quantize, mlx_quantize, mxfp4_quantize
from .test_gguf import _blocks as ggml_blocks
from .test_gguf_types import _lf as ggml_lf
from .test_quant_native import PATHS

pytestmark = pytest.mark.skipif(not native.paths(), reason="the CPU kernels are not built here")

GGML_TYPES = tuple(native.GGML_TYPES)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def stored(kind: str, out_f: int, in_f: int, seed: int = 0):
    """(pieces, LinearFormat, float64 weight [out, in]) of a random linear stored as ``kind``."""
    g = _gen(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    if kind.startswith("affine"):
        bits, group, sdt = kind.split("-")[1:]
        bits, group = int(bits), int(group)
        sdt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[sdt]
        packed, s, b, _ = mlx_quantize(w, bits, group)
        t = {"w": packed, "w.scales": s.to(sdt), "w.biases": b.to(sdt)}
        ref = affine.dequantize(packed, t["w.scales"], t["w.biases"], bits, group, torch.float64)
        return t, LinearFormat("w", Scheme("affine", bits, group), out_f, in_f), ref
    if kind == "fp8":
        q, s, _ = fp8_quantize(w, 128)
        t = {"w": q, "w.weight_scale_inv": s.bfloat16()}
        lf = LinearFormat("w", Scheme("fp8", 8, 128, (128, 128)), out_f, in_f)
        return t, lf, fp8.dequantize(q, t["w.weight_scale_inv"], (128, 128), torch.float64)
    if kind == "mxfp4":
        blocks, scales, _ = mxfp4_quantize(w)
        t = {"w": blocks, "w.scales": scales}
        return t, LinearFormat("w", Scheme("mxfp4", 4, 32), out_f, in_f), mxfp4.dequantize(blocks, scales,
                                                                                          torch.float64)
    raw = ggml_blocks(kind, out_f, in_f, seed)
    lf = ggml_lf(kind, out_f, in_f)
    return {"w": raw}, lf, ggml.dequantize(raw, kind, in_f).double()


QUANT_KINDS = ("affine-4-64-bf16", "affine-3-32-f16", "affine-8-128-f32", "affine-2-64-bf16", "affine-5-32-bf16",
               "affine-6-64-bf16", "fp8", "mxfp4") + GGML_TYPES
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def run_quant(kind_pieces, x):
    t, lf, _ = kind_pieces
    return native.linear(x, t, lf, out_dtype=torch.float32)


def on_every_path(fn) -> dict:
    """fn() on each compiled path of this build."""
    out = {}
    for p in PATHS:
        if p in native.paths():
            with native.use(p):
                out[p] = fn()
    return out


@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_every_path_gives_the_same_bits_for_stored_weights(kind):
    """AVX-512, AVX2 and portable give the same bits as each other for every stored form (the one reduction),
    at the expert's real width and an odd one, for 1, 3 and 9 tokens; and within 1e-5 of the float64 product."""
    for out_f, in_f in ((768, 2048), (40, 256)):
        pieces = stored(kind, out_f, in_f, seed=out_f)
        for n in (1, 3, 9):
            x = torch.randn(n, in_f, generator=_gen(n)).bfloat16()
            got = on_every_path(lambda pieces=pieces, x=x: run_quant(pieces, x))
            first = next(iter(got.values()))
            for p, y in got.items():
                assert torch.equal(y, first), f"{kind} [{out_f}, {in_f}] n={n}: {p} differs"
            want = x.double() @ pieces[2].t()
            assert (first.double() - want).abs().max() <= 1e-5 * want.abs().max() + 1e-30


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_every_path_gives_the_same_bits_for_float_weights(dtype):
    """Float weights (row form and input-major ``x @ W``), widths that are and are not multiples of 16, with a
    bias: the same bits on every path, within 1e-6 of the float64 product (float32 accumulation)."""
    for out_f, in_f in ((768, 2048), (2048, 768), (37, 100), (5, 17), (151, 64)):
        w = torch.randn(out_f, in_f, generator=_gen(in_f)).to(dtype)
        b = torch.randn(out_f, generator=_gen(out_f))
        for n in (1, 2, 5, 13):
            x = torch.randn(n, in_f, generator=_gen(n))
            for transposed in (False, True):
                wt = w.t().contiguous() if transposed else w
                got = on_every_path(lambda x=x, wt=wt, b=b, tr=transposed: native.float_linear(x, wt, b, transposed=tr))
                first = next(iter(got.values()))
                for p, y in got.items():
                    assert torch.equal(y, first), f"{dtype} [{out_f}, {in_f}] n={n} T={transposed}: {p}"
                want = x.double() @ w.double().t() + b.double()
                # the worst-case bound of one 16-lane chain of in/16 steps and the tree, and the bias add
                steps = -(-in_f // 16) + 5
                bound = steps * 2**-24 * (x.double().abs() @ w.double().abs().t() + b.double().abs())
                assert ((first.double() - want).abs() <= bound).all(), f"{dtype} [{out_f}, {in_f}] n={n}"


@pytest.mark.parametrize("kind", ("affine-4-64-bf16", "Q4_K", "Q6_K", "IQ2_XS", "bf16", "f32"))
def test_a_row_gives_its_bits_alone_among_others_and_on_any_thread_count(kind):
    """A token's output is the same computed alone, among 1..63 others, and with 1, 2 or 4 threads."""
    if kind in ("bf16", "f32"):
        w = torch.randn(768, 2048, generator=_gen(1)).to(torch.bfloat16 if kind == "bf16" else torch.float32)

        def f(x):
            return native.float_linear(x, w)
    else:
        pieces = stored(kind, 768, 2048, seed=2)

        def f(x):
            return run_quant(pieces, x)
    x = torch.randn(64, 2048, generator=_gen(3)).bfloat16()
    threads = torch.get_num_threads()
    try:
        results = []
        for nt in (1, 2, 4):
            torch.set_num_threads(nt)
            results.append(f(x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])
    for a, b in ((0, 1), (5, 6), (63, 64), (3, 10), (0, 2), (1, 9)):
        assert torch.equal(f(x[a:b]), results[0][a:b]), f"{kind} rows {a}:{b}"


@pytest.mark.parametrize("kind", ("affine-4-64-bf16", "Q4_K", "fp8", "bf16", "f16", "f32"))
def test_a_weight_gives_its_bits_wherever_it_lies(kind):
    """The same weight at byte offsets 4..60 past a 4 KiB boundary (element offsets 0..16 for floats), as the
    expert store's views at file offsets lie: the same bits, 1 and 7 tokens."""
    if kind in ("bf16", "f16", "f32"):
        dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[kind]
        w = torch.randn(768, 2048, generator=_gen(4)).to(dt)
        big = torch.empty(w.numel() + 64, dtype=dt)
        x = torch.randn(7, 2048, generator=_gen(5))
        want = native.float_linear(x, w)
        for off in range(17):
            view = big[off : off + w.numel()].view(768, 2048)
            view.copy_(w)
            assert torch.equal(native.float_linear(x, view), want), f"{kind} offset {off}"
            assert torch.equal(native.float_linear(x[:1], view), want[:1])
        return
    t, lf, _ = stored(kind, 768, 2048, seed=6)
    x = torch.randn(7, 2048, generator=_gen(7)).bfloat16()
    want = native.linear(x, t, lf, out_dtype=torch.float32)
    for off in (4, 8, 12, 16, 20, 28, 32, 36, 60):  # multiples of the pieces' element sizes, as the store's
        moved = {}
        for role, v in t.items():
            raw = v.contiguous().view(torch.uint8).reshape(-1)
            buf = torch.empty(raw.numel() + 4096 + 64, dtype=torch.uint8)
            start = (-buf.data_ptr()) % 4096 + off  # off bytes past a 4 KiB boundary
            piece = buf[start : start + raw.numel()]
            piece.copy_(raw)
            moved[role] = piece.view(v.dtype).view(v.shape)
        assert torch.equal(native.linear(x, moved, lf, out_dtype=torch.float32), want), f"{kind} offset {off}"


def attention64(q, k, v, start, scale, window=None, sinks=None, mask=None):
    """float64 reference: q [T, Hq, D], k [Hkv, S, D], v [Hkv, S, Dv] -> [T, Hq, Dv]."""
    t, hq, _ = q.shape
    hkv, s, _ = k.shape
    rep = hq // hkv
    kk, vv = k.double().repeat_interleave(rep, 0), v.double().repeat_interleave(rep, 0)
    logits = torch.einsum("thd,hsd->hts", q.double(), kk) * scale
    pos = torch.arange(start, start + t)[:, None]
    at = torch.arange(s)[None, :]
    allowed = at <= pos
    if window:
        allowed &= at > pos - window
    if mask is not None:
        allowed &= mask
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.double()[:, None, None].expand(hq, t, 1)], dim=-1)
    p = torch.softmax(logits, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("hts,hsd->thd", p, vv)


@pytest.mark.parametrize("case", ["gqa", "window", "sinks", "mask", "split-keys", "odd-dims"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_attention_against_float64_and_invariant(case, dtype):
    """The attention kernel within 1e-5 of float64 attention; the same bits on every path, for any cache
    capacity beyond the positions seen, any split of the queries into calls, and 1, 2 or 4 threads."""
    hq, hkv, d, dv = {"odd-dims": (6, 3, 40, 24)}.get(case, (8, 2, 64, 64))
    cap, t, start = 96, 9, 30
    q = torch.randn(t, hq, d, generator=_gen(1))
    k = torch.randn(hkv, cap, d, generator=_gen(2)).to(dtype)
    v = torch.randn(hkv, cap, dv, generator=_gen(3)).to(dtype)
    kw = {}
    if case == "window":
        kw["window"] = 7
    if case == "sinks":
        kw["sinks"] = torch.randn(hq, generator=_gen(4))
    if case == "mask":
        kw["mask"] = torch.rand(t, start + t, generator=_gen(5)) < 0.6
        kw["mask"][:, 0] = True
    n = start + t
    if case == "split-keys":  # MLA: the keys in two parts, the value a view of the first
        k1, k2 = k[:, :, :48], k[:, :, 48:]
        got = native.attention(q, k1[:, :n], k1[:, :n], start, 0.1, k2=k2[:, :n])
        want = attention64(q, k[:, :n], k1[:, :n], start, 0.1)
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
        assert torch.equal(got, native.attention(q, k1, k1, start, 0.1, k2=k2))  # capacity
        return
    ref = attention64(q, k[:, :n], v[:, :n], start, 0.125, **kw)
    got = on_every_path(lambda: native.attention(q, k[:, :n], v[:, :n], start, 0.125, **kw))
    first = next(iter(got.values()))
    assert all(torch.equal(first, y) for y in got.values())
    assert (first.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    if "mask" not in kw:  # a longer cache (capacity) and one query per call give the same bits
        assert torch.equal(native.attention(q, k, v, start, 0.125, **kw), first)
        one = torch.cat([native.attention(q[i : i + 1], k, v, start + i, 0.125, **kw) for i in range(t)])
        assert torch.equal(one, first)
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2, 4):
            torch.set_num_threads(nt)
            assert torch.equal(native.attention(q, k[:, :n], v[:, :n], start, 0.125, **kw), first)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def portable_ops(tmp_path_factory):
    """csrc/ops.cpp alone, built for baseline x86-64 (no AVX2, no FMA instructions): the scalar loops the SIMD
    registers must match."""
    cxx = native._compiler()
    if cxx is None or platform.machine() not in ("x86_64", "AMD64") or native.library() is None:
        pytest.skip("needs a C++ compiler, x86-64 and the compiled kernels")
    out = tmp_path_factory.mktemp("portable-ops") / "libops.so"
    subprocess.run([cxx, *native.FLAGS, "-O2", "-march=x86-64", "-fopenmp", "-shared", str(native.CSRC / "ops.cpp"),
                    "-o", str(out)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    lib.ms_attention.restype = ctypes.c_int
    lib.ms_attention.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


# real widths: Qwen3-30B-A3B (32 query heads on 4 key heads of 128), gpt-oss (64 on 8 of 64, sinks and a
# window), DeepSeek-V3's MLA (128 heads on one latent of 512 + 64 rotary, values a view of the keys)
REAL_ATTENTION = {"qwen3": (32, 4, 128, 0, {}), "gpt-oss": (64, 8, 64, 0, {"sinks": True, "window": 128}),
                  "mla": (128, 1, 512, 64, {})}


@pytest.mark.parametrize("model", list(REAL_ATTENTION))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_simd_gives_the_scalar_bits_at_real_widths(model, dtype, portable_ops):
    """At real head counts and widths (groups of 16 heads, a key tail past the 4-key value passes), the
    machine's SIMD build of the attention kernel gives the bits of its scalar build, within 1e-5 of float64,
    and the same bits for one query per call and any cache capacity."""
    hq, hkv, d1, d2, extra = REAL_ATTENTION[model]
    dv = d1 if d2 else d1
    cap, t, start = 520, 13, 490  # 503 positions: not a multiple of 4
    q = torch.randn(t, hq, d1 + d2, generator=_gen(11)) * 2
    k = torch.randn(hkv, cap, d1 + d2, generator=_gen(12)).to(dtype)
    v = torch.randn(hkv, cap, dv, generator=_gen(13)).to(dtype)
    kw = {"window": extra.get("window")}
    if extra.get("sinks"):
        kw["sinks"] = torch.randn(hq, generator=_gen(14))
    n = start + t
    if d2:  # MLA: the value is a view of the keys' first part
        k1, k2 = k[:, :, :d1], k[:, :, d1:]
        call = dict(q=q, k=k1[:, :n], v=k1[:, :n], start=start, scale=0.05, k2=k2[:, :n])
        ref = attention64(q, k[:, :n], k1[:, :n], start, 0.05)
    else:
        call = dict(q=q, k=k[:, :n], v=v[:, :n], start=start, scale=0.08, **kw)
        ref = attention64(q, k[:, :n], v[:, :n], start, 0.08, **kw)
    got = native.attention(**call)
    assert torch.equal(got, native.attention(**call, lib=portable_ops))
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    one = torch.cat([native.attention(**{**call, "q": q[i : i + 1], "start": start + i}) for i in range(t)])
    assert torch.equal(one, got)
    if not d2:
        assert torch.equal(native.attention(**{**call, "k": k, "v": v}), got)  # the whole capacity


@pytest.mark.parametrize("mode", list(native.NORM_MODES))
def test_rms_norm_against_float64(mode):
    """Each RMSNorm mode within 2 ulp (bf16: one rounding) of float64, the same bits on every path, a row alone
    or among others."""
    x = torch.randn(13, 2048, generator=_gen(1)).bfloat16()
    w = (torch.randn(2048, generator=_gen(2)) * 0.1 + 1).bfloat16()
    weight = None if mode in ("none", "l2") else w
    got = on_every_path(lambda: native.rms_norm(x, weight, 1e-6, mode))
    first = next(iter(got.values()))
    assert all(torch.equal(first, y) for y in got.values())
    xd = x.double()
    ss = xd.pow(2).sum(-1, keepdim=True)
    h = xd / torch.sqrt((ss if mode == "l2" else ss / 2048) + 1e-6)
    want = {"weight": w.double() * h, "one_plus": h * (1 + w.double()), "none": h, "l2": h,
            "weight_f32": w.double() * h}[mode]
    assert ((first.double() - want).abs() <= 2 ** -6 * want.abs() + 1e-30).all()
    assert torch.equal(native.rms_norm(x[4:5], weight, 1e-6, mode), first[4:5])


def test_rms_norm_of_one_dtype_gives_the_general_loops_bits():
    """A model's own norm (x, weight and output of one dtype) runs a loop of its own: the same bits as the general
    loop (bf16: the weight as float32 holding the same values, the float32 output then rounded; float32: mode
    weight_f32, the same products)."""
    x = torch.randn(5, 2048, generator=_gen(3)) * 3
    w = (torch.randn(2048, generator=_gen(4)) * 0.1 + 1).bfloat16()
    xb = x.bfloat16()
    assert torch.equal(native.rms_norm(xb, w, 1e-6), native.rms_norm(xb, w.float(), 1e-6).bfloat16())
    assert torch.equal(native.rms_norm(x, w.float(), 1e-6), native.rms_norm(x, w.float(), 1e-6, "weight_f32"))


@pytest.mark.parametrize("name", ["silu", "sigmoid", "softplus", "exp"])
def test_activations_against_float64_and_position_free(name):
    """Each activation within 3 ulp of float64 (float32) over [-90, 90], +-inf and NaN handled, and a value's bits
    the same whatever its position in the tensor (PyTorch's vectorized and scalar loops differ for sigmoid,
    silu and softplus)."""
    x = torch.cat([torch.linspace(-90, 90, 20001), torch.randn(4096, generator=_gen(1)) * 6])
    got = native.activation(name, x)
    ref = {"silu": F.silu, "sigmoid": torch.sigmoid, "softplus": F.softplus, "exp": torch.exp}[name](x.double())
    rel = ((got.double() - ref).abs() / ref.abs().clamp_min(1e-300))
    fine = (ref.abs() > 1e-30) & (ref.abs() < 3e38)  # relative error where float32 is normal
    assert rel[fine].max() <= 3 * 2**-23, f"{name}: {rel[fine].max():.2e}"
    shifted = torch.cat([torch.zeros(7), x])
    assert torch.equal(native.activation(name, shifted)[7:], got)
    assert torch.equal(torch.stack([native.activation(name, x[i : i + 1])[0] for i in range(0, x.numel(), 997)]),
                       got[0 : x.numel() : 997])
    special = native.activation(name, torch.tensor([float("inf"), float("-inf"), float("nan")]))
    want = {"silu": [float("inf"), float("nan")], "sigmoid": [1.0, 0.0], "softplus": [float("inf"), 0.0],
            "exp": [float("inf"), 0.0]}[name]
    assert torch.equal(torch.isnan(special[:2]), torch.isnan(torch.tensor(want)))  # as PyTorch: silu(-inf) is NaN
    assert all(a == b for a, b in zip(special[:2].tolist(), want) if b == b) and torch.isnan(special[2])


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated-deltanet", "kda"])
def test_delta_rule_against_float64_and_any_split(per_channel):
    """The delta-rule recurrence within 1e-5 of float64 over 40 tokens, and the same bits (outputs and final
    state) whether the tokens come in one call, one at a time, or in chunks of 7."""
    t, h, dk, dv = 40, 4, 32, 24
    q = F.normalize(torch.randn(t, h, dk, generator=_gen(1)), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(t, h, dk, generator=_gen(2)), dim=-1)
    v = torch.randn(t, h, dv, generator=_gen(3))
    g = -torch.rand((t, h, dk) if per_channel else (t, h), generator=_gen(4))
    beta = torch.rand(t, h, generator=_gen(5))
    s0 = torch.randn(h, dk, dv, generator=_gen(6)) * 0.1
    out, state = native.delta_rule(q, k, v, g, beta, s0)
    s = s0.double()
    want = torch.empty(t, h, dv, dtype=torch.float64)
    for i in range(t):
        decay = g[i].double().exp()
        s = s * (decay[..., None] if per_channel else decay[:, None, None])
        r = (s * k[i].double()[..., None]).sum(-2)
        s = s + k[i].double()[..., None] * ((v[i].double() - r) * beta[i].double()[:, None])[:, None, :]
        want[i] = (s * q[i].double()[..., None]).sum(-2)
    assert (out.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert (state.double() - s).abs().max() <= 1e-5 * s.abs().max()
    for step in (1, 7):
        st, parts = s0, []
        for a in range(0, t, step):
            o, st = native.delta_rule(q[a : a + step], k[a : a + step], v[a : a + step], g[a : a + step],
                                      beta[a : a + step], st)
            parts.append(o)
        assert torch.equal(torch.cat(parts), out) and torch.equal(st, state), f"chunks of {step}"
    assert not torch.equal(native.delta_rule(q, k, v, g, beta, s0)[1], s0)  # the input state is left as it was
