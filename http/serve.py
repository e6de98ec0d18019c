"""`deltaserve serve`: start an engine, serve it over HTTP, shut down cleanly.

Exit codes: 0 after SIGTERM/SIGINT (running requests drained for up to --shutdown-timeout,
the rest ended with a terminal error); 1 when the engine dies (a rank crashed, a step failed)
or cannot start, or the address cannot be listened on (checked before any weight loads); 2
for bad arguments. Signal handlers are installed here only, never by the
library code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.config_flags import add_engine_flags, engine_config
from deltaserve.engine.interface import Engine, start_engine
from deltaserve.http.access_flags import access_config, add_access_flags
from deltaserve.http.listen import (
    Listen,
    add_listen_flags,
    check_listen,
    listen_config,
    remove_socket,
)
from deltaserve.http.reasoning import REASONING_PARSERS
from deltaserve.http.server_config import (
    DEFAULT_MAX_PENDING_STREAM_EVENTS,
    DEFAULT_MAX_REQUEST_BYTES,
    ServerConfig,
)
from deltaserve.http.tool_parsers import TOOL_CALL_PARSERS
from deltaserve.http.vllm_flags import (
    UVICORN_LOG_LEVELS,
    add_vllm_flags,
    check_quantization,
    refused_vllm_flag,
)

log = logging.getLogger("deltaserve.serve")

RUNNER_SHUTDOWN_TIMEOUT_S = 5.0  # handlers end by themselves once the engine ends the streams


@dataclass(frozen=True, slots=True)
class DemoCheckpoint:
    """What `serve` runs when no MODEL is given (the CLI's is tools/demo_model.py): where it
    is, the name it is served as, what it holds, and `make`, which makes it on first use."""

    path: Path
    served_name: str
    description: str
    make: Callable[[], object]


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be in 0..65535, got {port}")
    return port


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        example = '{"enable_thinking": false}'
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{example}', got {text!r}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """'(default: X)' after a flag's help, but none for a None default: such a flag's help says
    what it stands for (--device: 'cuda if available, else cpu', not 'None')."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deltaserve serve",
        description="Serve a Qwen3.5-family checkpoint over an OpenAI-compatible HTTP API.",
        formatter_class=_HelpFormatter,
    )
    eng = p.add_argument_group("engine (EngineConfig fields, one flag each)")
    eng.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the checkpoint directory, as `vllm serve MODEL` takes it (or --model)",
    )
    add_engine_flags(eng)
    srv = p.add_argument_group("server")
    srv.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model names clients may send (several: each accepted, the first "
        "reported in metrics); default: MODEL (or --model) as given, the demo's own name for "
        "the demo checkpoint. Give MODEL before it, or as --model",
    )
    srv.add_argument(
        "--generation-config",
        choices=("auto", "vllm"),
        default="auto",
        help="auto: the sampling settings in the model's generation_config.json "
        "(temperature, top_p, top_k, min_p, repetition_penalty) are the default "
        "of every request that leaves them out, as in vLLM; vllm: ignore them",
    )
    srv.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="chat messages carry the model's thinking (between <think> and </think>) "
        "as `reasoning`, apart from its answer in `content`, as vLLM's parsers "
        "of these names; default: all the text in `content`",
    )
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="read the tool calls of chats that give tools (tool_choice 'auto', their "
        "default) out of the output into message.tool_calls, as vLLM's flag; "
        "needs --tool-call-parser",
    )
    srv.add_argument(
        "--tool-call-parser",
        choices=tuple(TOOL_CALL_PARSERS),
        default=None,
        help="the format the model writes tool calls in, as vLLM's parsers of these "
        "names: qwen3_coder (Qwen3.5, Qwen3-Coder), hermes (Qwen2.5, Qwen3)",
    )
    srv.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage gains prompt_tokens_details.cached_tokens (prefix caching), as vLLM's",
    )
    srv.add_argument(
        "--return-tokens-as-token-ids",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="logprobs name each token 'token_id:{id}' instead of its text, in requests "
        "that leave return_tokens_as_token_ids out (as vLLM's flag)",
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free)")
    add_listen_flags(srv)
    add_access_flags(p.add_argument_group("access (keys, admin routes, hosts, CORS)"))
    srv.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=30.0,
        help="seconds running requests may take to finish after SIGTERM",
    )
    srv.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest accepted request body (HTTP 413 beyond)",
    )
    srv.add_argument(
        "--max-pending-stream-events",
        type=int,
        default=DEFAULT_MAX_PENDING_STREAM_EVENTS,
        metavar="N",
        help="a streamed request is aborted once over N events per choice wait for a client "
        "that does not read them (counted in /metrics)",
    )
    srv.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,  # SGLang's lower case too
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="log level of the server and its rank processes",
    )
    srv.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="the chat template chats render with, replacing the model's: a file, "
        "or the Jinja template itself (as vLLM's flag)",
    )
    srv.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="template variables of every chat, e.g. '{\"enable_thinking\": false}'; "
        "a request's chat_template_kwargs win key by key (as vLLM's flag)",
    )
    srv.add_argument(
        "--seed",
        type=int,
        default=None,
        help="requests that give no seed take theirs from a generator seeded with "
        "this, so the same requests in the same order sample the same; default: "
        "each a random seed",
    )
    add_vllm_flags(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The serve flags; the checkpoint given as MODEL or --model (both: they must agree)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        parser.error(
            f"the model is given twice: MODEL {args.model_tag!r} and --model {args.model!r}"
        )
    args.model = args.model if args.model is not None else args.model_tag
    if (refused := refused_vllm_flag(args)) is not None:
        parser.error(refused)
    names = args.served_model_name
    if args.model is None and names is not None and len(names) > 1:
        # --served-model-name takes every word up to the next flag, MODEL given after it too
        # (vLLM's parser does the same); a MODEL so lost must not start the demo checkpoint
        parser.error(
            f"no MODEL, and --served-model-name took {', '.join(map(repr, names))}: a "
            "MODEL given after it is taken as a name. Give MODEL first (deltaserve serve "
            "MODEL --served-model-name a b), as --model MODEL, or after --"
        )
    return args


def serve_main(argv: list[str] | None = None, demo: DemoCheckpoint | None = None) -> int:
    """`deltaserve serve`; `demo`: what to serve when no MODEL is given (none: MODEL is
    needed)."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.uvicorn_log_level is not None:  # the HTTP server's own loggers
        logging.getLogger("aiohttp").setLevel(UVICORN_LOG_LEVELS[args.uvicorn_log_level])
    # Every check before the first slow step (making the demo checkpoint, loading weights):
    # the flags (exit 2), then the listen address (exit 1).
    use_demo = args.model is None
    if use_demo and demo is None:
        print("deltaserve serve: error: no MODEL given (a checkpoint folder)", file=sys.stderr)
        return 2
    if use_demo:
        args.model = str(demo.path)
        args.served_model_name = args.served_model_name or [demo.served_name]
    elif not Path(args.model).is_dir():
        print(
            f"deltaserve serve: error: --model {args.model!r} is not a directory (a local "
            "checkpoint folder; hub names are not downloaded)",
            file=sys.stderr,
        )
        return 2
    try:
        listen = listen_config(args)
        server_config, config = _server_config(args), engine_config(args)
        check_quantization(args.quantization, None if use_demo else args.model)
        if server_config.generation_config == "auto":  # read again at start: refused now, not then
            from deltaserve.engine.tokenizer import generation_sampling_defaults

            generation_sampling_defaults(args.model)
    except ValueError as exc:
        print(f"deltaserve serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        check_listen(listen)
    except OSError as exc:
        log.error("cannot listen on %s: %s", args.uds or f"{args.host}:{args.port}", exc)
        return 1
    if use_demo:
        log.info(
            "no --model given: serving the built-in demo checkpoint (%s) from %s%s",
            demo.description,
            args.model,
            "" if (demo.path / "config.json").is_file() else " (making it now, once)",
        )
        demo.make()
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # windows
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve(args, listen, server_config, config))


def _server_config(args: argparse.Namespace) -> ServerConfig:
    from deltaserve.engine.tokenizer import load_chat_template

    return ServerConfig(
        served_model_name=args.served_model_name or [args.model],
        max_request_bytes=args.max_request_bytes,
        max_pending_stream_events=args.max_pending_stream_events,
        generation_config=args.generation_config,
        chat_template=args.chat_template and load_chat_template(args.chat_template),
        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        seed=args.seed,
        reasoning_parser=args.reasoning_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        **access_config(args),
    )


async def _start_engine(config: EngineConfig, stop: asyncio.Event) -> Engine | None:
    """Start the engine (data_parallel_size replicas: a DataParallelEngine), saying every few
    seconds that weights are still loading; None if a signal came first."""
    t0 = time.monotonic()
    log.info(
        "loading %s on %s (tp=%d, dp=%d, dtype=%s) ...",
        config.model,
        config.device,
        config.tp_size,
        config.data_parallel_size,
        config.dtype,
    )
    task = asyncio.ensure_future(start_engine(config))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        while not task.done():
            await asyncio.wait({task, stopped}, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set() and not task.done():
                task.cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await task
                return None
            if not task.done():
                log.info("still loading weights ... %.0f s", time.monotonic() - t0)
    finally:
        stopped.cancel()
    engine = task.result()
    ready, short = _sizes(engine)
    log.info("engine ready in %.1f s: %s", time.monotonic() - t0, ready)
    if short is not None:
        log.warning("%s", short)
    return engine


def _sizes(engine: Engine) -> tuple[str, str | None]:
    """What the ready line says of the limits, each with where it came from, and a warning
    when the KV cache holds fewer positions than max_model_len. Its max_model_len is what one
    request can use, as /v1/models reports it."""
    config, load = engine.config, engine.load()
    model_max = engine.model_config.max_position_embeddings
    if config.max_model_len is not None:
        why = "--max-model-len"
    elif engine.max_model_len < model_max:
        why = (
            f"the default: min(the model's max_position_embeddings {model_max}, "
            f"{engine.max_model_len}); --max-model-len for more"
        )
    else:
        why = "the model's max_position_embeddings"
    kv_tokens = load.num_blocks * config.block_size
    if config.num_kv_blocks is not None:
        kv_why = "--num-kv-blocks"
    elif config.device == "cuda":
        kv_why = f"what --gpu-memory-utilization {config.gpu_memory_utilization} leaves"
    else:
        kv_why = "the cpu default: max_num_seqs x max_model_len; --num-kv-blocks to change"
    longest, short = engine.longest_sequence, None
    if longest < engine.max_model_len:
        why = f"all the KV cache holds, below the {engine.max_model_len} of {why}"
        short = (
            f"the KV cache holds {kv_tokens} tokens, fewer than max_model_len "
            f"{engine.max_model_len}: one request can use at most {longest} positions (prompt + "
            f"completion), as /v1/models says; raise --num-kv-blocks or lower --max-model-len"
        )
    ready = (
        f"max_model_len={longest} ({why}), {load.num_slots} state slots (--max-num-seqs), "
        f"{load.num_blocks} KV blocks of {config.block_size} = {kv_tokens} tokens of KV "
        f"({kv_why})"
    )
    if config.enable_prefix_caching:
        states = config.prefix_cache_states
        ready += f"; prefix caching: {states} saved prompt states (--prefix-cache-states)"
    return ready, short


async def _serve(
    args: argparse.Namespace, listen: Listen, server_config: ServerConfig, config: EngineConfig
) -> int:
    from deltaserve.http.listen import start_server
    from deltaserve.http.server import STATE, build_app

    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:  # first: drain; second: abort what still runs
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        engine = await _start_engine(config, stop)
    except Exception as exc:
        log.error("the engine failed to start: %s", exc)
        return 1
    if engine is None:
        log.info("signal received while loading: stopped")
        return 0
    exit_code = 0
    runner = None
    try:
        try:
            app = build_app(engine, server_config)
        except ValueError as exc:  # what only the loaded tokenizer tells: no think tags
            log.error("%s", exc)
            return 1
        if defaults := app[STATE].sampling_defaults:
            log.info(
                "default sampling from the model's generation_config.json: %s (a request's own "
                "values win; --generation-config vllm ignores the file)",
                ", ".join(f"{k}={v}" for k, v in defaults.items()),
            )
        try:
            runner, site = await start_server(
                app,
                listen.host,
                listen.port,
                uds=listen.uds,
                ssl_context=listen.ssl,
                shutdown_timeout_s=RUNNER_SHUTDOWN_TIMEOUT_S,
            )
        except OSError as exc:
            log.error("cannot listen on %s: %s", args.uds or f"{args.host}:{args.port}", exc)
            return 1
        if (server_config.enable_admin_routes or server_config.enable_sleep_mode) and (
            server_config.admin_api_key is None and server_config.api_key is None
        ):
            log.warning(
                "admin routes are on and need no key: any client that reaches the server can "
                "load weights, pause or put it to sleep (--admin-api-key or --api-key)"
            )
        log.info(
            "ready: serving '%s' at %s/v1 (health: /health, metrics: /metrics, monitor: %s)",
            "', '".join(server_config.served_model_name),
            listen.url(runner.addresses[0]),
            engine.monitor_endpoint or "off",
        )
        if not await _wait_stop_or_death(stop, engine):
            log.info(
                "signal received: admitting no new requests, draining for up to %.1f s "
                "(a second signal aborts at once)",
                args.shutdown_timeout,
            )
            app[STATE].draining = True
            await site.stop()  # stop listening; open connections get 503 for new requests
            await _drain(engine, args.shutdown_timeout, force)
        if engine.is_dead:
            log.error("the engine died: %s; shutting down", engine.dead_reason)
            exit_code = 1
    finally:
        if runner is not None:
            await runner.cleanup()
            remove_socket(listen)
        with contextlib.suppress(Exception):
            await engine.shutdown()
    log.info("stopped (exit code %d)", exit_code)
    return exit_code


async def _drain(engine: Engine, timeout_s: float, force: asyncio.Event) -> None:
    drain = asyncio.ensure_future(engine.shutdown(drain_timeout_s=timeout_s))
    forced = asyncio.ensure_future(force.wait())
    await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
    forced.cancel()
    if not drain.done():
        log.warning("second signal: aborting the running requests now")
        await engine.shutdown(drain_timeout_s=0.0)
    await drain


async def _wait_stop_or_death(stop: asyncio.Event, engine: Engine) -> bool:
    """Wait for a stop signal or the engine's death; True if the engine died first."""
    while not stop.is_set():
        if engine.is_dead:
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.2)
    return False
