"""Hostile checkpoints: property tests that mutate valid safetensors files and headers.

Every mutation must end in one of two ways: a :class:`CheckpointError` naming the file
(and the tensor, where one tensor's entry was changed), or a header whose every byte
range lies inside the file's data section, matches dtype size x shape and overlaps no
other -- and then each tensor reads back exactly the file's bytes, and exactly what the
reference ``safetensors`` library reads wherever that library accepts the file too.
Never another exception, a hang (hypothesis' deadline), or a read outside the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from moestream.checkpoint import Checkpoint, dtype_size, empty_for, pread_full, read_safetensors_header
from moestream.errors import CheckpointError

SETTINGS = settings(max_examples=250, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _valid_file() -> bytes:
    """A small safetensors file written by the reference library (several dtypes, an empty tensor)."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(3, 4, generator=g),
        "b.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.index": torch.arange(4, dtype=torch.int64).reshape(2, 2),
        "d.bytes": torch.arange(7, dtype=torch.uint8),
        "e.empty": torch.zeros(0, 3, dtype=torch.float16),
    }
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        return path.read_bytes()


VALID = _valid_file()
(N,) = struct.unpack("<Q", VALID[:8])
HEADER = json.loads(VALID[8 : 8 + N])
BODY = VALID[8 + N :]
NAMES = sorted(k for k in HEADER if k != "__metadata__")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile")


def check(path: Path, target: str | None = None) -> dict | None:
    """Parse ``path``; assert the outcome is a clear error or a sound header read exactly. Returns the tensors."""
    try:
        tensors, _ = read_safetensors_header(path)
    except CheckpointError as e:
        msg = str(e)
        assert msg.startswith(f"{path}:"), msg  # names the file
        assert len(msg) < 600, msg  # hostile values are not echoed in full
        if target is not None and "tensor" in msg and "'" in msg:
            assert repr(target) in msg or "twice" in msg, (target, msg)  # names the tensor at fault
        return None
    size = path.stat().st_size
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    data = path.read_bytes()
    spans = []
    for name, info in tensors.items():
        assert 8 + n <= info.offset and info.offset + info.nbytes <= size, (name, info)
        assert info.nbytes == math.prod(info.shape) * dtype_size(info.dtype)
        if info.nbytes:
            spans.append((info.offset, info.offset + info.nbytes))
        out, view = empty_for(info)
        fd = os.open(path, os.O_RDONLY)
        try:
            pread_full(fd, info.offset, [view], path, name)
        finally:
            os.close(fd)
        assert bytes(view) == data[info.offset : info.offset + info.nbytes]
    spans.sort()
    for (_, e0), (b1, _) in zip(spans, spans[1:]):
        assert b1 >= e0
    # where the reference library accepts the file, it reads the same tensors
    try:
        with safe_open(str(path), "pt") as ref:
            ref_tensors = {k: ref.get_tensor(k) for k in ref.keys()}
    except Exception:  # the reference refuses it (its own error types): nothing to compare with
        return tensors
    assert set(ref_tensors) == set(tensors)
    for name, t in ref_tensors.items():
        info = tensors[name]
        assert tuple(t.shape) == info.shape
        mine, view = empty_for(info)
        view[:] = data[info.offset : info.offset + info.nbytes]
        assert t.dtype == mine.dtype and torch.equal(t.view(torch.uint8), mine.view(torch.uint8)), name
    return tensors


def write(path: Path, header: object, body: bytes = BODY, raw: bytes | None = None) -> Path:
    text = raw if raw is not None else json.dumps(header, allow_nan=True).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    return path


# hostile JSON values: any type, nesting, huge and negative numbers, NaN, long strings
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=300),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
near = st.integers(min_value=-3, max_value=len(BODY) + 3)  # offsets at and around the data section's edges
field_values = {
    "dtype": json_values | st.sampled_from(["F32", "BF16", "F16", "I64", "U8", "F8_E4M3", "BOOL", "f32", "Q4", ""]),
    "shape": json_values | st.lists(st.integers(min_value=-2, max_value=20), max_size=4),
    "data_offsets": json_values | st.lists(near, min_size=2, max_size=2) | st.lists(near, max_size=3),
}


@st.composite
def header_mutations(draw):
    header = json.loads(json.dumps(HEADER))
    name = draw(st.sampled_from(NAMES))
    action = draw(st.sampled_from(["set", "set", "set", "delete", "replace", "add"]))
    if action == "set":
        key = draw(st.sampled_from(sorted(field_values)))
        header[name][key] = draw(field_values[key])
    elif action == "delete":
        del header[name][draw(st.sampled_from(sorted(field_values)))]
    elif action == "replace":
        header[name] = draw(json_values)
    else:
        name = draw(st.text(min_size=1, max_size=20).filter(lambda s: s not in HEADER))
        header[name] = {k: draw(v) for k, v in field_values.items()}
    cut = draw(st.one_of(st.just(0), st.integers(min_value=0, max_value=len(BODY))))
    return header, name, BODY[: len(BODY) - cut]


@SETTINGS
@given(header_mutations())
def test_mutated_headers_fail_clearly_or_read_exactly(workdir, mutation):
    header, name, body = mutation
    path = write(workdir / "h.safetensors", header, body)
    check(path, target=name if len(body) == len(BODY) else None)


@st.composite
def byte_mutations(draw):
    data = bytearray(VALID)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        op = draw(st.sampled_from(["flip", "flip", "truncate", "insert", "length"]))
        if op == "flip" and data:
            i = draw(st.integers(min_value=0, max_value=min(len(data), 8 + N + 16) - 1))
            data[i] = draw(st.integers(min_value=0, max_value=255))
        elif op == "truncate":
            del data[draw(st.integers(min_value=0, max_value=len(data))):]
        elif op == "insert":
            i = draw(st.integers(min_value=0, max_value=len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "length":
            n = draw(st.integers(min_value=0, max_value=2**64 - 1) | st.integers(min_value=N - 8, max_value=N + 8))
            data[:8] = struct.pack("<Q", n)
    return bytes(data)


@SETTINGS
@given(byte_mutations())
def test_mutated_bytes_fail_clearly_or_read_exactly(workdir, data):
    path = workdir / "b.safetensors"
    path.write_bytes(data)
    check(path)


def test_the_unmutated_file_is_accepted(workdir):
    tensors = check(write(workdir / "ok.safetensors", HEADER))
    assert sorted(tensors) == NAMES


@pytest.mark.parametrize("raw, message", [
    (b"[" * 200_000 + b"]" * 200_000, "nested too deep"),
    (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {}}', "gives the key 'a' twice"),
    (b'{"a": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 1]}}', "not valid JSON"),
    (b'{"a": {"dtype": ["U8"], "shape": [1], "data_offsets": [0, 1]}}', "tensor 'a': unknown dtype ['U8']"),
    (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}\xff', "not valid JSON"),
    (b'{"a": {"dtype": "' + b"X" * 100_000 + b'", "shape": [1], "data_offsets": [0, 1]}}', "unknown dtype 'XXX"),
])
def test_hostile_headers_named(workdir, raw, message):
    path = write(workdir / "r.safetensors", None, body=b"\0" * 16, raw=raw)
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        read_safetensors_header(path)
    assert str(e.value).startswith(str(path)) and len(str(e.value)) < 600


def _folder(workdir: Path, name: str) -> Path:
    d = workdir / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    return d


def test_pickle_weights_named_in_an_index_are_refused_unopened(workdir, monkeypatch):
    d = _folder(workdir, "pickle-index")
    (d / "pytorch_model-00001-of-00001.bin").write_bytes(b"\x80\x04never opened")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "pytorch_model-00001-of-00001.bin"}}))
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: opened.append(str(f)) or real_open(f, *a, **k))
    with pytest.raises(CheckpointError, match=r"shard pytorch_model-00001-of-00001.bin is a pickle file; "
                                              r"moestream never unpickles weights.*safetensors"):
        Checkpoint(d)
    assert not any(f.endswith(".bin") for f in opened)


def test_hostile_config_and_index_json(workdir):
    d = _folder(workdir, "deep")
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(Exception, match=r"config.json: not") as e:
        Checkpoint(d)
    assert e.type.__module__ == "moestream.errors"
    (d / "config.json").write_text("{}")
    (d / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match="not a valid index"):
        Checkpoint(d)


def test_no_code_path_unpickles():
    """No module of the package calls an unpickler (torch.load, pickle.load(s), numpy allow_pickle)."""
    root = Path(__file__).parents[1] / "moestream"
    bad = []
    for f in root.rglob("*.py"):
        text = f.read_text()
        for needle in ("torch.load(", "pickle.load", "import pickle", "allow_pickle=True", "dill", "joblib"):
            if needle in text:
                bad.append(f"{f.name}: {needle}")
    assert bad == []


def test_trust_remote_code_is_refused_with_the_reason(tmp_path):
    for cmd in (["generate", "--model", str(tmp_path), "--prompt", "hi", "--trust-remote-code"],
                ["serve", "--model", str(tmp_path), "--trust-remote-code"],
                ["convert", "--model=x", "--trust-remote-code=true"]):
        r = subprocess.run([sys.executable, "-m", "moestream", *cmd], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "--trust-remote-code is not supported" in r.stderr and "never runs code" in r.stderr, r.stderr
