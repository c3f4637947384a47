"""``--activations q8`` on MLX affine 4- and 8-bit weights (moestream/quant/csrc/q8.h Q8_A4, Q8_A8).

The activation quantizer against an independent numpy form (blocks of 32, float32 scale amax / 127, codes rounded
half to even, each group's sum of scale x code sum); the kernels on every compiled path against the float64 product
of the dequantized weights and the dequantized 8-bit activations at the Qwen3-30B-A3B expert's widths (2048, 768)
and odd row counts, groups of 32, 64 and 128, bf16, fp16 and float32 scales; every path the same bits; a row's bits
independent of the rows and tokens beside it, the thread count and where the operands lie; the gated expert and the
layer kernel; a tiny model from ``moestream convert`` streamed at budget 0 ``torch.equal`` to budget ``all`` in q8
mode and near its float-mode logits; 3-bit linears named once and kept float."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moestream.convert import ConvertSpec, convert
from moestream.engine import load
from moestream.quant import affine, native
from moestream.quant.expert import QuantizedSwiGLU
from moestream.quant.formats import ExpertFormat, LinearFormat, Scheme, with_activations

from .helpers import make_qwen3_moe
from .quant_helpers import mlx_quantize
from .test_activations_q8 import _x
from .test_quant_native import PATHS, on

EPS = 2.0 ** -24  # float32's unit roundoff


def ref_q8_affine(x: np.ndarray, group: int):
    """Blocks of 32: amax = max |x|, d = amax / 127 (float32), codes rint(x * (127 / amax)) in float32 (half to
    even) within +-127; each group's sum, in block order in float32, of d x (the block's code sum)."""
    n = x.shape[0]
    xb = x.astype(np.float32).reshape(n, -1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = np.where(amax == 0, np.float32(0), np.float32(127.0) / np.where(amax == 0, np.float32(1), amax))
        scaled = (xb * inv.astype(np.float32)).astype(np.float32)
        # amax below 127 / FLT_MAX: 127 / amax overflows, so x / amax * 127
        tiny = (xb / np.where(amax == 0, np.float32(1), amax)).astype(np.float32) * np.float32(127.0)
        scaled = np.where(np.isinf(inv), tiny.astype(np.float32), scaled)
    codes = np.clip(np.rint(scaled), -127, 127).astype(np.int8)
    d = (amax[..., 0] / np.float32(127.0)).astype(np.float32)
    e = (d * codes.astype(np.int32).sum(-1).astype(np.float32)).astype(np.float32)
    per = group // 32
    sums = np.zeros((n, e.shape[1] // per), np.float32)
    for j in range(per):
        sums = (sums + e[:, j::per]).astype(np.float32)
    return codes.reshape(x.shape), d, sums


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_activation_rounding(bits, group):
    if not native.paths():
        pytest.skip("the CPU kernels are not built here")
    x = _x(5, 2048, 0)
    x[1, :32] = 0  # ties: amax 127 makes x * 127 / amax = x exactly; half to even gives 0, 2, 2, -2
    x[1, :5] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5])
    x[2, 32:64] = torch.linspace(-1e-37, 1e-37, 32)  # 127 / amax overflows float32: the signs must stay
    codes, scales, sums = native.q8_quantize_affine(x, bits, group)
    want = ref_q8_affine(x.numpy(), group)
    np.testing.assert_array_equal(codes.numpy(), want[0])
    np.testing.assert_array_equal(scales.numpy(), want[1])
    np.testing.assert_array_equal(sums.numpy(), want[2])
    assert codes[1, :5].tolist() == [127, 0, 2, 2, -2] and (codes[0, :256] == 0).all()
    assert codes[2, 32].item() == -127 and codes[2, 63].item() == 127 and (codes[2, 32:48] < 0).all()
    with pytest.raises(ValueError, match="64-value chunks"):
        native.q8_quantize_affine(x[:, :96], bits, 32)


def affine_case(out: int, inn: int, bits: int, group: int, sdt=torch.bfloat16, seed: int = 0):
    """A random affine linear in q8 mode and its float64 codes, expanded scales and biases [out, inn]."""
    g = torch.Generator().manual_seed(seed)
    packed, s, b, _ = mlx_quantize(torch.randn(out, inn, generator=g) * 0.05, bits, group)
    t = {"w": packed, "w.scales": s.to(sdt), "w.biases": b.to(sdt)}
    lf = with_activations(LinearFormat("w", Scheme("affine", bits, group), out, inn), "q8")
    assert lf.scheme.act == "q8"
    ones = torch.ones(s.shape, dtype=torch.float32)
    q = affine.dequantize(packed, ones, torch.zeros_like(ones), bits, group, torch.float64)
    s64 = t["w.scales"].double().repeat_interleave(group, -1)
    b64 = t["w.biases"].double().repeat_interleave(group, -1)
    return t, lf, q, s64, b64


def deq_act(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    codes, d, _ = ref_q8_affine(x.numpy(), group)
    n = x.shape[0]
    return torch.from_numpy(codes.astype(np.float64).reshape(n, -1, 32) * d.astype(np.float64)[..., None]).view(n, -1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("out, inn", [(768, 2048), (2048, 768), (13, 2048), (5, 384), (9, 1536)])
def test_q8_affine_linear_against_float64(path, bits, group, out, inn):
    _check_linear(path, bits, group, out, inn)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_a_last_segment_of_one_chunk(path, bits, group):
    """The SIMD tiles widen a row's scales 16 chunks (1,024 values) at a time: 1,088 inputs end on a segment of one
    chunk, 1,536 (above) on one of 8 (groups of 32: its second 16 scales past the row's end, not loaded)."""
    _check_linear(path, bits, group, 7, 1088)


def _check_linear(path, bits, group, out, inn):
    on(path)
    t, lf, q, s64, b64 = affine_case(out, inn, bits, group, seed=out + inn + group)
    x = _x(5, inn, seed=inn + bits)
    xq = deq_act(x, bits, group)
    want = xq @ (s64 * q + b64).T
    # float32's part: a lane's fma chain (inn / 64 steps) and scale product, the bias chain (groups / 16), the
    # group sums (group / 32 adds), the trees; each a relative EPS of the sum of |scale x code| and |bias| products
    bound = (inn / 64 + inn / group / 16 + group / 32 + 12) * EPS * (xq.abs() @ (s64 * q).abs().T +
                                                                     xq.abs() @ b64.abs().T) + 1e-30
    with native.use(path):
        got = native.linear(x, t, lf)
    assert got is not None and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= bound).all()  # float activations miss it by the 8-bit rounding
    with native.use("portable"):
        assert torch.equal(got, native.linear(x, t, lf))  # every path: the same bits


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sdt", [torch.float16, torch.float32])
def test_fp16_and_float32_scales(path, sdt):
    on(path)
    t, lf, q, s64, b64 = affine_case(37, 2048, 4, 64, sdt=sdt, seed=2)
    x = _x(3, 2048, seed=5)
    xq = deq_act(x, 4, 64)
    bound = 60 * EPS * (xq.abs() @ (s64 * q).abs().T + xq.abs() @ b64.abs().T)
    with native.use(path):
        got = native.linear(x, t, lf)
    assert ((got.double() - xq @ (s64 * q + b64).T).abs() <= bound).all()
    with native.use("portable"):
        assert torch.equal(got, native.linear(x, t, lf))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_has_its_bits_in_any_batch_thread_count_and_place(path, bits):
    on(path)
    out, inn = 37, 2048
    t, lf, *_ = affine_case(out, inn, bits, 64, seed=9)
    x = _x(13, inn, seed=4)
    with native.use(path):
        all13 = native.linear(x, t, lf)
        for n in (1, 2, 8):
            assert torch.equal(native.linear(x[:n], t, lf), all13[:n])
        assert torch.equal(native.linear(x[7:8], t, lf), all13[7:8])
        threads = torch.get_num_threads()
        try:
            for k in (1, 2, 4):
                torch.set_num_threads(k)
                assert torch.equal(native.linear(x, t, lf), all13)
        finally:
            torch.set_num_threads(threads)
        w = t["w"].view(torch.uint8)
        for off in (1, 3, 4093):  # the weight's bytes and the input at other addresses
            buf = torch.zeros(w.numel() + off + 8, dtype=torch.uint8)
            moved = buf[off:off + w.numel()].view(w.shape)
            moved.copy_(w)
            xb = torch.zeros(x.numel() + off % 16 + 1)
            xm = xb[off % 16:off % 16 + x.numel()].view(x.shape)
            xm.copy_(x)
            assert torch.equal(native.linear(xm, {**t, "w": moved}, lf), all13)


def _expert(bits: int, seed: int = 0, inter: int = 768, hidden: int = 2048):
    pieces, lins, deq = {}, {}, {}
    g = torch.Generator().manual_seed(seed)
    for role, (o, i) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        packed, s, b, _ = mlx_quantize(torch.randn(o, i, generator=g) * 0.03, bits, 64)
        pieces[role], pieces[role + ".scales"], pieces[role + ".biases"] = packed, s.bfloat16(), b.bfloat16()
        lins[role] = with_activations(LinearFormat(role, Scheme("affine", bits, 64), o, i), "q8")
        deq[role] = affine.dequantize(packed, s.bfloat16(), b.bfloat16(), bits, 64, torch.float64)
    return pieces, ExpertFormat(lins), deq


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [4, 8])
def test_q8_affine_expert_at_the_30b_width_and_through_the_layer_kernel(path, bits):
    """The gated expert in one call, gate and up on the 8-bit input, the intermediate rounded to 8 bits again for
    down: against float64 from the same 8-bit input within down's share of the intermediate's rounding (half a code
    step per value) plus float32's; the layer kernel (one quantization of the layer's input) gives each row the
    same bits."""
    on(path)
    pieces, fmt, deq = _expert(bits)
    x = _x(3, 2048, seed=8)
    xq = deq_act(x, bits, 64)
    h = F.silu(xq @ deq["gate"].T) * (xq @ deq["up"].T)
    step = h.abs().view(3, -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(3, -1) / 127
    slack = (0.5 * step + 1e-5 * h.abs()) @ deq["down"].abs().T + 1e-5 * (h.abs() @ deq["down"].abs().T)
    with native.use(path):
        got = QuantizedSwiGLU(fmt)(x, pieces)
        assert ((got.double() - h @ deq["down"].T).abs() <= slack).all()
        call = native.expert_call(pieces, fmt)
        other = native.expert_call(_expert(bits, seed=5)[0], fmt)
        slots = native.moe(x, [call, other], [[0, 2, 4], [3]], 2, torch.ones(6), out=torch.zeros(6, 2048))
        alone = native.moe(x[1:2], [other], [[1]], 2, torch.ones(2))
    assert torch.equal(slots[0], got[0]) and torch.equal(slots[2], got[1]) and torch.equal(slots[4], got[2])
    assert torch.equal(slots[3], alone[1])


# every linear 64 wide (hidden 64, 4 x 16 heads, experts 64), so each takes q8 activations
SHAPE = dict(moe_intermediate_size=64, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
IDS = torch.randint(0, 300, (16,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("q8a")
    make_qwen3_moe(root / "float", seed=4, **SHAPE)
    return {b: convert(root / "float", root / f"b{b}", ConvertSpec(32, b, b, b, b)) for b in (4, 8, 3)}


def _logits(path, budget, **kw):
    engine = load(path, cache_budget_gb=budget, tokenizer=False, workers=2, **kw)
    try:
        with torch.inference_mode():
            return engine.model(IDS, 0, engine.model.new_kv_cache(), all_logits=True).float(), engine
    finally:
        engine.close()


@pytest.mark.parametrize("bits", [4, 8])
def test_q8_affine_model_streams_the_bits_of_budget_all_and_stays_near_float(builds, bits, capfd):
    if not native.paths():
        pytest.skip("the CPU kernels are not built here")
    path = builds[bits]
    full, _ = _logits(path, "all", activations="q8")
    assert "keep float activations" not in capfd.readouterr().err  # every linear is covered
    assert torch.equal(_logits(path, "0", activations="q8")[0], full)
    assert torch.equal(_logits(path, "0.0002", activations="q8", prefetch_ahead=1)[0], full)
    flt, _ = _logits(path, "all")
    assert not torch.equal(flt, full)  # the mode is on
    # 8-bit blocks round each input by at most half a code step (1/254 of its block's largest value), about what
    # bf16 does to each value (1/512 of itself; bf16 also rounds norms, attention and the KV cache): the median
    # position within 3x bf16 mode's distance from float mode (a wrong scale, bias or lane order moves it far more)
    bf16, _ = _logits(path, "all", dtype="bf16")
    scale = flt.abs().max()
    q8_rel = ((full - flt).abs().amax(-1) / scale).median()
    bf16_rel = ((bf16.float() - flt).abs().amax(-1) / scale).median()
    assert q8_rel < 3 * bf16_rel, (q8_rel, bf16_rel)


def test_other_widths_are_named_once_and_stay_float(builds, capfd):
    if not native.paths():
        pytest.skip("the CPU kernels are not built here")
    q8, _ = _logits(builds[3], "all", activations="q8")
    notes = [ln for ln in capfd.readouterr().err.splitlines() if "--activations q8 covers" in ln]
    assert len(notes) == 1 and "affine 3-bit" in notes[0] and "keep float activations" in notes[0], notes
    assert not torch.equal(q8, _logits(builds[3], "all")[0])  # the routers (8-bit in every build) are q8



@pytest.mark.parametrize("path", PATHS)
def test_inputs_too_small_for_127_over_amax_keep_their_sign(path):
    """A block whose largest value is below 127 / FLT_MAX (127 / amax overflows) is rounded as x / amax * 127."""
    on(path)
    t, lf, q, s64, b64 = affine_case(7, 128, 4, 32, seed=3)
    x = 3e-37 * torch.where(torch.arange(128) % 3 == 0, -1.0, 1.0)[None]
    want = x.double() @ (s64 * q + b64).T
    with native.use(path):
        got = native.linear(x, t, lf).double()
    assert ((got - want).abs() <= 1e-2 * want.abs().max()).all(), (got, want)


def test_widths_and_groups_q8_does_not_take_stay_float():
    lf = with_activations(LinearFormat("w", Scheme("affine", 4, 96), 5, 384), "q8", got := [], "w")
    assert lf.scheme.act == "float" and got == [("w", "affine 4-bit in groups of 96 (q8 takes 32 or multiples of 64)")]
    lf = with_activations(LinearFormat("w", Scheme("affine", 8, 32), 5, 96), "q8", got := [], "w")
    assert lf.scheme.act == "float" and "96 inputs" in got[0][1]
    assert with_activations(LinearFormat("w", Scheme("affine", 4, 128), 5, 384), "q8").scheme.act == "q8"
