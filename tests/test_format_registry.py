"""The stored-format registry (moestream.quant.registry): the Python entries and the compiled kernels' ggml
type-traits table (csrc/traits.h, read through ms_ggml_traits) agree for every ggml type, both agree with the
gguf package's block sizes (llama.cpp's own), and every entry's reference dequantizer, on one block, gives the
weights an independent dequantization gives (the gguf package, numpy unpacking of the MLX bit stream, the
e4m3 and e2m1 tables), so its float64 product with an input is that of the independent weights; where the
compiled kernels cover the format, their product is within the kernels' bound of that float64 product."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from moestream.quant import affine, ggml, native, registry, turboquant
from moestream.quant.formats import LinearFormat, Scheme, ggml_scheme

from .gguf_helpers import encode
from .quant_helpers import FP4, fp8_quantize, mlx_dequantize, mlx_quantize, mxfp4_quantize
from .test_quant_native import BOUND, rel_err

GGML = tuple(registry.ggml_formats())


def _library_traits() -> dict:
    lib = native.library()
    if lib is None:
        pytest.skip(f"the CPU kernels are not built here ({native._state['error']})")
    return native.library_ggml_traits(lib)


def test_every_ggml_type_has_one_entry_and_a_row_in_the_kernels_table():
    assert set(GGML) == set(ggml.TYPES) == set(_library_traits())
    codes = [registry.get(t).cpu.type_code for t in GGML]
    assert codes == list(range(len(GGML)))  # one row per code, no gaps


@pytest.mark.parametrize("qtype", GGML)
def test_registry_and_kernel_traits_agree(qtype):
    f = registry.get(qtype)
    code, block, size, group, q8, unit = _library_traits()[qtype]
    assert (f.name, f.cpu.type_code, f.block, f.type_size, f.cpu.group, f.cpu.q8) == (qtype, code, block, size,
                                                                                       group, q8)
    assert (f.block, f.type_size) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    assert ggml.TYPES[qtype] == (f.block, f.type_size, f.bits)
    assert native.GGML_TYPES[qtype] == code and native.GGML_GROUP[qtype] == group
    assert f.block % group == 0 and unit == ("x" if code >= native.GGML_TYPES["MXFP4"] else "g")
    assert (qtype in native.Q8_TYPES) == (q8 is not None)


def test_a_disagreeing_table_is_refused_at_load(monkeypatch):
    lib = native.library()
    if lib is None:
        pytest.skip("the CPU kernels are not built here")
    native._check_traits(lib)  # agrees
    wrong = registry.GgmlFormat(**{**registry.get("Q4_K").__dict__, "type_size": 145})
    monkeypatch.setitem(registry.FORMATS, "Q4_K", wrong)
    with pytest.raises(RuntimeError, match="ggml type Q4_K"):
        native._check_traits(lib)


def test_every_entry_declares_its_parts_and_describes_itself():
    assert {"affine", "fp8", "mxfp4", "compressed-tensors", "turboquant"} <= set(registry.FORMATS)
    for f in registry.FORMATS.values():
        assert f.dequantize is not None and f.check is not None and f.weight, f.name
        assert (f.cpu is not None) != (f.no_cpu is not None), f.name
        assert bool(f.gpu_bits) != (f.no_gpu is not None), f.name
        text = f.describe()
        assert text.startswith(f.name + ":") and "CPU kernel" in text and "GPU" in text
    assert registry.quant_params() == ("scales", "biases", "weight_scale_inv", "weight_scale")
    assert registry.by_quant_method("fp8").name == "fp8" and registry.by_mode("turboquant").name == "turboquant"
    assert registry.of(Scheme("gguf", 4, 256, ggml="Q4_K")) is registry.get("Q4_K")


def _product_check(fmt, t, lf, w_indep, kernel=True, exact=True):
    """The entry's weights equal the independent ones (``exact``; else their float64 products with x agree
    within 1e-6: MLX affine's reference rounds q * s + b once, moestream's twice), and the compiled kernel, where
    it covers the format, is within BOUND of the float64 product of the independent weights."""
    w = fmt.dequantize(t, lf, 0, lf.out_features)
    assert w.dtype == torch.float32 and w.shape == (lf.out_features, lf.in_features)
    finite = torch.isfinite(w_indep)
    assert torch.equal(torch.isfinite(w), finite)
    x = torch.randn(3, lf.in_features, generator=torch.Generator().manual_seed(1))
    y64 = x.double() @ (w_indep.float() if exact else w_indep).double().t()  # the weights as float32 values
    if exact:
        assert torch.equal(w[finite], w_indep[finite].float())
        assert torch.equal(x.double() @ w.double().t(), y64)
    else:
        assert rel_err(x.double() @ w.double().t(), y64) <= 1e-6
    if kernel and native.paths() and bool(finite.all()):
        y = native.linear(x, t, lf)
        assert y is not None and rel_err(y, y64) <= BOUND


@pytest.mark.parametrize("qtype", GGML)
def test_ggml_reference_dequantizer_on_one_block(qtype):
    f = registry.get(qtype)
    w = np.random.default_rng(3).normal(0, 0.05, (4, f.block)).astype(np.float32)
    raw = encode(w, qtype, np.random.default_rng(3))[0]
    lf = LinearFormat("w", ggml_scheme(ggml.dtype_name(qtype)), 4, f.block)
    with np.errstate(all="ignore"):
        indep = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, gguf.GGMLQuantizationType[qtype])))
    _product_check(f, {"w": torch.from_numpy(raw)}, lf, indep, kernel=f.block % 32 == 0)


@pytest.mark.parametrize("bits", affine.BITS)
def test_affine_reference_dequantizer_on_one_block(bits):
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(bits)) * 0.05
    packed, scales, biases, _ = mlx_quantize(w, bits, 64)
    t = {"w": packed, "w.scales": scales, "w.biases": biases}
    lf = LinearFormat("w", Scheme("affine", bits, 64), 4, 64)
    _product_check(registry.get("affine"), t, lf, mlx_dequantize(packed, scales, biases, bits), exact=False)


@pytest.mark.parametrize("scale", [None, "weight_scale"])
def test_fp8_reference_dequantizer_on_one_block(scale):
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    q, s_inv, _ = fp8_quantize(w, 16)
    sch = Scheme("fp8", 8, 16, (16, 16), scale=scale)
    t = {"w": q, "w." + sch.scale_param: s_inv}
    lf = LinearFormat("w", sch, 16, 32)
    indep = q.float().double() * s_inv.double().repeat_interleave(16, 0).repeat_interleave(16, 1)
    fmt = registry.get("fp8" if scale is None else "compressed-tensors")
    _product_check(fmt, t, lf, indep)


@pytest.mark.parametrize("packed", [False, True])
def test_mxfp4_reference_dequantizer_on_one_block(packed):
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(4))
    blocks, scales, _ = mxfp4_quantize(w)
    sch = Scheme("mxfp4", 4, 32, scale="weight_scale" if packed else None)
    t = {"w": blocks.reshape(4, 16) if packed else blocks, "w." + sch.scale_param: scales}
    codes = np.stack((blocks.numpy() & 15, blocks.numpy() >> 4), -1).reshape(4, 32)
    indep = torch.from_numpy(FP4[codes] * np.exp2(scales.numpy().astype(np.float64) - 127))
    fmt = registry.get("compressed-tensors" if packed else "mxfp4")
    _product_check(fmt, t, LinearFormat("w", sch, 4, 32), indep)


@pytest.mark.parametrize("levels", [2, 3, 4, 8, 16])
def test_turboquant_reference_dequantizer_on_one_block(levels):
    g = torch.Generator().manual_seed(levels)
    inn, out = 64, 4
    codes = torch.randint(0, levels, (out, inn), generator=g)
    codebook = torch.randn(levels, generator=g).half()
    scales = (torch.rand(out, 2, generator=g) + 0.5).half()
    t = {"w": turboquant.pack_codes(codes, levels), "w.scales": scales, "w.codebook": codebook}
    sch = turboquant.TQScheme("turboquant", turboquant.LEVEL_BITS.get(levels, 0), 32, levels=levels)
    indep = codebook.double()[codes] * scales.double().repeat_interleave(32, 1)
    _product_check(registry.get("turboquant"), t, LinearFormat("w", sch, out, inn), indep, kernel=False)
