"""Every read path (buffered, O_DIRECT in place, O_DIRECT through a bounce buffer, the
fallback where O_DIRECT is refused) hands out the same expert tensors: the checkpoint's
bytes, as safetensors loads them, at the same alignment (the buffer is laid out like the
file), so the kernels -- whose bits depend on alignment -- and the logits do not depend on
the path."""

from __future__ import annotations

import errno

import pytest
import torch
from safetensors import safe_open

import moestream.direct_io as direct_io
from moestream.checkpoint import Checkpoint, torch_dtype
from moestream.direct_io import DirectReader
from moestream.layout import discover_experts
from moestream.store import BLOCK, ExpertStore, HugePagePool, PreadReader, frame
from moestream.synth import synth

from .helpers import make_qwen3_moe, read_all, to_layout, write_checkpoint, write_tiny_synth_config


class OffsetPool(HugePagePool):
    """Slots 64 bytes past a block boundary: O_DIRECT cannot read into them in place."""

    def get(self, nbytes):
        slot, _, _ = super().get(nbytes + BLOCK)
        self._handed = getattr(self, "_handed", {})
        inner = slot[64 : 64 + nbytes]
        self._handed[id(inner)] = slot
        return inner, torch.frombuffer(inner, dtype=torch.uint8, count=nbytes), inner[:nbytes]

    def put(self, inner):
        super().put(self._handed.pop(id(inner)))


def refuse_o_direct(file):
    raise OSError(errno.EINVAL, "Invalid argument", str(file))


PATHS = ["buffered", "in place", "bounce", "fallback"]


def make_store(ckpt, path, workers, monkeypatch):
    if path == "buffered":
        reader = PreadReader()
    else:
        if path == "fallback":
            monkeypatch.setattr(direct_io, "_open_direct", refuse_o_direct)
        reader = DirectReader(note=lambda s: None)
    layout = discover_experts(ckpt.tensors)
    stored = torch_dtype(layout.pieces(min(layout.layers), 0)[0].dtype)
    store = ExpertStore(ckpt, layout, stored, workers=workers, reader=reader)  # no cast: the bytes as stored
    if path == "bounce":
        store.pool = OffsetPool()
    return store


def expected_bytes(files, ckpt, piece) -> torch.Tensor:
    """The piece's bytes from safetensors' own load of the tensor it lies in."""
    info = ckpt.tensors[piece.source]
    whole = files[info.file].get_tensor(piece.source).contiguous().view(-1).view(torch.uint8)
    at = piece.offset - info.offset
    return whole[at : at + piece.nbytes]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Multi-shard checkpoints whose experts are smaller than a block, a few blocks, and fused / stacked."""
    root = tmp_path_factory.mktemp("paths")
    out = {}
    # 1 KiB pieces: several experts share each 4 KiB block; 8 shards
    cfg = write_tiny_synth_config(root / "tiny.json")
    out["synth, 1 KiB pieces"] = synth(cfg, root / "tiny", shard_gb=0.003)
    # 48 KiB pieces (12 blocks), unaligned in the file by the header; 4 shards
    cfg = write_tiny_synth_config(root / "mid.json", hidden_size=256, moe_intermediate_size=96, num_experts=16,
                                  intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    out["synth, 48 KiB pieces"] = synth(cfg, root / "mid", shard_gb=0.1)
    src = root / "src"
    make_qwen3_moe(src, seed=3, num_hidden_layers=2, num_experts=8)
    tensors = read_all(src)
    for kind in ("fused", "stacked"):
        out[f"{kind}, 2 shards"] = write_checkpoint(src, root / kind, to_layout(tensors, kind, 8), shards=2)
    return out


@pytest.mark.parametrize("name", ["synth, 1 KiB pieces", "synth, 48 KiB pieces", "fused, 2 shards",
                                  "stacked, 2 shards"])
def test_every_expert_on_every_path_is_safetensors_load(checkpoints, name, monkeypatch):
    with Checkpoint(checkpoints[name]) as ckpt:
        files = {f: safe_open(str(f), "pt") for f in ckpt.shards}
        assert len(files) >= 2
        layout = discover_experts(ckpt.tensors)
        keys = [(i, e) for i, lay in layout.layers.items() for e in range(lay.num_experts)]
        for path in PATHS:
            for workers in (1, 3):
                with monkeypatch.context() as mp:
                    store = make_store(ckpt, path, workers, mp)
                    try:
                        got = store.read_all(keys[::-1])  # another order than the file's
                        for key in keys:
                            ew = got[key]
                            for p in layout.pieces(*key):
                                t = ew.tensors[p.role]
                                raw = t.contiguous().view(-1).view(torch.uint8)
                                assert torch.equal(raw, expected_bytes(files, ckpt, p)), (path, key, p.role)
                                assert t.shape == p.shape
                                if path != "bounce":  # one layout on every path: a tensor sits at its file offset
                                    assert t.data_ptr() % BLOCK == p.offset % BLOCK, (path, key, p.role)
                            store.release(ew)
                        reader = store.reader
                        if path == "in place":
                            assert reader.in_place_bytes > 0 and not reader.fallback_files
                            if name != "synth, 1 KiB pieces":  # only blocks two experts share are copied
                                assert reader.in_place_bytes >= 0.5 * reader.direct_bytes, reader.in_place_bytes
                        elif path == "bounce":
                            assert reader.in_place_bytes == 0 and reader.direct_bytes >= store.stats.bytes_read
                        elif path == "fallback":
                            assert reader.fallback_files and reader.direct_bytes == 0
                        assert store.stats.bytes_read == sum(layout.expert_nbytes(*k) for k in keys)
                    finally:
                        store.close()


def test_frame_lays_an_expert_out_like_the_file(tmp_path):
    """Runs of adjacent pieces keep their offsets modulo 4 KiB; separate runs get their own blocks."""
    from moestream.layout import Piece

    f, g = tmp_path / "a", tmp_path / "b"

    def piece(role, file, offset, n):
        return Piece(role, file, offset, n, "BF16", (n // 2,), role)

    one_run = [piece("gate", f, 5000, 3000), piece("up", f, 8000, 3000), piece("down", f, 2000, 3000)]
    fr = frame(one_run)
    # one run [2000, 11000): its blocks [0, 12288); each piece at its file offset
    assert fr.nbytes == 12288 and fr.at == (5000, 8000, 2000) and fr.shift == (0, 0, 0)
    assert fr.cost == 3 * 3008
    split = [piece("gate", f, 100, 10), piece("up", g, 4090, 20), piece("down", f, 9000, 10)]
    fr = frame(split)
    # file a: runs [100, 110) -> block 0, [9000, 9010) -> block 1; file b: [4090, 4110) -> blocks 2-3
    assert fr.at == (100, 2 * 4096 + 4090 - 0, 4096 + 9000 - 8192)
    assert fr.nbytes == 4 * 4096
    assert all(a % BLOCK == p.offset % BLOCK for a, p in zip(fr.at, split))


def test_a_buffer_slot_is_recycled_not_returned(tmp_path):
    pool = HugePagePool()
    a, ta, va = pool.get(9 * 1024 * 1024 + 8192)
    assert len(a) % BLOCK == 0 and direct_io._address(a) % BLOCK == 0 and pool.in_use == 1
    mapped = pool.nbytes
    pool.put(a)
    b, _, _ = pool.get(9 * 1024 * 1024 + 8192)
    assert b is a and pool.nbytes == mapped  # the same slot, nothing mapped anew
    others = [pool.get(9 * 1024 * 1024 + 8192)[0] for _ in range(7)]
    assert pool.nbytes > mapped and len({direct_io._address(s) for s in [b, *others]}) == 8


# -- the reader threads, prefill read-ahead, the CPU split, memory inside a cap --------------------------------


def test_demand_reads_run_before_reads_ahead():
    import threading

    from moestream.store import AHEAD, DEMAND, ReaderThreads

    threads = ReaderThreads(1)
    gate, order = threading.Event(), []
    try:
        first = threads.submit(DEMAND, gate.wait)  # holds the one worker
        later = [threads.submit(AHEAD, order.append, f"ahead {i}") for i in range(3)]
        later += [threads.submit(DEMAND, order.append, f"demand {i}") for i in range(2)]
        gate.set()
        for f in [first, *later]:
            f.result(timeout=10)
        assert order == ["demand 0", "demand 1", "ahead 0", "ahead 1", "ahead 2"]
        assert threads.cpu_seconds() >= 0.0
    finally:
        threads.shutdown()


@pytest.fixture(scope="module")
def mid_model(checkpoints):
    return checkpoints["synth, 48 KiB pieces"]


def prefill_and_decode(model, budget, **kw):
    from moestream.engine import load
    from moestream.generation import GenerationStats, SamplingParams, generate

    engine = load(model, cache_budget_gb=budget, workers=3, tokenizer=False, learn_experts=False, hotlist=False, **kw)
    try:
        prompt = torch.randint(0, 150000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
        stats = GenerationStats()
        steps = list(generate(engine, prompt, 6, SamplingParams(), stats, stop_at_eos=False, keep_logits=True,
                              prefill_chunk=16))
        return [s.logits for s in steps], stats, engine.io.prefetcher
    finally:
        engine.close()


def test_prefill_reads_the_next_layer_ahead_and_the_bits_stay(mid_model, monkeypatch):
    """A multi-token chunk reads the next layer's routed experts ahead (on by default when experts stream);
    the logits are those of every expert resident, with the read-ahead on or off."""
    import moestream.prefetch as prefetch

    ref, _, _ = prefill_and_decode(mid_model, "all", use_page_cache=True)
    from moestream.checkpoint import Checkpoint as C

    with C(mid_model) as c:
        one = discover_experts(c.tensors).expert_nbytes(0, 0)
    budget = str(one * 6 / 1e9)  # 6 of the 32 experts
    runs = {}
    for window in (0, prefetch.CHUNK_WINDOW_PER_WORKER):
        with monkeypatch.context() as mp:
            mp.setattr(prefetch, "CHUNK_WINDOW_PER_WORKER", window)
            runs[window] = prefill_and_decode(mid_model, budget, use_page_cache=False)
    for window, (logits, _, _) in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(logits, ref)) and len(logits) == len(ref), window
    off, on = runs[0], runs[prefetch.CHUNK_WINDOW_PER_WORKER]
    assert off[2] is None and off[1].prefill_read_ahead == 0  # no read-ahead at all: no prefetcher
    s, pf = on[1], on[2]
    assert pf.window == 6 and pf.ahead == 0
    assert s.prefill_read_ahead > 0 and s.prefill_read_ahead_hits > 0
    assert s.prefill_read_ahead == s.prefill_read_ahead_hits + s.prefill_read_ahead_wasted + pf.stats.outstanding
    assert pf.stats.per_layer == {}  # no decode read-ahead (--prefetch-ahead 0)


def test_the_cpu_split_of_a_decoded_token(mid_model, tmp_path):
    """CPU per decoded token and its split (reads, expert kernels, the rest) in the stats and their JSON."""
    import json

    _, s, _ = prefill_and_decode(mid_model, "0", use_page_cache=False, prefetch_ahead=1)
    assert s.decode_cpu_seconds > 0 and s.prefill_cpu_seconds > 0
    assert s.cpu_s_per_decoded_token == pytest.approx(s.decode_cpu_seconds / 5)
    assert s.cpu_reads_s_per_token > 0 and s.cpu_kernels_s_per_token > 0
    # the compiled kernels hold the expert kernels (and attention, norms, the LM head...): every part at least 0,
    # and together the whole (the rest is what the reads and kernels leave)
    assert s.cpu_compiled_s_per_token >= s.cpu_kernels_s_per_token and s.cpu_rest_s_per_token >= 0
    assert s.cpu_reads_s_per_token + s.cpu_compiled_s_per_token + s.cpu_rest_s_per_token >= s.cpu_s_per_decoded_token \
        - 1e-9
    assert s.cpu_kernels_s_per_token < s.cpu_s_per_decoded_token
    assert s.prefetch_per_layer and all(len(v) == 3 for v in s.prefetch_per_layer.values())
    hits = sum(v[1] for v in s.prefetch_per_layer.values())
    wasted = sum(v[2] for v in s.prefetch_per_layer.values())
    assert s.prefetch_accuracy == pytest.approx(hits / (hits + wasted))
    d = json.loads(s.to_json())
    for k in ("cpu_s_per_decoded_token", "cpu_reads_s_per_token", "cpu_kernels_s_per_token", "cpu_rest_s_per_token",
              "cpu_compiled_s_per_token",
              "prefetch_accuracy", "prefetch_per_layer", "prefill_read_ahead"):
        assert k in d
    assert "CPU per token" in s.summary() and "accuracy" in s.summary()


def cached_bytes(files) -> int:
    """Bytes of ``files`` in the page cache (mincore(2) over a private mapping of each)."""
    import ctypes
    import mmap
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    total = 0
    for f in files:
        size = os.path.getsize(f)
        with open(f, "rb") as fh:
            m = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            vec = (ctypes.c_ubyte * (-(-size // page)))()
            addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
            total += sum(v & 1 for v in vec) * page
        finally:
            del addr
            m.close()
    return total


@pytest.mark.parametrize("page_cache", [False, True], ids=["o_direct", "page-cache"])
def test_the_resident_weights_page_cache_is_dropped_as_they_load(checkpoints, monkeypatch, page_cache):
    """With expert reads bypassing the page cache, the shards' cached pages never pile up while the resident
    weights load (a cap would be charged for them twice); through the page cache they stay."""
    import os

    import moestream.io_setup as io_setup
    from moestream.engine import load
    from moestream.io_setup import IOSettings

    model = checkpoints["synth, 1 KiB pieces"]  # 20 MB of resident weights (embedding, LM head) in 8 shards
    shards = sorted(model.glob("*.safetensors"))
    for f in shards:  # written by the fixture: make the pages clean, then drop them
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    assert cached_bytes(shards) < 1 << 20
    monkeypatch.setattr(io_setup, "DROP_EVERY", 1 << 20)
    seen = []
    real = IOSettings.resident_progress

    def spying(self, ckpt, progress=None):
        step = real(self, ckpt, progress)

        def after_each_tensor(n):
            (step or (lambda n: None))(n)
            seen.append(cached_bytes(shards))

        return after_each_tensor

    monkeypatch.setattr(IOSettings, "resident_progress", spying)
    engine = load(model, cache_budget_gb="0.0001", tokenizer=False, use_page_cache=page_cache,
                  learn_experts=False, hotlist=False)
    try:
        resident = engine.resident_bytes
        assert resident > 15e6 and seen
        if page_cache:
            assert max(seen) > 0.9 * resident  # the control: the measure sees the page cache
        else:
            largest = max(t.nbytes for t in engine.checkpoint.tensors.values())
            assert max(seen) <= (1 << 20) + largest + (1 << 16), (max(seen), largest)
            assert cached_bytes(shards) < 1 << 20
    finally:
        engine.close()


def test_the_kv_cache_counts_in_the_reserve_of_any_budget(monkeypatch):
    """A given budget is refused when resident weights, the budget, the KV cache of the context and the read
    buffers exceed the memory available (the KV cache was counted for ``auto`` only)."""
    import json
    from pathlib import Path

    from moestream.budget import plan_cpu_budget
    from moestream.errors import BudgetError
    from moestream.models import family_for

    cfg = json.loads((Path(__file__).parent / "configs" / "Qwen3-30B-A3B.json").read_text())
    family = family_for(cfg, "cfg")
    with torch.device("meta"):
        net = family.Model(family.ModelArgs.from_config(cfg))
    one = 9_437_184
    kw = dict(dtype=torch.bfloat16, experts=48 * 128 * one, one=one, workers=8, page_cache=False, prefetch_ahead=0)
    monkeypatch.setattr("moestream.memory.available_bytes", lambda: 10**15)
    short = plan_cpu_budget(net, 2 * 10**9, context_tokens=1000, **kw)
    long = plan_cpu_budget(net, 2 * 10**9, context_tokens=32000, **kw)
    per_token = 48 * 4 * 128 * 2 * 2  # layers x KV heads x head_dim x (K, V) x bf16
    assert short.kv_cache == 2 * 1000 * per_token and long.kv_cache == 2 * 32000 * per_token
    need = 2 * 10**9 + long.reserve + long.kv_cache  # the resident weights come on top
    from moestream.budget import resident_bytes

    resident = resident_bytes(net, torch.bfloat16)
    monkeypatch.setattr("moestream.memory.available_bytes", lambda: resident + need - 1)
    plan_cpu_budget(net, 2 * 10**9, context_tokens=1000, **kw)  # fits with a short context
    with pytest.raises(BudgetError, match=r"KV cache \(6\.29 GB for 32000 tokens\)"):
        plan_cpu_budget(net, 2 * 10**9, context_tokens=32000, **kw)
