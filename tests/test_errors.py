"""Bad input gets a clear error naming the file, tensor or field, never a traceback or garbage."""

import json
import os
import re
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from moestream.checkpoint import Checkpoint, read_safetensors_header, resolve_model
from moestream.engine import load
from moestream.errors import BudgetError, CheckpointError, ConfigError, LayoutError, ReadError

from .helpers import make_qwen3_moe, read_all, write_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    make_qwen3_moe(src)
    return write_checkpoint(src, tmp_path_factory.mktemp("good"), read_all(src), shards=2)


def copy(good, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(good, dst)
    return dst


def raw_header(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_raw(path, header, body):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def test_missing_config(good, tmp_path):
    d = copy(good, tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no config.json in the checkpoint folder"):
        Checkpoint(d)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no such folder, and not a Hugging Face Hub id"):
        resolve_model(tmp_path / "nowhere" / "deeper")
    with pytest.raises(CheckpointError, match="no such folder, and not a Hugging Face Hub id"):
        resolve_model(tmp_path / "Qwen2.5-7B")  # a version's dot is no file suffix


@pytest.mark.parametrize("name", ["missing.gguf", "rel/missing.gguf"])
def test_a_missing_gguf_file_is_no_such_file(tmp_path, capsys, monkeypatch, name):
    """A missing ``*.gguf`` path is "no such file": it used to be "no such folder, and not a Hugging Face Hub id"
    (and a relative ``dir/x.gguf``, shaped as a Hub id, was sent to the Hub)."""
    from moestream.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(name)}: no such file$"):
        resolve_model(name)
    assert main(["inspect", "--model", name]) == 2
    assert capsys.readouterr().err.splitlines() == [f"moestream: error: {name}: no such file"]


def test_a_missing_file_path_is_no_such_file_or_folder(tmp_path):
    """A path with a file's suffix that is not there (nor a Hub id) says so, not "no such folder"."""
    for path in (tmp_path / "model.safetensors", tmp_path / "config.json", tmp_path / "Model-Q4_K_M.GGUF"):
        with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: no such file or folder$"):
            resolve_model(path)


def test_shard_named_in_index_but_absent(good, tmp_path):
    d = copy(good, tmp_path)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard model-00002-of-00002.safetensors is listed but missing"):
        Checkpoint(d)


def test_truncated_shard(good, tmp_path):
    d = copy(good, tmp_path)
    shard = d / "model-00001-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    msg = r"model-00001-of-00002.safetensors: tensor '.*': data_offsets end at .* truncated"
    with pytest.raises(CheckpointError, match=msg):
        Checkpoint(d)


def test_header_offsets_past_the_file(good, tmp_path):
    d = copy(good, tmp_path)
    shard = d / "model-00002-of-00002.safetensors"
    header, body = raw_header(shard)
    name = next(k for k in header if k != "__metadata__")
    b, e = header[name]["data_offsets"]
    header[name]["data_offsets"] = [b + len(body), e + len(body)]
    write_raw(shard, header, body)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}': data_offsets end at \d+ but the data section holds"):
        Checkpoint(d)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda h, n: h[n].update(dtype="Q7"), "unknown dtype 'Q7'"),
        (lambda h, n: h[n].update(shape=[-1, 2]), "is not a list of non-negative integers"),
        (lambda h, n: h[n].update(shape=[3, 3]), "bytes but dtype F32 x shape"),
        (lambda h, n: h[n].update(data_offsets=[8, 4]), "are not ordered"),
        (lambda h, n: h[n].update(data_offsets="0-4"), "is not a pair of integers"),
    ],
)
def test_malformed_header_fields(good, tmp_path, mutate, message):
    d = copy(good, tmp_path)
    shard = d / "model-00001-of-00002.safetensors"
    header, body = raw_header(shard)
    name = sorted(k for k in header if k != "__metadata__")[0]
    mutate(header, name)
    write_raw(shard, header, body)
    with pytest.raises(CheckpointError, match=message) as e:
        read_safetensors_header(shard)
    assert str(shard) in str(e.value)


def test_overlapping_tensors(good, tmp_path):
    d = copy(good, tmp_path)
    shard = d / "model-00001-of-00002.safetensors"
    header, body = raw_header(shard)
    a, b = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])[:2]
    if header[a]["shape"] == header[b]["shape"] and header[a]["dtype"] == header[b]["dtype"]:
        header[b]["data_offsets"] = header[a]["data_offsets"]
    else:
        header[b] = dict(header[a])
    write_raw(shard, header, body)
    with pytest.raises(CheckpointError, match="overlap"):
        read_safetensors_header(shard)


def test_header_not_json_and_too_short(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        read_safetensors_header(f)
    f.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="too short to be safetensors"):
        read_safetensors_header(f)
    f.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointError, match="runs past the end of the file"):
        read_safetensors_header(f)


def test_unsupported_model_type(good, tmp_path):
    d = copy(good, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llada_moe"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"model_type 'llada_moe' is not supported; moestream streams .*qwen3_moe"):
        load(d, tokenizer=False)


def test_missing_config_field_is_named(good, tmp_path):
    d = copy(good, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["moe_intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="required field 'moe_intermediate_size' is missing"):
        load(d, tokenizer=False)


def test_a_missing_field_with_other_names_is_named_by_the_config_s_own_name(good, tmp_path):
    """Qwen3's num_experts (transformers 5 also reads num_local_experts): the message names the config's own field
    first, then its other name."""
    d = copy(good, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    for name in ("num_experts", "num_local_experts"):
        cfg.pop(name, None)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"required field 'num_experts' is missing \(nor its other name "
                                          r"'num_local_experts'\)"):
        load(d, tokenizer=False)


def test_a_context_of_no_tokens_names_serve_s_flag():
    from moestream.options import EngineOptions

    with pytest.raises(ConfigError, match="--max-context must be at least 1, got 0"):
        EngineOptions.make(context_tokens=0)


def test_missing_resident_tensor_is_named(good, tmp_path):
    d = tmp_path / "m"
    tensors = read_all(good)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    write_checkpoint(good, d, tensors)
    with pytest.raises(CheckpointError, match="'model.layers.1.self_attn.k_norm.weight' is missing"):
        load(d, tokenizer=False)


def test_pickle_weights_are_refused_not_loaded(good, tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(good / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="never unpickles weights.*safetensors"):
        Checkpoint(d)


def test_budgets_that_cannot_fit_are_refused_before_loading(good, monkeypatch):
    monkeypatch.setattr("moestream.memory.available_bytes", lambda: 100_000)
    read = []
    monkeypatch.setattr("moestream.checkpoint.Checkpoint.read_tensor", lambda self, name: read.append(name))
    with pytest.raises(BudgetError, match=r"plus every expert \(--cache-budget-gb all\) \(0.00 GB\) plus the KV cache "
                                          r"\(0.00 GB for 512 tokens\) plus the runtime "
                                          r"and read buffers \(0.\d\d GB\) need 0.\d\d GB, "
                                          r"but only 0.00 GB of memory is available"):
        load(good, cache_budget_gb="all", tokenizer=False)
    # the weights fit but the runtime's reserve (0.5 GB and the read buffers) does not: refused, naming it
    monkeypatch.setattr("moestream.memory.available_bytes", lambda: 400_000_000)
    with pytest.raises(BudgetError, match=r"plus the runtime and read buffers \(0.\d\d GB\).*only 0.40 GB"):
        load(good, cache_budget_gb="0.001", tokenizer=False)
    with pytest.raises(BudgetError, match=r"resident weights \(0.00 GB\) plus a 1e-05 GB cache budget"):
        load(good, cache_budget_gb="0.00001", tokenizer=False)
    assert read == []  # refused before any weight was read


def test_shard_truncated_while_running(good, tmp_path):
    """A shard cut short after load: the read fails naming expert and file; nothing partial is used."""
    d = copy(good, tmp_path)
    engine = load(d, cache_budget_gb=0, tokenizer=False)
    try:
        with torch.inference_mode():
            engine.model(torch.arange(5), 0, engine.model.new_kv_cache())
        for shard in d.glob("*.safetensors"):
            os.truncate(shard, 200)
        msg = r"reading expert \(layer \d+, expert \d+\).* from .*safetensors: short read"
        with pytest.raises(ReadError, match=msg):
            with torch.inference_mode():
                engine.model(torch.arange(5), 0, engine.model.new_kv_cache())
        assert len(engine.cache) == 0 and not engine.cache.pinned()
    finally:
        engine.close()


def test_hub_id_goes_through_snapshot_download(monkeypatch, good):
    calls = []

    def fake(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(good)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake)
    assert resolve_model("Qwen/Qwen3-30B-A3B") == good
    assert calls[0][0] == "Qwen/Qwen3-30B-A3B" and "*.safetensors" in calls[0][1]
    assert not any(p.endswith((".bin", ".pt", ".pth")) for p in calls[0][1])


def test_cli_prints_one_line_errors(good, tmp_path):
    d = copy(good, tmp_path)
    (d / "model-00002-of-00002.safetensors").unlink()
    for args, message in [
        (["generate", "--model", str(d), "--prompt", "hi"], "is listed but missing"),
        (["generate", "--model", str(good), "--prompt", "hi", "--cache-budget-gb", "lots"], "is not a number of GB"),
        (["generate", "--model", str(good), "--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["synth", "--config", str(tmp_path / "none.json"), "--out", str(tmp_path / "o")], "cannot read a JSON config"),
    ]:
        r = subprocess.run([sys.executable, "-m", "moestream", *args], capture_output=True, text=True)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        lines = [line for line in r.stderr.splitlines() if line.startswith("moestream: error:")]
        assert len(lines) == 1 and message in lines[0], r.stderr


def test_generation_inputs_are_checked(good):
    from moestream.errors import InputError
    from moestream.generation import SamplingParams, generate

    engine = load(good, cache_budget_gb=0, tokenizer=False)  # vocab 300, context 512
    try:
        with pytest.raises(InputError, match="token id 300 is outside the model's vocabulary"):
            list(generate(engine, [5, 300], 4))
        with pytest.raises(InputError, match="the prompt has 512 tokens; the model's context holds 512"):
            list(generate(engine, [1] * 512, 4))
        with pytest.raises(InputError, match="the prompt is empty"):
            list(generate(engine, [], 4))
        steps = list(generate(engine, [1] * 500, 10**9, stop_at_eos=False))  # no huge KV allocation
        assert len(steps) == 12  # stopped at the context length
    finally:
        engine.close()
    for bad in (dict(temperature=float("inf")), dict(seed=2**64), dict(seed=-1)):
        with pytest.raises(InputError):
            SamplingParams(**bad)


def test_config_errors_name_the_file_and_field(good, tmp_path):
    d = copy(good, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, hidden_act="gelu")))
    with pytest.raises(ConfigError, match=rf"{d}/config.json: hidden_act 'gelu' is not supported"):
        load(d, tokenizer=False)
    (d / "config.json").write_text(json.dumps(dict(cfg, num_attention_heads="four")))
    with pytest.raises(ConfigError, match=rf"{d}/config.json: field 'num_attention_heads' = 'four' is not int"):
        load(d, tokenizer=False)


@pytest.mark.parametrize("field,value,shown", [
    ("rope_theta", "abc", "'abc' is not a number above 0"),  # was a ValueError traceback
    ("rope_scaling", 5, "5 is not an object"),  # was an AttributeError traceback
    ("rope_theta", 0, "0 is not a number above 0"),  # was NaN logits, then a sampling traceback
    ("rope_theta", -10000.0, "-10000.0 is not a number above 0"),
    ("rms_norm_eps", -1e-6, "-1e-06 is not a number of at least 0"),
    ("eos_token_id", "x", "'x' is not a token id or a list of them"),  # was silently ignored
])
def test_shared_config_values_are_refused_in_one_line(good, tmp_path, capsys, field, value, shown):
    """config.json values that gave a traceback, NaN logits or were ignored: one line naming the file and field,
    exit 2, from `moestream generate` before any weight is read."""
    from moestream.cli import main

    d = copy(good, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, **{field: value})))
    assert main(["generate", "--model", str(d), "--prompt", "hi", "--max-tokens", "2", "--no-chat-template"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"moestream: error: {d}/config.json: field {field!r} = {shown}"]


def test_generation_config_eos_is_checked(good, tmp_path):
    from moestream.generation import eos_ids

    d = copy(good, tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, "x"]}))
    engine = load(d, tokenizer=False)
    try:
        with pytest.raises(ConfigError, match=rf"^{d}/generation_config.json: field 'eos_token_id' = \[2, 'x'\] is"):
            eos_ids(engine)
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
        assert {2, 7} <= eos_ids(engine)
    finally:
        engine.close()


def _family_config(mt: str) -> dict:
    """A valid config of ``mt``: transformers' default one, Kimi K3's as published, Kimi K2 as DeepSeek-V3's."""
    from pathlib import Path

    from transformers import CONFIG_MAPPING

    if mt == "kimi_k3":
        return json.loads((Path(__file__).parent / "configs" / "Kimi-K3.json").read_text())
    cfg = CONFIG_MAPPING["deepseek_v3" if mt == "kimi_k2" else mt]().to_dict()
    # transformers' defaults that no checkpoint has: top-k unset (DeepSeek-V2), head_dim 42 with half rotary (GLM)
    fix = {"deepseek_v2": {"num_experts_per_tok": 6}, "glm4_moe": {"head_dim": 128}}.get(mt, {})
    return dict(cfg, model_type=mt, **fix)


def _places(cfg: dict, name: str) -> list[tuple[str, ...]]:
    """Every key path in ``cfg`` where a family may read ``name``: the decoder's scope (``text_config`` when nested),
    the top level, and for ``rope_theta`` inside ``rope_scaling``/``rope_parameters`` and their per-layer-type dicts."""
    scopes = [()] + ([("text_config",)] if isinstance(cfg.get("text_config"), dict) else [])
    out = [(*s, name) for s in scopes]
    if name == "rope_theta":
        for s in scopes:
            inner = cfg
            for k in s:
                inner = inner[k]
            for key in ("rope_scaling", "rope_parameters"):
                if isinstance(inner.get(key), dict):
                    out.append((*s, key, name))
                    out += [(*s, key, k, name) for k, v in inner[key].items() if isinstance(v, dict)]
    return out


@pytest.mark.parametrize("mt", __import__("moestream.models", fromlist=["x"]).supported_model_types())
def test_shared_config_fields_are_checked_for_every_family(mt):
    """Each family's valid config is accepted; a bad RoPE base, RoPE dict, norm eps or eos id anywhere a family may
    read it (top level, ``text_config``, ``rope_parameters`` and its per-layer-type entries) is a ConfigError naming
    the file and the field's path."""
    import copy as copying
    import re

    from moestream.models import family_for

    cfg = _family_config(mt)
    family_for(cfg, "c.json").ModelArgs.from_config(cfg)
    bad = [("rope_theta", "abc"), ("rope_theta", 0), ("rope_theta", -1.0), ("rope_theta", float("nan")),
           ("rms_norm_eps", -1e-5), ("rms_norm_eps", "tiny"), ("eos_token_id", "x"), ("eos_token_id", [1, True]),
           ("eos_token_id", -1), ("rope_scaling", 5), ("rope_parameters", "yarn")]
    checked = 0
    for name, value in bad:
        for path in _places(cfg, name):
            broken = copying.deepcopy(cfg)
            inner = broken
            for k in path[:-1]:
                inner = inner[k]
            inner[path[-1]] = value
            with pytest.raises(ConfigError, match=rf"^c\.json: field '{re.escape('.'.join(path))}' = "):
                family_for(broken, "c.json")
            checked += 1
    assert checked >= len(bad)


def test_experts_with_pieces_the_family_lacks_are_refused(good, tmp_path):
    tensors = read_all(good)
    for e in range(8):
        tensors[f"model.layers.0.mlp.experts.{e}.gate_proj.bias"] = torch.zeros(32)
    d = write_checkpoint(good, tmp_path / "bias", tensors)
    with pytest.raises(LayoutError, match=r"model.layers.0.mlp experts hold gate, up, down, gate.bias; this family"):
        load(d, tokenizer=False)


def test_cli_checks_arguments_before_loading(good, tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text((good / "config.json").read_text())
    for args, message in [
        (["generate", "--model", str(good), "--prompt", "hi", "--stats-json", str(tmp_path / "no" / "s.json")],
         "--stats-json"),
        (["generate", "--model", str(good), "--prompt", "hi", "--usage-file", str(tmp_path / "no" / "u.json")],
         "--usage-file"),  # its folder was created silently at the end of the run
        (["generate", "--model", str(good), "--prompt", ""], "--prompt is empty"),
        (["generate", "--model", str(good), "--prompt", "hi", "--seed", str(10**30), "--temp", "1"], "--seed"),
        (["generate", "--model", str(good), "--prompt", "hi", "--top-p", "2"], "--top-p"),
        (["synth", "--config", str(cfg), "--out", str(tmp_path / "o"), "--shard-gb", "nan"], "--shard-gb nan"),
        (["synth", "--config", str(cfg), "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path)],
         "no tokenizer files there"),
        (["synth", "--config", str(cfg), "--out", str(cfg / "x")], "cannot write the checkpoint"),
    ]:
        r = subprocess.run([sys.executable, "-m", "moestream", *args], capture_output=True, text=True)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert message in r.stderr, r.stderr
    assert not any(tmp_path.glob("o*"))  # nothing half-written
    assert not (tmp_path / "no").exists()  # no folder made for --usage-file
