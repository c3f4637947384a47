"""Quantized matmul paths against the dequantized weight, and the bit packing of every width."""

import pytest
import torch

from moestream.quant import affine, native
from moestream.quant.formats import LinearFormat, Scheme
from moestream.quant.kernels import qlinear

from .quant_helpers import mlx_dequantize, mlx_quantize


@pytest.mark.parametrize("bits", affine.BITS)
def test_pack_is_the_mlx_bit_stream(bits):
    """moestream's packer and unpacker agree with the independent numpy writer, byte for byte."""
    w = torch.randn(6, 128, generator=torch.Generator().manual_seed(bits))
    packed, scales, biases, _ = mlx_quantize(w, bits, 32)
    codes = affine.unpack(packed, bits, 128)
    assert torch.equal(affine.pack(codes, bits).view(torch.int32), packed.view(torch.int32))
    want = mlx_dequantize(packed, scales, biases, bits)
    got = affine.dequantize(packed, scales, biases, bits, 32, torch.float32)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits,group", [(2, 32), (3, 64), (4, 64), (8, 32), (8, 128), (8, 256), (5, 32), (6, 64)])
@pytest.mark.parametrize("n", [1, 7])
@pytest.mark.parametrize("path", ["torch", "auto"])
def test_qlinear_paths_match_the_dequantized_weight(bits, group, n, path):
    """qlinear on the PyTorch path (int8 kernel, chunks) and on the compiled kernels, float32 and bf16 inputs,
    against a float64 product of the dequantized weight."""
    torch.manual_seed(bits * 1000 + group + n)
    w = torch.randn(96, 256) * 0.05
    packed, scales, biases, deq = mlx_quantize(w, bits, group)
    t = {"w": packed, "w.scales": scales.to(torch.bfloat16), "w.biases": biases.to(torch.bfloat16)}
    lf = LinearFormat("w", Scheme("affine", bits, group), 96, 256)
    ref_w = affine.dequantize(packed, t["w.scales"], t["w.biases"], bits, group, torch.float64)
    x = torch.randn(n, 256)
    want = x.double() @ ref_w.t()
    with native.use(path):
        got = qlinear(x, t, lf)
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
        xb = x.to(torch.bfloat16)
        got = qlinear(xb, t, lf)
        assert got.dtype == torch.bfloat16
        want_b = xb.double() @ ref_w.t()
        rel = (got.double() - want_b).abs().max() / want_b.abs().max()
        assert rel <= 0.01, f"{bits}-bit bf16: max relative error {rel:.4f}"  # the bf16 rounding of the output
        assert torch.equal(qlinear(xb, t, lf), got)  # deterministic
