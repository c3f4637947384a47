"""The fused MoE kernel on quantized experts as stored (MLX affine 2-8 bits, fp8 e4m3 blocks, MXFP4),
under Triton's interpreter: against a float64 product of the dequantized weights (from the independent
quantizers in quant_helpers), both kernel paths, odd shapes, the bits independent of the slot; and
quantized tiny checkpoints through the engine's fused path torch.equal at every budget. The same at
real shapes on a GPU: test_gpu_quant.py."""

import pytest
import torch

from moestream import fused_moe as fm
from moestream.quant import affine
from moestream.quant.formats import ExpertFormat, LinearFormat, Scheme
from moestream.slot_pool import SlotLayout

from .quant_helpers import fp8_quantize, mlx_quantize, mxfp4_quantize

interpreted = pytest.mark.skipif(fm.triton is None or not fm.interpreted(),
                                 reason="needs Triton's interpreter (pip install triton; TRITON_INTERPRET=1)")


def affine_pieces(role, w, bits, group, sdt):
    packed, scales, biases, _ = mlx_quantize(w, bits, group)
    scales, biases = scales.to(sdt), biases.to(sdt)
    deq = affine.dequantize(packed, scales, biases, bits, group, torch.float64)
    return {role: packed, role + ".scales": scales, role + ".biases": biases}, deq


def fp8_pieces(role, w, block, per):
    if per == "block":
        q, s, deq = fp8_quantize(w, block)
        return {role: q, role + ".weight_scale_inv": s}, deq.double()
    q, s, _ = fp8_quantize(w, max(w.shape))  # codes of one whole block, rescaled per row or per tensor below
    one = s.reshape(())  # the whole-weight scale; varied per row, or kept, as the stored scales
    rs = (torch.rand(w.shape[0], 1) + 0.5) * one if per == "channel" else one.clone()
    deq = q.double() * rs.double()
    return {role: q, role + ".weight_scale_inv": rs.float()}, deq


def fp8_raw_pieces(role, w, block):
    """Random e4m3 bytes (every finite value: subnormals, -0 and the largest included; NaN left out) with
    block scales near 1/500, so the decode of each byte is tested, not only the values a quantizer emits."""
    g = torch.Generator().manual_seed(int(w.abs().sum() * 1000) % 2**31)
    b = torch.randint(0, 256, w.shape, generator=g, dtype=torch.uint8)
    b = torch.where((b & 0x7F) == 0x7F, b ^ 0x01, b)  # 0x7F / 0xFF are NaN
    q = b.view(torch.float8_e4m3fn)
    s = torch.rand(-(-w.shape[0] // block), -(-w.shape[1] // block), generator=g) / 512 + 1 / 1024
    deq = q.double() * s.double().repeat_interleave(block, 0)[: w.shape[0]].repeat_interleave(block, 1)[:, : w.shape[1]]
    return {role: q, role + ".weight_scale_inv": s}, deq


def mxfp4_pieces(role, w, packed):
    blocks, scales, deq = mxfp4_quantize(w)
    b = blocks.reshape(w.shape[0], -1) if packed else blocks
    return {role: b, role + ".scales": scales}, deq.double()


def scheme_for(kind):
    name, *arg = kind.split("-")
    if name.startswith("affine"):
        return Scheme("affine", int(name[6:]), int(arg[0][1:]))
    if name in ("fp8", "fp8raw"):
        block = {"channel": (1, 0), "tensor": (0, 0)}.get(arg[0]) or (int(arg[0]), int(arg[0]))
        return Scheme("fp8", 8, block[1], block)
    return Scheme("mxfp4", 4, 32)


def expert_pieces(kind, role, w):
    name, *arg = kind.split("-")
    if name.startswith("affine"):
        sdt = torch.float16 if "fp16" in arg else torch.bfloat16
        return affine_pieces(role, w, int(name[6:]), int(arg[0][1:]), sdt)
    if name == "fp8raw":
        return fp8_raw_pieces(role, w, int(arg[0]))
    if name == "fp8":
        return fp8_pieces(role, w, int(arg[0]) if arg[0].isdigit() else 0,
                          "block" if arg[0].isdigit() else arg[0])
    return mxfp4_pieces(role, w, "packed" in arg)


def quant_layer(kind, s, i, h, g, down_kind=None, fused=False):
    """A slot pool of ``s`` random experts stored as ``kind`` over one uint8 storage, as the VRAM slot pool
    lays them out: (views, ExpertFormat, slot -> float64 dequantized {gate, up, down})."""
    down_kind = down_kind or kind
    experts, deq = [], []
    for _ in range(s):
        gate = torch.randn(i, h, generator=g)
        up = torch.randn(i, h, generator=g)
        down = torch.randn(h, i, generator=g) / i**0.5
        pieces, ref = {}, {}
        if fused:
            gu = torch.stack((gate, up), 1).flatten(0, 1)  # rows g0, u0, g1, u1, ...
            p, d = expert_pieces(kind, "gate_up", gu)
            pieces.update(p)
            ref["gate"], ref["up"] = d[0::2], d[1::2]
        else:
            for role, w in (("gate", gate), ("up", up)):
                p, ref[role] = expert_pieces(kind, role, w)
                pieces.update(p)
        p, ref["down"] = expert_pieces(down_kind, "down", down)
        pieces.update(p)
        experts.append(pieces)
        deq.append(ref)
    layout = SlotLayout.of([(r, t.dtype, tuple(t.shape)) for r, t in experts[0].items()])
    storage = torch.zeros(s, layout.slot_bytes, dtype=torch.uint8)
    views = layout.views(storage)
    for slot, pieces in enumerate(experts):
        for r, t in pieces.items():
            views[r][slot].copy_(t)
    lins = {"down": LinearFormat("down", scheme_for(down_kind), h, i)}
    if fused:
        lins["gate_up"] = LinearFormat("gate_up", scheme_for(kind), 2 * i, h)
    else:
        lins["gate"] = LinearFormat("gate", scheme_for(kind), i, h)
        lins["up"] = LinearFormat("up", scheme_for(kind), i, h)
    return storage, layout, views, ExpertFormat(lins, fused_gate_up=fused), deq


def routing(t, k, e, g):
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])


# kind, (I, H) -- odd widths where the format allows them (fp8 blocks cut at the edges)
CASES = [
    ("affine4-g32", (96, 64), None, False),
    ("affine3-g64", (64, 128), None, False),
    ("affine2-g32", (64, 96), "affine6-g32", False),
    ("affine5-g32", (32, 64), None, False),
    ("affine8-g64-fp16", (64, 64), None, False),
    ("fp8-32", (48, 80), None, False),
    ("fp8-channel", (40, 56), None, False),
    ("fp8-tensor", (40, 24), None, False),
    ("mxfp4", (64, 96), None, False),
    ("mxfp4-packed", (32, 64), None, True),
    ("affine4-g32", (32, 64), None, True),
    ("fp8raw-32", (40, 48), None, False),
]
# widths where the decode kernels' column loop runs more than once and ends in a partial step (their
# steps are 512 columns over H and 256 over I for quantized experts): the word offsets k0 // 8, k0 // GS
WIDE = [("affine4-g32", (288, 640)), ("affine2-g128", (256, 1152)), ("mxfp4", (288, 576)),
        ("affine8-g64", (320, 576)), ("fp8-128", (160, 320))]


@interpreted
@pytest.mark.parametrize("kind,shape,down,fused", CASES, ids=[
    f"{c[0]}{'-down-' + c[2] if c[2] else ''}{'-gate_up' if c[3] else ''}" for c in CASES])
@pytest.mark.parametrize("t,k,e", [(1, 2, 5), (3, 3, 6), (40, 2, 7)], ids=["decode", "rows", "blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_kernel_matches_float64(kind, shape, down, fused, t, k, e, dtype):
    g = torch.Generator().manual_seed(hash((kind, t, k)) % 2**31)
    i, h = shape
    s = e + 2
    storage, layout, views, fmt, deq = quant_layer(kind, s, i, h, g, down, fused)
    perm = torch.randperm(s, generator=g)[:e]
    x = torch.randn(t, h, generator=g).to(dtype)
    idx = routing(t, k, e, g)
    w = torch.rand(t, k, generator=g)
    gate, up, dn = fm.expert_projections(views, fmt)
    out = torch.full((t, h), float("nan"), dtype=dtype)
    got = fm.fused_moe(x, w, idx, perm.to(torch.int32), gate, up, dn, out=out)
    assert got is out and not torch.isnan(out).any()
    ref = fm.reference_moe(x, w, idx, {ex: deq[int(perm[ex])] for ex in range(e)})
    err = float((out.double() - ref).norm() / ref.norm())
    # float32: the float32 sums; bf16: the output's rounding (and, blocked, the tile's bf16 operands)
    assert err < (2e-5 if dtype == torch.float32 else 1.5e-2), f"{kind} t={t}: {err:.2e}"
    moved = torch.randperm(s, generator=g)[:e]
    storage2 = torch.zeros_like(storage)
    storage2[moved] = storage[perm]
    again = fm.fused_moe(x, w, idx, moved.to(torch.int32), *fm.expert_projections(layout.views(storage2), fmt))
    assert torch.equal(again, out), "the same experts in other slots gave other bits"


@interpreted
@pytest.mark.parametrize("kind,shape", WIDE, ids=[f"{k}-{s[0]}x{s[1]}" for k, s in WIDE])
@pytest.mark.parametrize("t,k", [(1, 1), (2, 2)], ids=["decode", "rows"])
def test_quantized_kernel_over_several_column_steps(kind, shape, t, k):
    g = torch.Generator().manual_seed(t * 7 + shape[0])
    i, h = shape
    e = 3
    _, _, views, fmt, deq = quant_layer(kind, e, i, h, g)
    x = torch.randn(t, h, generator=g)
    idx = routing(t, k, e, g)
    w = torch.rand(t, k, generator=g)
    got = fm.fused_moe(x, w, idx, torch.arange(e, dtype=torch.int32), *fm.expert_projections(views, fmt))
    ref = fm.reference_moe(x, w, idx, dict(enumerate(deq)))
    err = float((got.double() - ref).norm() / ref.norm())
    assert err < 2e-5, f"{kind} {shape} t={t}: {err:.2e}"


@interpreted
def test_affine_word_kernels_at_real_widths(monkeypatch):
    """The decode word kernels (4-bit, group 64) at Qwen3-30B-A3B's widths (H 2048, I 768) against float64, and a
    token's bits the same alone as beside another token. Tiles larger than the GPU's (fewer programs for the
    interpreter), the same code; the GPU's own tiles at these widths: test_gpu_quant.py."""
    monkeypatch.setattr(fm, "AFFINE_ROWS", {**fm.AFFINE_ROWS, "bn1": 128, "wk1": 64, "bn2": 256, "wk2": 32})
    g = torch.Generator().manual_seed(11)
    i, h, e = 768, 2048, 4
    _, _, views, fmt, deq = quant_layer("affine4-g64", e, i, h, g)
    proj = fm.expert_projections(views, fmt)
    table = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    x = torch.randn(2, h, generator=g)
    idx = routing(2, 2, e, g)
    w = torch.rand(2, 2, generator=g)
    got = fm.fused_moe(x, w, idx, table, *proj)
    ref = fm.reference_moe(x, w, idx, {ex: deq[int(table[ex])] for ex in range(e)})
    err = float((got.double() - ref).norm() / ref.norm())
    assert err < 2e-5, f"{err:.2e}"
    alone = fm.fused_moe(x[1:], w[1:], idx[1:], table, *proj)
    assert torch.equal(alone[0], got[1]), "a token's bits depend on the token beside it"


def test_formats_without_a_gpu_kernel_are_named():
    assert fm.gpu_format(Scheme("affine", 4, 64)) is None
    assert fm.gpu_format(Scheme("fp8", 8, 128, (128, 128))) is None
    assert fm.gpu_format(Scheme("mxfp4", 4, 32)) is None
    why = fm.gpu_format(Scheme("gguf", 4, 256, ggml="Q4_K"))
    assert why is not None and "gguf Q4_K" in why
    why = fm.gpu_format(Scheme("tq", 3, 128))
    assert why is not None and "no GPU kernel" in why


# -- quantized checkpoints through the engine's fused path (interpreter) --------------------------

ENGINE_FORMATS = ["mlx-4bit-g32", "mlx-2bit-g32-down6", "fp8-blocks", "mxfp4"]


@pytest.fixture(scope="module")
def quant_ckpts(tmp_path_factory):
    from .helpers import make_qwen3_moe
    from .test_quant_formats import SHAPE, WRITERS

    root = tmp_path_factory.mktemp("fused-quant")
    make_qwen3_moe(root / "float", seed=7, num_hidden_layers=2, **SHAPE)
    for name in ENGINE_FORMATS:
        WRITERS[name](root / "float", root / name)
    return root


def quant_run(path, **kw):
    from moestream.engine import load

    from .test_fused_moe import PROMPT, STEPS, run_steps

    engine = load(path, tokenizer=False, device="cpu", hotlist=False, learn_experts=False, **kw)
    try:
        names = {type(k).__name__ for k in engine.pipeline.kernels.values()}
        return run_steps(engine, PROMPT, STEPS), engine.cache, names
    finally:
        engine.close()


@interpreted
@pytest.mark.parametrize("name", ENGINE_FORMATS)
def test_quantized_checkpoint_on_the_fused_path(quant_ckpts, name):
    """Budget all on the fused kernel (stored bytes in the slots) close to the CPU kernels' logits; VRAM slots
    below a layer's needs with the host tier, and no VRAM cache beyond one layer with the disk, the same bits."""
    from .test_gpu_tier import expert_bytes

    path = quant_ckpts / name
    ref, _, names = quant_run(path, cache_budget_gb="all", fused_experts=True)
    assert names == {"FusedSwiGLUKernel"}
    cpu, _, cpu_names = quant_run(path, cache_budget_gb="all")
    assert "FusedSwiGLUKernel" not in cpu_names
    for a, b in zip(cpu, ref):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    one = expert_bytes(path)
    # the tiers move stored bytes whatever they encode: every tier for the first format, the host tier for the rest
    tiers = ((3, 16, 0), (0, 0, 0), (4, 16, 1)) if name == ENGINE_FORMATS[0] else ((3, 16, 0),)
    for vram, host, ahead in tiers:
        out, cache, _ = quant_run(path, cache_budget_gb=str(vram * one / 1e9), host_cache_gb=str(host * one / 1e9),
                                  fused_experts=True, prefetch_ahead=ahead)
        assert all(torch.equal(a, b) for a, b in zip(ref, out)), f"{name}: VRAM {vram}, host {host}"
        assert cache.stats.misses > 0


@interpreted
def test_quantized_tier_without_the_fused_kernel_is_refused(quant_ckpts):
    from moestream.engine import load
    from moestream.errors import ConfigError

    with pytest.raises(ConfigError, match="quantized experts on the GPU tier.*fused kernel is not in use"):
        load(quant_ckpts / "mlx-4bit-g32", tokenizer=False, device="cpu", host_cache_gb="0.001",
             fused_experts=False, cache_budget_gb="0")


def test_inspect_says_what_the_gpu_does_with_quantized_experts(quant_ckpts):
    from moestream.inspect import inspect

    text = inspect(str(quant_ckpts / "mlx-4bit-g32")).to_text()
    gpu = next(line for line in text.splitlines() if line.startswith("on a GPU:"))
    assert "on their stored bytes (affine 4-bit, group 32" in gpu and "MB of VRAM per expert" in gpu
    assert "over PCIe per token" in gpu


def test_gpu_unsupported_names_the_layer_and_why():
    from moestream.models.moe import swiglu_expert
    from moestream.quant.expert import DequantizedExpert, QuantizedSwiGLU
    from moestream.quant.model import gpu_unsupported

    def lin(role, sch, o=8, i=16):
        return LinearFormat(role, sch, o, i)

    ok = ExpertFormat({"gate": lin("gate", Scheme("affine", 4, 16)), "up": lin("up", Scheme("affine", 4, 16)),
                       "down": lin("down", Scheme("affine", 4, 8), 16, 8)})
    assert gpu_unsupported({0: QuantizedSwiGLU(ok)}) is None
    tq = ExpertFormat({"gate": lin("gate", Scheme("gguf", 4, 32, ggml="Q4_0")),
                       "up": lin("up", Scheme("gguf", 4, 32, ggml="Q4_0")),
                       "down": lin("down", Scheme("gguf", 4, 32, ggml="Q4_0"), 16, 8)})
    why = gpu_unsupported({0: QuantizedSwiGLU(ok), 3: QuantizedSwiGLU(tq)})
    assert why.startswith("layer 3:") and "gguf Q4_0" in why
    mixed = ExpertFormat({"gate": lin("gate", Scheme("affine", 4, 16)), "up": lin("up", Scheme("affine", 8, 16)),
                          "down": lin("down", Scheme("affine", 4, 8), 16, 8)})
    why = gpu_unsupported({1: QuantizedSwiGLU(mixed)})
    assert why.startswith("layer 1:") and "gate and up" in why
    why = gpu_unsupported({2: DequantizedExpert(ok, swiglu_expert)})
    assert "layer 2" in why and "not SwiGLU experts" in why


def test_inspect_gpu_line_for_quantized_attention_with_float_experts(quant_ckpts, tmp_path):
    """Attention quantized, experts float (convert --expert-bits 16): the fused kernel on float experts, and
    CUDA graphs (the resident linears are dequantized at load on CUDA); 4-bit experts: graphs too."""
    from moestream.convert import ConvertSpec, convert
    from moestream.inspect import inspect

    out = convert(quant_ckpts / "float", tmp_path / "a4", ConvertSpec(32, 16, 16, 4, 4))
    gpu = next(ln for ln in inspect(str(out)).to_text().splitlines() if ln.startswith("on a GPU:"))
    assert "fused SwiGLU kernel" in gpu and "decode steps as CUDA graphs" in gpu, gpu
    out = convert(quant_ckpts / "float", tmp_path / "e4", ConvertSpec(32, 4, 4, 4, 4))
    gpu = next(ln for ln in inspect(str(out)).to_text().splitlines() if ln.startswith("on a GPU:"))
    assert "on their stored bytes (affine 4-bit, group 32" in gpu and "decode steps as CUDA graphs" in gpu, gpu
