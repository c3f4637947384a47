"""The ``moestream`` command line: ``generate``, ``serve``, ``synth``, ``convert``, ``inspect``, ``hotlist``,
``cache-sim`` and ``demo``, one module per command or group (``engine_args``: the flags shared by every
command that loads a model).

Errors a user can cause are printed as one line naming the file, tensor or field
(exit status 2); tracebacks are for bugs. The package imports no torch at start-up: each
command's module imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import MoestreamError
from ..options import DTYPES
from .build import _add_convert_args, _add_synth_args, run_convert, run_synth
from .engine_args import add_engine_args, add_plan_args, engine_options, load_engine
from .generate import _add_generate_args, run_generate
from .serve import _add_serve_args, run_serve

__all__ = ["add_engine_args", "engine_options", "load_engine", "main", "generate_main", "run_convert",
           "run_generate", "run_serve", "run_synth"]


TRUST_REMOTE_CODE = (
    "--trust-remote-code is not supported: moestream never runs code that comes with a checkpoint "
    "(auto_map, modeling_*.py); it runs only its own model families (see `moestream inspect`)"
)


# inspect --dtype for a bare config: the storage its tensors are sized at (synth's dtypes)
_STORAGE = {"auto": "bf16", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def main(argv: list[str] | None = None) -> int:
    """The ``moestream`` command: 0 when done, 2 for an error a user can cause (one line on
    stderr), 130 when interrupted (Ctrl-C, at any point: the imports of building the parser
    included, never a traceback)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("moestream: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
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
    src.add_argument("--model", help="checkpoint folder, GGUF file (the first file of a split set) or Hugging "
                                      "Face Hub id (reads headers only)")
    src.add_argument("--config", type=Path, help="a bare config.json, sized at its real shape without weights")
    i.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="compute dtype of the load plan, as generate's --dtype (default auto: the checkpoint's); for "
                   "--config also the storage assumed (auto: bf16)")
    i.add_argument("--json", action="store_true", help="print JSON instead of text")
    # the engine flags that change the load plan: inspect prints the plan generate (or serve) loads with them
    add_plan_args(i, dtype=False)
    i.add_argument("--max-batch", type=int, default=1,
                   help="sequences the budget plan keeps a KV cache for, as serve's --max-batch (default 1)")
    i.add_argument("--max-context", type=int, default=None,
                   help="tokens of context each KV cache is counted for, as serve's --max-context (default: 4096, or "
                   "the model's context if smaller)")
    c = sub.add_parser("convert", help="write a quantized checkpoint (MLX affine; one read per expert)")
    _add_convert_args(c)
    d = sub.add_parser("demo", help="build a small model on first run and stream it")
    d.add_argument("--dir", type=Path, default=None, help="where the demo checkpoint lives (default: user cache)")
    d.add_argument("--max-tokens", type=int, default=48, help="tokens to generate in each demo run (default 48)")
    from .policy import add_commands, run_command

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
            from ..inspect import inspect

            options = engine_options(args, context=args.max_context)  # the plan generate and serve load by
            storage = _STORAGE.get(args.dtype, args.dtype)  # a bare config's tensors, as synth would write them
            report = inspect(args.model, args.config, storage, options=options)
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


def generate_main(argv: list[str] | None = None) -> int:
    """``python -m moestream.stream_generate``: the ``generate`` command's flags, alone."""
    return main(["generate", *(sys.argv[1:] if argv is None else argv)])
