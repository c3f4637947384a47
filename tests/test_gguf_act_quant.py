"""``benchmarks/gguf_vs_llamacpp.py``'s emulation of llama.cpp's 8-bit activation rounding."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gguf_vs_llamacpp.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gguf_vs_llamacpp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_q8_0_rounding_is_the_gguf_packages(bench):
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0)) * 3
    x[0, :32] = 0  # an all-zero block: scale 0
    kind = gguf.GGMLQuantizationType.Q8_0
    ref = gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), kind), kind)
    np.testing.assert_array_equal(bench.quantize_activations(x, "Q8_0").numpy(), ref)


def test_q8_k_blocks_of_256(bench):
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(1))
    y = bench.quantize_activations(x, "Q8_K")
    xb, yb = x.reshape(3, 3, 256), y.reshape(3, 3, 256)
    mx = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))
    codes = yb * (-127.0 / mx)  # the int8 codes, back from the dequantized values
    assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.abs().max() <= 127.001
    assert torch.allclose(yb.gather(-1, xb.abs().argmax(-1, keepdim=True)), mx)  # the largest value is kept
    assert (yb - xb).abs().max() <= (mx.abs() / 127 / 2 * 1.0001).max()


def test_emulation_restores_the_kernels(bench):
    from moestream.quant import native

    saved = native.linear, native.swiglu
    with bench.ActivationQuantEmulation():
        assert native.linear is not saved[0] and native.swiglu(None, None, None) is None
    assert (native.linear, native.swiglu) == saved
