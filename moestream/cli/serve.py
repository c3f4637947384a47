"""``moestream serve``: the OpenAI-compatible HTTP server for one streamed model."""

from __future__ import annotations

import argparse

from ..errors import MoestreamError
from . import engine_args
from .engine_args import add_engine_args, engine_options


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--max-context", type=int, default=None,
                   help="tokens per request, prompt plus generated (default: the model's context length)")
    p.add_argument("--max-batch", type=int, default=1,
                   help="requests generating together, one forward pass per step for all of them (each answer the "
                   "bits of its solo run); the budget plan keeps a KV cache of --max-context for each (default 1)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait while --max-batch generate; one more gets 429 (default 16)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (default: none)")
    p.add_argument("--model-name", default=None, help="the model id /v1/models reports (default: the folder name)")
    p.add_argument("--max-body-mb", type=float, default=4.0,
                   help="largest request body in MB (10^6 bytes); a larger one gets 413 (default 4)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt in tokens; a longer one gets 400 (default: --max-context less one)")


def run_serve(args: argparse.Namespace) -> None:
    """Load the model once and serve it until interrupted. Arguments are checked, and the address
    bound (so that a taken port or a wrong --host is said at once), before loading."""
    from ..server import ServerOptions, bind, serve

    options = engine_options(args, context=args.max_context)
    if not 0 <= args.port < 65536:
        raise MoestreamError(f"--port {args.port}: expected 0-65535")
    if args.max_batch < 1:
        raise MoestreamError(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.max_queue < 0:
        raise MoestreamError(f"--max-queue must be at least 0, got {args.max_queue}")
    if args.max_context is not None and args.max_context < 2:
        raise MoestreamError(f"--max-context must be at least 2 tokens, got {args.max_context}")
    if not 0.001 <= args.max_body_mb <= 1e4:  # NaN fails too
        raise MoestreamError(f"--max-body-mb {args.max_body_mb}: expected a number of MB between 0.001 and 10000")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise MoestreamError(f"--max-prompt-tokens must be at least 1, got {args.max_prompt_tokens}")
    from ..parallel import init_from_env, world_size_from_env

    par = sock = None
    if world_size_from_env() > 1:  # under torchrun: rank 0 serves HTTP, the other ranks follow its generations
        par = args._parallel = init_from_env(options)
        par.serving = True
    try:
        if par is None or par.rank == 0:
            sock = bind(args.host, args.port)
        engine = engine_args.load_engine(args, options)
    except BaseException:
        if sock is not None:
            sock.close()
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
        options = ServerOptions(name, args.max_context or model_max, args.max_queue, args.api_key, args.max_batch,
                                max_body_bytes=int(args.max_body_mb * 1e6), max_prompt_tokens=args.max_prompt_tokens)
        serve(engine, options, args.host, args.port, sock=sock)
    finally:
        if sock is not None:
            sock.close()
        try:
            if par is not None:
                par.shutdown()  # rank 0: the followers leave follow() and close with it
            engine.close()
        finally:
            if par is not None:
                par.close()
