"""models/linear.py: on the compiled kernels every linear is within one bf16 ulp of the float64 product and
invariant; on the PyTorch path (``MOESTREAM_CPU_KERNELS=torch``) wide bf16 matmuls on CPUs without native bf16
run in float32, exactly as far as streaming goes: every budget gives the bits of every expert resident."""

import pytest
import torch
import torch.nn.functional as F

from moestream.engine import load
from moestream.generation import SamplingParams, generate
from moestream.models import linear as lin
from moestream.quant import native

from .helpers import make_qwen3_moe, read_all, write_checkpoint


def bf16_ulp(y: torch.Tensor) -> torch.Tensor:
    """One bf16 unit in the last place at each |y| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(y.abs().clamp_min(1e-30))) - 7)


@pytest.mark.parametrize("rows", [1, 7, 8, 33])
@pytest.mark.parametrize("chunk", [lin.CHUNK_ELEMENTS, 3 * 64])  # 3 output rows of the weight per chunk
@pytest.mark.parametrize("path", ["torch", "auto"])
def test_linear_matches_float64_reference(monkeypatch, rows, chunk, path):
    monkeypatch.setattr(lin, "UPCAST", True)
    if path == "auto" and not native.paths():
        pytest.skip("the CPU kernels are not built here")
    monkeypatch.setattr(lin, "CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g).bfloat16()
    w = torch.randn(10, 64, generator=g).bfloat16()
    b = torch.randn(10, generator=g).bfloat16()
    with native.use(path):
        y = lin.linear(x, w, b)
    assert y.dtype is torch.bfloat16 and y.shape == (rows, 10)
    if rows < lin.UPCAST_ROWS and path == "torch":  # the plain bf16 kernel, untouched
        assert torch.equal(y, F.linear(x, w, b))
    ref = F.linear(x.double(), w.double(), b.double())
    # float32 accumulation, one rounding to bf16: within one bf16 ulp of the exact result
    assert ((y.double() - ref).abs() <= bf16_ulp(ref)).all()


def test_scratch_buffer_works_in_and_out_of_inference_mode(monkeypatch):
    """The reused float32 buffer, first made inside ``torch.inference_mode``, is written outside it too."""
    monkeypatch.setattr(lin, "UPCAST", True)
    monkeypatch.setattr(lin, "_scratch", __import__("threading").local())
    x, w = torch.randn(9, 16).bfloat16(), torch.randn(4, 16).bfloat16()
    with native.use("torch"):
        with torch.inference_mode():
            a = lin.linear(x, w)
        b = lin.linear(x, w)
        with torch.inference_mode():
            c = lin.linear(x, w)
    assert torch.equal(a, b) and torch.equal(b, c)


def test_linear_module_swap_keeps_state_dict():
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    assert lin.use_fast_linear(m) == 2
    assert all(isinstance(x, lin.Linear) for x in m)
    assert m.state_dict().keys() == before.keys()
    x = torch.randn(5, 4)
    with native.use("torch"):
        assert torch.equal(m(x), F.linear(F.linear(x, before["0.weight"], before["0.bias"]), before["1.weight"]))
    h = F.linear(x.double(), before["0.weight"].double(), before["0.bias"].double())
    want = F.linear(h, before["1.weight"].double())
    assert (m(x).double() - want).abs().max() <= 1e-6 * want.abs().max()


def test_bf16_prefill_streams_exactly_through_the_float32_path(tmp_path, monkeypatch):
    """On the PyTorch path, a bf16 model whose 64-token prefill gives each expert 8+ rows: budget 0 equals
    budget all."""
    monkeypatch.setattr(lin, "UPCAST", True)  # the path an AVX2 CPU takes, on any CPU
    monkeypatch.setenv(native.ENV, "torch")
    calls = []
    real = lin._upcast_linear
    monkeypatch.setattr(lin, "_upcast_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    src = tmp_path / "src"
    make_qwen3_moe(src, seed=3, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    path = write_checkpoint(src, tmp_path / "bf16", {k: v.bfloat16() for k, v in read_all(src).items()})
    prompt = torch.randint(0, 300, (64,), generator=torch.Generator().manual_seed(1)).tolist()

    def run(budget):
        engine = load(path, cache_budget_gb=budget, workers=2, tokenizer=False, learn_experts=False)
        try:
            assert engine.dtype is torch.bfloat16
            steps = list(generate(engine, prompt, 4, SamplingParams(), stop_at_eos=False, keep_logits=True))
            return [s.logits for s in steps], [s.token for s in steps]
        finally:
            engine.close()

    full = run("all")
    assert max(calls) >= 8  # experts and attention went through float32
    calls.clear()
    streamed = run("0")
    assert calls and full[1] == streamed[1]
    assert all(torch.equal(a, b) for a, b in zip(full[0], streamed[0]))
