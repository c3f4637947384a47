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
