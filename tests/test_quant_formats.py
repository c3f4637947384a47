"""Published quantized formats, read as they are: each tiny checkpoint (written by the
independent writers in quant_helpers from a float transformers model) matches transformers
run on its dequantized weights, and streams bit-identically at any budget."""

import pytest
import torch

from moestream.engine import load

from .helpers import make_qwen3_moe
from .quant_helpers import reference_model, write_fp8, write_mlx, write_mxfp4

SHAPE = dict(moe_intermediate_size=64, hidden_size=64, num_experts=8, num_experts_per_tok=2)


def logits(path, budget, ids, dtype="auto"):
    engine = load(path, cache_budget_gb=budget, tokenizer=False, workers=2, dtype=dtype)
    try:
        with torch.inference_mode():
            return engine.model(ids, 0, engine.model.new_kv_cache(), all_logits=True), engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("float")
    make_qwen3_moe(path, seed=7, **SHAPE)
    return path


WRITERS = {
    "mlx-4bit-g32": lambda s, d: write_mlx(s, d, 4, 32, 8),
    "mlx-3bit-g64": lambda s, d: write_mlx(s, d, 3, 64, 8),
    "mlx-2bit-g32-down6": lambda s, d: write_mlx(s, d, 2, 32, 8, down_bits=6),
    "mlx-5bit-g32-float-attn": lambda s, d: write_mlx(s, d, 5, 32, 8, quantize_attention=False),
    "mlx-8bit-g64": lambda s, d: write_mlx(s, d, 8, 64, 8),
    "fp8-blocks": lambda s, d: write_fp8(s, d, block=32),
    "mxfp4": lambda s, d: write_mxfp4(s, d, 8),
}


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_published_format_matches_dequantized_reference(src, tmp_path, fmt):
    ref_tensors = WRITERS[fmt](src, tmp_path / fmt)
    ref = reference_model(src, ref_tensors)
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    got, engine = logits(tmp_path / fmt, "all", ids)
    assert engine.dtype == torch.float32
    rel = (got - want).abs().max() / want.abs().max()
    assert rel < 1e-5, f"{fmt}: max relative error {rel:.2e}"
    tiny, _ = logits(tmp_path / fmt, "0", ids)
    assert torch.equal(tiny, got), f"{fmt}: streaming at budget 0 differs from budget all"
