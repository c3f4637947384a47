"""The ``moestream`` command line: ``generate``, ``serve``, ``synth``, ``convert``, ``inspect`` and ``demo``.

Errors a user can cause are printed as one line naming the file, tensor or field
(exit status 2); tracebacks are for bugs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import MoestreamError

TRUST_REMOTE_CODE = (
    "--trust-remote-code is not supported: moestream never runs code that comes with a checkpoint "
    "(auto_map, modeling_*.py); it runs only its own model families (see `moestream inspect`)"
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model, cache and I/O options, shared by every command that loads a model (generate, serve)."""
    p.add_argument("--model", required=True, help="checkpoint folder or Hugging Face Hub id")
    p.add_argument(
        "--cache-budget-gb", default="3",
        help="expert cache budget in GB (10^9 bytes), or 'all' to keep every expert resident, or 'auto' to size it "
        "from the memory available (cgroup limits included) less resident weights, KV cache and a reserve (default 3); "
        "under torchrun, per rank (auto: this rank's share)",
    )
    p.add_argument("--prefetch-workers", type=int, default=8, help="parallel expert reads (default 8)")
    # -- I/O (the "Cache and I/O" issue's read half) --
    pc = p.add_mutually_exclusive_group()
    pc.add_argument(
        "--use-page-cache", dest="use_page_cache", action="store_const", const=True, default=None,
        help="read experts through the OS page cache (default: only when the checkpoint is under 0.6 of the "
        "memory available)",
    )
    pc.add_argument(
        "--no-page-cache", dest="use_page_cache", action="store_const", const=False,
        help="bypass the page cache: O_DIRECT reads into huge-page buffers (posix_fadvise DONTNEED where refused)",
    )
    p.add_argument(
        "--prefetch-ahead", type=int, default=0,
        help="while layer L computes, read the experts layers L+1..L+N will likely need (default 0: off)",
    )
    # -- the GPU tier (moestream/tiered_cache.py) --
    p.add_argument("--device", default="auto",
                   help="compute device: auto (default: cuda when available, else cpu), cpu, cuda or cuda:N; on cuda "
                   "--cache-budget-gb is the VRAM expert cache")
    p.add_argument("--host-cache-gb", default=None,
                   help="with --device cuda: a second LRU tier of experts in pinned host RAM, in GB or 'auto' "
                   "(0.8 of the memory available less a reserve; default: none)")
    p.add_argument("--wire-memory", action="store_true",
                   help="lock the resident weights and the expert cache in RAM (mlock; needs RLIMIT_MEMLOCK)")
    p.add_argument("--fast", action="store_true",
                   help="turboquant builds: skip the QJL residual correction (faster; changes the output)")
    from .policy_cli import add_cache_policy_args

    add_cache_policy_args(p)
    from .parallel import add_parallel_args

    add_parallel_args(p)  # --dist-timeout, --ep-placement, --ep-combine (under torchrun)


def check_engine_args(args: argparse.Namespace) -> None:
    """Check the options of :func:`add_engine_args` before any loading. Raises MoestreamError."""
    from .cache import parse_budget
    from .io_setup import is_auto

    if args.prefetch_workers < 1:
        raise MoestreamError(f"--prefetch-workers must be at least 1, got {args.prefetch_workers}")
    if getattr(args, "prefetch_ahead", 0) < 0:
        raise MoestreamError(f"--prefetch-ahead must be at least 0, got {args.prefetch_ahead}")
    if not is_auto(args.cache_budget_gb):
        parse_budget(args.cache_budget_gb)
    if getattr(args, "host_cache_gb", None) is not None:
        from .tiered_cache import resolve_device

        if not is_auto(args.host_cache_gb):  # the value first: "-1" or "abc" is wrong on any device
            try:
                gb = float(args.host_cache_gb)
            except ValueError:
                gb = float("nan")
            if not 0 <= gb < 1e9:  # NaN fails too
                raise MoestreamError(
                    f"--host-cache-gb: {args.host_cache_gb!r} must be a number of GB between 0 and 1e9, or 'auto'"
                )

        if resolve_device(getattr(args, "device", "auto")).type != "cuda":
            raise MoestreamError(
                "--host-cache-gb needs --device cuda (on the CPU the expert cache is in host RAM already)"
            )
    timeout = getattr(args, "dist_timeout", None)
    if timeout is not None and not 0 < timeout < float("inf"):  # NaN fails too
        raise MoestreamError(f"--dist-timeout must be a positive number of seconds, got {timeout}")
    from .policy_cli import check_cache_policy_args

    check_cache_policy_args(args)


def load_engine(args: argparse.Namespace, tokenizer: bool = True, context: int | None = None):
    """``engine.load`` with the options of :func:`add_engine_args`.

    ``context``: tokens of context to leave room for (KV cache) when sizing ``--cache-budget-gb auto``.
    """
    from .engine import load
    from .policy_cli import cache_policy_kwargs

    return load(
        args.model, args.cache_budget_gb, workers=args.prefetch_workers, tokenizer=tokenizer,
        use_page_cache=getattr(args, "use_page_cache", None), prefetch_ahead=getattr(args, "prefetch_ahead", 0),
        wire_memory=getattr(args, "wire_memory", False), context_tokens=context, device=getattr(args, "device", "auto"),
        host_cache_gb=getattr(args, "host_cache_gb", None), fast=getattr(args, "fast", False),
        parallel=getattr(args, "_parallel", None), **cache_policy_kwargs(args),
    )


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
    from .generation import resolve_sampling

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
        from .textstream import ReasoningSplitter

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


def run_generate(args: argparse.Namespace, out=None, err=None, inp=None):
    """Load, generate with streamed output, print stats; returns the GenerationStats (of the last turn in --chat).

    Every argument is checked before the model is loaded. ``inp`` is where ``--prompt -``
    and the turns of ``--chat`` are read from. ``out``, ``err`` and ``inp`` default to the
    current ``sys.stdout``, ``sys.stderr`` and ``sys.stdin`` (looked up per call, so
    in-process callers may redirect them).
    """
    out, err, inp = out or sys.stdout, err or sys.stderr, inp or sys.stdin
    args = argparse.Namespace(**{**_generate_defaults(), **vars(args)})
    from .parallel import follower_args, init_from_env, world_size_from_env

    distributed = world_size_from_env() > 1  # under torchrun: expert parallelism (moestream/parallel.py)
    if distributed:
        out, err = follower_args(args, out, err)  # followers print nothing and run rank 0's prompt
    prompt = _read_prompt(args, inp)
    if args.max_tokens < 1:
        raise MoestreamError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.stats_json is not None and (args.stats_json.is_dir() or not args.stats_json.parent.is_dir()):
        raise MoestreamError(f"--stats-json {args.stats_json}: not a file in an existing folder")
    if args.no_chat_template and (args.chat or args.system is not None or args.no_think):
        raise MoestreamError("--chat, --system and --no-think need the chat template (drop --no-chat-template)")
    from .generation import GenerationStats, Session, eos_ids, generate, generation_defaults, whole_model_hint
    from .tokenizer import chat_ids, encode_prompt, next_turn_ids, prompt_opens_thinking, think_token_ids

    check_engine_args(args)
    _sampling(args, {})  # flags checked before loading
    # room for the KV cache under --cache-budget-gb auto: at most one token per prompt byte
    # (byte-level BPE) plus the chat template's tokens; a --chat session may grow past it
    context = args.max_tokens + len((prompt or "").encode("utf-8")) + 64
    if distributed:
        args._parallel = init_from_env(args.device, args.dist_timeout, args.ep_combine, args.ep_placement)
    try:
        engine = load_engine(args, context=context)
    except BaseException:
        if distributed:
            args._parallel.close()
        raise
    try:
        if engine.unused_tensors:
            names = engine.unused_tensors
            print(f"note: {len(names)} checkpoint tensors are not used, such as {names[:3]}", file=err)
        defaults = generation_defaults(engine.checkpoint.path)
        sampling = _sampling(args, defaults)
        if engine.io is not None and not args.quiet:
            if engine.io.auto is not None:
                print(engine.io.auto.describe(), file=err)
            print(engine.io.describe(), file=err)
            if hasattr(engine.cache, "describe_tiers"):
                print(engine.cache.describe_tiers(), file=err)
        if not args.quiet:
            flags = {"temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "rep_penalty"}
            used = {k: v for k, v in defaults.items() if getattr(args, flags[k]) is None}
            if used:
                print("sampling defaults from generation_config.json: "
                      + ", ".join(f"{k} {v:g}" for k, v in used.items()) + " (flags override them)", file=err)
            hint = whole_model_hint(engine) if getattr(args, "whole_model_hint", True) else None
            if hint:
                print(hint, file=err)
        tok = engine.tokenizer
        template_kwargs = {"enable_thinking": False} if args.no_think else {}
        eos = eos_ids(engine)
        think_ids = think_token_ids(tok)
        session = Session() if args.chat else None
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        conversation: list[int] = []
        stats = GenerationStats()
        first = True
        ep_stats = None
        while True:
            if args.chat:
                text = prompt if first and prompt is not None else _read_turn(inp, err)
                if text is None:
                    break
                messages.append({"role": "user", "content": text})
                if first:
                    ids = chat_ids(tok, messages, chat_template_kwargs=template_kwargs)
                else:
                    ids = conversation + next_turn_ids(tok, messages, chat_template_kwargs=template_kwargs)
            else:
                ids = encode_prompt(tok, prompt, chat_template=not args.no_chat_template, system=args.system,
                                    chat_template_kwargs=template_kwargs)
            first = False
            if not ids:
                raise MoestreamError("the prompt encodes to no tokens")
            if max(ids) >= engine.model.vocab_size:  # e.g. the bundled Qwen3 tokenizer on a smaller vocabulary
                raise MoestreamError(
                    f"the prompt encodes to token id {max(ids)}, outside the model's vocab_size "
                    f"{engine.model.vocab_size}: the tokenizer does not fit the model (try --no-chat-template, or "
                    "another tokenizer)"
                )
            stats = GenerationStats()
            printer = _Printer(out, args.hide_think, prompt_opens_thinking(ids, think_ids, eos))
            tokens = []
            for step in generate(engine, ids, args.max_tokens, sampling, stats, stop=args.stop,
                                 multi_think=args.multi_think, session=session):
                tokens.append(step.token)
                printer.push(step.text)
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
            if distributed:  # every rank's counters, gathered (a collective: every rank calls it)
                ep_stats = args._parallel.report(stats, engine, err, args.quiet)
            if not args.chat:
                break
            if tokens and tokens[-1] in eos:
                tokens = tokens[:-1]
            conversation = ids + tokens
            messages.append({"role": "assistant", "content": reply})
        if args.stats_json and not (distributed and args._parallel.rank):
            try:
                args.stats_json.write_text((stats.to_json() if ep_stats is None else ep_stats) + "\n")
            except OSError as e:
                raise MoestreamError(f"--stats-json {args.stats_json}: cannot write: {e.strerror or e}") from None
        return stats
    finally:
        try:
            engine.close()
        finally:
            if distributed:
                args._parallel.close()


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--max-context", type=int, default=None,
                   help="tokens per request, prompt plus generated (default: the model's context length)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait while one generates; one more gets 429 (default 16)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (default: none)")
    p.add_argument("--model-name", default=None, help="the model id /v1/models reports (default: the folder name)")
    p.add_argument("--max-body-mb", type=float, default=4.0,
                   help="largest request body in MB (10^6 bytes); a larger one gets 413 (default 4)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt in tokens; a longer one gets 400 (default: --max-context less one)")


def run_serve(args: argparse.Namespace) -> None:
    """Load the model once and serve it until interrupted. Arguments are checked before loading."""
    from .server import ServerOptions, serve

    check_engine_args(args)
    if not 0 <= args.port < 65536:
        raise MoestreamError(f"--port {args.port}: expected 0-65535")
    if args.max_queue < 0:
        raise MoestreamError(f"--max-queue must be at least 0, got {args.max_queue}")
    if args.max_context is not None and args.max_context < 2:
        raise MoestreamError(f"--max-context must be at least 2 tokens, got {args.max_context}")
    if not 0.001 <= args.max_body_mb <= 1e4:  # NaN fails too
        raise MoestreamError(f"--max-body-mb {args.max_body_mb}: expected a number of MB between 0.001 and 10000")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise MoestreamError(f"--max-prompt-tokens must be at least 1, got {args.max_prompt_tokens}")
    from .parallel import init_from_env, world_size_from_env

    par = None
    if world_size_from_env() > 1:  # under torchrun: rank 0 serves HTTP, the other ranks follow its generations
        par = args._parallel = init_from_env(args.device, args.dist_timeout, args.ep_combine, args.ep_placement)
        par.serving = True
    try:
        engine = load_engine(args, context=args.max_context)
    except BaseException:
        if par is not None:
            par.close()
        raise
    try:
        if par is not None and par.rank != 0:
            par.follow(engine)
            return
        model_max = engine.model.max_context or 32768
        if args.max_context is not None and args.max_context > model_max:
            raise MoestreamError(f"--max-context {args.max_context} exceeds the model's context of {model_max}")
        name = args.model_name or engine.checkpoint.path.name
        options = ServerOptions(name, args.max_context or model_max, args.max_queue, args.api_key,
                                max_body_bytes=int(args.max_body_mb * 1e6), max_prompt_tokens=args.max_prompt_tokens)
        serve(engine, options, args.host, args.port)
    finally:
        try:
            if par is not None:
                par.shutdown()  # rank 0: the followers leave follow() and close with it
            engine.close()
        finally:
            if par is not None:
                par.close()

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


def _add_synth_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, type=Path, help="a published config.json (real shapes)")
    p.add_argument("--out", required=True, type=Path, help="checkpoint folder to create")
    p.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default all)")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--seed", type=int, default=0, help="weights depend on the seed and tensor name only (default 0)")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder to copy (default: bundled Qwen3)")
    p.add_argument("--init", default="spread", choices=["spread", "plain", "trained"],
                   help="spread (default): near-uniform routing, the hard case for a cache; trained: routing that "
                        "reuses experts over time as trained models do (Qwen3-MoE, Qwen3-Next, Qwen3.5); "
                        "plain: all std 0.02")
    p.add_argument("--shard-gb", type=float, default=5.0, help="shard size in GB (default 5)")


def run_synth(args: argparse.Namespace) -> Path:
    from .engine import progress_bar
    from .synth import plan_synth, write_synth

    plan = plan_synth(args.config, args.layers, args.dtype, args.seed, args.tokenizer, args.init, args.shard_gb)
    with progress_bar(plan.nbytes, f"writing {args.out.name}") as bar:
        out = write_synth(plan, args.out, bar.update)
    print(f"wrote {out} ({plan.nbytes / 1e9:.2f} GB of weights)")
    return out


def _add_convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint folder or Hub id (bf16, fp16, fp32 or fp8)")
    p.add_argument("--out", type=Path, default=None, help="folder to create (default: <model>-e<bits>g<group>...)")
    p.add_argument("--bits", type=int, default=4, help="bits for every part not given below: 2-6, 8; 16 = float")
    p.add_argument("--group-size", type=int, default=64, help="weights per scale and bias: 32, 64 or 128 (default 64)")
    p.add_argument("--expert-bits", type=int, default=None, help="routed experts' gate and up (default --bits)")
    p.add_argument("--expert-down-bits", type=int, default=None, help="routed experts' down (default --expert-bits)")
    p.add_argument("--attn-bits", type=int, default=None, help="attention projections (default --bits)")
    p.add_argument("--other-bits", type=int, default=None, help="embedding, LM head, dense MLPs (default --bits)")
    p.add_argument("--shard-gb", type=float, default=5.0, help="shard size in GB (default 5)")


def run_convert(args: argparse.Namespace) -> Path:
    from .engine import progress_bar
    from .quant.affine import BITS
    from .quant.convert import ConvertSpec, convert, default_out

    if args.bits not in (*BITS, 16):
        raise MoestreamError(f"--bits {args.bits}: expected one of {BITS} or 16 (float)")
    expert = args.expert_bits or args.bits
    spec = ConvertSpec(args.group_size, expert, args.expert_down_bits or expert, args.attn_bits or args.bits,
                       args.other_bits or args.bits)
    spec.check()
    from .checkpoint import Checkpoint, resolve_model

    src = resolve_model(args.model)
    with Checkpoint(src) as ckpt:
        total = ckpt.total_bytes
    out = args.out if args.out is not None else default_out(args.model, src, spec)
    with progress_bar(total, f"writing {out.name}") as bar:
        out = convert(src, out, spec, args.shard_gb, bar.update)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({size / 1e9:.2f} GB)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moestream",
        description="Run Mixture-of-Experts models bigger than memory by streaming their experts from disk.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text, streaming experts through a cache")
    _add_generate_args(g)
    s = sub.add_parser("synth", help="write a random-weight checkpoint of a real config's shapes")
    _add_synth_args(s)
    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for one streamed model")
    _add_serve_args(v)
    i = sub.add_parser("inspect", help="what a checkpoint (or a config at its real size) holds, and whether it streams")
    src = i.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint folder or Hugging Face Hub id (reads headers only)")
    src.add_argument("--config", type=Path, help="a bare config.json, sized at its real shape without weights")
    i.add_argument("--dtype", default="bf16", help="storage assumed for --config: bf16 (default), fp16 or fp32")
    i.add_argument("--json", action="store_true", help="print JSON instead of text")
    c = sub.add_parser("convert", help="write a quantized checkpoint (MLX affine; one read per expert)")
    _add_convert_args(c)
    d = sub.add_parser("demo", help="build a small model on first run and stream it")
    d.add_argument("--dir", type=Path, default=None, help="where the demo checkpoint lives (default: user cache)")
    d.add_argument("--max-tokens", type=int, default=48, help="tokens to generate in each demo run (default 48)")
    from .policy_cli import add_commands, run_command

    add_commands(sub, add_engine_args)
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--trust-remote-code" or a.startswith("--trust-remote-code=") for a in argv):
        print(f"moestream: error: {TRUST_REMOTE_CODE}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        if args.command in ("hotlist", "cache-sim"):
            run_command(args)
        elif args.command == "generate":
            run_generate(args)
        elif args.command == "serve":
            run_serve(args)
        elif args.command == "synth":
            run_synth(args)
        elif args.command == "inspect":
            from .inspect import inspect

            report = inspect(args.model, args.config, args.dtype)
            print(report.to_json() if args.json else report.to_text())
        elif args.command == "convert":
            run_convert(args)
        elif args.command == "demo":
            from .demo import run_demo

            run_demo(args.dir, args.max_tokens)
        return 0
    except MoestreamError as e:
        print(f"moestream: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moestream: interrupted", file=sys.stderr)
        return 130


def generate_main(argv: list[str] | None = None) -> int:
    """``python -m moestream.stream_generate``: the ``generate`` command's flags, alone."""
    return main(["generate", *(sys.argv[1:] if argv is None else argv)])
