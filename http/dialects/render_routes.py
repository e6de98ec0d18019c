"""vLLM's render routes: a request as the engine would run it, without running it.

`POST /v1/chat/completions/render` takes a chat completion body and answers one vLLM
`GenerateRequest`: the prompt's token ids (the chat template rendered and tokenized as the chat
route does), the sampling parameters the route would use, the model, stream and priority;
`POST /v1/completions/render` takes a completion body and answers a list of them, one per
prompt. vllm-router calls them to place a request by the tokens it will run (its cache-aware
policies), and disaggregated setups to tokenize once. The body is decoded and refused as the
generating route's (request_body.py's policy: a 400 names the field); nothing is submitted,
and the weights may be asleep. Images and video are refused: their placeholders and hashes
(vLLM's `features`) are not rendered here.
"""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from deltaserve.engine.events import EngineDeadError
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.http import errors
from deltaserve.http.generation import apply_chat_template
from deltaserve.http.media_parts import media_sources
from deltaserve.http.protocol import (
    ChatRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
    truncate_prompt,
)
from deltaserve.http.request_body import read_json
from deltaserve.http.state import STATE, ServerState, json_response

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
    state = request.app[STATE]
    req = parse_chat_request(await read_json(request), state.sampling_defaults)
    _check(state, req)
    if media_sources(req.messages):
        raise errors.unsupported("messages", "images and video are not rendered by this route")
    ids = await apply_chat_template(
        state.engine,
        req.messages,
        {**state.config.default_chat_template_kwargs, **req.chat_template_kwargs},
        size=len(await request.read()),
        chat_template=state.config.chat_template,
        tools=req.tools,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
    )
    params = req.sampling
    ids = truncate_prompt(
        ids, req.truncate_prompt_tokens, params.max_tokens, state.engine.max_model_len
    )
    # max_tokens None: what the context leaves, as the chat route resolves it
    params = params.resolve_max_tokens(len(ids), state.engine.longest_sequence)
    return json_response(_generate_request("chatcmpl", ids, params, req))


async def render_completion(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = parse_completion_request(await read_json(request), state.sampling_defaults)
    _check(state, req)
    rendered = []
    for prompt in req.prompts:
        try:
            ids = await state.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
        except EngineDeadError as exc:
            raise errors.engine_dead(state.engine.dead_reason or str(exc)) from None
        except ValueError as exc:  # a lone surrogate: names where it is
            raise errors.bad_request(str(exc), "prompt") from None
        ids = truncate_prompt(
            ids, req.truncate_prompt_tokens, req.sampling.max_tokens, state.engine.max_model_len
        )
        rendered.append(_generate_request("cmpl", ids, req.sampling, req))
    return json_response(rendered)


def _check(state: ServerState, req: ChatRequest | CompletionRequest) -> None:
    """Its model served, no beam search (a render is one request's), the engine alive."""
    state.model_name(req.model)
    if req.beam_search:
        raise errors.unsupported("use_beam_search", "the render routes render no beam search")
    state.check_alive()


def _generate_request(
    kind: str, ids: list[int], params: SamplingParams, req: ChatRequest | CompletionRequest
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
