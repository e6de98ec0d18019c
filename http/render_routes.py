"""vLLM's render routes: a request as the engine would run it, without running it.

`POST /v1/chat/completions/render` takes a chat completion body and answers one vLLM
`GenerateRequest`: the prompt's token ids (the chat template rendered and tokenized as the chat
route does), the sampling parameters the route would use, the model, stream and priority;
`POST /v1/completions/render` takes a completion body and answers a list of them, one per
prompt. vllm-router calls them to place a request by the tokens it will run (its cache-aware
policies), and disaggregated setups to tokenize once. The body is parsed and refused exactly as
the generating route parses it (a 400 names the field); nothing is submitted, and the weights
may be asleep. Images and video are refused: their placeholders and hashes (vLLM's
`features`) are not rendered here.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from deltaserve.engine.events import EngineDeadError
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http import errors
from deltaserve.http.media_parts import media_sources
from deltaserve.http.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    parse_chat_request,
    parse_completion_request,
    truncate_prompt,
)
from deltaserve.http.request_body import read_json
from deltaserve.http.server import STATE, ServerState, _apply_chat_template, _json, _params

# SamplingParams' fields that vLLM's SamplingParams names alike (its render answers them all)
_VLLM_SAMPLING_FIELDS = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "allowed_token_ids",
    "bad_words",
)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions/render", render_chat)
    app.router.add_post("/v1/completions/render", render_completion)


async def render_chat(request: web.Request) -> web.Response:
    state, req = await _parsed(request, parse_chat_request)
    if media_sources(req.messages):
        raise errors.unsupported("messages", "images and video are not rendered by this route")
    ids = await _apply_chat_template(
        state.engine,
        req.messages,
        {**state.config.default_chat_template_kwargs, **req.chat_template_kwargs},
        size=len(await request.read()),
        chat_template=state.config.chat_template,
        tools=req.tools,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
    )
    max_tokens = req.sampling.max_tokens
    ids = truncate_prompt(ids, req.truncate_prompt_tokens, max_tokens, state.engine.max_model_len)
    if max_tokens is None:  # as the chat route: what the context leaves
        max_tokens = max(1, state.engine.longest_sequence - len(ids))
    params = _params(req.sampling, max_tokens, logprobs_param="top_logprobs")
    return _json(_generate_request("chatcmpl", ids, params, req, state))


async def render_completion(request: web.Request) -> web.Response:
    state, req = await _parsed(request, parse_completion_request)
    max_tokens = req.sampling.max_tokens
    params = _params(
        req.sampling,
        DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens,
        logprobs_param="logprobs",
    )
    rendered = []
    for prompt in req.prompts:
        try:
            ids = await state.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
        except EngineDeadError as exc:
            raise errors.engine_dead(state.engine.dead_reason or str(exc)) from None
        except ValueError as exc:  # a lone surrogate: names where it is
            raise errors.bad_request(str(exc), "prompt") from None
        ids = truncate_prompt(
            ids, req.truncate_prompt_tokens, params.max_tokens, state.engine.max_model_len
        )
        rendered.append(_generate_request("cmpl", ids, params, req, state))
    return _json(rendered)


async def _parsed(request: web.Request, parse: Callable[..., Any]) -> tuple[ServerState, Any]:
    """The body parsed by the generating route's parser, its model served, the engine alive."""
    state = request.app[STATE]
    req = parse(
        await read_json(request), state.sampling_defaults, max_logprobs=state.engine.max_logprobs
    )
    state.model_name(req.model)
    if req.beam_search:
        raise errors.unsupported("use_beam_search", "the render routes render no beam search")
    state.check_alive()
    return state, req


def _generate_request(
    kind: str, ids: list[int], params: SamplingParams, req: Any, state: ServerState
) -> dict[str, Any]:
    """vLLM's GenerateRequest (vllm/entrypoints/serve/disagg/protocol.py) as JSON."""
    sampling: dict[str, Any] = {name: getattr(params, name) for name in _VLLM_SAMPLING_FIELDS}
    sampling["logit_bias"] = {str(t): b for t, b in params.logit_bias} or None
    return {
        "request_id": f"{kind}-{uuid.uuid4().hex}",
        "token_ids": ids,
        "features": None,
        "sampling_params": sampling,
        "model": req.model,
        "stream": req.stream,
        "stream_options": {
            "include_usage": req.include_usage,
            "continuous_usage_stats": req.continuous_usage,
        }
        if req.stream
        else None,
        "cache_salt": None,
        "priority": req.priority,
        "kv_transfer_params": None,
    }
