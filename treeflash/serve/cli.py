"""`treeflash serve` (OpenAI-compatible HTTP server) and `treeflash chat` (terminal chat)."""
from __future__ import annotations

import ipaddress
import socket
import sys

from ..errors import TreeflashError


def register(sub) -> None:
    from ..cli import add_engine_args

    p = sub.add_parser("serve", help="serve the OpenAI API (chat/completions, completions, models, metrics)")
    add_engine_args(p)  # the sampling options are the defaults for requests that leave them out
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: --target)")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt in tokens (default: the context window)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429")
    p.add_argument("--max-batch", type=int, default=1,
                   help="requests decoded together (continuous batching; > 1 needs the static or a compiled backend; the KV "
                        "pool holds this many requests of --max-tokens-limit tokens; with --tree-size auto each "
                        "request's tree shrinks as the batch fills) (default: 1, one at a time)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="static and compiled backends: most prompt tokens prefilled per step, so a long prompt does "
                        "not stall the running requests (default: 256)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_serve)

    c = sub.add_parser("chat", help="chat in the terminal (streaming, multi-turn; /reset, /exit)")
    add_engine_args(c)
    c.add_argument("--system", default=None, help="a system message for the conversation")
    c.set_defaults(func=run_chat)


def _load_engine(args):
    from ..cli import load_engine

    return load_engine(args, quiet=args.method in ("vanilla", "lookup"), torch_only=getattr(args, "max_batch", 1) > 1)


def _check_bind(host: str, port: int) -> None:
    if not 0 < port < 65536:
        raise TreeflashError(f"port must be in 1..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise TreeflashError(f"cannot resolve host {host!r}: {e.strerror or e}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise TreeflashError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _config(args, model_name: str):
    """The server's settings; its GenerationConfig is checked against the engine later (`_warm_up`)."""
    from ..config import GenerationConfig
    from .jobs import ServeConfig

    for name in ("max_tokens_limit", "max_new_tokens", "max_queue", "max_batch", "prefill_chunk"):
        if getattr(args, name) < 1:
            raise TreeflashError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_new_tokens > args.max_tokens_limit:
        raise TreeflashError(f"--max-new-tokens {args.max_new_tokens} exceeds --max-tokens-limit {args.max_tokens_limit}")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise TreeflashError("--max-prompt-tokens must be >= 1")
    return ServeConfig(model_name=model_name, generation=GenerationConfig.from_args(args),
                       max_tokens_limit=args.max_tokens_limit, max_prompt_tokens=args.max_prompt_tokens,
                       api_key=args.api_key, max_queue=args.max_queue, max_batch=args.max_batch,
                       prefill_chunk=args.prefill_chunk)


def _warm_up(engine, config) -> None:
    """One tiny generation with the server's settings: bad options fail here, not per request."""
    engine.generate("Hello", config.generation, chat=False, max_new_tokens=2)


def off_main_thread(fn):
    """fn() on a thread of its own, which then ends; returns its result or raises its error.

    Why: the server decodes on its worker thread. libgomp (PyTorch's OpenMP on Linux) gives each
    thread that runs parallel kernels a team of its own, and once more OpenMP threads exist than
    CPUs it throttles their spin-waiting, so that every kernel waits for sleeping threads. Loading,
    calibrating and warming up on the main thread left its team behind: the worker's steps ran
    much slower on 2 cores (docs/performance.md, "One OpenMP team"). A thread that ends takes its
    team with it."""
    import threading

    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            box["err"] = e

    t = threading.Thread(target=run, name="treeflash-setup", daemon=True)  # Ctrl-C during setup exits
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


def _prepare_app(args, config, create_app):
    """Load, check, calibrate and warm up the engine, then build the app (its worker compiles the
    batched steps): all the torch work before serving."""
    engine = _load_engine(args)
    from ..api import generation_config
    from .worker import check_batchable

    check_batchable(engine, config.max_batch)  # before the (slow) --tree-size auto calibration
    config.generation = generation_config(engine, args)  # checked; --tree-size auto measured
    if config.max_batch > 1 and args.tree_size == "auto":  # budgets follow the load where trees pay
        choice = engine.auto_tree_size(config.generation)  # memoised
        config.auto_budget = choice if choice.budget > 1 else None
    _warm_up(engine, config)
    return create_app(engine, config)


def run_serve(args) -> int:
    try:
        import uvicorn

        from .app import create_app
    except ImportError as e:
        raise TreeflashError(f"treeflash serve needs {e.name}: pip install 'treeflash[serve]'") from None
    config = _config(args, args.served_model_name or args.target)
    _check_bind(args.host, args.port)
    if not _is_loopback(args.host) and not args.api_key:
        print(f"treeflash: warning: serving on {args.host} without --api-key", file=sys.stderr)
    app = off_main_thread(lambda: _prepare_app(args, config, create_app))
    batch = f", batches of up to {config.max_batch}" if config.max_batch > 1 else ""
    adaptive = " at batch 1, load-adaptive" if config.auto_budget is not None else ""
    size = config.generation.tree_size
    size = f"{size} (lookup-only trees per step)" if size == "auto" else size
    print(f"treeflash: serving {config.model_name!r} ({args.method}, tree size {size}"
          f"{adaptive}{batch}) "
          f"on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=5)
    return 0


def run_chat(args) -> int:
    from ..api import generation_config
    from .chat import HELP, ChatSession, line_reader

    engine = _load_engine(args)
    session = ChatSession(engine, generation_config(engine, args), system=args.system)
    print(f"treeflash chat: {args.target} ({args.method}). {HELP}", file=sys.stderr, flush=True)
    return session.run(line_reader(sys.stdin))
