"""Failing disks: an injected faulty ``preadv`` (EIO, short reads) and shards changed while
running. The request fails with an error naming the expert and the file; the cache never
holds a partial expert; the engine (and the server) keep serving, bit-identically."""

from __future__ import annotations

import errno
import os
import shutil

import httpx
import pytest
import torch
from safetensors import safe_open

from moestream.engine import load
from moestream.errors import ReadError
from moestream.generation import SamplingParams, generate
from moestream.server import ServerOptions, create_app

from .helpers import make_qwen3_moe, one_thread, read_all, write_checkpoint  # noqa: F401 (one_thread: autouse)

TOKENS = 6
PROMPT = list(range(3, 40, 2))  # 19 tokens: prefill routes to most experts of every layer
EXPERT = r"expert \(layer {layer}, expert \d+\).* from {file}"


class FaultyDisk:
    """Replaces ``os.preadv``: reads that touch a chosen byte range fail (EIO) or come back short.

    ``ranges``: (path, begin, end) byte ranges; ``mode``: ``"eio"``, ``"short"`` (about half
    the bytes, in 512-byte units) or ``"short-blocks"`` (half, in whole 4 KiB blocks: an O_DIRECT
    read in place resumes after it, and finds the end of the file); ``times``: how many faulty
    reads to serve before the disk heals (None: never heals).
    """

    def __init__(self, monkeypatch):
        self.real = os.preadv
        self.ranges: list[tuple[str, int, int]] = []
        self.mode = "eio"
        self.times: int | None = None
        self.hits = 0
        self._short: set[tuple[int, int]] = set()
        monkeypatch.setattr(os, "preadv", self.preadv)

    def preadv(self, fd, buffers, offset, *flags):
        length = sum(len(memoryview(b)) for b in buffers)
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if (fd, offset) in self._short:  # the retry after a short read finds the end of the file
            self._short.discard((fd, offset))
            return 0
        hit = any(p == path and offset < end and begin < offset + length for p, begin, end in self.ranges)
        if hit and (self.times is None or self.hits < self.times):
            self.hits += 1
            if self.mode == "eio":
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            n = self.real(fd, buffers, offset, *flags)
            unit = 4096 if self.mode == "short-blocks" else 512
            half = max(1, n // 2) - max(1, n // 2) % unit or 1
            self._short.add((fd, offset + half))
            return half
        return self.real(fd, buffers, offset, *flags)

    def fail_layer(self, engine, layer: int) -> None:
        """Fault every read that touches an expert of ``layer``."""
        lay = engine.layout.layers[layer]
        for e in range(lay.num_experts):
            for p in engine.layout.pieces(layer, e):
                self.ranges.append((str(p.file.resolve()), p.offset, p.offset + p.nbytes))

    def heal(self) -> None:
        self.ranges.clear()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    make_qwen3_moe(src, seed=11, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2)
    return write_checkpoint(src, tmp_path_factory.mktemp("disk"), read_all(src), shards=2)


def tokens_and_logits(engine) -> tuple[list[int], list[torch.Tensor]]:
    steps = list(generate(engine, PROMPT, TOKENS, SamplingParams(), stop_at_eos=False, keep_logits=True))
    return [s.token for s in steps], [s.logits for s in steps]


@pytest.fixture(scope="module")
def reference(ckpt):
    engine = load(ckpt, cache_budget_gb="all", workers=2, tokenizer=False, learn_experts=False, hotlist=False)
    try:
        return tokens_and_logits(engine)
    finally:
        engine.close()


def same_as_reference(engine, reference) -> None:
    tokens, logits = tokens_and_logits(engine)
    assert tokens == reference[0]
    assert all(torch.equal(a, b) for a, b in zip(logits, reference[1]))


def assert_cache_holds_only_whole_experts(engine, ckpt) -> None:
    """Every cached expert equals the checkpoint's bytes (read here by the reference library)."""
    files = {f: safe_open(str(f), "pt") for f in ckpt.glob("*.safetensors")}
    names = {name: f for f, h in files.items() for name in h.keys()}
    for (layer, e), ew in list(engine.cache._entries.items()):
        assert ew.tensors, f"expert ({layer}, {e}) cached without tensors"
        for role, t in ew.tensors.items():
            name = f"model.layers.{layer}.mlp.experts.{e}.{role}_proj.weight"
            assert torch.equal(t, files[names[name]].get_tensor(name)), name
    assert not engine.cache.pinned()  # no expert left pinned by the failed fetch


def small_engine(ckpt, **kw):
    # room for 6 of the 24 experts: most tokens read
    return load(ckpt, cache_budget_gb=6 * 3 * 32 * 64 * 4 / 1e9, workers=2, tokenizer=False,
                learn_experts=False, hotlist=False, **kw)


@pytest.mark.parametrize("mode, page_cache", [("eio", True), ("short", True), ("eio", False), ("short", False),
                                              ("short-blocks", False)],
                         ids=["eio-pread", "short-pread", "eio-o_direct", "short-o_direct", "short-blocks-o_direct"])
def test_a_failing_read_fails_the_request_and_nothing_else(ckpt, reference, monkeypatch, mode, page_cache):
    """O_DIRECT reads land in the experts' own buffers (in place): a failed one leaves a partly written
    buffer, which is never cached or handed out."""
    engine = small_engine(ckpt, use_page_cache=page_cache)
    try:
        disk = FaultyDisk(monkeypatch)
        disk.mode = mode
        disk.fail_layer(engine, 1)
        why = "Input/output error" if mode == "eio" else "short read"
        with pytest.raises(ReadError, match=EXPERT.format(layer=1, file=r".*model-0000\d-of-00002\.safetensors")
                           + f".*{why}"):
            tokens_and_logits(engine)
        assert disk.hits >= 1
        assert_cache_holds_only_whole_experts(engine, ckpt)
        disk.heal()
        same_as_reference(engine, reference)  # the engine serves the next request, bit for bit
        assert_cache_holds_only_whole_experts(engine, ckpt)
        reader = engine.store.reader
        if not page_cache:  # the faults hit the in-place path (not a bounce buffer, not the fallback)
            assert reader.in_place_bytes > 0 and not reader.fallback_files
    finally:
        engine.close()


def test_a_failed_read_ahead_surfaces_and_does_not_poison(ckpt, reference, monkeypatch):
    """--prefetch-ahead: a read ahead that fails is reported when its layer needs the expert."""
    engine = small_engine(ckpt, prefetch_ahead=2)
    try:
        pf = engine.io.prefetcher
        surfaced = []
        take = pf.take

        def recording_take(keys):
            try:
                yield from take(keys)
            except ReadError as e:
                surfaced.append(str(e))
                raise

        monkeypatch.setattr(pf, "take", recording_take)
        disk = FaultyDisk(monkeypatch)
        disk.fail_layer(engine, 2)
        with pytest.raises(ReadError, match=EXPERT.format(layer=2, file=r".*\.safetensors")):
            tokens_and_logits(engine)
        assert surfaced and "layer 2" in surfaced[0]  # it came through the read-ahead path
        assert_cache_holds_only_whole_experts(engine, ckpt)
        disk.heal()
        same_as_reference(engine, reference)
        assert pf.stats.hits > 0
    finally:
        engine.close()


def test_a_transient_fault_loses_one_request_only(ckpt, reference, monkeypatch):
    engine = small_engine(ckpt)
    try:
        disk = FaultyDisk(monkeypatch)
        disk.fail_layer(engine, 0)
        disk.times = 1  # one bad read, then the disk heals by itself
        with pytest.raises(ReadError):
            tokens_and_logits(engine)
        same_as_reference(engine, reference)
    finally:
        engine.close()


@pytest.mark.parametrize("page_cache", [True, False], ids=["pread", "o_direct"])
@pytest.mark.parametrize("change", ["replaced", "written"])
def test_a_shard_changed_while_running_is_refused(ckpt, tmp_path, change, page_cache):
    d = tmp_path / "m"
    shutil.copytree(ckpt, d)
    engine = small_engine(d, use_page_cache=page_cache)
    try:
        tokens_and_logits(engine)
        shard = d / "model-00002-of-00002.safetensors"
        if change == "replaced":  # same bytes, another file: what `cp new old.tmp && mv` does
            shutil.copy(shard, d / "new")
            os.replace(d / "new", shard)
        elif change == "written":
            with open(shard, "r+b") as f:
                f.seek(-64, os.SEEK_END)
                f.write(b"\0" * 64)
        else:
            with open(shard, "ab") as f:
                f.write(b"\0" * 64)
        why = {"replaced": "replaced by another file", "written": "it was written to", "grown": "its size went from"}
        with pytest.raises(ReadError, match=rf"model-00002-of-00002.safetensors: the shard changed on disk .*"
                                            rf"{why[change]}.*Restart moestream"):
            tokens_and_logits(engine)  # a budget of 6 experts in 24: this request reads
        assert_cache_holds_only_whole_experts(engine, ckpt)  # the bytes as they were at load
    finally:
        engine.close()


def test_the_server_answers_a_disk_fault_and_keeps_serving(tmp_path_factory, monkeypatch):
    from .helpers import write_tiny_synth_config
    from .test_server import Server

    root = tmp_path_factory.mktemp("srv")
    from moestream.cli import main

    assert main(["synth", "--config", str(write_tiny_synth_config(root / "config.json")),
                 "--out", str(root / "tiny")]) == 0
    engine = load(root / "tiny", cache_budget_gb=0.00002, workers=2, learn_experts=False, hotlist=False)
    srv = Server(create_app(engine, ServerOptions("tiny", max_context=64)))
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4, "temperature": 0}
    url = srv.url + "/v1/chat/completions"
    try:
        before = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]
        disk = FaultyDisk(monkeypatch)
        disk.fail_layer(engine, 1)
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "read_error"
        assert "layer 1, expert" in err["message"] and "tiny/model.safetensors" in err["message"]
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as s:
            events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and '"code": "read_error"' in events[-2]
        assert httpx.get(srv.url + "/health").json()["busy"] is False
        disk.heal()
        after = httpx.post(url, json=body, timeout=60)
        assert after.status_code == 200 and after.json()["choices"][0]["message"] == before
    finally:
        srv.stop()
        engine.close()


def test_a_failure_mid_forward_empties_the_session(ckpt, monkeypatch):
    """Some layers had written the failed step into the KV cache: the session starts over."""
    from moestream.generation import Session

    engine = small_engine(ckpt)
    try:
        session = Session()
        first = [s.token for s in generate(engine, PROMPT, TOKENS, SamplingParams(), stop_at_eos=False,
                                           session=session)]
        follow = PROMPT + first + [7, 8, 9]
        disk = FaultyDisk(monkeypatch)
        disk.fail_layer(engine, 2)  # layers 0 and 1 write the new tokens' keys and values, then layer 2 fails
        with pytest.raises(ReadError):
            list(generate(engine, follow, TOKENS, SamplingParams(), stop_at_eos=False, session=session))
        assert session.kv is None and session.ids == []
        disk.heal()
        again = list(generate(engine, follow, TOKENS, SamplingParams(), stop_at_eos=False, keep_logits=True,
                              session=session))
        fresh = list(generate(engine, follow, TOKENS, SamplingParams(), stop_at_eos=False, keep_logits=True))
        assert [s.token for s in again] == [s.token for s in fresh]
        assert all(torch.equal(a.logits, b.logits) for a, b in zip(again, fresh))
    finally:
        engine.close()
