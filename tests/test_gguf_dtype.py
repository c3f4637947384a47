"""The compute dtype of a GGUF file (docs/gguf.md, "Compute dtype"): ``--dtype`` of generate and serve reaches
the engine, its logits and its KV cache; bf16 by default for a quantized file, float32 when asked. (The default's
logits against the reference, and its bits at every budget, are checked per type in tests/test_gguf.py.)"""

import argparse

import pytest
import torch

from moestream.cli import add_engine_args, engine_options
from moestream.engine import load
from moestream.gguf_format import compute_dtype
from moestream.sources import open_gguf

from .gguf_helpers import (
    K_SHAPE,
    make_family_model,
    make_gpt_oss,
    make_hybrid,
    make_model,
    reference,
    write_gguf,
    write_gguf_family,
    write_gpt_oss_gguf,
    write_hybrid_gguf,
)
from .test_gguf import IDS as IDS_LONG
from .test_gguf import logits, want_logits

IDS = torch.arange(4)


def test_dtype_flag_reaches_the_engine(tmp_path):
    """``--dtype`` (generate, serve): auto by default (bf16 for this Q4_K file), float32 as llama.cpp computes."""
    p = argparse.ArgumentParser()
    add_engine_args(p)
    path = tmp_path / "m.gguf"
    write_gguf(make_model(seed=6, **K_SHAPE), path, "Q4_K")
    assert engine_options(p.parse_args(["--model", str(path)])).dtype == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--model", str(path), "--dtype", "float64"])
    for flag, want in (([], torch.bfloat16), (["--dtype", "float32"], torch.float32),
                       (["--dtype", "fp32"], torch.float32)):
        options = engine_options(p.parse_args(["--model", str(path), "--cache-budget-gb", "0", *flag]))
        engine = load(path, tokenizer=False, options=options)
        try:
            assert engine.dtype == want
            kv = engine.model.new_kv_cache()
            with torch.inference_mode():
                out = engine.model(IDS[:4], 0, kv)
            assert out.dtype == want and all(k.dtype == v.dtype == want for k, v in kv.layers)  # the KV cache
        finally:
            engine.close()


@pytest.mark.parametrize("types, want", [({}, torch.float32), ({"token_embd": "F16"}, torch.bfloat16),
                                          ({"ffn_down_exps": "Q8_0"}, torch.bfloat16)])
def test_float32_only_for_an_all_f32_file(types, want, tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(make_model(seed=5), path, "F32", types=types)
    ckpt = open_gguf(path)
    try:
        assert compute_dtype(ckpt.tensors) == ckpt.source_format.compute_dtype == want
    finally:
        ckpt.close()


def _architecture_file(family: str, path):
    """(transformers model, the weights the file holds) of a tiny Q8_0 file of ``family``'s GGUF architecture."""
    if family in ("deepseek_v3", "glm4_moe"):
        model = make_family_model(family, seed=4)
        kw = dict(split_kv_b=True, gating=True) if family == "deepseek_v3" else dict(mtp_layers=1)
        return model, write_gguf_family(model, path, "Q8_0", **kw)
    if family == "gpt_oss":
        model = make_gpt_oss(seed=12)
        return model, write_gpt_oss_gguf(model, path, "Q8_0")
    model = make_hybrid(family, seed=11)
    return model, write_hybrid_gguf(model, path, "Q8_0")


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe", "gpt_oss"])
def test_bf16_default_for_every_architecture(family, tmp_path):
    """deepseek2, glm4moe, qwen3next, qwen35moe and gpt-oss at the default dtype: bf16 for a Q8_0 file (the
    derived float32 tensors, such as DeepSeek's joined kv_b_proj and the Qwens' norms - 1, cast at load), within
    twice the error transformers itself makes in bf16 on the same weights (both against float64: measured
    1.0e-1 vs 7.5e-2 for DeepSeek-V3, whose sigmoid routing flips a near-tied expert, 5.7e-2 vs 5.9e-2 for
    gpt-oss, <= 1.9e-2 for the others), and the same bits streaming at budget 0 as with every expert resident."""
    path = tmp_path / f"{family}.gguf"
    model, held = _architecture_file(family, path)
    want = want_logits(model, held)
    with torch.no_grad():
        bf16 = reference(model, held).to(torch.bfloat16)(IDS_LONG[None]).logits[0].double()
    theirs = ((bf16 - want).abs().max() / want.abs().max()).item()
    auto, engine = logits(path, "all", dtype="auto")
    assert engine.dtype == auto.dtype == torch.bfloat16
    ours = ((auto.double() - want).abs().max() / want.abs().max()).item()
    assert ours < max(2 * theirs, 3e-2), f"bf16: max relative error {ours:.2e}, transformers' {theirs:.2e}"
    tiny, _ = logits(path, "0", dtype="auto")
    assert torch.equal(tiny, auto), "bf16 streaming at budget 0 differs from budget all"
