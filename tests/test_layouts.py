"""Expert layout discovery: per-expert, fused and stacked checkpoints give the same logits."""

import json
import os

import pytest
import torch

from moestream.checkpoint import Checkpoint
from moestream.engine import load
from moestream.errors import LayoutError
from moestream.layout import discover_experts

from .helpers import make_qwen3_moe, read_all, to_layout, write_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("per-expert")
    make_qwen3_moe(path, seed=7)
    return path


def logits(path, budget="0"):
    engine = load(path, cache_budget_gb=budget, tokenizer=False)
    try:
        ids = torch.arange(3, 33)
        with torch.inference_mode():
            return engine.model(ids, 0, engine.model.new_kv_cache(), all_logits=True)
    finally:
        engine.close()


@pytest.mark.parametrize("kind,prefix", [("fused", "model"), ("stacked", "model"), ("stacked", "model.language_model"),
                                         ("fused", "model.language_model")])
def test_layouts_found_and_identical(base, tmp_path, kind, prefix):
    tensors = to_layout(read_all(base), kind, num_experts=8)
    if prefix != "model":  # the Qwen3.5-style text-model prefix
        tensors = {k.replace("model.layers.", prefix + ".layers.", 1): v for k, v in tensors.items()}
    path = write_checkpoint(base, tmp_path / kind, tensors, shards=2)
    with Checkpoint(path) as c:
        lay = discover_experts(c.tensors)
    layers = lay.layers
    assert {x.kind for x in layers.values()} == {kind}
    assert sorted(layers) == [0, 1, 2] and all(x.num_experts == 8 for x in layers.values())
    assert all(x.block == f"{prefix}.layers.{i}.mlp" for i, x in layers.items())
    if prefix == "model":  # our qwen3_moe module names its weights under model.layers
        assert torch.equal(logits(path), logits(base))


def test_per_expert_pieces_point_at_the_right_bytes(base):
    with Checkpoint(base) as c:
        lay = discover_experts(c.tensors)
        assert lay.layers[1].kind == "per-expert"
        gate, up, down = lay.pieces(1, 5)
        assert (gate.role, up.role, down.role) == ("gate", "up", "down")
        assert gate.source == "model.layers.1.mlp.experts.5.gate_proj.weight"
        assert gate.shape == (32, 64) and down.shape == (64, 32)
        assert lay.expert_nbytes(1, 5) == 3 * 32 * 64 * 4
        assert lay.total_bytes == 3 * 8 * 3 * 32 * 64 * 4


def test_fused_slices_split_gate_and_up(base, tmp_path):
    tensors = to_layout(read_all(base), "fused", num_experts=8)
    path = write_checkpoint(base, tmp_path / "f", tensors)
    with Checkpoint(path) as c:
        lay = discover_experts(c.tensors)
        gate, up, down = lay.pieces(2, 3)
        fused = tensors["model.layers.2.mlp.experts.gate_up_proj"][3]
        down_want = tensors["model.layers.2.mlp.experts.down_proj"][3]
        for piece, want in ((gate, fused[:32]), (up, fused[32:]), (down, down_want)):
            raw = torch.empty(piece.nbytes, dtype=torch.uint8)
            os.preadv(c.fd(piece.file), [memoryview(raw.numpy())], piece.offset)
            assert torch.equal(raw.view(torch.float32).view(piece.shape), want)


def test_unknown_layout_names_what_was_found(base, tmp_path):
    tensors = read_all(base)
    # experts as fc1/fc2 pairs: a layout moestream does not know
    tensors = {k.replace("gate_proj", "fc1").replace("up_proj", "fc2").replace("down_proj", "fc3")
               if ".experts." in k else k: v for k, v in tensors.items()}
    path = write_checkpoint(base, tmp_path / "odd", tensors)
    with Checkpoint(path) as c, pytest.raises(LayoutError, match=r"unknown expert layout: found \d+ tensors such as"):
        discover_experts(c.tensors)


def test_missing_expert_projection_is_named(base, tmp_path):
    tensors = read_all(base)
    del tensors["model.layers.1.mlp.experts.4.up_proj.weight"]
    path = write_checkpoint(base, tmp_path / "gap", tensors)
    with Checkpoint(path) as c, pytest.raises(LayoutError, match=r"model.layers.1.mlp: expert 4 lacks up"):
        discover_experts(c.tensors)


def test_config_disagreeing_with_experts_is_refused(base, tmp_path):
    path = write_checkpoint(base, tmp_path / "cfg", read_all(base))
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_local_experts"] = 16
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LayoutError, match="holds 8 experts; the config says 16"):
        load(path, tokenizer=False)
