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


def test_a_context_of_no_tokens_names_the_option_as_its_caller_gave_it():
    """The Python API's options name moestream.load's keyword, the CLI's the flag (serve's --max-context, or the
    flag a command sizes the context from)."""
    import argparse

    from moestream.options import EngineOptions

    with pytest.raises(ConfigError, match=r"^context_tokens= must be at least 1, got 0$"):
        EngineOptions.make(context_tokens=0)
    with pytest.raises(ConfigError, match=r"^--max-context must be at least 1, got 0$"):
        EngineOptions.from_args(argparse.Namespace(), context_tokens=0)
    with pytest.raises(ConfigError, match=r"^--max-tokens must be at least 1, got 0$"):
        EngineOptions.from_args(argparse.Namespace(), context_tokens=0, context_flag="--max-tokens")


@pytest.mark.parametrize("keywords, message", [
    (dict(cache_budget_gb="lots"), "cache_budget_gb='lots' is not a number of GB: give a number between 0 and 1e9, "
                                   "'all' or 'auto' (it must be a number of GB)"),
    (dict(host_cache_gb=-1), "host_cache_gb=-1 must be a number of GB between 0 and 1e9, or 'auto'"),
    (dict(prefix_cache_gb=-1), "prefix_cache_gb=-1: give a number of GB >= 0 (0: off)"),
    (dict(max_batch=0), "max_batch= must be at least 1, got 0"),
    (dict(workers="2"), "workers= must be an integer, got '2'"),
    (dict(cache_policy="fifo"), "cache_policy='fifo': expected one of lru, lfu, layer"),
    (dict(hot_fraction=1.5), "hot_fraction=1.5: give a share of the budget between 0 and 1"),
    (dict(device="tpu"), "device='tpu': expected auto, cpu, cuda or cuda:N"),
    (dict(host_cache_gb="0.001", wire_memory=True, device="cpu"),
     "wire_memory=True applies to the CPU expert cache; with device=cuda use host_cache_gb="),
])
def test_api_errors_name_the_python_keyword_not_the_flag(good, keywords, message):
    """``moestream.load``'s errors name its keywords (``max_batch=``), not the CLI's flags (``--max-batch``) the same
    checks name for ``moestream generate``."""
    import moestream
    from moestream.errors import MoestreamError

    with pytest.raises(MoestreamError) as e:
        moestream.load(good, tokenizer=False, **keywords)
    assert str(e.value) == message
    assert "--" not in str(e.value)


@pytest.mark.parametrize("flags, message", [
    (["--cache-budget-gb", "lots"], "--cache-budget-gb: 'lots' is not a number of GB"),
    (["--prefetch-workers", "0"], "--prefetch-workers must be at least 1, got 0"),
    (["--cache-policy", "lru", "--hot-fraction", "1.5"], "--hot-fraction 1.5: give a share of the budget"),
    (["--device", "tpu"], "--device: 'tpu': expected auto, cpu, cuda or cuda:N"),
])
def test_cli_errors_name_the_flag(good, capsys, flags, message):
    from moestream.cli import main

    assert main(["generate", "--model", str(good), "--prompt", "hi", "--max-tokens", "1", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moestream: error: {message}"), err
    assert "=" not in err[0].split(":", 2)[2].split()[0]  # the flag, not a keyword


def _memory(monkeypatch, avail: int) -> None:
    """This process may take ``avail`` bytes (what the budget plan and the read-path choice see)."""
    monkeypatch.setattr("moestream.memory.available_bytes", lambda *a, **k: avail)
    monkeypatch.setattr("moestream.memory.available_with_source", lambda *a, **k: (avail, "MemAvailable"))


def _budget_refusal(path, **keywords):
    """The budget refusal of planning ``path`` with ``moestream.load``'s ``keywords`` on the CPU, or None."""
    from moestream.load_plan import plan_load
    from moestream.options import EngineOptions
    from moestream.sources import open_checkpoint

    ckpt = open_checkpoint(path)
    try:
        refusal = plan_load(ckpt, EngineOptions.make(device="cpu", **keywords)).refusal("budget")
    finally:
        ckpt.close()
    return None if refusal is None else refusal.message


@pytest.mark.parametrize("budget, sequences", [("0", 1), ("0.0001", 3), ("auto", 1), ("auto", 2)])
def test_a_context_that_does_not_fit_says_how_many_tokens_do(good, monkeypatch, budget, sequences):
    """When everything but the KV caches fits, the refusal says the KV cache is what does not fit and names the
    context option with the tokens that fit: that many load, one more does not (a given budget and auto, one
    sequence and several)."""
    _memory(monkeypatch, 2 * 10**9)
    kw = dict(cache_budget_gb=budget, max_batch=sequences)
    message = _budget_refusal(good, context_tokens=10**9, **kw)
    each = f" for each of {sequences} sequences" if sequences > 1 else ""
    m = re.search(rf"; the KV cache is what does not fit: give a smaller context_tokens= \(at most (\d+) tokens of "
                  rf"context fit{each}\)", message)
    assert m, message
    fit = int(m[1])
    assert 1000 < fit < 10**9
    assert _budget_refusal(good, context_tokens=fit, **kw) is None
    assert _budget_refusal(good, context_tokens=fit + 1, **kw) is not None
    assert ("or fewer max_batch= sequences" in message) == (sequences > 1)
    assert "--" not in message
    with pytest.raises(BudgetError, match=re.escape(message)):  # load raises the planned refusal, before reading
        load(good, tokenizer=False, device="cpu", context_tokens=10**9, **kw)


def test_a_budget_that_does_not_fit_with_any_context_keeps_the_budget_hint(good, monkeypatch):
    """When the resident weights and the reserve alone exceed the memory, a shorter context cannot help: the message
    says to give a smaller budget, not a context."""
    _memory(monkeypatch, 300_000_000)
    message = _budget_refusal(good, context_tokens=10**6)
    assert message.endswith("; give a smaller cache_budget_gb=, or auto"), message
    assert "KV cache is what does not fit" not in message


def test_a_missing_pin_file_is_an_error_naming_it(good, tmp_path, monkeypatch):
    """A pin file that does not exist was a warning after the resident weights loaded; it is an error naming the
    file and the option, before the checkpoint is opened (a folder too)."""
    read = []
    monkeypatch.setattr("moestream.checkpoint.Checkpoint.read_tensor", lambda self, name: read.append(name))
    missing = tmp_path / "pins.json"
    with pytest.raises(ConfigError, match=rf"^pin_file={re.escape(str(missing))}: no such file$"):
        load(good, tokenizer=False, pin_file=missing)
    with pytest.raises(ConfigError, match=rf"^pin_file={re.escape(str(tmp_path))}: not a file$"):
        load(good, tokenizer=False, pin_file=tmp_path)
    assert read == []


def test_budgets_are_plain_numbers_of_gb():
    """A budget is printed as a plain number, never as 1e+05 or 1e-05."""
    from moestream.budget import gb_text
    from moestream.options import EngineOptions

    cases = {100000e9: "100000", 3e9: "3", 0.5e9: "0.5", 12.5e9: "12.5", 1e4: "0.00001", 1234.5678e9: "1235",
             0: "0", 1.2345e9: "1.23"}
    assert {v: gb_text(v) for v in cases} == cases
    assert gb_text(1.2345e9, 6) == "1.2345" and gb_text(1e15, 6) == "1000000"
    assert EngineOptions.make(100000).describe_budget() == "100000 GB"
    assert EngineOptions.make(0.00001).describe_budget() == "0.00001 GB"


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
    with pytest.raises(BudgetError, match=r"plus every expert \(cache_budget_gb=all\) \(0.00 GB\) plus the KV cache "
                                          r"\(0.00 GB for 512 tokens\) plus the runtime "
                                          r"and read buffers \(0.\d\d GB\) need 0.\d\d GB, "
                                          r"but only 0.00 GB of memory is available"):
        load(good, cache_budget_gb="all", tokenizer=False)
    # the weights fit but the runtime's reserve (0.5 GB and the read buffers) does not: refused, naming it
    monkeypatch.setattr("moestream.memory.available_bytes", lambda: 400_000_000)
    with pytest.raises(BudgetError, match=r"plus the runtime and read buffers \(0.\d\d GB\).*only 0.40 GB"):
        load(good, cache_budget_gb="0.001", tokenizer=False)
    with pytest.raises(BudgetError, match=r"resident weights \(0.00 GB\) plus a 0.00001 GB cache budget"):
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


def test_a_context_that_does_not_fit_on_a_cuda_device_says_how_many_tokens_do():
    """The VRAM budget ``auto`` (planned here without a GPU: the free bytes are an argument): when the KV cache is what
    leaves nothing for the experts, the refusal names the context option and the tokens that fit; a given budget that
    does not fit names the budget in plain GB."""
    from pathlib import Path

    from moestream.budget import plan_device_budget, resident_bytes
    from moestream.models import family_for

    cfg = json.loads((Path(__file__).parent / "configs" / "Qwen3-30B-A3B.json").read_text())
    family = family_for(cfg, "cfg")
    with torch.device("meta"):
        net = family.Model(family.ModelArgs.from_config(cfg))
    one, free = 9_437_184, 40 * 10**9
    kw = dict(dtype=torch.bfloat16, experts=48 * 128 * one, one=one, free=free, device="cuda:0")

    def plan(budget, tokens, name=None):
        return plan_device_budget(net, budget, context_tokens=tokens, **kw, **({"name": name} if name else {}))

    with pytest.raises(BudgetError) as e:
        plan("auto", 10**6)
    m = re.search(r"leave nothing for experts; the KV cache is what does not fit: give a smaller --max-context "
                  r"\(at most (\d+) tokens of context fit\)$", str(e.value))
    assert m and str(e.value).startswith("--cache-budget-gb auto: cuda:0 has 40.00 GB free"), str(e.value)
    fit = int(m[1])
    assert plan("auto", fit).budget > 0
    with pytest.raises(BudgetError):
        plan("auto", fit + 1)
    from moestream.errors import keyword

    with pytest.raises(BudgetError, match=r"^cache_budget_gb=auto: .*give a smaller context_tokens= \(at most"):
        plan("auto", 10**6, keyword)
    resident = resident_bytes(net, torch.bfloat16)
    with pytest.raises(BudgetError, match=r"plus a 100000 GB cache budget \(57\.98 GB\) need .*; give a smaller "
                                          r"--cache-budget-gb$"):
        plan_device_budget(net, 10**14, context_tokens=None, **dict(kw, free=resident + 10**9))
    fits = plan_device_budget(net, 10**14, context_tokens=None, **dict(kw, free=100 * 10**9))
    assert fits.budget == 10**14 and fits.experts == 48 * 128 * one  # what inspect's tiers line says it is capped at
