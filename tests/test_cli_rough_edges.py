"""The CLI and the Python API at their edges: Ctrl-C at any point, output paths that do not exist,
an engine used after close, progress when nobody watches a terminal."""

import json
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from moestream.engine import load
from moestream.generation import SamplingParams, Session, generate

from .helpers import qwen3_moe_fixture, tiny_synth_fixture, write_tiny_synth_config

text_model = tiny_synth_fixture("text")  # a tiny model with the real Qwen3 tokenizer and vocabulary
tiny = qwen3_moe_fixture("tiny", 5, num_hidden_layers=3)


def _default_sigint():
    # a shell's background job ignores SIGINT, and its children inherit that (Python then installs no
    # KeyboardInterrupt handler): the CLI under test gets the default a terminal gives it
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_decode_prints_the_stats_so_far_and_writes_the_json(text_model, tmp_path):
    """SIGINT once tokens are streaming: the stats block of the tokens so far (finish reason "interrupted"),
    --stats-json written with them, exit 130, no traceback."""
    stats_file = tmp_path / "s.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moestream", "generate", "--model", str(text_model), "--prompt", "Tell me a story.",
         "--max-tokens", "3000", "--temp", "1", "--seed", "1", "--cache-budget-gb", "0", "--stats-json",
         str(stats_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    seen = threading.Event()

    def watch():
        if proc.stdout.read(1):  # the first generated text: decoding has begun
            seen.set()
        proc.stdout.read()

    threading.Thread(target=watch, daemon=True).start()
    assert seen.wait(240), "no token within 240 s"
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert "moestream: interrupted" in err.splitlines()[-1]
    stats = json.loads(stats_file.read_text())
    assert stats["finish_reason"] == "interrupted"
    assert 1 <= stats["generated_tokens"] < 3000 and len(stats["generated_token_ids"]) == stats["generated_tokens"]
    assert stats["decode_seconds"] > 0 and stats["cache_lookups"] > 0 and stats["experts_read"] > 0
    assert f"generated tokens     {stats['generated_tokens']} (interrupted)" in err


def test_ctrl_c_in_prefill_fills_the_stats(text_model, tmp_path, monkeypatch, capsys):
    """Interrupted between two prefill chunks: generate's stats still hold what was done (lookups, reads,
    prefill time), and the CLI prints and writes them and returns 130."""
    import moestream.generation as generation
    from moestream.cli import main

    calls = []
    forward = generation._forward

    def interrupt_second_chunk(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return forward(*a, **kw)

    monkeypatch.setattr(generation, "_forward", interrupt_second_chunk)
    stats_file = tmp_path / "s.json"
    rc = main(["generate", "--model", str(text_model), "--prompt", "disk " * 700, "--max-tokens", "4",
               "--cache-budget-gb", "0", "--stats-json", str(stats_file), "--no-chat-template"])
    err = capsys.readouterr().err
    assert rc == 130 and err.splitlines()[-1] == "moestream: interrupted"
    assert len(calls) == 2  # prefill chunk 1 ran, chunk 2 was interrupted
    stats = json.loads(stats_file.read_text())
    assert stats["finish_reason"] == "interrupted" and stats["generated_tokens"] == 0
    assert stats["prompt_tokens"] > 512 and stats["prefill_seconds"] > 0
    assert stats["cache_lookups"] > 0 and stats["experts_read"] > 0  # the first chunk's, counted
    assert "generated tokens     0 (interrupted)" in err


def test_ctrl_c_during_the_imports_is_not_a_traceback(tmp_path):
    """SIGINT while the CLI imports PyTorch to build its parser (as a Ctrl-C in the first seconds would): exit 130
    and one line. The signal is sent by an import hook, so it lands inside the import every time."""
    hook = (
        "import os, signal, sys\n"
        "class Hook:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            sys.meta_path.remove(self)\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Hook())\n"
        "from moestream.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    r = subprocess.run([sys.executable, "-c", hook, "generate", "--model", str(tmp_path), "--prompt", "hi"],
                       capture_output=True, text=True, timeout=300, preexec_fn=_default_sigint)
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip() == "moestream: interrupted", r.stderr


def test_an_interrupted_forward_empties_the_session(tiny, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) inside a forward pass, after some layers wrote the step into the KV cache: the
    Session starts over, as after a failed read, and its next call equals a fresh one bit for bit."""
    engine = load(tiny, cache_budget_gb="0", tokenizer=False, workers=2, learn_experts=False, hotlist=False)
    try:
        prompt = list(range(3, 20))
        session = Session()
        first = [s.token for s in generate(engine, prompt, 4, SamplingParams(), stop_at_eos=False, session=session)]
        follow = prompt + first + [7, 8, 9]
        block = engine.model.decoder.layers[2].mlp
        monkeypatch.setattr(block, "forward", lambda x: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            list(generate(engine, follow, 4, SamplingParams(), stop_at_eos=False, session=session))
        assert session.kv is None and session.ids == []
        monkeypatch.undo()
        again = list(generate(engine, follow, 4, SamplingParams(), stop_at_eos=False, keep_logits=True,
                              session=session))
        fresh = list(generate(engine, follow, 4, SamplingParams(), stop_at_eos=False, keep_logits=True))
        assert all(torch.equal(a.logits, b.logits) for a, b in zip(again, fresh))
    finally:
        engine.close()


def test_usage_file_in_a_missing_folder_is_refused(text_model, tmp_path, capsys):
    """--usage-file whose folder does not exist: refused before loading, as --trace and --stats-json are (the run
    used to create the folders silently when it saved the profile)."""
    from moestream.cli import main

    path = tmp_path / "new" / "deeper" / "usage.json"
    assert main(["generate", "--model", str(text_model), "--prompt", "hi", "--max-tokens", "2",
                 "--usage-file", str(path)]) == 2
    assert capsys.readouterr().err.strip() == f"moestream: error: --usage-file {path}: not a file in an existing folder"
    assert not (tmp_path / "new").exists()
    path.parent.mkdir(parents=True)  # in an existing folder it is read and written as before
    assert main(["generate", "--model", str(text_model), "--prompt", "hi", "--max-tokens", "2", "--quiet",
                 "--usage-file", str(path)]) == 0
    assert json.loads(path.read_text())["model_id"]


@pytest.mark.parametrize("budget", ["0", "all"])
def test_engine_is_a_context_manager_and_refuses_use_after_close(tiny, budget):
    """``with moestream.load(...) as engine`` closes it at the end of the block (the profile saved, the readers
    stopped); using it afterwards -- generate, stream_generate, a forward that reads an expert -- raises
    EngineClosedError saying it is closed, at any budget (with every expert resident it used to run on)."""
    import moestream
    from moestream.errors import EngineClosedError, MoestreamError

    with moestream.load(tiny, cache_budget_gb=budget, tokenizer=False, learn_experts=False) as engine:
        want = [s.token for s in generate(engine, [5, 6, 7], 3, SamplingParams(), stop_at_eos=False)]
        assert len(want) == 3 and not engine.closed
    assert engine.closed and engine.store.closed
    assert issubclass(EngineClosedError, MoestreamError)
    with pytest.raises(EngineClosedError, match=rf"the engine of {tiny} is closed"):
        list(generate(engine, [5, 6, 7], 3, SamplingParams(), stop_at_eos=False))
    with pytest.raises(EngineClosedError, match="is closed"):
        list(moestream.stream_generate(engine, [5, 6, 7], 3))
    if budget == "0":
        with pytest.raises(EngineClosedError, match="the expert store is closed"), torch.inference_mode():
            engine.model(torch.tensor([5, 6]), 0, engine.model.new_kv_cache())
    engine.close()  # a second close does nothing


def test_synth_and_convert_log_progress_lines_without_a_terminal(tmp_path):
    """With stderr a pipe (a log, CI, nohup), synth and convert print progress lines instead of nothing."""
    cfg = write_tiny_synth_config(tmp_path / "c.json", vocab_size=300)
    convert = ["convert", "--model", str(tmp_path / "m"), "--bits", "16",
               "--out", str(tmp_path / "q")]
    for args, name in ((["synth", "--config", str(cfg), "--out", str(tmp_path / "m")], "m"), (convert, "q")):
        r = subprocess.run([sys.executable, "-m", "moestream", *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith(f"writing {name}: ")]
        assert len(lines) >= 2 and lines[0].endswith("GB to go") and lines[-1].startswith(f"writing {name}: done, ")
        assert "\r" not in r.stderr  # no terminal bar redrawn in the log


def test_line_progress_prints_at_most_one_line_per_interval():
    import io

    from moestream.engine import LineProgress

    now = [100.0]
    out = io.StringIO()
    with LineProgress(4_000_000_000, "writing m", interval=5.0, out=out, clock=lambda: now[0]) as bar:
        for _ in range(40):  # 0.1 GB every 0.5 s: one line per 5 s, ten updates apart
            now[0] += 0.5
            bar.update(100_000_000)
    lines = out.getvalue().splitlines()
    assert lines[0] == "writing m: 4.00 GB to go"
    assert lines[1] == "writing m: 1.00 of 4.00 GB (25%), 200 MB/s, 5 s, about 15 s left"
    assert len(lines) == 1 + 4 + 1 and lines[-1] == "writing m: done, 4.00 GB in 20 s"
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt), LineProgress(10, "writing m", out=out) as bar:
        raise KeyboardInterrupt
    assert out.getvalue().splitlines() == ["writing m: 0.00 GB to go"]  # no "done" for a run that did not end


@pytest.mark.parametrize("command, wanted", [
    ("cache-sim", ["--budgets BUDGETS cache budgets in GB, comma-separated (e.g. 0.5,1,2); this or --residency is "
                   "required", "(e.g. 0.1,0.2,0.4); this or --budgets is required"]),
    ("convert", ["--bits BITS bits for every part not given below (default 4): 2-6, 8;"]),
    ("inspect", ["--model MODEL checkpoint folder, GGUF file (the first file of a split set) or Hugging Face Hub id"]),
])
def test_help_says_what_is_required_and_the_defaults(command, wanted, capsys):
    """cache-sim's help says one of --budgets and --residency is required (it used to say so only once run),
    convert's gives --bits' default, inspect's says --model takes a GGUF file too."""
    from moestream.cli import main

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    for w in wanted:
        assert w in text, text


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_bad_kernel_choice_is_one_line_before_anything_is_read(tiny, command):
    """``MOESTREAM_CPU_KERNELS=foo``: exit 2 with one line naming the variable and the choices, no traceback,
    before the checkpoint is opened (nothing about reads or loading printed)."""
    import os

    env = dict(os.environ, MOESTREAM_CPU_KERNELS="foo")
    args = ["--prompt", "hi", "--max-tokens", "2"] if command == "generate" else ["--port", "0"]
    run = subprocess.run([sys.executable, "-m", "moestream", command, "--model", str(tiny), *args], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert lines[-1] == ("moestream: error: environment variable MOESTREAM_CPU_KERNELS='foo': expected one of "
                         "auto, avx512, avx2, portable, torch"), run.stderr
    assert "Traceback" not in run.stderr and "expert reads" not in run.stderr


def _memory(monkeypatch, avail: int) -> None:
    """This process may take ``avail`` bytes (what the budget plan and the read-path choice see)."""
    monkeypatch.setattr("moestream.memory.available_bytes", lambda *a, **k: avail)
    monkeypatch.setattr("moestream.memory.available_with_source", lambda *a, **k: (avail, "MemAvailable"))


def test_a_missing_pin_file_is_one_line_naming_the_flag_before_anything_is_read(text_model, tmp_path, capsys,
                                                                                monkeypatch):
    """--pin-file that does not exist was a warning once the resident weights were in, and the run went on without
    pins; it is one error line naming the flag and the file, before any weight is read (nothing else printed)."""
    from moestream.cli import main

    read = []
    monkeypatch.setattr("moestream.checkpoint.Checkpoint.read_tensor", lambda self, name: read.append(name))
    path = tmp_path / "pins.json"
    assert main(["generate", "--model", str(text_model), "--prompt", "hi", "--max-tokens", "2",
                 "--pin-file", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"moestream: error: --pin-file {path}: no such file"]
    assert read == []


def test_a_budget_above_every_expert_is_a_plain_number(text_model, capsys):
    """--cache-budget-gb 100000 was shown as "1e+05 GB"; the stats say 100000 GB, and inspect's plan says it is capped
    at every expert."""
    from moestream.cli import main

    assert main(["generate", "--model", str(text_model), "--prompt", "hi", "--max-tokens", "2", "--no-chat-template",
                 "--cache-budget-gb", "100000"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"^cache budget         100000 GB \(peak held \d+\.\d\d GB\)$", err, re.M), err
    assert "e+0" not in err
    assert main(["inspect", "--model", str(text_model), "--cache-budget-gb", "100000"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  tiers:            CPU expert cache \(100000\.00 GB, capped at every expert, 0\.05 MB\) over "
                     r"the checkpoint's shards$", out, re.M), out


def test_a_context_that_does_not_fit_names_the_flag_that_sized_it(text_model, capsys, monkeypatch):
    """When the KV cache is what does not fit, the refusal names the flag the context came from: generate's
    --max-tokens, inspect's (and serve's) --max-context, with the tokens that fit (the same for both)."""
    from moestream.cli import main

    _memory(monkeypatch, 2 * 10**9)
    assert main(["generate", "--model", str(text_model), "--prompt", "hi", "--max-tokens", str(10**9)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    said = re.search(r"; the KV cache is what does not fit: give a smaller --max-tokens \(at most (\d+) tokens of "
                     r"context fit\)$", err[0])
    assert said and err[0].startswith("moestream: error: resident weights"), err
    assert main(["inspect", "--model", str(text_model), "--max-context", str(10**9)]) == 0
    out = capsys.readouterr().out
    planned = re.search(r"^  refused:          .*; the KV cache is what does not fit: give a smaller --max-context "
                        r"\(at most (\d+) tokens of context fit\)$", out, re.M)
    assert planned and planned[1] == said[1], out


def _plan_block(text: str) -> list[str]:
    """inspect's load plan lines: from "load plan:" to the line before "can stream:"."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("load plan:"))
    end = next(i for i, ln in enumerate(lines) if ln.startswith("can stream:"))
    return lines[start:end]


@pytest.mark.parametrize("flags, wanted", [
    (["--cache-budget-gb", "0.0001"], "  tiers:            CPU expert cache (0.10 MB) over the checkpoint's shards"),
    (["--cache-budget-gb", "all", "--dtype", "bf16"], "load plan:          on cpu, bfloat16; family qwen3_moe"),
    (["--cache-budget-gb", "auto", "--prefetch-ahead", "1", "--no-page-cache", "--prefetch-workers", "2"],
     "  budget:           cache budget auto: "),
    (["--max-batch", "3", "--max-context", str(10**8)], "x 3 sequences (--max-batch)"),
])
def test_inspect_prints_the_plan_the_engine_loads_with_the_same_flags(tiny, capsys, monkeypatch, flags, wanted):
    """``inspect`` takes the engine flags that change the load plan and prints the plan ``engine.load`` executes
    with the options those flags make (serve's parser: the engine flags, --max-batch, --max-context), line for line,
    refusals included; without the flags the plan is another (the flags are not ignored)."""
    import argparse

    from moestream.cli import main
    from moestream.cli.engine_args import engine_options
    from moestream.cli.serve import _add_serve_args
    from moestream.errors import BudgetError

    _memory(monkeypatch, 2 * 10**9)  # the budget and read-path lines, and refusals, do not drift between the two
    assert main(["inspect", "--model", str(tiny), "--device", "cpu", *flags]) == 0
    text = capsys.readouterr().out
    printed = _plan_block(text)
    verdict = next(ln for ln in text.splitlines() if ln.startswith("can stream:"))
    assert any(wanted in ln for ln in printed), printed
    p = argparse.ArgumentParser()
    _add_serve_args(p)
    args = p.parse_args(["--model", str(tiny), "--device", "cpu", "--no-learn-experts", *flags])
    options = engine_options(args, context=args.max_context)
    try:
        engine = load(tiny, options=options, tokenizer=False)
    except BudgetError as e:  # refused as planned: inspect printed that refusal, and does not say it loads
        assert f"  refused:          {e}" in printed, printed
        assert verdict == "can stream:         yes, but not here with these options (the load plan says why)"
    else:
        with engine:
            assert printed == engine.plan.describe()
        assert verdict == "can stream:         yes"
    assert main(["inspect", "--model", str(tiny), "--device", "cpu"]) == 0
    assert _plan_block(capsys.readouterr().out) != printed


def test_a_context_above_the_models_is_noted_once(text_model, capsys):
    """A context past the config's max_position_embeddings (inspect's or serve's --max-context, load's
    context_tokens=) loads, with one note naming the option and the model's context; one within it says nothing."""
    from moestream.cli import main

    limit = json.loads((text_model / "config.json").read_text())["max_position_embeddings"]
    assert main(["inspect", "--model", str(text_model), "--max-context", str(limit + 1)]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if "max_position_embeddings" in ln]
    assert notes == [f"note: a context of {limit + 1} tokens (--max-context) is above the model's "
                     f"(max_position_embeddings {limit} in its config): positions past it are beyond what it was "
                     "trained on"], notes
    with load(text_model, tokenizer=False, hotlist=False, learn_experts=False, context_tokens=limit + 1):
        pass
    err = capsys.readouterr().err
    assert err.count("max_position_embeddings") == 1 and "(context_tokens=)" in err, err
    with load(text_model, tokenizer=False, hotlist=False, learn_experts=False, context_tokens=limit):
        pass
    assert "max_position_embeddings" not in capsys.readouterr().err
