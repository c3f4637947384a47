"""``--activations q8``: llama.cpp's numerics for GGUF files (moestream/quant/csrc/q8.h).

The activation quantizer against an independent numpy form of ggml's ``quantize_row_q8_K_ref`` and x86
``quantize_row_q8_0``; each q8 kernel (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0, IQ4_NL) on every compiled path
against the float64 product of the gguf package's dequantized weights and the dequantized 8-bit activations, at the
Qwen3-30B-A3B expert's widths (2048, 768) and odd row and block counts; every path the same bits; a row's
bits independent of the rows beside it, the thread count and where the weight and input lie; a tiny GGUF
model streamed at budget 0 ``torch.equal`` to budget ``all`` in q8 mode, near its float-mode logits; q8 refused
for a checkpoint that is not GGUF, and the types it does not cover named once."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize

from moestream.engine import load
from moestream.errors import ConfigError
from moestream.options import EngineOptions
from moestream.quant import ggml, native
from moestream.quant.expert import QuantizedSwiGLU
from moestream.quant.formats import ExpertFormat, LinearFormat, ggml_scheme, with_activations

from .gguf_helpers import K_SHAPE, _random_blocks, make_model, write_gguf
from .test_gguf import logits
from .test_quant_native import PATHS, on

TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "IQ4_NL")
EPS = 2.0 ** -24  # float32's unit roundoff


# --- an independent numpy form of ggml's activation rounding ---------------------------------------------------

def ref_q8_k(x: np.ndarray):
    """ggml-quants.c quantize_row_q8_K_ref: per 256, max = the value of largest |x| (the first), iscale =
    -127 / max in float32, codes nearest_int(iscale * x) (half to even) capped at 127, d = 1 / iscale."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, 256)
    idx = np.abs(xb).argmax(-1)[..., None]
    mx = np.take_along_axis(xb, idx, -1)
    zero = mx == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, np.float32(0), np.float32(-127.0) / np.where(zero, np.float32(1), mx))
    codes = np.minimum(np.rint((iscale * xb).astype(np.float32)), 127).astype(np.int8)
    d = np.where(zero, np.float32(0), np.float32(1) / np.where(zero, np.float32(1), iscale)).astype(np.float32)
    sums = codes.reshape(x.shape[0], -1, 16).astype(np.int32).sum(-1).astype(np.int16)
    return codes.reshape(x.shape), d[..., 0], sums.reshape(x.shape[0], -1)


def ref_q8_0(x: np.ndarray):
    """ggml-cpu/arch/x86/quants.c quantize_row_q8_0: per 32, amax = max |x|, d = fp16(amax / 127), codes
    round_half_even(x * (127 / amax)) in float32."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax == 0, np.float32(0), np.float32(127.0) / np.where(amax == 0, np.float32(1), amax))
    codes = np.rint((xb * inv.astype(np.float32)).astype(np.float32)).astype(np.int8)
    d = (amax / np.float32(127.0)).astype(np.float32).astype(np.float16).astype(np.float32)
    return codes.reshape(x.shape), d[..., 0], codes.astype(np.int32).sum(-1)


def _x(n: int, inn: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inn, generator=g) * torch.rand(n, inn // 32, 1, generator=g).repeat_interleave(32, 1).view(n, -1)
    x[0, :256] = 0  # an all-zero block: scale 0, codes 0
    return x


@pytest.mark.parametrize("block", ["Q8_K", "Q8_0"])
def test_activation_rounding_is_ggmls(block):
    if not native.paths():
        pytest.skip("the CPU kernels are not built here")
    x = _x(7, 2048, 0)
    if block == "Q8_0":  # ties: amax 127 makes x * 127 / amax = x exactly; half to even gives 0, 2, 2, -2
        x[1, :32] = 0
        x[1, :5] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5])
    else:  # the first value of largest magnitude sets the sign; ties of x * (-127 / max) round to even
        x[1, :256] = 0
        x[1, :4] = torch.tensor([-127.0, 127.0, 0.5, 1.5])
    codes, scales, sums = native.q8_quantize(x, block)
    want = (ref_q8_k if block == "Q8_K" else ref_q8_0)(x.numpy())
    np.testing.assert_array_equal(codes.numpy(), want[0])
    np.testing.assert_array_equal(scales.numpy(), want[1])
    np.testing.assert_array_equal(sums.numpy(), want[2])
    if block == "Q8_0":
        assert codes[1, :5].tolist() == [127, 0, 2, 2, -2]
    else:
        assert codes[1, :4].tolist() == [-127, 127, 0, 2] and scales[1, 0].item() == 1.0


def _weights(qtype: str, out: int, inn: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if qtype in ("Q8_0", "Q4_0", "Q5_0"):  # the gguf package's blocks, then random codes (Q8_0: -128 included)
        qt = gguf.GGMLQuantizationType[qtype]
        raw = quantize(rng.normal(0, 0.05, (out, inn)).astype(np.float32), qt)
        raw = raw.reshape(out, -1, gguf.GGML_QUANT_SIZES[qt][1])
        raw[:, :, 2:] = rng.integers(0, 256, raw[:, :, 2:].shape)
        return torch.from_numpy(raw.reshape(out, -1).copy())
    return torch.from_numpy(_random_blocks((out, inn), qtype, 0.05, rng))


def _lf(qtype: str, out: int, inn: int, role: str = "w") -> LinearFormat:
    return with_activations(LinearFormat(role, ggml_scheme(ggml.dtype_name(qtype)), out, inn), "q8")


def _deq_act(x: torch.Tensor, qtype: str) -> torch.Tensor:
    """The 8-bit activations as float64 (from the numpy reference: codes * scale)."""
    block = 256 if native.Q8_TYPES[qtype] == "Q8_K" else 32
    codes, d, _ = (ref_q8_k if block == 256 else ref_q8_0)(x.numpy())
    n = x.shape[0]
    deq = codes.astype(np.float64).reshape(n, -1, block) * d.astype(np.float64)[..., None]
    return torch.from_numpy(deq).view(n, -1)


def _bound(xq: torch.Tensor, w64: torch.Tensor, inn: int) -> torch.Tensor:
    """The float32 part's worst case: each lane's fma chain (inn / 64 steps), the block scale products, the
    mins/offset chain and the 4-step tree, each a relative EPS of the sum of |products|."""
    return (inn / 64 + inn / 256 + 8) * EPS * (xq.abs() @ w64.abs().T) + 1e-30


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("out, inn", [(768, 2048), (2048, 768), (13, 2048), (5, 96)])
def test_q8_linear_against_float64(path, qtype, out, inn):
    on(path)
    if native.Q8_TYPES[qtype] == "Q8_K" and inn % 256:
        inn = 256  # a K-quant row is whole blocks of 256: one block
    w = _weights(qtype, out, inn, seed=out + inn)
    x = _x(5, inn, seed=inn) if inn >= 256 else torch.randn(5, inn, generator=torch.Generator().manual_seed(3))
    w64 = torch.from_numpy(dequantize(w.numpy(), gguf.GGMLQuantizationType[qtype]).astype(np.float64))
    xq = _deq_act(x, qtype)
    want = xq @ w64.T
    with native.use(path):
        got = native.linear(x, {"w": w}, _lf(qtype, out, inn))
    assert got is not None and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= _bound(xq, w64, inn)).all()
    with native.use("portable"):
        assert torch.equal(got, native.linear(x, {"w": w}, _lf(qtype, out, inn)))  # every path: the same bits


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", TYPES)
def test_a_row_has_its_bits_in_any_batch_thread_count_and_place(path, qtype):
    on(path)
    out, inn = 37, 2048
    w = _weights(qtype, out, inn, seed=9)
    lf = _lf(qtype, out, inn)
    x = _x(13, inn, seed=4)
    with native.use(path):
        all13 = native.linear(x, {"w": w}, lf)
        for n in (1, 8):
            assert torch.equal(native.linear(x[:n], {"w": w}, lf), all13[:n])
        assert torch.equal(native.linear(x[7:8], {"w": w}, lf), all13[7:8])
        threads = torch.get_num_threads()
        try:
            for t in (1, 2, 4):
                torch.set_num_threads(t)
                assert torch.equal(native.linear(x, {"w": w}, lf), all13)
        finally:
            torch.set_num_threads(threads)
        for off in (1, 3, 4093):  # the weight's bytes and the input at other addresses
            buf = torch.zeros(w.numel() + off + 8, dtype=torch.uint8)
            moved = buf[off:off + w.numel()].view(out, -1)
            moved.copy_(w)
            xb = torch.zeros(x.numel() + off % 16 + 1)
            xm = xb[off % 16:off % 16 + x.numel()].view(x.shape)
            xm.copy_(x)
            assert torch.equal(native.linear(xm, {"w": moved}, lf), all13)


def _expert(qtype: str, inter: int = 768, hidden: int = 2048, seed: int = 0):
    roles = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    pieces = {r: _weights(qtype, o, i, seed + k) for k, (r, (o, i)) in enumerate(roles.items())}
    return pieces, ExpertFormat({r: _lf(qtype, o, i, r) for r, (o, i) in roles.items()})


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", TYPES)
def test_q8_expert_at_the_30b_width_and_through_the_layer_kernel(path, qtype):
    """The gated expert in one call: gate and up on the 8-bit input, the float32 intermediate rounded to 8 bits
    again for down. Against float64 from the same 8-bit input, within the down projection's share of the
    intermediate's rounding (half a code step per value, each block's step its scale) plus the float32 bound;
    ms_moe (one quantization of the layer's input shared by its experts) gives each row the same bits."""
    on(path)
    pieces, fmt = _expert(qtype)
    x = _x(3, 2048, seed=8)
    deq = {r: torch.from_numpy(dequantize(pieces[r].numpy(), gguf.GGMLQuantizationType[qtype]).astype(np.float64))
           for r in pieces}
    xq = _deq_act(x, qtype)
    h = F.silu(xq @ deq["gate"].T) * (xq @ deq["up"].T)
    want = h @ deq["down"].T
    block = 256 if native.Q8_TYPES[qtype] == "Q8_K" else 32
    step = h.abs().view(3, -1, block).amax(-1, keepdim=True).expand(-1, -1, block).reshape(3, -1) / 127
    slack = (0.5 * step + 1e-5 * h.abs()) @ deq["down"].abs().T + 1e-5 * (h.abs() @ deq["down"].abs().T)
    with native.use(path):
        got = QuantizedSwiGLU(fmt)(x, pieces)
        assert ((got.double() - want).abs() <= slack).all()
        call = native.expert_call(pieces, fmt)
        other = native.expert_call(_expert(qtype, seed=5)[0], fmt)
        # k = 2: slots 0, 2, 4 (tokens 0, 1, 2) to this expert, slot 3 (token 1) to the other
        slots = native.moe(x, [call, other], [[0, 2, 4], [3]], 2, torch.ones(6), out=torch.zeros(6, 2048))
    assert torch.equal(slots[0], got[0]) and torch.equal(slots[2], got[1]) and torch.equal(slots[4], got[2])
    with native.use(path):
        alone = native.moe(x[1:2], [other], [[1]], 2, torch.ones(2))
    assert torch.equal(slots[3], alone[1])


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """A tiny Qwen3-MoE as a Q4_K_M-style GGUF (Q4_K, Q6_K down, value and embedding; every linear 256 wide)."""
    path = tmp_path_factory.mktemp("q8") / "m.gguf"
    model = make_model(seed=6, **K_SHAPE)
    write_gguf(model, path, "Q4_K", types={"ffn_down_exps": "Q6_K", "attn_v": "Q6_K", "token_embd": "Q6_K"})
    q8 = path.with_name("q8.gguf")
    write_gguf(model, q8, "Q8_0")
    return path, q8


IDS = torch.randint(0, 300, (16,), generator=torch.Generator().manual_seed(1))


def _logits(path, budget, dtype="float32", **kw):
    return logits(path, budget, IDS, dtype, **kw)


@pytest.mark.parametrize("which", [0, 1])
def test_q8_mode_streams_the_bits_of_budget_all_and_stays_near_float(q4_k_m, which):
    if not native.paths():
        pytest.skip("the CPU kernels are not built here")
    path = q4_k_m[which]
    full, engine = _logits(path, "all", activations="q8")
    streamed, _ = _logits(path, "0", activations="q8")
    assert torch.equal(streamed, full)
    chunked, _ = _logits(path, "0.0002", activations="q8", prefetch_ahead=1)
    assert torch.equal(chunked, full)
    auto, engine = _logits(path, "all", dtype="auto", activations="q8")  # bf16, GGUF's default, too
    assert engine.dtype == torch.bfloat16
    assert torch.equal(_logits(path, "0", dtype="auto", activations="q8")[0], auto)
    flt, _ = _logits(path, "all")
    assert not torch.equal(flt, full)  # the mode is on
    # How far from float mode: 8-bit blocks round each input value by at most half a code step, 1/254 of its
    # block's largest value, where bf16 rounds each value by at most 2^-9 = 1/512 of itself; so q8 mode's inputs
    # are perturbed about as much as bf16 mode's (which also rounds norms, attention and the KV cache). This
    # random model amplifies any rounding (a near-tied top-k expert flips: bf16 moves one position's logits by
    # 0.29 of the largest here), so the bound is on the median position: at most 3x bf16 mode's distance on the
    # same file (measured: 0.0145 against 0.0088 for the Q4_K_M mix, 0.0139 against 0.0103 for Q8_0). A wrong
    # scale, offset or lane order moves every position by several times more.
    bf16, _ = _logits(path, "all", dtype="bf16")
    scale = flt.abs().max()
    q8_rel = ((full - flt).abs().amax(-1) / scale).median()
    bf16_rel = ((bf16.float() - flt).abs().amax(-1) / scale).median()
    assert q8_rel < 3 * bf16_rel, (q8_rel, bf16_rel)


def test_q8_mode_is_refused_for_a_checkpoint_neither_gguf_nor_affine(tmp_path):
    from .helpers import make_qwen3_moe

    ckpt = tmp_path / "m"
    make_qwen3_moe(ckpt)
    with pytest.raises(ConfigError, match="activations=q8 is llama.cpp's numerics for GGUF files and integer dot "
                       "products for MLX affine 4- and 8-bit weights; .* is neither"):
        load(ckpt, cache_budget_gb="all", tokenizer=False, activations="q8")  # the API's keyword, not the flag
    with pytest.raises(ConfigError, match="activations='q4'"):
        EngineOptions.make(activations="q4")


def test_types_q8_does_not_cover_are_named_once_and_stay_float(tmp_path, capfd):
    if not native.paths():
        pytest.skip("the CPU kernels are not built here")
    path = tmp_path / "q4_1.gguf"
    write_gguf(make_model(seed=6, **K_SHAPE), path, "Q4_1", types={"ffn_down_exps": "Q8_0"})
    q8, _ = _logits(path, "all", activations="q8")
    err = capfd.readouterr().err
    notes = [ln for ln in err.splitlines() if "--activations q8 covers" in ln]
    assert len(notes) == 1 and "Q4_1" in notes[0] and "keep float activations" in notes[0], err
    flt, _ = _logits(path, "all")
    assert not torch.equal(q8, flt)  # the Q8_0 experts' down projections are q8
    lf = with_activations(LinearFormat("w", ggml_scheme(ggml.dtype_name("Q4_1")), 4, 256), "q8", got := [], "w")
    assert lf.scheme.act == "float" and got == [("w", "Q4_1")]


def test_the_flag_reaches_the_options():
    import argparse

    from moestream.cli.engine_args import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    m = ["--model", "m.gguf"]
    assert EngineOptions.from_args(p.parse_args([*m, "--activations", "q8"])).activations == "q8"
    assert EngineOptions.from_args(p.parse_args(m)).activations == "float"
    with pytest.raises(SystemExit):
        p.parse_args([*m, "--activations", "int4"])
