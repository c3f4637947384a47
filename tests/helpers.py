"""Builders of tiny checkpoints for the tests: reference models from transformers, and the
same weights rewritten in other expert layouts or shardings."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=512,
    rope_theta=10000.0,
)


@contextlib.contextmanager
def threads(n: int):
    """``n`` intra-op threads for the block; the count before restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for the module that imports this fixture (autouse there): tiny models run no slower,
    and far faster on a loaded 2-core machine (no OpenMP spin-waits); restored afterwards."""
    with threads(1):
        yield


def at_threads(fn, *counts: int) -> list:
    """``fn()`` at each intra-op thread count of ``counts``, in turn; the count before restored after."""
    out = []
    for n in counts:
        with threads(n):
            out.append(fn())
    return out


@contextlib.contextmanager
def background(kind: str, size: int = 96):
    """CPU load for the length of a run: ``thread`` (a busy thread of this process running torch
    matmuls of ``size`` x ``size`` and plain Python: it competes for the cores, OpenMP and the GIL),
    ``process`` (a busy process), or ``none``."""
    if kind == "process":
        p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            yield
        finally:
            p.kill()
            p.wait()
    elif kind == "thread":
        stop = threading.Event()

        def busy():
            a = torch.randn(size, size)
            while not stop.is_set():
                a = torch.tanh(a @ a * 0.01)
                sum(range(2000))

        t = threading.Thread(target=busy, daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()
    else:
        yield


def has(*words):
    """A :func:`redraw_` rule's test: the tensor's name holds one of ``words``."""
    return lambda name, p: any(w in name for w in words)


def ends(*suffixes):
    """A :func:`redraw_` rule's test: the tensor's name ends with one of ``suffixes``."""
    return lambda name, p: name.endswith(suffixes)


NORMS = (has("norm"), 1.0, 0.2)  # init 1: a norm applied wrongly would hide
ROUTERS = (ends("mlp.gate.weight"), 0.0, 0.5)  # routers that actually discriminate between experts
# DeepSeek-style families: 1-D norms, routers, the correction bias (big enough to change which experts are
# chosen) and every other bias, of the parameters and buffers
MLA_RULES = ((lambda name, p: "norm" in name and p.dim() == 1, 1.0, 0.2), ROUTERS,
             (ends("e_score_correction_bias"), 0.0, 0.3), (has("bias"), 0.0, 0.1))
# a tiny hybrid Qwen (Qwen3-Next, Qwen3.5 MoE): DeltaNet, attention, DeltaNet, attention; 8 experts top-2 and
# a shared expert; 2 key heads for 4 value heads
QWEN_HYBRID_TINY = dict(
    vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, max_position_embeddings=512,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)
# a tiny GLM-4.5 (transformers' Glm4MoeConfig): partial rotary, attention bias, qk norm, sigmoid + bias with 4
# groups of 2
GLM4_MOE_TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=1, n_shared_experts=1,
                     n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
                     use_qk_norm=True, partial_rotary_factor=0.5, max_position_embeddings=512, rope_theta=10000.0)


def redraw_(named, *rules, extra=None):
    """Redraw in place, without grad, each tensor of ``named`` ((name, tensor) pairs, in order) that a rule
    ``(test, mean, std)`` matches (``test(name, tensor)``; the first that does) from N(mean, std); then
    ``extra(name, tensor)`` of every one when given. Transformers' init leaves norms at 1 and routers and
    biases small or 0, which would hide their misuse."""
    with torch.no_grad():
        for name, p in named:
            for test, mean, std in rules:
                if test(name, p):
                    p.normal_(mean, std)
                    break
            if extra is not None:
                extra(name, p)


def random_family_model(families: dict, family: str, seed: int = 0, **overrides):
    """A random float32 transformers ``<prefix>ForCausalLM`` of ``families[family]`` (``(prefix, config
    kwargs)``, the kwargs changed by ``overrides``), redrawn by :data:`MLA_RULES`."""
    import transformers

    prefix, kwargs = families[family]
    cfg = getattr(transformers, prefix + "Config")(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, prefix + "ForCausalLM")(cfg).eval()
    redraw_(list(model.named_parameters()) + list(model.named_buffers()), *MLA_RULES)
    return model


def make_qwen3_moe(path: Path, seed: int = 0, **overrides):
    """Save a random float32 transformers ``Qwen3MoeForCausalLM`` to ``path``; return the model.

    Norm weights are randomized too (transformers initializes them to 1), so a norm
    applied wrongly cannot hide.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    redraw_(model.named_parameters(), NORMS, ROUTERS)
    model.save_pretrained(path)
    return model


def qwen3_moe_fixture(name: str, seed: int, **overrides):
    """A module-scoped fixture: the folder of :func:`make_qwen3_moe` (``seed``, ``overrides``) in a temporary
    folder named ``name``. Assign it to the fixture's name in the test module."""

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        path = tmp_path_factory.mktemp(name)
        make_qwen3_moe(path, seed=seed, **overrides)
        return path

    return fixture


def expert_bytes(path: Path) -> int:
    """Bytes of expert 0 of layer 0 of the checkpoint ``path``."""
    from moestream.checkpoint import Checkpoint
    from moestream.layout import discover_experts

    with Checkpoint(path) as c:
        return discover_experts(c.tensors).expert_nbytes(0, 0)


def read_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def write_checkpoint(src: Path, dst: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """Write ``tensors`` to ``dst`` in ``shards`` files (with an index when > 1), copying src's other files."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    names = list(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in names}, str(dst / "model.safetensors"))
        return dst
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(dst / fname))
        weight_map.update({k: fname for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def split_experts(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(block -> projection -> expert -> weight of the per-expert weights :data:`EXPERT` names, the other
    tensors), each in the order of ``tensors``."""
    experts, rest = {}, {}
    for k, v in tensors.items():
        m = EXPERT.match(k)
        if m:
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = v
        else:
            rest[k] = v
    return experts, rest


def to_layout(tensors: dict[str, torch.Tensor], kind: str, num_experts: int) -> dict[str, torch.Tensor]:
    """Rewrite per-expert expert tensors as ``fused`` ([E, 2I, H] + [E, H, I]) or ``stacked`` (switch_mlp)."""
    groups, out = split_experts(tensors)
    for block, projs in groups.items():
        stack = {p: torch.stack([projs[p][e] for e in range(num_experts)]) for p in ("gate", "up", "down")}
        if kind == "fused":
            out[f"{block}.experts.gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1)
            out[f"{block}.experts.down_proj"] = stack["down"]
        elif kind == "stacked":
            for p in ("gate", "up", "down"):
                out[f"{block}.switch_mlp.{p}_proj.weight"] = stack[p]
        else:
            raise ValueError(kind)
    return out


def write_tiny_synth_config(path: Path, **overrides) -> Path:
    """A tiny qwen3_moe config.json whose vocabulary covers the bundled Qwen3 tokenizer."""
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "eos_token_id": 151645, "max_position_embeddings": 4096,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    }
    cfg.update(overrides)
    path.write_text(json.dumps(cfg))
    return path


def cli_synth_tiny(root: Path, **overrides) -> Path:
    """``moestream synth`` (the CLI, which must exit 0) of :func:`write_tiny_synth_config` (``overrides``) at
    ``root/config.json``, into ``root/tiny``; that folder."""
    from moestream.cli import main

    cfg = write_tiny_synth_config(root / "config.json", **overrides)
    assert main(["synth", "--config", str(cfg), "--out", str(root / "tiny")]) == 0
    return root / "tiny"


def bench_smoke(tmp_path: Path, *flags: str, timeout: int = 300) -> tuple[subprocess.CompletedProcess, Path]:
    """``benchmarks/bench.py --smoke`` with ``flags``, its work folder, output folder and (empty) peers' folder in
    ``tmp_path``, which must exit 0: (the completed run, its output folder)."""
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parent.parent / "benchmarks/bench.py"), "--smoke", *flags,
         "--work", str(tmp_path / "work"), "--out", str(out), "--peers-dir", str(tmp_path / "no-peers")],
        capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r, out


def tiny_synth_fixture(name: str):
    """A module-scoped fixture: ``moestream.synth.synth`` of :func:`write_tiny_synth_config` (the real Qwen3
    tokenizer and vocabulary, so a text prompt runs) in a temporary folder named ``name``; the checkpoint
    folder. Assign it to the fixture's name in the test module."""

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        from moestream.synth import synth

        d = tmp_path_factory.mktemp(name)
        return synth(write_tiny_synth_config(d / "c.json"), d / "m")

    return fixture


class Wrapped(torch.nn.Module):
    """A module around the real model ``inner``, standing in for it: what it lacks is the inner model's."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)
