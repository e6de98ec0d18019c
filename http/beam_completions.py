"""vLLM's use_beam_search, answered: each prompt's n beams (engine/beam_search.py) come back
whole as n choices, best first. /v1/completions indexes them prompt-major (choice p * n + i);
/v1/chat/completions reads them as it reads a request's stream (`BeamChoices`), so each
beam's message goes through the same reasoning and tool-call parsing as a sampled one."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from deltaserve.engine.beam_search import Beam, BeamSearchError, beam_search, check_beam_search
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.events import (
    EngineDeadError,
    Event,
    FinishedEvent,
    QueueFullError,
    TokenEvent,
)
from deltaserve.engine.sampling_params import ParamError, SamplingParams
from deltaserve.http import errors
from deltaserve.http.protocol import CompletionRequest, truncate_prompt


async def _search(
    engine: Any,
    prompts: list[str | list[int]],
    params: SamplingParams,
    length_penalty: float,
    request_id: str,
    names: Mapping[str, str],
    fit: Callable[[list[int]], list[int]] | None = None,
) -> tuple[list[list[int]], list[list[Beam]]]:
    """Every prompt's token ids (a text encoded, then `fit`) and beams (n = params.n of them),
    each search checked before any starts; an ApiError for a refusal (naming the request's
    field, through `names`), a full queue or a dead engine."""
    try:
        ids = [await engine.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        ids = [fit(i) for i in ids] if fit is not None else ids
        for prompt in ids:
            check_beam_search(engine, prompt, params.n, params.max_tokens)
        searches = [
            beam_search(
                engine,
                prompt,
                params.n,
                params.max_tokens,
                engine.eos_token_ids,
                length_penalty=length_penalty,
                ignore_eos=params.ignore_eos,
                include_stop=params.include_stop_str_in_output,
                request_id=f"{request_id}-{p}",
            )
            for p, prompt in enumerate(ids)
        ]
        return ids, await asyncio.gather(*searches)
    except QueueFullError as e:
        raise errors.queue_full(str(e)) from None
    except (EngineDeadError, BeamSearchError) as e:
        raise errors.engine_dead(engine.dead_reason or str(e)) from None
    except ParamError as e:
        raise errors.refused_param(e, names) from None


async def beam_completions(engine: Any, req: CompletionRequest, model: str) -> dict[str, Any]:
    """The completion body; an ApiError as `_search` raises them."""
    width = req.sampling.n
    fit = functools.partial(
        truncate_prompt,
        keep=req.truncate_prompt_tokens,
        max_tokens=req.sampling.max_tokens,
        max_model_len=engine.max_model_len,
    )
    request_id = f"cmpl-{uuid.uuid4().hex}"
    prompts, results = await _search(
        engine,
        list(req.prompts),
        req.sampling,
        req.length_penalty,
        request_id,
        req.param_names,
        fit,
    )
    skip = req.sampling.skip_special_tokens
    texts = await engine.run_tokenizer(
        lambda tok: [
            [tok.decode(list(b.tokens), skip_special_tokens=skip) for b in beams]
            for beams in results
        ],
        sum(len(b.tokens) for beams in results for b in beams),
    )
    choices = [
        {
            "index": p * width + i,
            "text": texts[p][i],
            "logprobs": None,
            "finish_reason": beam.finish_reason,
            "stop_reason": beam.stop_reason,
        }
        for p, beams in enumerate(results)
        for i, beam in enumerate(beams)
    ]
    # each prompt once, as the completion route counts it
    prompt_tokens = sum(len(ids) for ids in prompts)
    completion_tokens = sum(len(beam.tokens) for beams in results for beam in beams)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


@dataclass(frozen=True, slots=True)
class BeamChoices:
    """A finished beam search as a request's stream reads: beam i is choice i, its tokens'
    TokenEvents (text deltas as the engine's detokenizer makes them) and its FinishedEvent."""

    prompt_token_ids: list[int]
    events: list[Event]

    async def __aiter__(self) -> AsyncIterator[Event]:
        for event in self.events:
            yield event

    async def aclose(self) -> None:
        """Nothing runs any more: the search has finished."""


async def beam_chat_choices(
    engine: Any,
    prompt_ids: list[int],
    params: SamplingParams,
    length_penalty: float,
    request_id: str,
    names: Mapping[str, str],
) -> BeamChoices:
    """A chat request's params.n beams, best first; an ApiError as `_search` raises them."""
    params = params.resolve_max_tokens(len(prompt_ids), engine.longest_sequence)
    _, (beams,) = await _search(engine, [prompt_ids], params, length_penalty, request_id, names)
    events = await engine.run_tokenizer(
        functools.partial(
            _beam_events,
            beams=beams,
            prompt_tokens=len(prompt_ids),
            skip_special=params.skip_special_tokens,
        ),
        sum(len(beam.tokens) for beam in beams),
    )
    return BeamChoices(prompt_ids, events)


def _beam_events(
    tokenizer: Any, beams: list[Beam], prompt_tokens: int, skip_special: bool
) -> list[Event]:
    events: list[Event] = []
    for i, beam in enumerate(beams):
        text = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special)
        for token, logprob in zip(beam.tokens, beam.logprobs, strict=True):
            events.append(TokenEvent(i, token, text.add(token), logprob, []))
        events.append(
            FinishedEvent(
                i,
                beam.finish_reason,
                prompt_tokens,
                len(beam.tokens),
                text.flush(),
                stop_reason=beam.stop_reason,
            )
        )
    return events


__all__ = ["BeamChoices", "beam_chat_choices", "beam_completions"]
