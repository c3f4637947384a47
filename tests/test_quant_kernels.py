"""Quantized matmul paths against the dequantized weight, and the bit packing of every width."""

import pytest
import torch

from moestream.quant import affine
from moestream.quant.formats import LinearFormat, Scheme
from moestream.quant.kernels import int4_eligible, prepare, qlinear

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
def test_qlinear_paths_match_the_dequantized_weight(bits, group, n):
    torch.manual_seed(bits * 1000 + group + n)
    w = torch.randn(96, 256) * 0.05
    packed, scales, biases, deq = mlx_quantize(w, bits, group)
    t = {"w": packed, "w.scales": scales.to(torch.bfloat16), "w.biases": biases.to(torch.bfloat16)}
    lf = LinearFormat("w", Scheme("affine", bits, group), 96, 256)
    ref_w = affine.dequantize(packed, t["w.scales"], t["w.biases"], bits, group, torch.float32)
    x = torch.randn(n, 256)
    want = x @ ref_w.t()
    got = qlinear(x, t, lf)  # float32: chunked path
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    xb = x.to(torch.bfloat16)
    ready = prepare(t, type("F", (), {"linears": {"w": lf}})(), torch.bfloat16)
    assert ("w.int4" in ready) == int4_eligible(lf, torch.bfloat16)
    got = qlinear(xb, ready, lf).float()
    rel = (got - want).abs().max() / want.abs().max()
    assert rel <= 0.02, f"{bits}-bit bf16: max relative error {rel:.4f}"  # bf16 input and output
    assert torch.equal(qlinear(xb, ready, lf), qlinear(xb, ready, lf))  # deterministic


def test_int4_layout_is_the_one_pytorch_builds_on_this_cpu():
    """The hand-built int4 layout equals PyTorch's own converter at a real expert width, on the CPU at hand
    (rows in blocks of 32 on AVX2, 64 on AVX-512), so the int4 path is on wherever PyTorch has it."""
    from moestream.quant.kernels import _int4pack, int4_block

    block = int4_block()
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512"):
        assert block == (64 if cap == "AVX512" else 32), f"{cap}: probed block {block}"
    if block is None:
        pytest.skip(f"PyTorch's int4 CPU kernel is off on this CPU ({cap})")
    codes = torch.randint(0, 16, (768, 2048), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(_int4pack(codes.to(torch.uint8)), torch._convert_weight_to_int4pack_for_cpu(codes, 2))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 7])
def test_int4_path_at_a_real_expert_width(bits, n):
    """bf16 experts of the Qwen3-30B-A3B shape (768 x 2048, group 64) go through the int4 kernel and match a
    float64 product of the dequantized weight (the AVX-512 layout bug gave relative errors above 1)."""
    torch.manual_seed(bits + 10 * n)
    out_f, in_f, group = 768, 2048, 64
    w = torch.randn(out_f, in_f) * 0.05
    packed, scales, biases, _ = mlx_quantize(w, bits, group)
    t = {"w": packed, "w.scales": scales.to(torch.bfloat16), "w.biases": biases.to(torch.bfloat16)}
    lf = LinearFormat("w", Scheme("affine", bits, group), out_f, in_f)
    if not int4_eligible(lf, torch.bfloat16):
        pytest.skip(f"the int4 kernel is off on this CPU ({torch.backends.cpu.get_cpu_capability()})")
    ref_w = affine.dequantize(packed, t["w.scales"], t["w.biases"], bits, group, torch.float64)
    xb = torch.randn(n, in_f).to(torch.bfloat16)
    want = xb.double() @ ref_w.t()
    ready = prepare(t, type("F", (), {"linears": {"w": lf}})(), torch.bfloat16)
    assert "w.int4" in ready
    got = qlinear(xb, ready, lf).double()
    rel = (got - want).abs().max() / want.abs().max()
    assert rel <= 0.02, f"{bits}-bit: max relative error {rel:.4f}"
