"""On a CUDA GPU (``pytest -m gpu``): quantized experts as stored in the VRAM slots (MLX affine, fp8 e4m3
blocks, MXFP4), dequantized in the fused kernel's registers. Each format's kernel against float64 of the
dequantized weights at Qwen3-30B-A3B's expert widths (T = 1, 7, 512); the quantized tiny checkpoints the
CPU tests use and a 2-layer real-shape 4-bit synth (``moestream convert --bits 4``) streamed at budget
all (CUDA graphs), eager, 25% VRAM + host tier and 10% VRAM + disk, torch.equal; the GPU's logits
within the format's tolerance of the CPU path's on the same checkpoint."""

import pytest
import torch

from moestream import fused_moe as fm

from .test_fused_moe_quant import ENGINE_FORMATS, quant_layer, routing
from .test_gpu_decode import CONFIG, PROMPT, STEPS, decode, expert_bytes

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(fm.triton is None, reason="needs Triton")]

KINDS = [("affine4-g64", None, False), ("affine8-g64", None, False), ("affine3-g64", None, False),
         ("affine2-g64", "affine6-g64", False), ("fp8-128", None, False), ("mxfp4", None, False),
         ("mxfp4", None, True)]


@pytest.fixture(scope="module", params=KINDS, ids=lambda c: f"{c[0]}{'-down-' + c[1] if c[1] else ''}"
                f"{'-gate_up' if c[2] else ''}")
def layer(request):
    kind, down, fused = request.param
    g = torch.Generator().manual_seed(3)
    storage, layout, _, fmt, deq = quant_layer(kind, 19, 768, 2048, g, down, fused)  # I 768, H 2048, 19 slots
    storage = storage.cuda()
    deq = [{r: w.cuda() for r, w in d.items()} for d in deq]  # float64 on the GPU, for the reference
    return storage, layout.views(storage), fmt, deq


def reference(x, w, idx, deq, perm):
    """float64 on the GPU, expert by expert (grouped), from the dequantized weights of each expert's slot."""
    import torch.nn.functional as F

    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in idx.unique().tolist():
        rows, cols = (idx == e).nonzero(as_tuple=True)
        d = deq[int(perm[e])]
        xe = x[rows].double()
        y = (F.silu(xe @ d["gate"].T) * (xe @ d["up"].T)) @ d["down"].T
        out.index_add_(0, rows, y * w[rows, cols, None].double())
    return out


@pytest.mark.parametrize("t", [1, 7, 512])
def test_quantized_kernel_at_real_widths(layer, t):
    storage, views, fmt, deq = layer
    e, k = 17, 8
    g = torch.Generator().manual_seed(t)
    perm = torch.randperm(19, generator=g)[:e]
    x = torch.randn(t, 2048, generator=g).to(torch.bfloat16).cuda()
    idx = routing(t, k, e, g).cuda()
    w = torch.rand(t, k, generator=g).cuda()
    proj = fm.expert_projections(views, fmt)
    out = fm.fused_moe(x, w, idx, perm.to(torch.int32).cuda(), *proj)
    ref = reference(x, w, idx, deq, perm)
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 1e-2, f"{fmt.tag} T={t}: {err:.2e}"
    assert torch.equal(fm.fused_moe(x, w, idx, perm.to(torch.int32).cuda(), *proj), out), "not repeatable"


@pytest.fixture(scope="module")
def quant_tiny(tmp_path_factory):
    from .helpers import make_qwen3_moe
    from .test_quant_formats import SHAPE, WRITERS

    root = tmp_path_factory.mktemp("gpu-quant")
    make_qwen3_moe(root / "float", seed=5, num_hidden_layers=3, **SHAPE)
    names = [*ENGINE_FORMATS, "mlx-3bit-g64", "mlx-8bit-g64", "mlx-5bit-g32-float-attn"]
    for name in names:
        WRITERS[name](root / "float", root / name)
    return root, names


@pytest.fixture(scope="module")
def real2_q4(tmp_path_factory):
    """Qwen3-30B-A3B's shapes, 2 layers, bf16 synth converted to 4-bit affine (group 64) by moestream convert."""
    from moestream.convert import ConvertSpec, convert
    from moestream.synth import plan_synth, write_synth

    root = tmp_path_factory.mktemp("gpu-real-q")
    write_synth(plan_synth(CONFIG, 2, "bf16", 0, None, "spread", 5.0), root / "bf16", device="cuda")
    out = convert(root / "bf16", root / "q4", ConvertSpec(64, 4, 4, 4, 4))
    return out


def cpu_logits(path):
    from moestream.engine import load

    engine = load(path, tokenizer=False, device="cpu", hotlist=False, learn_experts=False, cache_budget_gb="all")
    try:
        kv = engine.model.new_kv_cache()
        with torch.inference_mode():
            outs = [engine.model(PROMPT, 0, kv, all_logits=True).float()]
            for n, tok in enumerate(STEPS):
                outs.append(engine.model(torch.tensor([tok]), len(PROMPT) + n, kv).float())
        return outs
    finally:
        engine.close()


def budget_runs(path):
    total = expert_bytes(path)
    return {
        "all, graphs": dict(cache_budget_gb="all"),
        "all, eager": dict(cache_budget_gb="all", cuda_graphs=False),
        "25% + host tier": dict(cache_budget_gb=str(0.25 * total / 1e9), host_cache_gb="auto"),
        "10% + disk": dict(cache_budget_gb=str(0.10 * total / 1e9)),
    }


def check_budgets_and_cpu(path, rtol):
    runs = {name: decode(path, PROMPT, STEPS, **kw) for name, kw in budget_runs(path).items()}
    ref = runs["all, graphs"][0]
    for name, (out, _, cache) in runs.items():
        for n, (a, b) in enumerate(zip(ref, out)):
            assert torch.equal(a, b), f"{path.name}: {name} differs from budget all (graphs) at step {n}"
        if name.startswith(("25", "10")):
            assert cache.stats.misses > 0
    assert runs["25% + host tier"][2].tier_stats.host_hits > 0
    assert runs["10% + disk"][2].tier_stats.disk_reads > 0
    cpu = cpu_logits(path)
    got, want = torch.cat(ref), torch.cat(cpu)
    for row in range(got.shape[0]):
        err = float((got[row] - want[row]).norm() / want[row].norm())
        assert err < rtol, f"{path.name}: row {row} relative error {err:.2e} from the CPU path"


def test_quantized_tiny_checkpoints_on_the_gpu(quant_tiny):
    root, names = quant_tiny
    for name in names:
        check_budgets_and_cpu(root / name, 1e-4)


def test_real_shape_4bit_synth_on_the_gpu(real2_q4):
    check_budgets_and_cpu(real2_q4, 2e-2)
