"""``moestream generate`` (and ``python -m moestream.stream_generate``): load, generate with streamed
output, print the stats; ``--chat`` for turns read from the terminal."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import MoestreamError
from . import engine_args
from .engine_args import add_engine_args, engine_options


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--prompt", default=None, help="the prompt text; '-' reads it from stdin")
    p.add_argument("--prompt-file", type=Path, default=None, help="read the prompt from this file (UTF-8)")
    p.add_argument("--system", default=None, help="a system message (through the chat template)")
    p.add_argument("--chat", action="store_true",
                   help="interactive multi-turn chat in the terminal; the KV cache is kept between turns")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    p.add_argument("--temp", type=float, default=None,
                   help="sampling temperature; 0 = greedy (default: generation_config.json, else 0)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass; 0 or 1 = off (default: generation_config.json, else off)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the k most likely tokens; 0 = off (default: generation_config.json, else off)")
    p.add_argument("--min-p", type=float, default=None,
                   help="drop tokens less likely than min-p x the top token; 0 = off "
                        "(default: generation_config.json, else off)")
    p.add_argument("--rep-penalty", type=float, default=None,
                   help="repetition penalty (CTRL); 1 = off (default: generation_config.json, else off)")
    p.add_argument("--rep-ctx", type=int, default=256,
                   help="tokens the repetition penalty looks back at (default 256)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's frequency penalty (default 0)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's presence penalty (default 0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop before this string (never printed); repeatable")
    p.add_argument("--no-think", action="store_true",
                   help="render the chat template with enable_thinking=False (thinking models)")
    p.add_argument("--multi-think", action="store_true",
                   help="allow </think> again after the thinking block closed (default: masked)")
    p.add_argument("--hide-think", action="store_true", help="print only the answer, not the thinking block")
    p.add_argument("--no-chat-template", action="store_true", help="encode the prompt as is, without the chat template")
    p.add_argument("--stats-json", type=Path, default=None, help="also write the run's stats to this JSON file")
    p.add_argument("--quiet", action="store_true", help="print only the generated text, not the stats")


def _generate_defaults() -> dict:
    p = argparse.ArgumentParser(add_help=False)
    _add_generate_args(p)
    return {a.dest: a.default for a in p._actions if a.dest != "help"}


def _read_prompt(args: argparse.Namespace, inp) -> str | None:
    """The prompt from --prompt, --prompt - (stdin) or --prompt-file; None in --chat without one."""
    if args.prompt is not None and args.prompt_file is not None:
        raise MoestreamError("give --prompt or --prompt-file, not both")
    if args.prompt == "-":
        if args.chat:
            raise MoestreamError("--prompt - reads stdin, which --chat reads the turns from")
        text = inp.read()
        if not text.strip():
            raise MoestreamError("--prompt -: stdin is empty")
        return text
    if args.prompt_file is not None:
        try:
            text = args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise MoestreamError(f"--prompt-file {args.prompt_file}: cannot read it: {why}") from None
        if not text.strip():
            raise MoestreamError(f"--prompt-file {args.prompt_file}: the file is empty")
        return text
    if args.prompt is None:
        if args.chat:
            return None
        raise MoestreamError("give --prompt TEXT, --prompt - (stdin), --prompt-file PATH or --chat")
    if not args.prompt:
        raise MoestreamError("--prompt is empty")
    return args.prompt


def _sampling(args: argparse.Namespace, defaults: dict):
    """SamplingParams from the flags, then ``defaults`` (generation_config.json), then the built-in defaults."""
    from ..sampling import resolve_sampling

    try:
        return resolve_sampling(
            defaults, args.temp, args.top_p, args.top_k, args.min_p, args.rep_penalty, seed=args.seed,
            repetition_context=args.rep_ctx, frequency_penalty=args.frequency_penalty,
            presence_penalty=args.presence_penalty,
        )
    except MoestreamError as e:
        if defaults:
            raise MoestreamError(f"{e} (flags and generation_config.json together)") from None
        raise


class _Printer:
    """Writes generated text, the thinking block included or not (--hide-think)."""

    def __init__(self, out, hide_think: bool, starts_in_reasoning: bool):
        from ..textstream import ReasoningSplitter

        self.out = out
        self.splitter = ReasoningSplitter(starts_in_reasoning) if hide_think else None
        self.raw: list[str] = []

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()

    def push(self, text: str) -> None:
        self.raw.append(text)
        self._write(self.splitter.push(text).answer if self.splitter else text)

    def end(self) -> str:
        """Flush; return the whole raw text of the turn."""
        if self.splitter:
            self._write(self.splitter.flush().answer)
        self.out.write("\n")
        self.out.flush()
        return "".join(self.raw)


def _read_turn(inp, err) -> str | None:
    """One user turn from ``inp`` (a line); None at the end of input or on /exit, /quit."""
    while True:
        if inp.isatty():
            err.write(">> ")
            err.flush()
        line = inp.readline()
        if not line:
            return None
        text = line.strip()
        if text in ("/exit", "/quit"):
            return None
        if text:
            return text


def run_generate(args: argparse.Namespace, out=None, err=None, inp=None):
    """Load, generate with streamed output, print stats; returns the GenerationStats (of the last turn in --chat).

    Every argument is checked before the model is loaded. ``inp`` is where ``--prompt -``
    and the turns of ``--chat`` are read from. ``out``, ``err`` and ``inp`` default to the
    current ``sys.stdout``, ``sys.stderr`` and ``sys.stdin`` (looked up per call, so
    in-process callers may redirect them). Ctrl-C prints the stats so far, writes
    ``--stats-json`` and raises KeyboardInterrupt (the CLI exits 130).
    """
    out, err, inp = out or sys.stdout, err or sys.stderr, inp or sys.stdin
    args = argparse.Namespace(**{**_generate_defaults(), **vars(args)})
    from ..parallel import init_from_env, world_size_from_env

    distributed = world_size_from_env() > 1  # under torchrun: expert parallelism (moestream/parallel.py)
    if distributed:
        out, err = follower_args(args, out, err)  # followers print nothing and run rank 0's prompt
    prompt = _read_prompt(args, inp)
    _check_generate_args(args)
    # room for the KV cache under --cache-budget-gb auto: at most one token per prompt byte
    # (byte-level BPE) plus the chat template's tokens; a --chat session may grow past it
    options = engine_options(args, context=args.max_tokens + len((prompt or "").encode("utf-8")) + 64,
                             context_flag="--max-tokens")
    _sampling(args, {})  # flags checked before loading
    if distributed:
        args._parallel = init_from_env(options)
    try:
        engine = engine_args.load_engine(args, options)
    except BaseException:
        if distributed:
            args._parallel.close()
        raise
    try:
        return _Run(engine, args, prompt, out, err, inp, distributed).run()
    finally:
        try:
            engine.close()
        finally:
            if distributed:
                args._parallel.close()


def _check_generate_args(args: argparse.Namespace) -> None:
    """The generate flags that need no model. Raises MoestreamError naming the flag."""
    if args.max_tokens < 1:
        raise MoestreamError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.stats_json is not None and (args.stats_json.is_dir() or not args.stats_json.parent.is_dir()):
        raise MoestreamError(f"--stats-json {args.stats_json}: not a file in an existing folder")
    if args.no_chat_template and (args.chat or args.system is not None or args.no_think):
        raise MoestreamError("--chat, --system and --no-think need the chat template (drop --no-chat-template)")


def _print_notes(engine, args: argparse.Namespace, defaults: dict, err) -> None:
    """What the user should know before the text: unused tensors, the budget and read path, sampling defaults."""
    from ..generation import whole_model_hint

    if engine.unused_tensors:
        names = engine.unused_tensors
        print(f"note: {len(names)} checkpoint tensors are not used, such as {names[:3]}", file=err)
    if args.quiet:
        return
    if engine.io is not None:
        if engine.budget.auto is not None:
            print(engine.budget.auto.describe(), file=err)
        print(engine.io.describe(), file=err)
        if hasattr(engine.cache, "describe_tiers"):
            print(engine.cache.describe_tiers(), file=err)
    flags = {"temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "rep_penalty"}
    used = {k: v for k, v in defaults.items() if getattr(args, flags[k]) is None}
    if used:
        print("sampling defaults from generation_config.json: "
              + ", ".join(f"{k} {v:g}" for k, v in used.items()) + " (flags override them)", file=err)
    hint = whole_model_hint(engine) if getattr(args, "whole_model_hint", True) else None
    if hint:
        print(hint, file=err)


class _Run:
    """One ``generate`` command on a loaded engine: one prompt, or the turns of ``--chat``."""

    def __init__(self, engine, args: argparse.Namespace, prompt: str | None, out, err, inp, distributed: bool):
        from ..generation import Session, eos_ids
        from ..sampling import generation_defaults
        from ..tokenizer import think_token_ids

        self.engine, self.args, self.prompt, self.out, self.err, self.inp = engine, args, prompt, out, err, inp
        self.distributed = distributed
        defaults = generation_defaults(engine.checkpoint.path)
        self.sampling = _sampling(args, defaults)
        _print_notes(engine, args, defaults, err)
        self.template_kwargs = {"enable_thinking": False} if args.no_think else {}
        self.eos = eos_ids(engine)
        self.think_ids = think_token_ids(engine.tokenizer)
        self.session = Session() if args.chat else None
        self.messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        self.conversation: list[int] = []
        self.ep_stats = None

    def run(self):
        """Every turn; the stats of the last. Writes ``--stats-json``; re-raises a Ctrl-C after it."""
        from ..generation_stats import GenerationStats

        args, stats, interrupted, first = self.args, GenerationStats(), False, True
        try:
            while True:
                ids = self._turn_ids(first)
                if ids is None:
                    break
                first = False
                stats = GenerationStats()
                self._turn(ids, stats)
                if not args.chat:
                    break
        except KeyboardInterrupt:
            interrupted = True  # the stats of the turn that ran (or was cut), then exit 130
        if args.stats_json and not (self.distributed and args._parallel.rank) and (
                stats.prompt_tokens or not interrupted):
            text = stats.to_json() if self.ep_stats is None or interrupted else self.ep_stats
            try:
                args.stats_json.write_text(text + "\n")
            except OSError as e:
                raise MoestreamError(f"--stats-json {args.stats_json}: cannot write: {e.strerror or e}") from None
        if interrupted:
            raise KeyboardInterrupt
        return stats

    def _turn_ids(self, first: bool) -> list[int] | None:
        """The token ids of the next turn (None when --chat's input ends), checked against the vocabulary."""
        from ..tokenizer import chat_ids, encode_prompt, next_turn_ids

        args, tok, kw = self.args, self.engine.tokenizer, self.template_kwargs
        if args.chat:
            text = self.prompt if first and self.prompt is not None else _read_turn(self.inp, self.err)
            if text is None:
                return None
            self.messages.append({"role": "user", "content": text})
            ids = chat_ids(tok, self.messages, chat_template_kwargs=kw) if first else \
                self.conversation + next_turn_ids(tok, self.messages, chat_template_kwargs=kw)
        else:
            ids = encode_prompt(tok, self.prompt, chat_template=not args.no_chat_template, system=args.system,
                                chat_template_kwargs=kw)
        if not ids:
            raise MoestreamError("the prompt encodes to no tokens")
        vocab = self.engine.model.vocab_size
        if max(ids) >= vocab:  # e.g. the bundled Qwen3 tokenizer on a smaller vocabulary
            raise MoestreamError(
                f"the prompt encodes to token id {max(ids)}, outside the model's vocab_size {vocab}: the tokenizer "
                "does not fit the model (try --no-chat-template, or another tokenizer)"
            )
        return ids

    def _turn(self, ids: list[int], stats) -> None:
        """Generate one turn, printing as it goes, then its stats; a Ctrl-C prints the stats so far and re-raises."""
        from ..generation import generate
        from ..tokenizer import prompt_opens_thinking

        args, err = self.args, self.err
        printer = _Printer(self.out, args.hide_think, prompt_opens_thinking(ids, self.think_ids, self.eos))
        tokens = []
        steps = generate(self.engine, ids, args.max_tokens, self.sampling, stats, stop=args.stop,
                         multi_think=args.multi_think, session=self.session)
        try:
            for step in steps:
                tokens.append(step.token)
                printer.push(step.text)
        except KeyboardInterrupt:  # Ctrl-C: the stats so far, as after a whole run
            steps.close()  # generate's own clean-up fills them in (at once if it was interrupted inside)
            stats.finish_reason = "interrupted"
            printer.end()
            if not args.quiet:
                print("-" * 60, file=err)
                print(stats.summary(), file=err)
            raise
        reply = printer.end()
        if args.hide_think and printer.splitter.reasoning and not args.quiet:
            print("note: the thinking block did not end within --max-tokens (nothing to show with --hide-think)",
                  file=err)
        if not args.quiet:
            if args.chat:
                prefilled = stats.prompt_tokens - stats.prompt_cached_tokens
                print(f"[{stats.generated_tokens} tokens ({stats.finish_reason}), {prefilled} prefilled, "
                      f"{stats.decode_tok_s:.2f} tok/s, cache hit rate {stats.cache_hit_rate:.1%}]", file=err)
            else:
                print("-" * 60, file=err)
                print(stats.summary(), file=err)
        if self.distributed:  # every rank's counters, gathered (a collective: every rank calls it)
            self.ep_stats = args._parallel.report(stats, self.engine, err, args.quiet)
        if args.chat:
            if tokens and tokens[-1] in self.eos:
                tokens = tokens[:-1]
            self.conversation = ids + tokens
            self.messages.append({"role": "assistant", "content": reply})


class _Discard:
    """A text stream that drops what is written (a follower rank's output)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def follower_args(args, out, err):
    """``generate`` under torchrun: rank 0 reads the prompt and prints; the other ranks run rank
    0's request (:meth:`ExpertParallel.agree_generation`) and print nothing. Returns the
    ``(out, err)`` streams of this rank.

    Raises:
        MoestreamError: ``--chat`` (the turns come from one terminal; not supported under torchrun).
    """
    if args.chat:
        raise MoestreamError("--chat is not supported under torchrun (expert parallelism); give --prompt or "
                             "--prompt-file")
    if int(os.environ.get("RANK", "0")) == 0:
        return out, err
    args.prompt, args.prompt_file = "(rank 0's prompt)", None  # replaced by rank 0's token ids
    return _Discard(), _Discard()
