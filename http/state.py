"""What every route shares: the server's state (the engine, the config, whether it admits),
its key on the aiohttp app, and the JSON answer. The core's public interface for the route
modules beside it (dialects/), with generation.py."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from deltaserve.engine.tokenizer import generation_sampling_defaults
from deltaserve.http import errors
from deltaserve.http.errors import ApiError
from deltaserve.http.reasoning import ReasoningParser
from deltaserve.http.responses import TokenStrings
from deltaserve.http.server_config import ServerConfig

if TYPE_CHECKING:
    from deltaserve.engine.interface import Engine

_json_bytes = msgspec.json.Encoder().encode


class ServerState:
    """What the handlers share: the engine, the config, and whether we still admit."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        # logprobs' token strings; a request's return_tokens_as_token_ids: `.rendering`
        self.strings = TokenStrings(engine.tokenizer, config.return_tokens_as_token_ids)
        self.created = int(time.time())
        self.draining = False  # set by the serve command on SIGTERM
        # streamed requests aborted for a client that stopped reading (`_respond`)
        self.stream_overflows = 0
        self.weight_version = (
            "default"  # SGLang's name for the weights served (/update_weights_from_disk)
        )
        # what a request leaves out of temperature, top_p, top_k, min_p, repetition_penalty
        self.sampling_defaults = (
            generation_sampling_defaults(engine.config.model)
            if config.generation_config == "auto"
            else {}
        )
        # the seeds of requests that give none (--seed); None: the engine draws each at random
        self.seeds = None if config.seed is None else random.Random(config.seed)
        # ValueError when the tokenizer lacks the think tags
        self.reasoning = (
            ReasoningParser.for_tokenizer(config.reasoning_parser, engine.tokenizer)
            if config.reasoning_parser is not None
            else None
        )

    def model_name(self, requested: str | None) -> str:
        """The name a response carries: the one requested (refused if not served), else the
        first (as vLLM's)."""
        names = self.config.served_model_name
        if requested is None:
            return names[0]
        if requested not in names:
            raise errors.model_not_found(requested, "', '".join(names))
        return requested

    def check_alive(self) -> None:
        """503 when the engine is dead or the server drains (what an admin route asks)."""
        if self.engine.is_dead:
            raise errors.engine_dead(self.engine.dead_reason)
        if self.draining:
            raise errors.shutting_down()

    def check_admitting(self) -> None:
        """`check_alive`, and 503 while the weights are gone (a level-2 sleep discards
        them until new ones load): what a route that generates, and /health, ask."""
        self.check_alive()
        if self.engine.weights_dropped:
            raise errors.no_weights()


STATE = web.AppKey("deltaserve_state", ServerState)


def json_response(body: dict[str, Any] | list[Any], status: int = 200) -> web.Response:
    return web.Response(body=_json_bytes(body), status=status, content_type="application/json")


def error_response(err: ApiError) -> web.Response:
    return json_response(err.body(), err.status)
