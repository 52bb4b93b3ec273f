"""`serve run`: the OpenAI-compatible HTTP server.

SIGTERM (or Ctrl-C) drains: admission stops at once (new requests get 503, the listening socket
closes), in-flight requests get --shutdown-timeout seconds to finish and are then aborted with
finish_reason "abort", and the process exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from serve.chat_template import resolve_chat_template
from serve.cli_args import add_engine_arguments, engine_config_from_args
from serve.reasoning import REASONING_PARSERS
from serve.server_config import ServerConfig

if TYPE_CHECKING:
    from serve.api_processes import ApiProcesses

API_KEY_ENV = "PAGEDSERVE_API_KEY"
# The engine steps on a worker thread while the event loop streams responses; both need the GIL.
# At Python's default 5 ms switch interval a step waits up to 5 ms per hand-over. Measured on an
# H100 (Qwen2.5-0.5B shape, dummy weights, 64 streaming clients, 512 in / 128 out, warm server):
# 4.6k output tok/s at 5 ms, 8.2-8.4k at 0.2-0.5 ms, 8.0k at 1 ms.
GIL_SWITCH_INTERVAL_S = 0.0005


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every /v1 route (or set {API_KEY_ENV})")
    g.add_argument("--allowed-origins", default=None, nargs="+", metavar="ORIGIN",
                   help="CORS: web pages of these origins (e.g. http://localhost:3000, or * for any) may call the "
                        "API from a browser (default: none)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key (PEM) ...")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE", help="... and this certificate (PEM)")
    g.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                   help="model id clients must send (default: the folder name); with several, any of them, and "
                        "responses name the first")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="sequences that may wait for the engine; beyond it requests get 429 with Retry-After")
    g.add_argument("--max-request-rate", type=float, default=None, help="sequences admitted per second (default: no limit)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    g.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="largest request body accepted")
    g.add_argument("--max-n", type=int, default=16, help="most choices (n) per prompt")
    g.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens accepted (default: the context length)")
    g.add_argument("--tool-parser", default="auto",
                   choices=("auto", "hermes", "llama3_json", "mistral", "qwen3_coder"),
                   help="the format of the model's tool calls: hermes (<tool_call> tags), llama3_json, mistral "
                        "([TOOL_CALLS]) or qwen3_coder (<function=...>); auto: llama3_json for a Llama 3 chat "
                        "template, mistral for one that writes [TOOL_CALLS], qwen3_coder for one that writes "
                        "<function=, else hermes")
    g.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja chat template for /v1/chat/completions in place of the tokenizer's: a file, or "
                        "the template itself (for a base model that ships none, or a fine-tune trained on another)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="a reasoning model's thinking (<think> ... </think>) goes to the chat message's reasoning "
                        "field, apart from its content: qwen3 (Qwen3, QwQ) or deepseek_r1 (DeepSeek-R1 and its "
                        "distills; an output that never closes its thinking is all reasoning)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="auto (default): fields a request leaves out (temperature, top_p, top_k, min_p, "
                        "repetition_penalty) take the values of the model's generation_config.json, as vLLM does; "
                        "vllm: pagedserve's own defaults (temperature 1, no filters); DIR: the generation_config.json "
                        "of that folder")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    g.add_argument("--engine-loop", default="process", choices=("thread", "process"),
                   help="process (default): the engine runs in a child process of its own, and the server process "
                        "only does HTTP, tokenization and streaming; thread: the engine steps on a worker thread of "
                        "the server process (one GIL for both). Measured on an H100, 64 streaming clients: process "
                        "serves 1.4x (Llama-3-8B) to 1.9x (Qwen2.5-0.5B) the tokens/s of thread")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="N replicas of the engine, each in a process of its own on GPUs of its own (replica i on "
                        "GPUs i*T .. i*T+T-1 of those visible, T = tensor x pipeline parallel size), or sharing the CPU, "
                        "behind this one server: each request goes to the replica that holds the longest cached "
                        "prefix of its prompt, else to the least loaded one")
    g.add_argument("--api-processes", type=int, default=None, metavar="N",
                   help="N processes serve HTTP on the port, each streaming its own requests, over one engine "
                        "process: a small model's many streamed chunks a second are more than one event loop writes "
                        "without delaying new requests. Default: 2 where the engine runs multi-step decode rounds "
                        "(a host-bound model) on a host of 8 or more cores, else 1")
    g.add_argument("--disaggregate", default=None, metavar="P:D",
                   help="P prefill engines and D decode engines, each in a process of its own on a GPU of its own "
                        "(or sharing the CPU): a prefill engine computes the prompt and the first token, then the "
                        "prompt's KV cache moves to a decode engine, which streams the rest (e.g. 1:1)")
    add_engine_arguments(p)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    names = args.served_model_name or [None]
    return ServerConfig(served_model_name=names[0], model_aliases=tuple(names[1:]),
                        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                        max_waiting_requests=args.max_waiting_requests, max_request_rate=args.max_request_rate,
                        shutdown_timeout_s=args.shutdown_timeout, max_body_bytes=args.max_body_bytes, max_n=args.max_n,
                        max_tokens_limit=args.max_tokens_limit, tool_parser=args.tool_parser,
                        reasoning_parser=args.reasoning_parser, generation_config=args.generation_config,
                        chat_template=None if args.chat_template is None else resolve_chat_template(args.chat_template),
                        allowed_origins=tuple(args.allowed_origins or ()), ssl_keyfile=args.ssl_keyfile,
                        ssl_certfile=args.ssl_certfile)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Ctrl-C inside the block raises KeyboardInterrupt at its end. For imports: pydantic turns a
    KeyboardInterrupt raised while it builds a model's schema (fastapi's, on import) into a
    SchemaError, which printed a traceback and exited 1."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def build(engine_loop: str, cfg: EngineConfig, data_parallel_size: int = 1,
          disaggregate: tuple[int, int] | None = None, meanwhile: Callable[[], None] = lambda: None,
          api_processes: int = 1) -> Any:
    """serve.build.Engine, or for --engine-loop process a ProcessEngine (the same fields), or for
    --data-parallel-size N > 1 a serve.replicas.ReplicatedEngine, or for --disaggregate P:D a
    serve.disagg.DisaggregatedEngine. meanwhile: run while the engine process builds (one engine
    process), else before the engines start. api_processes: as --api-processes (one engine process)."""
    if engine_loop == "process" and disaggregate is None and data_parallel_size == 1:
        from serve.engine_process import start_engine_process
        return start_engine_process(cfg, meanwhile=meanwhile, api_processes=api_processes)
    meanwhile()
    if disaggregate is not None:
        if engine_loop != "process":
            raise ValueError("--disaggregate runs each engine in a process of its own: drop --engine-loop thread")
        if data_parallel_size != 1:
            raise ValueError("--disaggregate and --data-parallel-size don't combine yet: pick one")
        from serve.disagg import start_disaggregated
        return start_disaggregated(cfg, *disaggregate)
    if data_parallel_size != 1:
        if engine_loop != "process":
            raise ValueError("--data-parallel-size runs each replica in a process of its own: drop --engine-loop thread")
        from serve.replicas import start_replicas
        return start_replicas(cfg, data_parallel_size)
    from serve.build import build_engine
    return build_engine(cfg)


def freeze_startup_objects() -> None:
    """Move everything built so far (the tokenizer, the app, pydantic's schemas, the imported
    modules) out of the cyclic collector's sight: it lives as long as the process. A full
    collection then walks only what serving creates; before, each one stalled every stream for
    ~130 ms on the 2-core dev machine (lab/api_stream.py's GC pauses), as the engine process's did
    before it froze its own (scheduler/engine_proc.py)."""
    gc.collect()
    gc.freeze()


def serve_app(app: Any, listener: socket.socket, host: str, port: int, log_level: str, shutdown_timeout_s: float,
              others: "ApiProcesses | None" = None) -> str | None:
    """Serve the app (serve/api.py) on the bound listener until SIGTERM or SIGINT has drained it, or
    its engine died; others: the other API processes (this is the server process), told to drain
    with it. -> why the server failed (the engine, or another API process, died), or None."""
    import uvicorn

    from serve.uvicorn_server import DrainingServer

    loop = app.state.server.loop

    async def on_exit() -> None:
        if others is not None:
            others.terminate()  # the other API processes drain meanwhile
        await loop.drain(shutdown_timeout_s)

    cfg = app.state.server.config
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, ssl_keyfile=cfg.ssl_keyfile,
                            ssl_certfile=cfg.ssl_certfile, timeout_graceful_shutdown=int(shutdown_timeout_s) + 5)
    server = DrainingServer(config, on_exit=on_exit)

    def stop(message: str) -> None:
        # their requests have failed: stop, and exit non-zero, so that whatever supervises the
        # server restarts it
        server.should_exit = True

    loop.on_failure = stop
    if others is not None:
        others.on_death = stop
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    freeze_startup_objects()
    server.run(sockets=[listener])
    return loop.failure or (others.failure if others is not None else None)


def bind_listener(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before any engine starts: a port in use fails at once (not after the
    model has loaded), and the engines' processes, whose process groups pick free ports of their
    own while they start, cannot be handed this one."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run(args: argparse.Namespace) -> int:
    server_cfg = server_config_from_args(args)
    engine_cfg = engine_config_from_args(args)
    from serve.generation_config import model_folder, sampling_defaults
    sampling_defaults(server_cfg.generation_config, model_folder(engine_cfg))  # a bad file says so before start-up
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535; got {args.port}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1; got {args.data_parallel_size}")
    disaggregate = None
    if args.disaggregate is not None:
        from serve.disagg import parse_disaggregate
        disaggregate = parse_disaggregate(args.disaggregate)
    from serve import api_processes as apis
    n_api = apis.check_api_processes(args.api_processes, args.engine_loop, args.data_parallel_size,
                                     disaggregate is not None)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from serve.build import is_follower_rank, run_follower

    if is_follower_rank(engine_cfg):  # under torchrun: rank 0 serves, this rank follows its steps
        run_follower(engine_cfg)
        return 0
    imported: list[Any] = []

    def import_server() -> None:
        # imported late, like torch (`serve --help` stays fast), and while the engine process builds
        # (1-2 s that the first answer no longer waits for)
        with sigint_deferred():
            from serve.api import create_app
            importlib.import_module("serve.uvicorn_server")  # uvicorn, for serve_app
        imported.append(create_app)
        logging.getLogger("pagedserve").debug("start-up: server imports done")

    listener = bind_listener(args.host, args.port)
    metrics_dir = apis.shared_dir(apis.METRICS_DIR_ENV) if n_api > 1 else None  # before prometheus_client is imported
    responses_dir = None
    workers = apis.ApiProcesses(server_cfg.shutdown_timeout_s)
    try:
        engine = build(args.engine_loop, engine_cfg, args.data_parallel_size, disaggregate, import_server, n_api)
    except BaseException as e:
        listener.close()
        apis.remove_dirs(metrics_dir)
        if isinstance(e, KeyboardInterrupt):
            # Ctrl-C during start-up: quietly (torch cut off in its import logs INFO lines at exit).
            logging.getLogger().setLevel(logging.WARNING)
        raise
    try:
        n_api = apis.settle(args.api_processes, n_api, engine)
        server_cfg = apis.per_process(server_cfg, n_api)
        responses_dir = apis.shared_dir(apis.RESPONSES_DIR_ENV) if n_api > 1 else None
        create_app = imported[0]
        app = create_app(engine, server_cfg, workers if n_api > 1 else None)
        if n_api > 1:  # spawned as the app starts
            workers.prepare(listener, engine.core.channels, apis.WorkerSpec(
                0, n_api, args.host, args.port, args.log_level, server_cfg, engine_cfg, engine.model_config,
                engine.runner, engine.core.snapshot))
        name = server_cfg.served_model_name or engine.model_name
        scheme = "https" if server_cfg.ssl_certfile else "http"
        url = f"{scheme}://{f'[{args.host}]' if ':' in args.host else args.host}:{listener.getsockname()[1]}"
        print(f"pagedserve: model {name} ({engine.model_config.architecture}, {engine.runner.device}, "
              f"{engine.runner.dtype_name}); KV cache {engine.kv_capacity_tokens} tokens "
              f"({engine.runner.num_blocks} blocks of {engine_cfg.block_size}, {engine_cfg.kv_cache_dtype}); "
              f"context {engine.max_model_len} tokens; engine loop: {args.engine_loop}", flush=True)
        if args.data_parallel_size > 1:
            print(f"pagedserve: {args.data_parallel_size} data-parallel replicas: {engine.describe()}", flush=True)
        if disaggregate is not None:
            print(f"pagedserve: disaggregated prefill/decode: {engine.describe()}", flush=True)
        if n_api > 1:
            print(f"pagedserve: {n_api} API processes", flush=True)
        print(f"pagedserve: OpenAI API at {url}/v1{' (API key required)' if server_cfg.api_key else ''}", flush=True)
        if not is_loopback(args.host) and not server_cfg.api_key:
            print(f"pagedserve: warning: listening on {args.host} without --api-key: anyone who can reach it can use it",
                  file=sys.stderr, flush=True)
        failure = serve_app(app, listener, args.host, args.port, args.log_level, server_cfg.shutdown_timeout_s,
                            workers)
        if failure is not None:
            print(f"pagedserve: error: {failure}", file=sys.stderr, flush=True)
            return 1
    finally:
        listener.close()
        workers.kill()  # a no-op once the app's shutdown has waited for them
        engine.shutdown()  # a no-op once the app's shutdown has stopped the engine (process, ranks)
        apis.remove_dirs(metrics_dir, responses_dir)
        if responses_dir is not None:
            os.environ.pop(apis.RESPONSES_DIR_ENV, None)
    return 0
