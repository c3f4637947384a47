"""The load plan (moestream.load_plan): what ``moestream inspect`` prints is what ``engine.load`` executes.

Over every kind of checkpoint the suite builds (families, layouts, quantized formats, GGUF, MLX, turboquant,
CPU budgets, a host tier on the CPU), the plan inspect prints equals the plan the engine loaded with, and the
loaded engine's pipeline kernels per layer, cache tier, slot pool and decode path are the plan's. Device
decisions for CUDA are planned on the CPU without executing; refusals are raised by load as planned.
"""

import dataclasses
import re

import pytest
import torch

from moestream import fused_moe
from moestream.cache import ExpertCache
from moestream.engine import load
from moestream.errors import BudgetError, ConfigError
from moestream.inspect import inspect
from moestream.load_plan import LoadPlan, plan_load
from moestream.options import EngineOptions
from moestream.pipeline import ExpertKernel, ExpertSpec
from moestream.sources import open_checkpoint
from moestream.tiered_cache import TieredExpertCache

from .helpers import make_qwen3_moe, read_all, to_layout, write_checkpoint

SHAPE = dict(moe_intermediate_size=64, hidden_size=64, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2)


def _build(kind: str, root):
    """A checkpoint of ``kind`` under ``root``; its path."""
    src = root / "float"
    if not src.exists():
        make_qwen3_moe(src, seed=7, **SHAPE)
    if kind == "qwen3_moe":
        return src
    if kind in ("fused", "stacked"):
        return write_checkpoint(src, root / kind, to_layout(read_all(src), kind, SHAPE["num_experts"]))
    if kind in ("mlx-4bit-g32", "fp8-blocks", "mxfp4"):
        from .test_quant_formats import WRITERS

        WRITERS[kind](src, root / kind)
        return root / kind
    if kind == "turboquant":
        from .test_turboquant import SHAPE as TQ_SHAPE
        from .test_turboquant import write_tq

        make_qwen3_moe(root / "tq-float", seed=3, **TQ_SHAPE)
        write_tq(root / "tq-float", root / kind)
        return root / kind
    if kind == "gguf-q8_0":
        from .gguf_helpers import make_model, write_gguf

        write_gguf(make_model(seed=1, num_hidden_layers=2), root / "m.gguf", "Q8_0")
        return root / "m.gguf"
    if kind == "gpt_oss-gguf":
        from .gguf_helpers import make_gpt_oss, write_gpt_oss_gguf

        write_gpt_oss_gguf(make_gpt_oss(seed=1), root / "g.gguf")
        return root / "g.gguf"
    if kind == "kimi_linear":  # SwiGLU experts
        from .test_family_kimi import make_kimi_linear

        make_kimi_linear(root / kind)
        return root / kind
    if kind == "kimi_k3":  # SiTU-GLU experts (beta, linear_beta), latent
        from .test_family_kimi import write_k3

        (root / kind).mkdir()
        return write_k3(root / kind)[0]
    from .test_mlx_format import build  # the families' transformers references, saved

    return build(kind, root / kind)[1]


KINDS = ["qwen3_moe", "fused", "stacked", "mlx-4bit-g32", "fp8-blocks", "mxfp4", "turboquant", "gguf-q8_0",
         "gpt_oss-gguf", "kimi_linear", "kimi_k3", "gpt_oss", "mixtral", "deepseek_v3"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("plans"), {}

    def get(kind):
        if kind not in built:
            built[kind] = _build(kind, root)
        return built[kind]

    return get


def _options(options: dict) -> EngineOptions:
    options = {"device": "cpu", **options}
    return EngineOptions.make(options.pop("cache_budget_gb", "0"), hotlist=False, learn_experts=False, **options)


def _stable(lines: list[str]) -> list[str]:
    """The plan's lines less those with measured numbers (memory available drifts between two calls)."""
    return [ln for ln in lines if not ln.lstrip().startswith(("note:", "budget:"))]


def assert_engine_runs_its_plan(engine, plan: LoadPlan) -> None:
    """The loaded engine's kernels per layer, tiers and decode path are the plan's."""
    assert engine.plan is plan and engine.budget is plan.budget
    kernels = engine.pipeline.kernels
    assert sorted(kernels) == [lp.layer for lp in plan.layers]
    for lp in plan.layers:
        k = kernels[lp.layer]
        assert isinstance(k, ExpertKernel)
        assert (type(k).__name__, k.kind, k.name) == (lp.kernel, lp.kind, lp.name), lp
        assert k.reduces_k == (lp.kind == "in_slots")
        block = next(b for b in engine.model.moe_blocks() if b.layer == lp.layer)
        assert block.expert.describe() == lp.expert
    assert isinstance(engine.cache, TieredExpertCache) == plan.tiered
    assert type(engine.cache) is (TieredExpertCache if plan.tiered else ExpertCache)
    if plan.tiered:
        assert (engine.cache.pool is not None) == plan.pooled
    assert engine.cache.budget_bytes == plan.budget.budget
    runner = getattr(engine.model, "decode_runner", None)
    assert (runner is not None) == plan.decode_runner
    if runner is not None:
        assert runner.graphs == plan.graphs
    assert engine.pipeline.following == {} or plan.lookahead > 0
    assert engine.io is plan.io and engine.io.prefetch_ahead == plan.disk_ahead
    assert engine.device == plan.device and engine.dtype == plan.dtype


def check(path, **options):
    """Plan, inspect and load ``path`` with ``options`` (on the CPU unless ``device`` says); assert they agree; the
    plan."""
    opts = _options(options)
    printed = inspect(str(path), options=opts)
    engine = load(path, options=opts, tokenizer=False)
    try:
        plan = engine.plan
        assert_engine_runs_its_plan(engine, plan)
        assert _stable(printed.load_plan) == _stable(plan.describe()), "inspect's plan is not the engine's"
        assert printed.load_plan[0].startswith("load plan:") and any("kernel:" in ln for ln in printed.load_plan)
        text = printed.to_text()
        assert all(ln in text for ln in _stable(plan.describe()))
        return plan
    finally:
        engine.close()


def plan_load_of(path, device=None, **options) -> LoadPlan:
    """The plan for ``path`` on ``device`` (None: the options', the CPU unless they say), nothing executed."""
    opts = _options(options)
    ckpt = open_checkpoint(path)
    try:
        return plan_load(ckpt, opts, device)
    finally:
        ckpt.close()


def cuda_plan(path, **options) -> LoadPlan:
    """The plan for a CUDA device, made here on the CPU (nothing executed)."""
    return plan_load_of(path, torch.device("cuda"), **options)


@pytest.mark.parametrize("kind", KINDS)
def test_inspect_prints_the_plan_the_engine_executes(ckpts, kind):
    path = ckpts(kind)
    for budget in ("0", "all"):
        plan = check(path, cache_budget_gb=budget)
        assert plan.device.type == "cpu" and not plan.tiered and not plan.refusals
        assert (plan.budget.budget is None) == (budget == "all")
    # the GPU line inspect prints comes from the CUDA plan
    gpu = cuda_plan(path)
    from moestream.inspect import gpu_kernel

    assert inspect(str(path), options=_options({})).gpu_kernel.split(";")[0] == gpu_kernel(gpu, 1, 1).split(";")[0]


def test_kernels_follow_the_declared_expert_kinds(ckpts):
    qwen = check(ckpts("qwen3_moe"))
    assert {(lp.expert, lp.kernel, lp.kind) for lp in qwen.layers} == {("swiglu", "NativeMoEKernel", "grouped")}
    assert {lp.expert for lp in check(ckpts("kimi_linear")).layers} == {"swiglu"}
    kimi = check(ckpts("kimi_k3"))
    assert {lp.expert.split(" ")[0] for lp in kimi.layers} == {"situ_glu"}
    assert {lp.kind for lp in kimi.layers} == {"grouped"}
    oss = check(ckpts("gpt_oss-gguf"))  # separate gate/up/down with biases: the compiled clamped kernel
    assert {lp.expert.split(" ")[0] for lp in oss.layers} == {"clamped_swiglu"} and {lp.kind for lp in oss.layers} \
        == {"grouped"}
    oss = check(ckpts("gpt_oss"))  # transformers' fused gate_up [H, 2I]: the family's own function
    assert all("gate_up layout" in lp.expert and lp.kind == "per_expert" for lp in oss.layers)
    q8 = check(ckpts("gguf-q8_0"))
    assert all(lp.stored.startswith("gguf") and lp.kind == "grouped" for lp in q8.layers)
    tq = check(ckpts("turboquant"))
    assert all(lp.kind == "per_expert" and lp.kernel == "PerExpertKernel" for lp in tq.layers)
    with load(ckpts("kimi_k3"), tokenizer=False, learn_experts=False, hotlist=False, device="cpu") as engine:
        spec = ExpertSpec.of(engine.model.moe_blocks()[0].expert_fn)  # a bare function: its declared kind
    assert spec.kind == "situ_glu" and "beta" in spec.keywords


def test_batched_and_per_expert_kernels_on_the_cpu(ckpts):
    plan = check(ckpts("qwen3_moe"), batched_experts=True)
    assert {(lp.kernel, lp.kind) for lp in plan.layers} == {("BatchedSwiGLUKernel", "per_layer")}
    plan = check(ckpts("kimi_k3"), batched_experts=True)  # batched covers SwiGLU only: one expert at a time
    assert {lp.kind for lp in plan.layers} == {"per_expert"}


def test_a_host_tier_on_the_cpu(ckpts):
    """The GPU tier's cache on the CPU (--host-cache-gb): executed here, as planned."""
    plan = check(ckpts("qwen3_moe"), host_cache_gb="0.001")
    assert plan.tiered and not plan.fused and plan.budget.host > 0
    assert "host tier" in plan.tiers()


@pytest.mark.skipif(not fused_moe.available("cpu"), reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
def test_the_fused_kernel_on_the_cpu(ckpts):
    """``fused_experts=True`` under Triton's interpreter: the slot pool, the fused kernel and the static decode
    path on the CPU, executed as planned (float and MLX affine experts)."""
    for kind in ("qwen3_moe", "mlx-4bit-g32"):
        plan = check(ckpts(kind), fused_experts=True, host_cache_gb="0.001")
        assert plan.tiered and plan.fused and plan.pooled and not plan.graphs, kind
        assert {lp.kind for lp in plan.layers} == {"in_slots"}
    assert check(ckpts("qwen3_moe"), fused_experts=True).decode_runner  # static buffers, no graphs on the CPU
    assert "graphs are CUDA's" in plan_load_of(ckpts("qwen3_moe"), fused_experts=True).graphs_why
    # quantized resident linears stay quantized on the CPU (dequantized at load on CUDA only): no static path
    quantized = plan_load_of(ckpts("mlx-4bit-g32"), fused_experts=True)
    assert not quantized.decode_runner and "QuantLinear" in quantized.graphs_why


def test_cuda_decisions_planned_on_the_cpu(ckpts, tmp_path):
    plan = cuda_plan(ckpts("qwen3_moe"))
    assert plan.tiered and plan.fused and plan.pooled and plan.decode_runner and plan.graphs
    assert {(lp.kernel, lp.kind) for lp in plan.layers} == {("FusedSwiGLUKernel", "in_slots")}
    assert plan.disk_ahead == 0 and plan.lookahead == 0
    ahead = cuda_plan(ckpts("qwen3_moe"), prefetch_ahead=1)  # host-tier staging in the graphs, no disk read-ahead
    assert ahead.disk_ahead == 0 and ahead.lookahead == 1 and ahead.graphs
    traced = cuda_plan(ckpts("qwen3_moe"), trace=tmp_path / "trace.jsonl")
    assert traced.decode_runner and not traced.graphs and "trace" in traced.graphs_why
    eager = cuda_plan(ckpts("qwen3_moe"), cuda_graphs=False)
    assert eager.decode_runner and not eager.graphs
    off = cuda_plan(ckpts("qwen3_moe"), fused_experts=False)
    assert not off.fused and {lp.kind for lp in off.layers} == {"per_layer"} and not off.decode_runner
    for kind in ("mlx-4bit-g32", "fp8-blocks", "mxfp4"):  # stored bytes in the slots, dequantized in registers
        plan = cuda_plan(ckpts(kind))
        assert plan.fused and not plan.refusals and {lp.kind for lp in plan.layers} == {"in_slots"}, kind
    for kind in ("turboquant", "gguf-q8_0"):  # no GPU kernel: refused, as load would
        plan = cuda_plan(ckpts(kind))
        assert plan.refusals and plan.refusals[0].stage == "quantized tier", kind
        assert "not on the GPU tier" in inspect(str(ckpts(kind))).gpu_kernel
    kimi = cuda_plan(ckpts("kimi_k3"))  # SiTU experts: the fused kernels cover plain SwiGLU only
    assert not kimi.fused and {lp.kind for lp in kimi.layers} == {"per_expert"} and not kimi.decode_runner
    wired = cuda_plan(ckpts("qwen3_moe"), wire_memory=True)
    assert wired.refusals[0].stage == "device" and wired.refusals[0].message.startswith("wire_memory=True applies")


def test_refusals_are_what_load_raises(ckpts, monkeypatch):
    """A refusal in the plan is the error load raises, message for message, and inspect prints it."""
    # the memory available fixed: the budget refusal's numbers (the tokens of context that fit) are measured from it
    monkeypatch.setattr("moestream.memory.available_bytes", lambda *a, **k: 20 * 10**9)
    monkeypatch.setattr("moestream.memory.available_with_source", lambda *a, **k: (20 * 10**9, "MemAvailable"))
    cases = [("qwen3_moe", dict(host_cache_gb="0.001", wire_memory=True), ConfigError, "device"),
             ("kimi_k3", dict(fused_experts=True), ConfigError, "fused"),  # SiTU experts: no fused kernel
             ("turboquant", dict(host_cache_gb="0.001"), ConfigError, "quantized tier"),
             ("qwen3_moe", dict(cache_budget_gb="all", context_tokens=10**9), BudgetError, "budget")]
    for kind, options, error, stage in cases:
        path = ckpts(kind)
        plan = plan_load_of(path, **dict(options))
        opts = _options(options)
        first = plan.refusals[0]
        assert first.stage == stage and first.error is error
        with pytest.raises(error, match=re.escape(first.message)):
            load(path, options=opts, tokenizer=False)
        assert f"refused:          {first.message}" in inspect(str(path), options=opts).to_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["qwen3_moe", "mlx-4bit-g32", "kimi_k3"])
def test_on_a_gpu_the_engine_runs_the_plan_made_anywhere(ckpts, kind):
    """On CUDA the engine executes its plan (fused slots and CUDA graphs, or the batched chain, or one expert at a
    time), and the plan made for ``cuda`` is the same decisions as the one a CPU machine makes (budget aside)."""
    cases = ({}, {"cache_budget_gb": "all"}) + (() if kind.startswith("mlx") else ({"fused_experts": False},))
    for options in cases:  # (quantized experts without the fused kernel are refused on the GPU tier)
        plan = check(ckpts(kind), device="cuda", **dict(options))
        assert plan.device.type == "cuda" and plan.tiered
        same = cuda_plan(ckpts(kind), **dict(options))
        assert [dataclasses.astuple(lp) for lp in same.layers] == [dataclasses.astuple(lp) for lp in plan.layers]
        assert (same.fused, same.pooled, same.decode_runner, same.graphs) == (
            plan.fused, plan.pooled, plan.decode_runner, plan.graphs)
