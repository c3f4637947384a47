"""The compute dtype of a GGUF file (docs/gguf.md, "Compute dtype"): ``--dtype`` of generate and serve reaches
the engine, its logits and its KV cache; bf16 by default for a quantized file, float32 when asked. (The default's
logits against the reference, and its bits at every budget, are checked per type in tests/test_gguf.py.)"""

import argparse

import pytest
import torch

from moestream.cli import add_engine_args, engine_options
from moestream.engine import load
from moestream.gguf_format import compute_dtype, open_gguf

from .gguf_helpers import K_SHAPE, make_model, write_gguf

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
