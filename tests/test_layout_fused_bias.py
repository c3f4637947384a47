"""Layout rules for fused experts with biases: gpt-oss's x @ W orientation and the nn.Linear one."""

from pathlib import Path

import pytest

from moestream.checkpoint import TensorInfo
from moestream.errors import LayoutError
from moestream.layout import discover_experts


def index(shapes: dict[str, tuple]) -> dict[str, TensorInfo]:
    """TensorInfos laid out back to back in one float32 file, in the given order."""
    out, pos = {}, 0
    for name, shape in shapes.items():
        n = 4
        for d in shape:
            n *= d
        out[name] = TensorInfo(name, Path("x.safetensors"), pos, n, "F32", shape)
        pos += n
    return out


E, H, N = 4, 6, 5
P = "model.layers.0.mlp.experts."


def test_gpt_oss_orientation_pieces():
    t = index({P + "gate_up_proj": (E, H, 2 * N), P + "gate_up_proj_bias": (E, 2 * N),
               P + "down_proj": (E, N, H), P + "down_proj_bias": (E, H)})
    lay = discover_experts(t)
    assert lay.layers[0].kind == "fused" and lay.layers[0].num_experts == E
    pieces = {p.role: p for p in lay.pieces(0, 2)}
    assert list(pieces) == ["gate_up", "down", "down.bias", "gate_up.bias"]
    assert pieces["gate_up"].shape == (H, 2 * N) and pieces["down"].shape == (N, H)
    assert pieces["gate_up"].offset == t[P + "gate_up_proj"].offset + 2 * H * 2 * N * 4
    assert pieces["gate_up.bias"].offset == t[P + "gate_up_proj_bias"].offset + 2 * 2 * N * 4
    assert pieces["down.bias"].shape == (H,) and pieces["down.bias"].nbytes == H * 4
    assert lay.expert_nbytes(0, 1) == (H * 2 * N + 2 * N + N * H + H) * 4


def test_linear_orientation_bias_splits_into_gate_and_up():
    t = index({P + "gate_up_proj": (E, 2 * N, H), P + "gate_up_proj_bias": (E, 2 * N), P + "down_proj": (E, H, N)})
    pieces = {p.role: p for p in discover_experts(t).pieces(0, 3)}
    assert list(pieces) == ["gate", "up", "down", "gate.bias", "up.bias"]
    base = t[P + "gate_up_proj_bias"].offset + 3 * 2 * N * 4
    assert (pieces["gate.bias"].offset, pieces["up.bias"].offset) == (base, base + N * 4)
    assert pieces["gate.bias"].shape == pieces["up.bias"].shape == (N,)


def test_fused_shapes_fitting_neither_orientation_are_refused():
    t = index({P + "gate_up_proj": (E, 2 * N, H), P + "down_proj": (E, H + 1, N)})
    with pytest.raises(LayoutError, match="fit neither"):
        discover_experts(t)


def test_laguna_correction_bias_under_experts_is_resident():
    t = index({P + "e_score_correction_bias": (E,), P + "0.gate_proj.weight": (N, H), P + "0.up_proj.weight": (N, H),
               P + "0.down_proj.weight": (H, N)})
    lay = discover_experts(t)
    assert P + "e_score_correction_bias" not in lay.expert_tensors and lay.layers[0].num_experts == 1
