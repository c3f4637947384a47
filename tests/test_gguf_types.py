"""The ggml types of published MoE quants beyond the K-quants: MXFP4 (gpt-oss GGUFs), the codebook types
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M and the ternary TQ1_0, TQ2_0.

Independent sources: ``gguf.quants.dequantize`` (llama.cpp's own Python reference, gguf 0.19) for the
weights, a float64 product of those weights for the kernels. (tests/test_gguf.py runs the same types
end to end through GGUF files, against transformers on the weights the gguf package reads.)
"""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize

from moestream.quant import ggml, native
from moestream.quant.expert import QuantizedSwiGLU
from moestream.quant.formats import ExpertFormat, LinearFormat, ggml_scheme

from .gguf_helpers import _random_blocks
from .helpers import at_threads
from .test_quant_native import BOUND, PATHS, on, rel_err

NEW = ("MXFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")


def _qt(qtype: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[qtype]


def _reference(raw: np.ndarray, qtype: str) -> torch.Tensor:
    with np.errstate(all="ignore"):  # random scale bytes: inf and NaN scales on purpose
        return torch.from_numpy(np.ascontiguousarray(dequantize(raw, _qt(qtype))))


def _blocks(qtype: str, out: int, inn: int, seed: int, std: float = 0.05) -> torch.Tensor:
    """Random ``qtype`` blocks [out, row bytes] whose weights have about ``std`` (finite scales)."""
    return torch.from_numpy(_random_blocks((out, inn), qtype, std, np.random.default_rng(seed)))


def _lf(qtype: str, out: int, inn: int, role: str = "w") -> LinearFormat:
    return LinearFormat(role, ggml_scheme(ggml.dtype_name(qtype)), out, inn)


@pytest.mark.parametrize("qtype", NEW)
def test_types_are_known_with_ggmls_block_sizes(qtype):
    assert ggml.TYPES[qtype][:2] == gguf.GGML_QUANT_SIZES[_qt(qtype)]
    assert qtype in native.GGML_TYPES


@pytest.mark.parametrize("qtype", NEW)
def test_dequantize_is_the_gguf_packages_bits_on_random_bytes(qtype):
    """Every byte random, scales included (NaN and inf scales among them): the same bits (signs of zeros too)
    and NaN in the same places; then blocks with finite scales through ggml.dequantize's row handling."""
    rng = np.random.default_rng(11)
    block, size = gguf.GGML_QUANT_SIZES[_qt(qtype)]
    inn = 1024
    raw = rng.integers(0, 256, (9, inn // block * size), dtype=np.uint8)
    got = ggml.dequantize(torch.from_numpy(raw), qtype, inn)
    want = _reference(raw, qtype)
    nan = torch.isnan(want)
    assert got.shape == want.shape == (9, inn)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    # stacked experts [E, out, row bytes]
    stacked = _blocks(qtype, 6, 512, seed=2).reshape(2, 3, -1)
    assert torch.equal(ggml.dequantize(stacked, qtype, 512), _reference(stacked.numpy(), qtype).reshape(2, 3, 512))


@pytest.mark.parametrize("qtype", [t for t in NEW if t in ggml.GRID_TYPES])
def test_grids_are_the_gguf_packages_tables(qtype):
    cls = getattr(gguf.quants, qtype)
    cls.init_grid()
    assert torch.equal(ggml.grid(qtype), torch.from_numpy(cls.grid.reshape(cls.grid_shape)))
    table = native._grid_table(qtype)
    assert torch.equal(table.float(), ggml.grid(qtype).flatten())


def test_mxfp4_nibble_order_is_ggmls_not_safetensors():
    """block_mxfp4: weight j is the low nibble of qs[j], weight j + 16 its high nibble (Q4_0's order), where the
    safetensors MXFP4 of gpt-oss pairs neighbours (2 i low, 2 i + 1 high); e = 127 is a scale of 1."""
    raw = np.zeros((1, 17), np.uint8)
    raw[0, 0] = 127
    raw[0, 1] = 0x72  # weight 0: code 2 (value 2 doubled e2m1 1.0); weight 16: code 7 (12, e2m1 6.0)
    raw[0, 16] = 0x9F  # weight 15: code 15 (-12); weight 31: code 9 (-1)
    got = ggml.dequantize(torch.from_numpy(raw), "MXFP4", 32)[0]
    want = torch.zeros(32)
    want[0], want[16], want[15], want[31] = 1.0, 6.0, -6.0, -0.5
    assert torch.equal(got, want) and torch.equal(got, _reference(raw, "MXFP4")[0])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", NEW)
def test_kernels_decode_the_reference_weights_exactly(path, qtype):
    """One-hot inputs pick single weights out: the kernels' decoded weights are the reference's bits, in the
    decode path (3 tokens) and in the blocked prefill path (every input, one token each)."""
    out, inn = 21, 512
    w = _blocks(qtype, out, inn, seed=3)
    want = _reference(w.numpy(), qtype)
    eye = torch.eye(inn)
    with on(path):
        assert torch.equal(native.linear(eye, {"w": w}, _lf(qtype, out, inn)), want.t())
        pick = eye[[0, 257, 511]]
        assert torch.equal(native.linear(pick, {"w": w}, _lf(qtype, out, inn)), want[:, [0, 257, 511]].t())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", NEW)
def test_kernels_at_odd_shapes(path, qtype):
    """Odd row counts and odd numbers of blocks per row, 1 to 19 tokens: within float32 accumulation of the
    float64 product; a token's bits are the same alone as among the others."""
    block = ggml.TYPES[qtype][0]
    with on(path):
        for out, blocks in ((1, 1), (5, 3), (37, 5)):
            inn = block * blocks
            w = _blocks(qtype, out, inn, seed=out)
            lf = _lf(qtype, out, inn)
            ref = _reference(w.numpy(), qtype).double()
            x = torch.randn(19, inn, generator=torch.Generator().manual_seed(blocks))
            y = native.linear(x, {"w": w}, lf)
            assert rel_err(y, x.double() @ ref.t()) <= BOUND, f"{qtype} [{out}, {inn}]"
            for n in (1, 2, 3, 5, 9):
                assert torch.equal(native.linear(x[:n], {"w": w}, lf), y[:n]), f"{qtype} [{out}, {inn}] n={n}"
            assert torch.equal(native.linear(x[7:8], {"w": w}, lf), y[7:8])


def _expert(qtype: str, inter: int = 768, hidden: int = 2048):
    roles = (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)))
    pieces = {r: _blocks(qtype, o, i, seed=k, std=0.03) for k, (r, (o, i)) in enumerate(roles)}
    fmt = ExpertFormat({r: _lf(qtype, o, i, r) for r, (o, i) in roles})
    deq = {r: _reference(pieces[r].numpy(), qtype).double() for r in pieces}
    return pieces, fmt, deq


def _swiglu64(x, deq):
    xd = x.double()
    return (F.silu(xd @ deq["gate"].t()) * (xd @ deq["up"].t())) @ deq["down"].t()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", NEW)
def test_kernels_at_the_30b_expert_width(path, qtype):
    """Qwen3-30B-A3B's expert: gate and up [768, 2048], down [2048, 768]; each linear and the gated expert in one
    call, decode (1, 2, 7 tokens) and blocked prefill (19, 64), within the bound; batch and thread invariant."""
    pieces, fmt, deq = _expert(qtype)
    with on(path):
        for role in ("gate", "down"):
            lf = fmt.linears[role]
            for n in (1, 8, 19):
                x = torch.randn(n, lf.in_features, generator=torch.Generator().manual_seed(n))
                err = rel_err(native.linear(x, pieces, lf), x.double() @ deq[role].t())
                assert err <= BOUND, f"{qtype} {role} n={n}: {err:.2e}"
        x = torch.randn(64, 2048, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        one, two = at_threads(lambda: native.expert(x, pieces, fmt, out_dtype=torch.float32), 1, 2)
        assert torch.equal(one, two)
        assert rel_err(one, _swiglu64(x, deq)) <= BOUND
        for a, b in ((0, 1), (0, 2), (3, 10), (63, 64)):
            got = native.expert(x[a:b], pieces, fmt, out_dtype=torch.float32)
            assert torch.equal(got, one[a:b]), f"{qtype} tokens {a}:{b}"
            assert rel_err(got, _swiglu64(x[a:b], deq)) <= BOUND


@pytest.mark.parametrize("path", ["avx2", "avx512"])
@pytest.mark.parametrize("qtype", NEW)
def test_compiled_paths_agree_with_portable(path, qtype):
    with on(path):
        pass
    w = _blocks(qtype, 200, 1024, seed=7)
    lf = _lf(qtype, 200, 1024)
    for n in (1, 5, 33):
        x = torch.randn(n, 1024, generator=torch.Generator().manual_seed(n))
        with native.use("portable"):
            want = native.linear(x, {"w": w}, lf)
        with native.use(path):
            got = native.linear(x, {"w": w}, lf)
        assert rel_err(got, want.double()) <= 2 * BOUND, f"{path} vs portable, {qtype} n={n}"


@pytest.mark.parametrize("qtype", ["MXFP4", "IQ2_XXS", "IQ1_M", "TQ1_0"])
def test_the_pytorch_path_agrees(qtype):
    """The PyTorch path (dequantize, then a float32 matmul) and the kernels: within the bound of each other."""
    pieces, fmt, deq = _expert(qtype, inter=256, hidden=512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    with native.use("torch"):
        ref = QuantizedSwiGLU(fmt)(x, pieces)
    assert rel_err(ref, _swiglu64(x, deq)) <= BOUND
    if native.selected() == "torch":
        pytest.skip("the CPU kernels are not built here")
    assert rel_err(QuantizedSwiGLU(fmt)(x, pieces), _swiglu64(x, deq)) <= BOUND


@pytest.mark.parametrize("qtype", list(native.GGML_TYPES))
def test_one_row_of_one_block_dequantizes_as_among_others(qtype):
    """A single row of a single 256-wide block (a one-token embedding lookup of a 256-wide model), sliced out of a
    larger tensor at any row, gives the values it has among the other rows (a row's odd byte offset once made the
    wider views of IQ2_XXS and IQ3_XXS raise)."""
    from .test_gguf import _blocks

    raw = _blocks(qtype, 3, 256, 5)
    whole = ggml.dequantize(raw, qtype, 256)
    for r in range(3):
        assert torch.equal(ggml.dequantize(raw[r : r + 1], qtype, 256), whole[r : r + 1])
        assert torch.equal(ggml.dequantize(raw[r], qtype, 256), whole[r])
