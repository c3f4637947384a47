"""State on disk survives SIGKILL at any moment: usage profiles and hot lists are written to a
temporary name and renamed over the old file; converted checkpoints are written to
``.<out>.partial`` and renamed. A process killed mid-write leaves the previous file whole."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moestream.convert import ConvertSpec, convert
from moestream.usage import read_keys, read_profile

from .helpers import make_qwen3_moe

LAYERS, EXPERTS = 16, 8192  # 131,072 counts: each write takes a while, so a kill lands mid-write

WRITER = textwrap.dedent("""
    import sys
    import torch
    from moestream.usage import save_profile, write_keys
    path, kind = sys.argv[1], sys.argv[2]
    num = {{layer: {E} for layer in range({L})}}
    i = 0
    while True:
        i += 1
        if kind == "profile":
            save_profile(path, "m", "m", num, {{layer: torch.full(({E},), i) for layer in range({L})}})
        else:
            write_keys(path, [(layer, (e + i) % {E}) for layer in range({L}) for e in range({E})], f"m{{i}}")
        print("wrote", i, flush=True)
""").format(L=LAYERS, E=EXPERTS)


def _kill_mid_write(path: Path, kind: str) -> bytes:
    """Start a writer, let it finish one write, SIGKILL it while the next is half written.

    Returns the file's bytes as they were when the half-written temporary file was seen."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), kind], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("wrote 1"), "the writer did not write"
        deadline = time.time() + 60
        while True:
            before = path.read_bytes()
            tmps = [t for t in path.parent.glob(f".{path.name}.*.tmp") if t.stat().st_size > 0]
            if tmps:
                proc.send_signal(signal.SIGKILL)
                break
            assert time.time() < deadline, "never saw a write in progress"
            time.sleep(0.001)
        proc.wait(10)
        return before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("kind", ["profile", "hotlist"])
def test_sigkill_during_a_write_leaves_the_previous_file(tmp_path, kind):
    path = tmp_path / f"{kind}.json"
    before = _kill_mid_write(path, kind)
    leftovers = list(tmp_path.glob(f".{path.name}.*.tmp"))
    assert leftovers, "the kill did not land mid-write"
    with pytest.raises(json.JSONDecodeError):
        json.loads(leftovers[0].read_bytes())  # the half-written temporary file...
    after = path.read_bytes()
    assert after == before or json.loads(after)  # ...never reached the real name: old (or a later whole) file
    num = {layer: EXPERTS for layer in range(LAYERS)}
    if kind == "profile":
        data, problem = read_profile(path, "m", num)
        assert data is not None and problem == "" and len(data) == LAYERS
    else:
        keys, problem = read_keys(path, json.loads(after)["model_id"], num)
        assert problem == "" and len(keys) == LAYERS * EXPERTS


SLOW_CONVERT = textwrap.dedent("""
    import builtins, sys, time
    from moestream.convert import ConvertSpec, convert
    real_open = builtins.open

    class Slow:
        def __init__(self, f):
            self.f = f
        def write(self, b):
            n = self.f.write(b)
            self.f.flush()
            print("writing", flush=True)
            time.sleep(0.05)
            return n
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self.f.close()
        def __getattr__(self, name):
            return getattr(self.f, name)

    def slow_open(file, mode="r", *args, **kw):
        f = real_open(file, mode, *args, **kw)
        return Slow(f) if "w" in mode and ".partial" in str(file) else f

    builtins.open = slow_open
    convert(sys.argv[1], sys.argv[2], ConvertSpec(32, 4, 4, 4, 4))
""")


def test_sigkill_during_convert_leaves_no_checkpoint_and_a_rerun_works(tmp_path):
    src = tmp_path / "src"
    make_qwen3_moe(src)
    out = tmp_path / "q4"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CONVERT, str(src), str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("writing"), proc.stderr.read()[-2000:]
        for _ in range(3):
            proc.stdout.readline()  # a few writes in
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not out.exists()  # nothing under the real name
    partial = tmp_path / ".q4.partial"
    assert partial.is_dir() and any(partial.iterdir())  # the kill landed mid-write
    again = convert(src, out, ConvertSpec(32, 4, 4, 4, 4))  # a rerun clears the stale partial folder
    assert again == out and not partial.exists()
    fresh = convert(src, tmp_path / "q4-fresh", ConvertSpec(32, 4, 4, 4, 4))
    for f in sorted(fresh.iterdir()):
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
